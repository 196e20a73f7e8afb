"""The expert lookahead buffer (Specter's ELB): while the draft speculates, the experts its routers choose are
brought into the target's expert cache, so that the verification finds them in slots.

Each draft step records its routing on the device (`agreement.RoutingAgreement.on_draft`, inside the draft's CUDA
graph: no host read per token). At chunk boundaries of the drafting (`chunk_ends`: a cold start after the first ~20%
of the drafted tokens, then chunks sized so that their copies take about as long as drafting them, then the rest)
the buffer counts the steps recorded so far into a [layers, experts] counter on the device, in one pass (counting
inside every MoE layer of every step took a kernel each, between the layer's native kernels), and copies the counter
to the host without waiting. `plan`, called once the whole drafting is enqueued, then reads the copies in order,
each as it lands (drafting on the device, the GPU is still drafting meanwhile; drafting on the host, it has ended by
then), and asks the cache for the experts counted so far, most used first (ties: earlier layer first, the order
verification meets them): the missing ones are copied in. Their slots, and those of the resident ones, are reserved
in the cache: no later request evicts them before the coming verification has run. The last snapshot's copies are
queued layer by layer, the cache's `CopyProgress` raised after each layer's, so that the verification, its experts
wrapped in `AfterCopies`, waits on the GPU in each MoE layer for that layer's copies only
(`wait_for_copies(in_kernels=True)`) — the copies of later layers land while earlier layers compute — rather than
for all of them before it starts (`in_kernels=False`), or reading the experts in place while their copies land
(slower than either: the same bytes cross PCIe twice; docs/BENCHMARKS.md, 2026-12-01 14:03).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from specter_gguf.layers import Experts, Transformer
from specter_gguf.runtime.cache import CopyProgress, ExpertCache


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
    """Counts the draft's recorded routing on the device and prefetches what it counted."""

    def __init__(self, cache: ExpertCache, n_layer: int, n_expert: int, moe_layers: list[int],
                 device: torch.device) -> None:
        self.cache = cache
        self.counts = torch.zeros((n_layer, n_expert), dtype=torch.int32, device=device)
        self._moe = torch.tensor(moe_layers, dtype=torch.long, device=device)
        self._first = (self._moe * n_expert).to(torch.int32)[:, None]  # each MoE layer's first count
        self._hosts: list[torch.Tensor] = []  # snapshot buffers, reused iteration after iteration
        self._pinned = device.type == "cuda"
        self._events: list[torch.cuda.Event | None] = []
        self._pending = 0
        self._seen: set[tuple[int, int]] = set()
        self.prefetched: set[tuple[int, int]] = set()  # this iteration's copies
        self.refused = 0  # this iteration's counted experts that found no evictable slot
        self._ones = torch.ones(0, dtype=torch.int32, device=device)  # made once, grown when a count needs more

    def start(self) -> None:
        """A new iteration: nothing requested yet (a new round of the cache's copy progress)."""
        self.cache.progress.begin()
        self.cache.reserved.clear()
        self._seen.clear()
        self.prefetched.clear()
        self.refused = 0
        self._pending = 0

    def snapshot(self, drafted: torch.Tensor) -> None:
        """Count the routing of the iteration's draft steps so far, `drafted` [steps, n_layer, top_k] (rows of the
        MoE layers read), and enqueue a copy of the counts to the host (after the draft steps enqueued before it)."""
        flat = (drafted.index_select(1, self._moe) + self._first).reshape(-1)
        if self._ones.numel() < flat.numel():
            self._ones = torch.ones(flat.numel(), dtype=torch.int32, device=flat.device)
        self.counts.zero_()
        self.counts.view(-1).index_add_(0, flat, self._ones[:flat.numel()])
        if self._pending == len(self._hosts):
            self._hosts.append(torch.empty(self.counts.shape, dtype=torch.int32, pin_memory=self._pinned))
            self._events.append(torch.cuda.Event() if self._pinned else None)
        self._hosts[self._pending].copy_(self.counts, non_blocking=True)
        if self._events[self._pending] is not None:
            self._events[self._pending].record()
        self._pending += 1

    def plan(self) -> int:
        """Read each snapshot as it lands (waiting for it: the GPU drafts on meanwhile) and request the counted
        experts, the last snapshot's layer by layer with the copy progress raised after each layer's; returns the
        copies issued."""
        issued = 0
        for i in range(self._pending):
            if self._events[i] is not None:
                self._events[i].synchronize()
            issued += self._request(self._hosts[i].numpy(), by_layer=i == self._pending - 1)
        self._pending = 0
        self.cache.progress.landed(self.cache.progress.n_layers)
        return issued

    def _request(self, counts: np.ndarray, by_layer: bool) -> int:
        layers, experts = np.nonzero(counts)
        uses = -counts[layers, experts]
        # most used first, then earlier layers; by_layer: the verification's order, most used first in a layer
        order = np.lexsort((uses, layers)) if by_layer else np.lexsort((layers, uses))
        keys = [key for key in ((int(layers[i]), int(experts[i])) for i in order) if key not in self._seen]
        self._seen.update(keys)
        where = self.cache.where
        self.cache.reserved.update(where[key] for key in keys if key in where)  # before any copy takes a slot
        fresh = [key for key in keys if key not in where]
        if by_layer:
            issued = 0
            for layer, group in itertools.groupby(fresh, key=lambda key: key[0]):
                self.cache.progress.landed(self.cache.position[layer])  # every earlier layer's copies are queued
                issued += self.cache.request(list(group), reserve=True)
        else:
            issued = self.cache.request(fresh, reserve=True)
        self.prefetched.update(key for key in fresh if key in where)
        self.refused += len(fresh) - issued
        return issued

    def wait_for_copies(self, in_kernels: bool) -> None:
        """Publish this iteration's copies: the coming verification reads them from their slots, waiting for them
        on the GPU — all of them before it starts, or (`in_kernels`, its experts wrapped in `AfterCopies`) each
        MoE layer for its own — instead of reading the experts in place while they land."""
        where = self.cache.where
        self.cache.publish(wait=[where[key] for key in self.prefetched if key in where], in_kernels=in_kernels)


@dataclass
class AfterCopies:
    """A MoE layer's experts run once the copies queued for that layer have landed (`CopyProgress.wait`, a GPU-side
    wait inside the verification's CUDA graph); `position`: the layer's index among the MoE layers."""

    experts: Experts
    progress: CopyProgress
    position: int

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.progress.wait(self.position)
        return self.experts(x, ids, weights)


def after_copies(transformer: Transformer, cache: ExpertCache) -> list[Experts | None]:
    """A forward's expert source (`layers.ExpertSource`) whose MoE layers wait for their copies (`AfterCopies`)."""
    out: list[Experts | None] = [None] * len(transformer.blocks)
    for block in transformer.blocks:
        if block.layer in cache.position:
            out[block.layer] = AfterCopies(block.ffn.experts, cache.progress, cache.position[block.layer])
    return out
