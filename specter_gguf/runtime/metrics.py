"""Counters of the offload runtime, read as a difference between two snapshots (one generation)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class OffloadCounters:
    """Monotonic counters. A *lookup* is one (layer, expert) that a layer needed to compute; a *hit* found
    it in a slot already (resident, or its copy already issued by a prefetch); a *miss* had to be copied.
    `copy_s` is the time copies took on the copy stream (CPU: the memcpy), `copy_exposed_s` the time compute
    waited for them (CUDA events around the waits; CPU copies are synchronous, so all of it)."""

    cache_lookups: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    prefetches: int = 0          # copies issued ahead of need (gate-prefetch, `request`)
    bytes_copied: int = 0
    copies: int = 0
    copy_s: float = 0.0
    copy_exposed_s: float = 0.0
    zero_copy_bytes: int = 0     # missed experts read in place from host memory (once per forward each)
    spare_fetches: int = 0       # missed experts a forward's kernels copied into a spare slot (bytes in bytes_copied)
    cpu_expert_pairs: int = 0    # (token, expert) pairs of missed experts computed on the CPU (hybrid)
    cpu_expert_s: float = 0.0    # ... the time the CPU's worker spent on them
    cpu_wait_s: float = 0.0      # ... the time the forwards waited for the worker's answers (on CUDA the GPU's)

    def snapshot(self) -> OffloadCounters:
        return OffloadCounters(**asdict(self))

    def since(self, start: OffloadCounters) -> OffloadCounters:
        return OffloadCounters(**{f.name: getattr(self, f.name) - getattr(start, f.name) for f in fields(self)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
