"""An expert cache of a few slots over a model file, on the CPU, as the offload runtime makes it (the cache and
lookahead tests share it)."""

from __future__ import annotations

from pathlib import Path

import torch

from specter_gguf.config import ModelConfig
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime import ExpertCache, RoutingProfile
from specter_gguf.runtime.budget import moe_layers, record_layout
from specter_gguf.runtime.store import ExpertStore


def small_cache(path: Path, slots: int, policy: str = "lru", profile: RoutingProfile | None = None,
                n_spare: int = 0) -> ExpertCache:
    """Per-layer partitions for lru (`slots` per MoE layer), one global partition of `slots` for lfu/static-hot;
    `n_spare` of them a layer set aside as spares."""
    partition = "layer" if policy == "lru" else "global"
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    layers = moe_layers(f, cfg)
    n_slots = slots * len(layers) if partition == "layer" else slots
    layouts = {i: record_layout(f, cfg, i) for i in layers}
    store = ExpertStore(f, layouts, cfg.n_expert, torch.device("cpu"))
    slot = max(r.nbytes for r in layouts.values())
    return ExpertCache(store, n_slots, slot, layers, torch.device("cpu"), policy, partition, profile, n_spare=n_spare)
