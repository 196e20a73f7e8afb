"""OLMoE (`olmoe`): attention with RMSNorm of q and k over all heads at once, NeoX RoPE; softmax top-k
routing without renormalization."""

from __future__ import annotations

from specter_gguf.config import ModelConfig
from specter_gguf.layers import Block
from specter_gguf.models.common import Weights, moe_block


def build_block(cfg: ModelConfig, i: int, w: Weights) -> Block:
    return moe_block(cfg, i, w, neox=True, normalize_topk=False, qk_norm="full")
