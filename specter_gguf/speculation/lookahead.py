"""The expert lookahead buffer (Specter's ELB): while the draft speculates, the experts its routers choose are
brought into the target's expert cache, so that the verification finds them in slots.

The buffer is a routing observer of the draft's forwards: every drafted token adds its (layer, expert) choices into
a [layers, experts] counter on the device (inside the draft's CUDA graph: no host read per token). At chunk
boundaries of the drafting (`chunk_ends`: a cold start after the first ~20% of the drafted tokens, then chunks
sized so that their copies take about as long as drafting them, then the rest) the counter is copied to the
host without waiting. `plan`, called once the whole drafting is enqueued, then reads the copies in order, each as
it lands (drafting on the device, the GPU is still drafting meanwhile; drafting on the host, it has ended by
then), and asks the cache for the experts counted so far, most used first (ties: earlier layer first, the order
verification meets them): the missing ones are copied in. Their slots, and those of the resident ones, are reserved
in the cache: no later request evicts them before the coming verification has run. `wait_for_copies` then makes
that verification wait (on the GPU) for the copies still in flight rather than read those experts in place
while they land: measured faster on the H200 (docs/BENCHMARKS.md, 2026-12-01 14:03).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specter_gguf.runtime.cache import ExpertCache


def chunk_ends(k: int, step_s: float, copy_s: float) -> list[int]:
    """Drafted-token counts after which the counter is read: ceil(0.2 k) first, then every
    max(1, round(copy_s / step_s)) tokens (`copy_s`: the copy time of one drafted token's new experts, `step_s`:
    one draft step), and k."""
    ends = [max(1, math.ceil(0.2 * k))]
    size = max(1, round(copy_s / step_s)) if step_s > 0 else 1
    while ends[-1] < k:
        ends.append(min(k, ends[-1] + size))
    return ends


class ExpertLookahead:
    """Counts the draft's routing on the device (a `RoutingObserver`) and prefetches what it counted."""

    def __init__(self, cache: ExpertCache, n_layer: int, n_expert: int, device: torch.device) -> None:
        self.cache = cache
        self.counts = torch.zeros((n_layer, n_expert), dtype=torch.int32, device=device)
        self._hosts: list[torch.Tensor] = []  # snapshot buffers, reused iteration after iteration
        self._pinned = device.type == "cuda"
        self._events: list[torch.cuda.Event | None] = []
        self._pending = 0
        self._seen: set[tuple[int, int]] = set()
        self.prefetched: set[tuple[int, int]] = set()  # this iteration's copies
        self.refused = 0  # this iteration's counted experts that found no evictable slot

    def __call__(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        self.counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def start(self) -> None:
        """A new iteration: nothing counted, nothing requested yet."""
        self.counts.zero_()
        self.cache.reserved.clear()
        self._seen.clear()
        self.prefetched.clear()
        self.refused = 0
        self._pending = 0

    def snapshot(self) -> None:
        """Enqueue a copy of the counts so far to the host (after the draft steps enqueued before it)."""
        if self._pending == len(self._hosts):
            self._hosts.append(torch.empty(self.counts.shape, dtype=torch.int32, pin_memory=self._pinned))
            self._events.append(torch.cuda.Event() if self._pinned else None)
        self._hosts[self._pending].copy_(self.counts, non_blocking=True)
        if self._events[self._pending] is not None:
            self._events[self._pending].record()
        self._pending += 1

    def plan(self) -> int:
        """Read each snapshot as it lands (waiting for it: the GPU drafts on meanwhile) and request the counted
        experts; returns the copies issued."""
        issued = 0
        for i in range(self._pending):
            if self._events[i] is not None:
                self._events[i].synchronize()
            issued += self._request(self._hosts[i].numpy())
        self._pending = 0
        return issued

    def _request(self, counts: np.ndarray) -> int:
        layers, experts = np.nonzero(counts)
        order = np.lexsort((layers, -counts[layers, experts]))  # most used first, then earlier layers
        keys = [key for key in ((int(layers[i]), int(experts[i])) for i in order) if key not in self._seen]
        self._seen.update(keys)
        where = self.cache.where
        self.cache.reserved.update(where[key] for key in keys if key in where)  # before any copy takes a slot
        fresh = [key for key in keys if key not in where]
        issued = self.cache.request(fresh, reserve=True)
        self.prefetched.update(key for key in fresh if key in where)
        self.refused += len(fresh) - issued
        return issued

    def wait_for_copies(self) -> None:
        """Make the compute stream wait (GPU-side) for this iteration's copies and publish them: the coming
        verification reads them from their slots instead of reading the experts in place while they land."""
        where = self.cache.where
        self.cache.publish(wait=[where[key] for key in self.prefetched if key in where])
