"""ExpertCache: a fixed pool of expert slots on the compute device, filled from the ExpertStore.

One device allocation holds `n_slots` slots of `slot_bytes` each; a slot holds one (layer, expert) record
(gate|up|down, see `budget.record_layout`). Slots are grouped in *partitions*: one per MoE layer
(`partition="layer"`, Mixtral-offloading's per-layer cache: a layer only evicts its own experts) or one for
all (`"global"`: hot layers may take more slots). Inside a partition the policy picks the victim:

- `lru`: least recently used;
- `lfu`: fewest recent uses (ties broken by recency): every count halves after each `USES_HALVED_AFTER` × `n_slots`
  counted uses, so that an expert once hot does not outweigh the experts used now (TinyLFU's ageing);
- `static-hot`: lowest count in a routing profile (a profiling run's counts per (layer, expert)); the hottest
  experts are loaded up front (`warm`) and a cold expert brought in for a miss is the next to go, so the hot
  set stays resident.

The **residency table** `table` [layers, n_expert] (int64, on the compute device: the slot of each expert, -1
when none) is what kernels read to find an expert without asking the host (`OffloadRuntime.expert_table`): an
expert whose slot is not published there is read from the store in host memory instead. An entry is published
(`publish`) only once its copy has completed, and cleared on the compute stream before its slot is refilled.

**Spare slots** (`n_spare` per MoE layer, `spares` [layers, n_spare] on the device): free slots, outside every
partition, that a layer's table kernel copies the experts it misses into during the forward (one crossing of PCIe,
resident for the next forward; `kernels.residency_pointers`), entering them in `table` itself. The host learns of
it when the forward's routing comes back (`adopt`: the slot joins the partition, the least recently used slot
becomes the spare) and supersedes the device's entry with its own. So that the device never copies an expert that
a copy is already bringing in, with spares the table holds -2 - slot for an expert whose copy is on its way. The
spares can be lent to the partitions as free slots and taken back (`keep_spares`: hybrid lends them where routing
does not repeat).

CUDA ordering, without host waits:
- copies run on a dedicated copy stream (`non_blocking` from pinned memory);
- each slot has a **ready** event recorded after its copy; compute waits on it with `stream.wait_event` (a
  GPU-side wait) — only when the copy is not already known complete;
- work that reads slots (a forward of the target, a wave of the host-managed path) is followed by a **reads**
  event on the compute stream (`mark_reads`); before a slot is refilled, its old table entry is cleared on the
  compute stream and the copy waits for the last reads event, so the slot is overwritten only after every
  kernel that could read it, and no kernel enqueued after finds it in the table (work in between that reads no
  slot, such as drafting, does not hold the copy back);
- slots in use by the current wave are *pinned* (not evictable) until `release`;
- slots the lookahead buffer asked for are *reserved* for the coming verification: no `request` (a later
  prefetch, lru's refresh) evicts them until the lookahead's next iteration clears them;
- `progress` (a `CopyProgress`) tells kernels, layer by layer, that the copies queued for them have landed: a
  verification captured as one CUDA graph waits in each MoE layer for that layer's copies only (issued after
  its capture), not for all of them before it starts.
Timing: an event pair around every copy on the copy stream (copy time) and around every compute-side wait
(exposed time: how long compute stalled on copies), plus the time `progress`'s waits spent, which they count on
the device themselves. They are read back lazily (`collect`), never forcing a
synchronisation in the decode path except the one deliberate `collect(sync=True)` at the end of a generation.

On the CPU the pool is a host buffer, a copy is a memcpy done at once (all of its time exposed), events are
not needed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np
import torch

from specter_gguf.errors import SpecterError
from specter_gguf.kernels import MAX_SPARES, pace, wait_counter
from specter_gguf.runtime.metrics import OffloadCounters
from specter_gguf.runtime.routing import RoutingProfile
from specter_gguf.runtime.store import ExpertStore

Key = tuple[int, int]  # (layer, expert)
POLICIES = ("lru", "lfu", "static-hot")
# Use counts (lfu's victims, lru's bring-in by uses) halve after this many times the slots in counted uses, so that
# a long-running cache follows the experts used now: replaying 8 generations in one cache (4-layer Qwen1.5-MoE shapes,
# routing that follows the token, 6-21 slots a layer), bringing in by lifetime uses hit 2-9 points less than lru, by
# uses halved after 5 x the slots 2-7 points more (after 3 or 8 x: within 1.9 points of 5; docs/BENCHMARKS.md).
USES_HALVED_AFTER = 5


def halve_counts(counts: dict[Key, int]) -> dict[Key, int]:
    """Every use count halved (the ageing of `USES_HALVED_AFTER`), those that reach 0 dropped."""
    return {key: count // 2 for key, count in counts.items() if count > 1}


class CopyProgress:
    """How far the copies queued for the coming forward have landed, in its MoE layer order, as a counter on the
    device that kernels wait for without the host (`kernels.wait_counter`).

    Each round (`begin`, on the compute stream before the forward that waits) takes a base above every value of
    the rounds before. `landed(p)`, once the copies of the round's first p MoE layers are all queued, raises the
    counter to base + p on the copy stream (so after those copies: stream order); `wait(p)`, enqueued by the
    forward before MoE layer p's experts, waits until it reaches base + p + 1 — for that layer's copies and those
    of the layers before it, not for the later ones. A round ends with `landed(n_layers)`."""

    def __init__(self, n_layers: int, device: torch.device, copy_stream: torch.cuda.Stream | None) -> None:
        self.n_layers, self.copy_stream = n_layers, copy_stream
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.base = torch.zeros(1, dtype=torch.int64, device=device)
        self.waited_ns = torch.zeros(1, dtype=torch.int64, device=device)  # time kernels spent waiting
        self._base = self._landed = 0

    def begin(self) -> None:
        """A new round: the forwards enqueued from now on wait for this round's `landed` calls."""
        self._base += self.n_layers + 1
        self._landed = 0
        self.base.fill_(self._base)

    def landed(self, p: int) -> None:
        """The copies of the round's first `p` MoE layers are all queued (p never decreases within a round)."""
        if p <= self._landed and p < self.n_layers:
            return
        self._landed = p
        if self.copy_stream is None:  # CPU: the copies are done already
            self.counter.fill_(self._base + p)
            return
        with torch.cuda.stream(self.copy_stream):
            self.counter.fill_(self._base + p)

    def wait(self, p: int) -> None:
        """Kernels enqueued after this (on the current stream) run once MoE layer p's copies have landed."""
        wait_counter(self.counter, self.base, p + 1, self.waited_ns)

    def take_waited_s(self) -> float:
        """Seconds kernels waited since the last call (reads the device: at the end of a generation)."""
        ns = int(self.waited_ns.item())
        self.waited_ns.zero_()
        return ns / 1e9


