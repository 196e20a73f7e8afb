"""Mixtral and other `llama` files with experts: GQA, original (adjacent-pair) RoPE; softmax top-k routing,
renormalized."""

from __future__ import annotations

from specter_gguf.config import ModelConfig
from specter_gguf.layers import Block
from specter_gguf.models.common import Weights, moe_block


def build_block(cfg: ModelConfig, i: int, w: Weights) -> Block:
    return moe_block(cfg, i, w, neox=False, normalize_topk=True)
