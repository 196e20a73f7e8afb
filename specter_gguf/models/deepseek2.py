"""DeepSeek-V2 / V2-Lite (`deepseek2`), as llama.cpp 0.3.36 reads and runs it (src/models/deepseek2.cpp).

Attention is multi-head latent attention (`LatentAttention`) in llama.cpp's absorbed form: the cache holds one
normalized latent (kv_lora_rank) plus one rotated shared rope key per token, not per-head keys and values.
- q: `attn_q` (V2-Lite, no q_lora_rank; llama.cpp ignores q_lora_rank for 26/27-layer files) or
  `attn_q_a` -> RMSNorm `attn_q_a_norm` -> `attn_q_b`; per head [qk_nope | qk_rope].
- `attn_kv_a_mqa` gives [latent | k_pe]; the latent is RMS-normed by `attn_kv_a_norm`.
- Both layouts llama.cpp loads: `attn_k_b` + `attn_v_b` (what the current converter writes, with
  `attention.key_length_mla`/`value_length_mla`), or the legacy unsplit `attn_kv_b`, which we split at load.
- RoPE: original (adjacent-pair, LLAMA_ROPE_TYPE_NORM) on the rope dims only, with YaRN from metadata; the
  softmax scale is mscale^2 / sqrt(qk_nope + qk_rope) with mscale = 1 + 0.1 * mscale_all_dim * ln(factor)
  (times the context's attention factor), exactly as llama.cpp pre-scales it.
FFN: the first `leading_dense_block_count` layers are dense SwiGLU; the others route over experts (softmax,
or sigmoid when `expert_gating_func` says 2, plus the `exp_probs_b` selection bias when present; group-limited
choice when `expert_group_count` > 1; top-k renormalized only when `expert_weights_norm`; scaled by
`expert_weights_scale`) and add `expert_shared_count` shared experts (one FFN of n_ff_exp * count) ungated.
"""

from __future__ import annotations

import math

import torch

from specter_gguf.config import ModelConfig
from specter_gguf.layers import (Block, FeedForward, LatentAttention, Linear, MoE, RMSNorm,
                                  SelectingRouter, rope_for)
from specter_gguf.models.common import Weights, norm


def latent_attention(cfg: ModelConfig, w: Weights) -> LatentAttention:
    d, H, r, rot = cfg.n_embd, cfg.n_head, cfg.n_lora_kv, cfg.rope_dim
    dk, dv = cfg.head_dim_k_mla, cfg.head_dim_v_mla
    nope = dk - rot
    q: dict = {}
    if cfg.n_lora_q > 0:
        q = dict(wq_a=Linear(w("attn_q_a.weight", (cfg.n_lora_q, d))),
                 q_a_norm=RMSNorm(w("attn_q_a_norm.weight", (cfg.n_lora_q,)), cfg.rms_eps),
                 wq_b=Linear(w("attn_q_b.weight", (H * dk, cfg.n_lora_q))))
    else:
        q = dict(wq=Linear(w("attn_q.weight", (H * dk, d))))
    if cfg.mla_split_kv_b:
        wk_b, wv_b = w("attn_k_b.weight", (H, r, nope)), w("attn_v_b.weight", (H, dv, r))
    else:  # legacy attn_kv_b [H * (nope + v), r]: split per head and transpose the key part, as the converter does
        kv_b = w("attn_kv_b.weight", (H * (nope + dv), r))
        if not isinstance(kv_b, torch.Tensor):  # a quantized file: split the dequantized values
            kv_b = kv_b.dequantize(torch.float16 if kv_b.device.type == "cuda" else torch.float32)
        kv_b = kv_b.view(H, nope + dv, r)
        wk_b, wv_b = kv_b[:, :nope].transpose(1, 2).contiguous(), kv_b[:, nope:].contiguous()
    # llama.cpp's kq_scale: undo the context's YaRN attention-factor adjustment, then mscale^2 / sqrt(d_k)
    ln_factor = math.log(1.0 / cfg.rope_freq_scale)
    mscale = cfg.rope_attn_factor * (1.0 + 0.1 * ln_factor) * (1.0 + 0.1 * cfg.rope_yarn_log_mul * ln_factor)
    return LatentAttention(
        n_head=H, n_nope=nope, n_rot=rot, n_lora_kv=r,
        wkv_a=Linear(w("attn_kv_a_mqa.weight", (r + rot, d))),
        kv_a_norm=RMSNorm(w("attn_kv_a_norm.weight", (r,)), cfg.rms_eps),
        wk_b=wk_b, wv_b=wv_b,
        wo=Linear(w("attn_output.weight", (d, H * dv))),
        rope=w.shared("rope", lambda: rope_for(cfg, neox=False)),
        kq_scale=mscale * mscale / math.sqrt(dk),
        **q,
    )


def build_block(cfg: ModelConfig, i: int, w: Weights) -> Block:
    d = cfg.n_embd
    if i < cfg.n_leading_dense:
        f = cfg.n_ff
        ffn: MoE | FeedForward = FeedForward.of(w("ffn_gate.weight", (f, d)), w("ffn_up.weight", (f, d)),
                                                w("ffn_down.weight", (d, f)))
    else:
        router = SelectingRouter(
            w("ffn_gate_inp.weight", (cfg.n_expert, d)), cfg.n_expert_used, cfg.expert_weights_norm,
            cfg.expert_weights_scale, gating=cfg.expert_gating_func,
            selection_bias=w("exp_probs_b.bias", (cfg.n_expert,), optional=True),
            n_groups=cfg.n_expert_groups, n_group_used=cfg.n_group_used)
        shared = None
        if cfg.n_expert_shared > 0:
            s = cfg.n_ff_shexp
            shared = FeedForward.of(w("ffn_gate_shexp.weight", (s, d)), w("ffn_up_shexp.weight", (s, d)),
                                    w("ffn_down_shexp.weight", (d, s)))
        ffn = MoE(i, router, w.make_experts(cfg, i, w), shared)
    return Block(layer=i, attn_norm=norm(cfg, w, "attn_norm"), attn=latent_attention(cfg, w),
                 ffn_norm=norm(cfg, w, "ffn_norm"), ffn=ffn)
