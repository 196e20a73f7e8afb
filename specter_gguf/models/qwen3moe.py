"""Qwen3-MoE (`qwen3moe`: Qwen3-30B-A3B, Qwen3-Coder): GQA without bias, per-head RMSNorm of q and k, NeoX
RoPE; softmax top-k routing, always renormalized (as llama.cpp does, whatever the file says)."""

from __future__ import annotations

from specter_gguf.config import ModelConfig
from specter_gguf.layers import Block
from specter_gguf.models.common import Weights, moe_block


def build_block(cfg: ModelConfig, i: int, w: Weights) -> Block:
    return moe_block(cfg, i, w, neox=True, normalize_topk=True, qk_norm="head")
