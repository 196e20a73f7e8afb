"""Phi-3.5-MoE (`phimoe`), as llama.cpp 0.3.36 runs it (src/models/phimoe.cpp, which uses the phi3 graph).

- Norms: RMS norm *with a bias* (`attn_norm`, `ffn_norm`, `output_norm`: weight and bias), since llama.cpp
  builds them as LLM_NORM_RMS + bias.
- Attention: GQA with q/k/v and output biases (separate `attn_q/k/v` or a fused `attn_qkv`), NeoX RoPE over
  the whole head with Phi-3 "longrope" frequency factors (`rope_factors_short`/`rope_factors_long`, the long
  ones when the context exceeds `rope.scaling.original_context_length`, decided by the context size as
  llama.cpp does) and cos/sin scaled by `rope.scaling.attn_factor`.
- MoE: softmax over the router logits, top-2, renormalized to sum 1 (scaled by `expert_weights_scale` if
  set); the LM head has a bias.

Differences to the Hugging Face reference (PhiMoEForCausalLM), which llama.cpp does not reproduce and so
neither do we: HF routes with *sparsemixer* (top-1 by masked softmax with a jitter threshold, then the second
expert by a masked softmax over the rest, each weight from its own masked softmax) rather than softmax top-2
renormalized; HF's norms are LayerNorm (mean-subtracting), not RMS norm + bias; HF scales cos/sin by the
config's `short_mscale`/`long_mscale` while the converter writes sqrt(1 + ln(scale) / ln(n_ctx_orig)).
Outputs therefore follow llama.cpp's reading of the file, not HF's.
"""

from __future__ import annotations

import torch

from specter_gguf.config import ModelConfig
from specter_gguf.layers import (Block, ContextRopeAttention, Linear, MoE, Projections, RMSNorm, Router,
                                  rope_for)
from specter_gguf.models.common import Weights
from specter_gguf.weights import load_tensor


def _global(w: Weights, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A file-level tensor (no blk. prefix), shared by every layer."""
    return load_tensor(w.f.tensor(name, shape), w.device) if w.f.has_tensor(name) else None


def _norm(cfg: ModelConfig, w: Weights, name: str) -> RMSNorm:
    d = cfg.n_embd
    return RMSNorm(w(f"{name}.weight", (d,)), cfg.rms_eps, w(f"{name}.bias", (d,)))


def attention(cfg: ModelConfig, w: Weights) -> ContextRopeAttention:
    d, hd = cfg.n_embd, cfg.head_dim
    nq, nkv = cfg.n_head * hd, cfg.n_head_kv * hd
    if w.f.has_tensor(w.prefix + "attn_qkv.weight"):
        qkv = Projections.split(Linear(w("attn_qkv.weight", (nq + 2 * nkv, d)),
                                       w("attn_qkv.bias", (nq + 2 * nkv,), optional=True)), [nq, nkv, nkv])
    else:
        qkv = Projections.of(Linear(w("attn_q.weight", (nq, d)), w("attn_q.bias", (nq,), optional=True)),
                             Linear(w("attn_k.weight", (nkv, d)), w("attn_k.bias", (nkv,), optional=True)),
                             Linear(w("attn_v.weight", (nkv, d)), w("attn_v.bias", (nkv,), optional=True)))
    half = cfg.rope_dim // 2
    rope = w.shared("rope", lambda: rope_for(cfg, neox=True,
                                             freq_factors=_global(w, "rope_factors_short.weight", (half,)),
                                             freq_factors_long=_global(w, "rope_factors_long.weight", (half,))))
    return ContextRopeAttention(
        n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=hd, qkv=qkv,
        wo=Linear(w("attn_output.weight", (d, nq)), w("attn_output.bias", (d,))), rope=rope)


def build_block(cfg: ModelConfig, i: int, w: Weights) -> Block:
    router = Router(w("ffn_gate_inp.weight", (cfg.n_expert, cfg.n_embd)), cfg.n_expert_used, True,
                    cfg.expert_weights_scale)
    return Block(layer=i, attn_norm=_norm(cfg, w, "attn_norm"), attn=attention(cfg, w),
                 ffn_norm=_norm(cfg, w, "ffn_norm"),
                 ffn=MoE(i, router, w.make_experts(cfg, i, w)))
