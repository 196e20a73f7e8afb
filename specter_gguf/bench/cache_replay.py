"""Expert-cache hit rates replayed over recorded routing: how far the cache's policy, its size and the delay before a
missed expert is in a slot leave a model's decoding from the best any policy could do.

A trace is a generation's forwards in order, each the experts every MoE layer used (`RoutingRecorder`, a routing
observer). `replay` plays the residency path's cache over it (`runtime.offload.OffloadRuntime`): each MoE layer has
`slots` slots (the per-layer partition of lru); a forward's lookup of an expert hits when the expert is in a slot it
can see; after the forward every expert it used is brought in (a resident one refreshed, a missing one evicting the
policy's victim; a long prompt's in waves: `replay`), and forward n sees what the forwards up to n - 1 - `delay`
brought in. On CUDA the engine decodes one step ahead of the host and copies into a slot only after the forward
enqueued before the copy: forward n finds in slots the misses of forward n - 4 and earlier (`ENGINE_DELAY`, read
from the code's order). On the CPU a copy is done before the next forward: delay 0, where the engine's decode hit
rate is the replay's (a test checks). With `spares` (the engine's `--spare-slots`), that many of a layer's slots are
set aside: a forward's misses, in ascending order, take the free ones and are in a slot from the next forward on;
the host takes them into the cache (evicting the policy's victim among the experts that forward did not use) and
frees the spares when it reads the forward's routing: before the next forward with delay 0, on CUDA before the one
after (`SPARE_RETURN`, read from the code's order), so there a spare serves one forward in two. A forward's experts
already resident are refreshed before its misses are brought in, and none of them is a victim. Policies: `lru`,
`lfu` (fewest recent uses; the engine's lfu shares one partition among the layers, here each layer has its own),
`by-uses` (lru, but a forward brings a missed expert in only where it has been used more often lately than the least
recently used expert it would evict: the engine's lru with hybrid where routing does not repeat), `optimal`
(Belady's: the resident expert used again last, or never, goes; no policy that brings in every miss does better).
Uses are counted as the host learns of them, a layer at a time, and every count halves after each `halve_after`
times the slots of all layers in counted uses, as the engine's (`runtime.cache.USES_HALVED_AFTER`).
`replay_served` plays one cache through several generations in turn, as a server keeps it.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import accumulate
from typing import Sequence

import torch

from specter_gguf.runtime.cache import USES_HALVED_AFTER, halve_counts

Forward = dict[int, frozenset[int]]  # MoE layer -> the experts it used
POLICIES = ("lru", "lfu", "by-uses", "optimal")
ENGINE_DELAY = 3
SPARE_RETURN = 2  # on CUDA: forwards after the one that used a spare, the host has taken its expert and freed it


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


def replay(trace: Sequence[Forward], slots: int, policy: str = "lru", delay: int = 0, spares: int = 0,
           prompt_in_waves: bool = False, halve_after: int = USES_HALVED_AFTER) -> float:
    """The hit rate of the lookups of every forward after the first (the prompt's, which fills the cache). The
    prompt's experts come in as any forward's, or with `prompt_in_waves` (a prompt of more than
    `runtime.offload.residency_max_tokens` tokens, which the engine's prefill takes in host-managed waves) as lru
    with each wave of a layer's slots evicting the one before. `halve_after` 0: lifetime use counts."""
    hits, lookups = _replay(trace, {0: prompt_in_waves}, slots, policy, delay, spares, halve_after)
    return hits / lookups if lookups else 0.0


def replay_served(runs: Sequence[tuple[Sequence[Forward], bool]], slots: int, policy: str = "lru", delay: int = 0,
                  spares: int = 0, halve_after: int = USES_HALVED_AFTER) -> float:
    """`replay` of several generations one after another in one cache, each a (trace, prompt_in_waves) pair: the
    hit rate of their decode forwards' lookups. A prompt finds the cache as the generation before left it, but for
    the bring-ins of its last `delay` forwards, which come after the prompt's (the engine settles them when a
    generation ends: on the traces of docs/BENCHMARKS.md 2026-12-08 00:30, 0.1 points at most)."""
    trace = [forward for run, _ in runs for forward in run]
    starts = accumulate((len(run) for run, _ in runs[:-1]), initial=0)
    hits, lookups = _replay(trace, {start: waves for start, (_, waves) in zip(starts, runs)}, slots, policy, delay,
                            spares, halve_after)
    return hits / lookups if lookups else 0.0


def _replay(trace: Sequence[Forward], prompt_waves: dict[int, bool], slots: int, policy: str, delay: int, spares: int,
            halve_after: int) -> tuple[int, int]:
    """Hits and lookups of the forwards that are not prompts (`prompt_waves`: a prompt's forward -> whether its
    experts come in waves)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {POLICIES}")
    if not 0 <= spares < slots:
        raise ValueError(f"spares: 0 to {slots - 1} of {slots} slots, not {spares}")
    if halve_after < 0:
        raise ValueError(f"halve_after: 0 (lifetime counts) or more, not {halve_after}")
    part = slots - spares
    back = 1 + min(delay, SPARE_RETURN - 1)  # forwards until the host takes a spare's expert and frees it
    cache: dict[int, OrderedDict[int, None]] = {}
    uses: dict[tuple[int, int], int] = {}
    halving = halve_after * slots * len({layer for forward in trace for layer in forward})
    counted = 0  # uses counted since the last halving
    copied: list[Forward] = []  # per forward: the misses each layer copied into spares
    hits = lookups = 0
    for n, forward in enumerate(trace):
        if n - back >= 0:  # taken into the cache, before the host brings in that forward's other experts
            f = n - back
            for layer, experts in copied[f].items():
                _bring_in(cache.setdefault(layer, OrderedDict()), layer, experts, part,
                          "lru" if policy == "by-uses" else policy, uses, trace, n, keep=trace[f][layer])
        if n - 1 - delay >= 0:
            f = n - 1 - delay
            for layer, experts in trace[f].items():
                for e in experts:  # the uses the host knows of when it brings them in
                    uses[layer, e] = uses.get((layer, e), 0) + 1
                counted += len(experts)
                if halving and counted >= halving:
                    uses = halve_counts(uses)
                    counted = 0
                waves = prompt_waves.get(f, False)  # (each wave evicts the one before: no expert is kept)
                _bring_in(cache.setdefault(layer, OrderedDict()), layer, experts, part, "lru" if waves else policy,
                          uses, trace, n, keep=frozenset() if waves else None)
        now: Forward = {}
        if n not in prompt_waves:
            for layer, experts in forward.items():
                resident = cache.get(layer, ())
                in_spares = frozenset().union(*(copied[f].get(layer, frozenset()) for f in range(n - back + 1, n)))
                hits += sum(e in resident or e in in_spares for e in experts)
                lookups += len(experts)
                misses = sorted(e for e in experts if e not in resident and e not in in_spares)
                now[layer] = frozenset(misses[:spares - len(in_spares)])
        copied.append(now)
    return hits, lookups


def _bring_in(cache: OrderedDict[int, None], layer: int, experts: frozenset[int], slots: int, policy: str,
              uses: dict[tuple[int, int], int], trace: Sequence[Forward], now: int,
              keep: frozenset[int] | None = None) -> None:
    """`experts` into `cache` (the resident ones refreshed first), each evicting the policy's victim among the
    experts not in `keep` (default: `experts`) when the cache is full."""
    keep = experts if keep is None else keep
    for e in sorted(experts & cache.keys()):
        cache.move_to_end(e)
    for e in sorted(experts - cache.keys()):
        if len(cache) >= slots:
            others = [x for x in cache if x not in keep]  # least recently used first
            if not others:  # the forward used more experts than the layer has slots
                continue
            if policy == "by-uses" and uses.get((layer, e), 0) <= uses.get((layer, others[0]), 0):
                continue
            if policy in ("lru", "by-uses"):
                victim = others[0]
            elif policy == "lfu":
                victim = min(others, key=lambda x: uses.get((layer, x), 0))
            else:
                victim = max(others, key=lambda x: _next_use(trace, layer, x, now))
            del cache[victim]
        cache[e] = None


def _next_use(trace: Sequence[Forward], layer: int, expert: int, now: int) -> int:
    return next((n for n in range(now, len(trace)) if expert in trace[n].get(layer, ())), len(trace))
