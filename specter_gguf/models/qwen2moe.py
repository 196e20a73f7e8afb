"""Qwen1.5-MoE / Qwen2-MoE (`qwen2moe`): GQA with q/k/v bias and NeoX RoPE; softmax top-k routing without
renormalization; a shared expert added behind a sigmoid gate."""

from __future__ import annotations

from specter_gguf.config import ModelConfig
from specter_gguf.layers import Block, FeedForward
from specter_gguf.models.common import Weights, moe_block


def build_block(cfg: ModelConfig, i: int, w: Weights) -> Block:
    d, f = cfg.n_embd, cfg.n_ff_shexp
    shared = FeedForward.of(w("ffn_gate_shexp.weight", (f, d)), w("ffn_up_shexp.weight", (f, d)),
                            w("ffn_down_shexp.weight", (d, f)))
    return moe_block(cfg, i, w, neox=True, normalize_topk=False, shared=shared,
                     shared_gate=w("ffn_gate_inp_shexp.weight", (d,)).view(1, d))