class ExpertCache:
    def __init__(self, store: ExpertStore, n_slots: int, slot_bytes: int, layers: Sequence[int],
                 device: torch.device, policy: str = "lru", partition: str = "layer",
                 profile: RoutingProfile | None = None, counters: OffloadCounters | None = None,
                 n_layer: int | None = None, n_spare: int = 0) -> None:
        """`n_layer`: rows of the residency table (default: the last MoE layer + 1). `n_spare`: spare slots per MoE
        layer (module docstring), taken from the layer's partition (`layer`) or the common one (`global`)."""
        if policy not in POLICIES:
            raise SpecterError(f"unknown cache policy '{policy}'; choose one of {', '.join(POLICIES)}")
        if policy == "static-hot" and profile is None:
            raise SpecterError("the static-hot cache policy needs a routing profile (--routing-profile FILE, "
                               "written by a profiling run with --save-routing-profile)")
        if partition not in ("layer", "global"):
            raise SpecterError(f"partition must be 'layer' or 'global', not {partition!r}")
        if n_slots < (len(layers) if partition == "layer" else 1):
            raise SpecterError(f"an expert cache of {n_slots} slots cannot serve {len(layers)} MoE layers")
        self.store, self.n_slots, self.slot_bytes, self.device = store, n_slots, slot_bytes, device
        self.policy, self.partition, self.profile = policy, partition, profile
        self.counters = counters or OffloadCounters()
        self.cuda = device.type == "cuda"
        # One allocation for every slot (the compute kernels get addresses inside it).
        self.pool = torch.empty(n_slots * slot_bytes, dtype=torch.uint8, device=device)
        self._pool_np = None if self.cuda else self.pool.numpy()
        self.key: list[Key | None] = [None] * n_slots
        self.where: dict[Key, int] = {}
        self._pins = [0] * n_slots
        # slots a coming verification needs (the lookahead buffer's): no request evicts them until it clears them
        self.reserved: set[int] = set()
        self._uses: dict[Key, int] = {}  # recent uses (lfu, bring-in by uses): halved by `_age`
        self._counted = 0  # uses counted since the last halving
        # partitions: ordered least- to most-recently used (OrderedDict of slot -> None)
        if partition == "layer":
            base, extra = divmod(n_slots, len(layers))
            self._part_of_layer, self._parts, s = {}, [], 0
            for i, layer in enumerate(layers):
                n = base + (1 if i < extra else 0)
                self._part_of_layer[layer] = len(self._parts)
                self._parts.append(OrderedDict((j, None) for j in range(s, s + n)))
                s += n
        else:
            self._part_of_layer = {layer: 0 for layer in layers}
            self._parts = [OrderedDict((j, None) for j in range(n_slots))]
        self._free = [[j for j in part] for part in self._parts]
        rows = max(layers) + 1 if n_layer is None else n_layer
        self.table = torch.full((rows, store.n_expert), -1, dtype=torch.int64, device=device)
        self.published = np.zeros((rows, store.n_expert), dtype=bool)  # the host's copy of `table >= 0`
        self._unpublished: dict[int, Key] = {}  # slots loaded, copy possibly in flight, not yet in the table
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._ready = [torch.cuda.Event() for _ in range(n_slots)]
            self._reads: torch.cuda.Event | None = None
        self.position = {layer: p for p, layer in enumerate(layers)}  # a layer's index among the MoE layers
        self.progress = CopyProgress(len(self.position), device, self.copy_stream if self.cuda else None)
        self._ordered = [True] * n_slots  # compute is already ordered after the slot's last copy
        if not 0 <= n_spare <= MAX_SPARES:
            raise SpecterError(f"spare slots per MoE layer: 0 to {MAX_SPARES}, not {n_spare}")
        self.n_spare = n_spare
        self.spares = torch.full((rows, n_spare), -1, dtype=torch.int64, device=device)
        self.arrivals = torch.zeros(rows, dtype=torch.int32, device=device)  # the table kernel's CTA counter
        self._spare_of: dict[int, tuple[int, int]] = {}  # a spare slot -> (layer, its index in the layer's spares)
        self._copy_timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wait_timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.pace_ns_per_byte = 0.0  # a benchmark's slower PCIe (`OffloadRuntime.pace_transfers`): each copy's extra
        # spares waiting for a slot (`publish` retries them): none, every slot being free now
        self._unarmed = [(layer, j) for layer in layers for j in range(n_spare) if not self._arm(layer, j)]
        self.spares_kept = True  # (`keep_spares`)

    # -- sizes and addresses -------------------------------------------------------------------------------
    def capacity(self, layer: int) -> int:
        """Slots layer `layer` can use at once (its partition)."""
        return len(self._parts[self._part_of_layer[layer]])

    def view(self, slot: int) -> torch.Tensor:
        """The bytes of `slot` (uint8, on the device)."""
        return self.pool[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def slot_address(self, slot: int) -> int:
        return self.pool.data_ptr() + slot * self.slot_bytes

    def publish(self, wait: Iterable[int] = (), in_kernels: bool = False) -> int:
        """Enter into `table` the slots whose copies have completed (queried, never waited for) and those of
        `wait`, whose copies the compute stream waits for (GPU-side) or, with `in_kernels`, the kernels reading
        them wait for themselves (`progress`); on the compute stream; returns how many. Kernels enqueued after
        this find them there."""
        for slot in wait:
            if slot in self._unpublished:
                if in_kernels:
                    self._ordered[slot] = True
                else:
                    self.wait(slot)
        done = [slot for slot in self._unpublished
                if not self.cuda or self._ordered[slot] or self._ready[slot].query()]
        for slot in done:
            key = self._unpublished.pop(slot)
            self.table[key].fill_(slot)
            self.published[key] = True
            self._ordered[slot] = True  # a kernel reading it through the table runs after the copy
        self._unarmed = [spare for spare in self._unarmed if not self._arm(*spare)]
        return len(done)

    # -- spare slots ---------------------------------------------------------------------------------------
    def adopt(self, key: Key, slot: int) -> None:
        """A forward's table kernel copied `key` into the spare `slot` (module docstring): the slot joins the
        partition, most recently used, and the next `publish` makes another slot the spare (after the forward's
        other experts are refreshed: the least recently used slot is then one it did not use). The table entry is
        written again, on the compute stream: a later forward may have copied the expert into another spare, and
        that one's adoption finds it resident. When a copy has brought the expert in meanwhile (its table entry,
        written since, no longer names `slot`), `slot` stays the spare."""
        layer, j = self._spare_of.pop(slot)
        self.counters.spare_fetches += 1
        self.counters.bytes_copied += self.store.layouts[layer].nbytes
        if key in self.where:
            self._set_spare(slot, layer, j)
            return
        self.key[slot], self.where[key] = key, slot
        self.table[key].fill_(slot)
        self.published[key] = True
        self._parts[self._part_of_layer[layer]][slot] = None
        self._unarmed.append((layer, j))

    def keep_spares(self, keep: bool) -> None:
        """Keep the spare slots (the next `publish` takes them from the partitions again), or lend them to the
        partitions as free slots, so that a layer caches with every slot it has and a forward copies no miss (its
        table kernel finds no usable spare). Lend only once every forward that may have copied into a spare has
        been adopted."""
        if keep == self.spares_kept:
            return
        self.spares_kept = keep
        if keep:
            self._unarmed = [(layer, j) for layer in self.position for j in range(self.n_spare)]
            return
        for slot, (layer, _) in self._spare_of.items():
            p = self._part_of_layer[layer]
            self._parts[p][slot] = None
            self._free[p].append(slot)
        self._spare_of.clear()
        self._unarmed = []
        self.spares.fill_(-1)

    def _arm(self, layer: int, j: int) -> bool:
        """Make a slot of `layer`'s partition its spare j: a free one, else the least recently used one that no
        copy, wave or coming verification holds (its expert evicted). False when there is none."""
        slot = self._victim(layer, self.reserved.union(self._unpublished))
        if slot is None:
            return False
        old = self.key[slot]
        if old is not None:
            del self.where[old]
            self.counters.cache_evictions += 1
            self.key[slot] = None
            self.table[old].fill_(-1)  # forwards enqueued from now on read it in place: the device may overwrite it
            self.published[old] = False
        del self._parts[self._part_of_layer[layer]][slot]
        self._set_spare(slot, layer, j)
        return True

    def _set_spare(self, slot: int, layer: int, j: int) -> None:
        self._spare_of[slot] = (layer, j)
        self.spares[layer, j].fill_(slot)

    # -- prefetch (gate-prefetch, the lookahead buffer, lru's refresh after a forward, static-hot's warm-up) -
    def request(self, keys: Sequence[Key], priority: Sequence[float] | None = None, prefetch: bool = True,
                reserve: bool = False, by_uses: bool = False) -> int:
        """Make `keys` resident, most important first (`priority`, higher first; default: the order given).
        Returns at once: copies are queued on the copy stream. A key already resident is refreshed (it
        becomes most recently used); a key that finds no evictable slot in its partition (all pinned, reserved
        or taken by higher-priority keys of this request) is skipped, and so, `by_uses`, is one used no more often
        lately (`count_uses` and `acquire` count uses; `USES_HALVED_AFTER`) than the expert it would evict. With
        `reserve`, the keys' slots join `reserved`. Returns the number of copies issued, counted as prefetches
        unless `prefetch` is False (experts brought in because they were just used)."""
        order = list(keys) if priority is None else \
            [k for _, k in sorted(zip(priority, keys), key=lambda pk: -pk[0])]
        taken: set[int] = set()
        issued = 0
        for key in order:
            slot = self.where.get(key)
            if slot is None:
                slot = self._victim(key[0], taken | self.reserved)
                if slot is None:
                    continue
                old = self.key[slot]
                if by_uses and old is not None and self._uses.get(key, 0) <= self._uses.get(old, 0):
                    continue
                self._load(slot, key)
                self.counters.prefetches += prefetch
                issued += 1
            self._touch(slot)
            taken.add(slot)
        if reserve:
            self.reserved |= taken
        return issued

    def count_uses(self, keys: Iterable[Key]) -> None:
        """A forward used `keys` (counted for lfu and bringing in by uses; `acquire` counts its own)."""
        for key in keys:
            self._count_use(key)
        self._age()

    def resident(self, keys: Iterable[Key], include_in_flight: bool = False) -> list[bool]:
        """Which of `keys` are resident now: copy finished (or, with `include_in_flight`, at least issued).
        Queries events only, never waits."""
        out = []
        for key in keys:
            slot = self.where.get(key)
            out.append(slot is not None and (include_in_flight or not self.cuda or self._ordered[slot]
                                             or self._ready[slot].query()))
        return out

    def warm(self) -> int:
        """Load the hottest experts of the routing profile (static-hot), as many as the partitions hold."""
        if self.profile is None:
            return 0
        keys = [k for k in self.profile.hottest() if k[0] in self._part_of_layer]
        return self.request(keys, [self.profile.count(k) for k in keys])

    # -- the decode path -----------------------------------------------------------------------------------
    def acquire(self, layer: int, experts: Sequence[int], reuse: bool = True) -> list[int]:
        """Slots holding `experts` of `layer`, copying the misses; the slots are pinned until `release`.
        `reuse=False` (on-demand mode) copies every expert again. At most `capacity(layer)` experts."""
        slots: list[int] = []
        for e in experts:
            key = (layer, e)
            self.counters.cache_lookups += 1
            self._count_use(key)
            slot = self.where.get(key)
            if slot is not None and reuse:
                self.counters.cache_hits += 1
            else:
                self.counters.cache_misses += 1
                if slot is None:
                    slot = self._victim(layer, ())
                    if slot is None:
                        raise SpecterError(f"expert cache: layer {layer} needs more than its "
                                           f"{self.capacity(layer)} slots at once")
                self._load(slot, key)
            self._pins[slot] += 1
            self._touch(slot)
            slots.append(slot)
        self._age()
        return slots

    def wait(self, slot: int) -> None:
        """Order the compute stream after `slot`'s copy — a GPU-side wait, no host synchronisation. Timed
        with an event pair (the exposed copy time) only when the copy may still be running."""
        if not self.cuda or self._ordered[slot]:
            return
        self._ordered[slot] = True
        if self._ready[slot].query():  # finished already: nothing to wait for (a non-blocking query)
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(self._ready[slot])
        end.record(stream)
        self._wait_timers.append((start, end))

    def mark_reads(self) -> None:
        """Kernels that may read slots are enqueued: a refill waits for them (an event on the compute stream)."""
        if self.cuda:
            self._reads = torch.cuda.Event()
            self._reads.record(torch.cuda.current_stream(self.device))

    def release(self, slots: Sequence[int]) -> None:
        """The kernels reading `slots` are enqueued: unpin them (a refill of the slot is ordered after them)."""
        self.mark_reads()
        for slot in slots:
            self._pins[slot] -= 1
        if len(self._copy_timers) + len(self._wait_timers) > 4096:
            self.collect(sync=False)

    def collect(self, sync: bool = False) -> None:
        """Add the finished copies' and waits' times to the counters. `sync=True` first waits for the device
        — the one deliberate host synchronisation, at the end of a generation, so the figures are complete."""
        if not self.cuda:
            return
        if sync:
            torch.cuda.synchronize(self.device)
            self.counters.copy_exposed_s += self.progress.take_waited_s()
        for timers, field in ((self._copy_timers, "copy_s"), (self._wait_timers, "copy_exposed_s")):
            keep = []
            for start, end in timers:
                if end.query():
                    setattr(self.counters, field, getattr(self.counters, field) + start.elapsed_time(end) / 1000)
                else:
                    keep.append((start, end))
            timers[:] = keep

    # -- internals -----------------------------------------------------------------------------------------
    def _touch(self, slot: int) -> None:
        part = self._parts[self._part_of_layer[self.key[slot][0]]] if self.partition == "layer" else self._parts[0]
        part.move_to_end(slot)

    def _count_use(self, key: Key) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1
        self._counted += 1

    def _age(self) -> None:
        """Halve every use count once `USES_HALVED_AFTER` × `n_slots` uses are counted since the last halving."""
        if self._counted >= USES_HALVED_AFTER * self.n_slots:
            self._uses = halve_counts(self._uses)
            self._counted = 0

    def _score(self, slot: int) -> float:
        key = self.key[slot]
        if self.policy == "lfu":
            return self._uses.get(key, 0)
        return self.profile.count(key)  # static-hot

    def _victim(self, layer: int, excluded: Iterable[int]) -> int | None:
        p = self._part_of_layer[layer]
        free = self._free[p]
        if free:
            return free.pop()
        candidates = (s for s in self._parts[p] if self._pins[s] == 0 and s not in excluded)
        if self.policy == "lru":
            return next(candidates, None)  # the partition is ordered least recently used first
        return min(candidates, key=self._score, default=None)  # ties: least recently used (min is stable)

    def _load(self, slot: int, key: Key) -> None:
        """Copy `key`'s record into `slot` (evicting what it held)."""
        old = self.key[slot]
        if old is not None:
            if old != key:
                del self.where[old]
                self.counters.cache_evictions += 1
            self._unpublished.pop(slot, None)
            if self.published[old] or self.n_spare:  # no kernel enqueued from now on reads the slot through the table
                self.table[old].fill_(-1)
                self.published[old] = False
        self.key[slot], self.where[key] = key, slot
        self._unpublished[slot] = key
        if self.n_spare:  # on its way: no spare takes it meanwhile
            self.table[key].fill_(-2 - slot)
        chunks = self.store.chunks(*key)
        base = slot * self.slot_bytes
        nbytes = sum(c.shape[0] for _, c in chunks)
        self.counters.bytes_copied += nbytes
        self.counters.copies += 1
        if not self.cuda:  # a memcpy; compute runs after it on the same thread: all of it is exposed
            t0 = time.perf_counter()
            for offset, src in chunks:
                self._pool_np[base + offset:base + offset + src.shape[0]] = src
            dt = time.perf_counter() - t0
            self.counters.copy_s += dt
            self.counters.copy_exposed_s += dt
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            if self._reads is not None:  # never overwrite a slot a kernel may still read
                self.copy_stream.wait_event(self._reads)
            start.record(self.copy_stream)
            for offset, src in chunks:
                self.pool[base + offset:base + offset + src.shape[0]].copy_(src, non_blocking=True)
            if self.pace_ns_per_byte:
                pace(None, nbytes, self.pace_ns_per_byte, self.device)
            end.record(self.copy_stream)
            self._ready[slot].record(self.copy_stream)
        self._ordered[slot] = False
        self._copy_timers.append((start, end))
