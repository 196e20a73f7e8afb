"""Expert-cache hit rates replayed over recorded routing: how far the cache's policy, its size and the delay before a
missed expert is in a slot leave a model's decoding from the best any policy could do.

A trace is a generation's forwards in order, each the experts every MoE layer used (`RoutingRecorder`, a routing
observer). `replay` plays the residency path's cache over it (`runtime.offload.OffloadRuntime`): each MoE layer has
`slots` slots (the per-layer partition of lru); a forward's lookup of an expert hits when the expert is in a slot
it can see; after the forward every expert it used is brought in (a resident one refreshed, a missing one evicting
the policy's victim), and forward n sees what the forwards up to n - 1 - `delay` brought in. On CUDA the engine
decodes one step ahead of the host and copies into a slot only after the forward enqueued before the copy: forward
n finds in slots the misses of forward n - 4 and earlier (`ENGINE_DELAY`, read from the code's order). On the CPU a
copy is done before the next forward: delay 0, where the engine's decode hit rate is the replay's (a test checks).
Policies: `lru`, `lfu` (uses so far; the engine's lfu shares one partition among the layers, here each layer has its
own), `optimal` (Belady's: the resident expert used again last, or never, goes; no policy that brings in every miss
does better).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

Forward = dict[int, frozenset[int]]  # MoE layer -> the experts it used
POLICIES = ("lru", "lfu", "optimal")
ENGINE_DELAY = 3


class RoutingRecorder:
    """A routing observer that records each forward's experts per layer (reads the ids back: a measurement, not the
    engine's path). A layer seen again starts the next forward."""

    def __init__(self) -> None:
        self.forwards: list[Forward] = []
        self._current: Forward = {}

    def __call__(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if layer in self._current:
            self.forwards.append(self._current)
            self._current = {}
        self._current[layer] = frozenset(int(e) for e in ids.reshape(-1).tolist() if e >= 0)

    def take(self) -> list[Forward]:
        """The forwards recorded since the last call."""
        out = self.forwards + ([self._current] if self._current else [])
        self.forwards, self._current = [], {}
        return out


def replay(trace: Sequence[Forward], slots: int, policy: str = "lru", delay: int = 0) -> float:
    """The hit rate of the lookups of every forward after the first (the prompt's, which fills the cache)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {POLICIES}")
    cache: dict[int, OrderedDict[int, None]] = {}
    uses: dict[tuple[int, int], int] = {}
    hits = lookups = 0
    for n, forward in enumerate(trace):
        if n - 1 - delay >= 0:
            for layer, experts in trace[n - 1 - delay].items():
                for e in experts:  # the uses the host knows of when it brings them in
                    uses[layer, e] = uses.get((layer, e), 0) + 1
                _bring_in(cache.setdefault(layer, OrderedDict()), layer, experts, slots, policy, uses, trace, n)
        if n > 0:
            for layer, experts in forward.items():
                hits += sum(e in cache.get(layer, ()) for e in experts)
                lookups += len(experts)
    return hits / lookups if lookups else 0.0


def _bring_in(cache: OrderedDict[int, None], layer: int, experts: frozenset[int], slots: int, policy: str,
              uses: dict[tuple[int, int], int], trace: Sequence[Forward], now: int) -> None:
    for e in sorted(experts):
        if e in cache:
            cache.move_to_end(e)
            continue
        if len(cache) >= slots:
            others = [x for x in cache if x not in experts]  # least recently used first
            if not others:  # the forward used more experts than the layer has slots
                continue
            if policy == "lru":
                victim = others[0]
            elif policy == "lfu":
                victim = min(others, key=lambda x: uses.get((layer, x), 0))
            else:
                victim = max(others, key=lambda x: _next_use(trace, layer, x, now))
            del cache[victim]
        cache[e] = None


def _next_use(trace: Sequence[Forward], layer: int, expert: int, now: int) -> int:
    return next((n for n in range(now, len(trace)) if expert in trace[n].get(layer, ())), len(trace))
