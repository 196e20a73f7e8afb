"""Offloaded experts: the `Experts` of a MoE layer served from the ExpertStore through the ExpertCache,
and the baseline decoding modes built on them (no speculation):

- `on-demand`: no cache for small batches: each expert is read in place from host memory, every time;
- `lru`: Mixtral-offloading's per-layer LRU cache (a hit reads a slot; a miss reads host memory once and brings
  the expert into a slot for the next steps; with a draft, the lookahead buffer brings in what the draft routes
  to instead, and the speculative decoder's plain steps bring in their misses);
- `gate-prefetch`: the host-managed path: each layer's experts are copied in before it computes, and the *next*
  MoE layer's router is applied to this layer's input to prefetch its predicted experts (Mixtral-offloading's
  speculative loading).

Small batches (decoding, verification) of on-demand and lru run from the cache's residency table with no host
synchronisation (`OffloadRuntime.from_residency`), so their forwards replay as CUDA graphs. Big batches
(prefill chunks) and gate-prefetch take the host-managed waves of `OffloadedExperts`, with one deliberate host
synchronisation per MoE layer: the layer's expert ids are read back (`tolist`) because the host decides which
records to copy (gate-prefetch reads the next layer's predicted ids in the same transfer); compute waits for
copies with `stream.wait_event`.

Computing from slots: slots keep the GGUF type of the file; the grouped kernel `kernels.moe_ffn` reads them
through a per-layer pointer table (from the residency table on the device, or of the slots a wave acquired),
exactly as the resident engine runs its experts; the dense path (big batches) views float slots as torch
tensors and dequantizes quantized ones, again as the resident engine does.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from specter_gguf.config import ModelConfig
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import EXPERT_PARTS, GGUFFile, expert_tensor_name
from specter_gguf.kernels import (MAX_SPARES, ExpertTable, QuantizedTensor, SlotPool, SpareSlots, moe_ffn, pace,
                                  residency_pointers)
from specter_gguf.layers import FeedForward, MoE, ResidentExperts, Router, Transformer
from specter_gguf.runtime.budget import (FIT_MARGIN, MemoryPlan, RecordLayout, fitted_budget, moe_layers,
                                         plan_memory, record_layout, slots_after_load)
from specter_gguf.runtime.cache import POLICIES, ExpertCache
from specter_gguf.runtime.hybrid import DEFAULT_HYBRID, CpuExperts, HybridChoice, start_hybrid
from specter_gguf.runtime.hybrid import check_mode as check_hybrid_mode
from specter_gguf.runtime.metrics import OffloadCounters
from specter_gguf.runtime.routing import RoutingProfile
from specter_gguf.runtime.store import ExpertStore
from specter_gguf.sizes import format_size

log = logging.getLogger(__name__)

MODES = ("on-demand", "lru", "gate-prefetch")
OFFLOAD_CHOICES = (*MODES, "none")  # what --offload takes: a mode, or "none" (every expert on the device)
_TORCH_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
DENSE_MIN_TOKENS_PER_EXPERT = ResidentExperts.DENSE_MIN_TOKENS_PER_EXPERT
SPARES_WITH_LOOKAHEAD = 2  # lru's default spare slots per MoE layer under speculative decoding (its rows' count)
# Routing repeats from token to token where decode steps share at least this share of their experts with the step
# before, on average over the last REUSE_FORWARDS or so (an exponential average). Then hybrid's spare slots take
# their misses before the split and lru brings in every expert a forward used, as they will be wanted again; else
# the spare slots join their layers' cache, the link's share of the misses is read in place, and lru brings in only
# an expert used more often than the one it would evict (`runtime.hybrid`). Between the means measured on 4-layer
# Qwen1.5-MoE files with random weights (bench prompts, 48 tokens greedy and sampled): 0.36-0.37 at the usual scale,
# 0.16-0.17 at --attn-output-scale 0.3.
REUSED_SHARE = 0.27
REUSE_FORWARDS = 8


def default_spare_slots(top_k: int, lookahead: bool = False) -> int:
    """The spare slots lru wants per MoE layer without --spare-slots (`spares_per_layer` caps them by the layer's
    room). Plain decoding: two steps' experts, 2 × top-k (at most MAX_SPARES). A spare goes back to the cache when
    the host reads the routing of the forward that filled it, two forwards later on CUDA; with fewer spares, a
    step's misses beyond those free wait for a slot until the fourth step (measured: 8 spares against 2 at top-k 4,
    docs/BENCHMARKS.md 2026-12-06 05:48). Speculative decoding (`lookahead`) keeps SPARES_WITH_LOOKAHEAD: its
    lookahead prefetches into the same slots, and 8 spares there were 19% / 38% slower than 2 (greedy / sampled,
    16 GiB, docs/BENCHMARKS.md 2026-12-06 07:47)."""
    return SPARES_WITH_LOOKAHEAD if lookahead else min(MAX_SPARES, 2 * top_k)


def spares_per_layer(n_slots: int, n_moe_layers: int, top_k: int, requested: int | None = None,
                     lookahead: bool = False) -> int:
    """The spare slots each MoE layer gets in lru mode: `requested`, at most what its share of the `n_slots` holds
    beyond its top-k (one forward's experts); by default `default_spare_slots`, at most half of that, so that the
    cache keeps as many slots beyond a step's experts as the spares take (replayed on a 4-layer Qwen1.5-MoE file at
    14 slots a layer, 8 spares hit 54% of greedy lookups against 2 spares' 75%: docs/BENCHMARKS.md 2026-12-06
    05:48)."""
    room = max(0, n_slots // n_moe_layers - top_k)
    if requested is None:
        return min(default_spare_slots(top_k, lookahead), room // 2)
    return min(requested, room)


def residency_max_tokens(cfg: ModelConfig) -> int:
    """The most tokens of a forward that `OffloadRuntime.from_residency` serves (`OffloadedExperts`: fewer (token,
    expert) pairs than DENSE_MIN_TOKENS_PER_EXPERT per expert): decode steps, verifications, short prefills."""
    return max(1, (DENSE_MIN_TOKENS_PER_EXPERT * cfg.n_expert - 1) // cfg.n_expert_used)


class OffloadedExperts:
    """One MoE layer's routed experts, served through the cache (see the module docstring). Computes exactly
    as `layers.ResidentExperts` does, from slots or host memory instead of whole tensors: the native grouped
    kernel (`kernels.moe_ffn`) for small batches, from the residency table (or, for gate-prefetch, from the slots
    of its waves), one GEMM per expert (ascending, `index_add_`) for batches of `DENSE_MIN_TOKENS_PER_EXPERT`
    tokens per expert or more — so the output is bitwise the resident engine's, except where gate-prefetch's
    kernel path needs more distinct experts than the layer has slots: it runs in waves, each accumulating into
    the output, which may change the rounding of a token's k-term sum."""

    def __init__(self, runtime: OffloadRuntime, layer: int, layout: RecordLayout) -> None:
        self.runtime, self.layer, self.layout = runtime, layer, layout
        self.next_router: Router | None = None  # gate-prefetch: the next MoE layer's router
        self.next_layer: int | None = None
        self.types = tuple(int(p.type) for p in layout.parts)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        if rt.mode != "gate-prefetch" and x.shape[0] <= residency_max_tokens(rt.cfg):
            return rt.from_residency(self.layer, x, ids, weights)
        cache = rt.cache
        flat = ids.reshape(-1)
        n = flat.shape[0]
        predicted: list[int] = []
        if self.next_router is not None:
            pred, _ = self.next_router(x)
            # HOST SYNC (deliberate): this layer's ids and the next layer's predicted ids, in one transfer
            host = torch.cat([flat, pred.reshape(-1)]).tolist()
            host_ids, predicted = host[:n], host[n:]
        else:
            host_ids = flat.tolist()  # HOST SYNC (deliberate): the ids decide which experts to copy in
        counts: dict[int, int] = {}
        for e in host_ids:
            counts[e] = counts.get(e, 0) + 1
        needed = sorted(counts)
        # hits first: they compute while the misses are still being copied
        resident = cache.resident([(self.layer, e) for e in needed], include_in_flight=True)
        needed = [e for e, r in zip(needed, resident) if r] + [e for e, r in zip(needed, resident) if not r]
        dense = n >= DENSE_MIN_TOKENS_PER_EXPERT * rt.cfg.n_expert
        if dense:
            order = torch.argsort(flat, stable=True)  # positions grouped by expert, experts ascending
            spans, start = {}, 0
            for e in sorted(counts):
                spans[e] = (start, counts[e])
                start += counts[e]
            results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        out = torch.empty((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        cap = cache.capacity(self.layer)
        for w0 in range(0, len(needed), cap):  # waves, when a batch needs more experts than the layer's slots
            wave = needed[w0:w0 + cap]
            slots = cache.acquire(self.layer, wave, reuse=rt.mode != "on-demand")
            if w0 == 0 and predicted and self.next_layer is not None:
                ranked = sorted(set(predicted), key=lambda e: (-predicted.count(e), e))
                cache.request([(self.next_layer, e) for e in ranked])  # queued after this layer's misses
            for slot in slots:
                cache.wait(slot)
            if dense:
                k = ids.shape[1]
                w_flat = weights.reshape(-1)
                for e, slot in zip(wave, slots):
                    s, c = spans[e]
                    pos = order[s:s + c]
                    tokens = pos // k
                    results[e] = (tokens, self.ffn(slot)(x[tokens]) * w_flat[pos, None])
            else:
                moe_ffn(x, ids, weights, self.table(dict(zip(wave, slots))), out=out, accumulate=w0 > 0)
            cache.release(slots)
        if dense:
            out.zero_()
            for e in sorted(results):  # ascending experts: the summation order of ResidentExperts._dense
                tokens, y = results[e]
                out.index_add_(0, tokens, y)
        return out

    def table(self, slots: dict[int, int]) -> ExpertTable:
        """The kernel's pointer table: expert e -> its slot's gate|up|down addresses; 0 for experts not in
        `slots` (they contribute nothing)."""
        cache, cfg = self.runtime.cache, self.runtime.cfg
        rows = [[0] * cfg.n_expert for _ in self.layout.parts]
        for e, slot in slots.items():
            base = cache.slot_address(slot)
            for row, part in zip(rows, self.layout.parts):
                row[e] = base + part.offset
        ptrs = torch.tensor(rows, dtype=torch.int64)
        if cache.cuda:  # pinned staging: an asynchronous copy, ordered on the compute stream, no host wait
            ptrs = ptrs.pin_memory().to(cache.device, non_blocking=True)
        return ExpertTable(ptrs, self.types, cfg.n_embd, cfg.n_ff_exp, (cache.pool,))

    def ffn(self, slot: int) -> FeedForward:
        """The expert in `slot` as torch matrices (the dense path): float parts are views of the slot,
        quantized ones dequantized as `ResidentExperts._matrix` does (to float32)."""
        raw = self.runtime.cache.view(slot)
        mats = []
        for p in self.layout.parts:
            b = raw[p.offset:p.offset + p.nbytes]
            if p.type in _TORCH_TYPES:
                mats.append(b.view(_TORCH_TYPES[p.type]).view(p.shape))
            else:
                q = QuantizedTensor(b, int(p.type), p.shape)
                mats.append(q.dequantize(torch.float32))
        return FeedForward.of(*mats, stack=False)


@dataclass
class OffloadOptions:
    mode: str = "lru"
    policy: str = "lru"
    profile: RoutingProfile | None = None
    pin: str = "background"
    # a speculative decoder's lookahead buffer fills the cache: lru does not bring in what a forward read in
    # place (those copies would compete with the lookahead's; measured slower, docs/BENCHMARKS.md 2026-12-01 14:03),
    # except in the decoder's plain steps, which no lookahead serves (`OffloadRuntime.bringing_in`)
    lookahead: bool = False
    hybrid: str = DEFAULT_HYBRID  # HYBRID_CHOICES: missed experts of small batches computed on the CPU (runtime.hybrid)
    spare_slots: int | None = None  # per MoE layer, lru mode: slots a forward copies its misses into (None:
    # default_spare_slots)


class OffloadRuntime:
    """Everything the offloaded model shares: plan, store, cache, counters.

    Small batches (decoding, verification) run from the residency table without the host (`from_residency`): a
    layer's pointer table is computed on the device from the table — a published expert from its slot, any other
    read in place from the store in host memory (zero-copy over PCIe: no copy, no slot, no wait). In lru mode the
    same kernel first copies the layer's misses into its spare slots, as many as it has free (`spare_slots` per
    layer; `cache` module docstring), and they are computed from there: they cross PCIe once and the next forward
    finds them in a slot (with hybrid on, only while routing repeats: REUSED_SHARE). The layer adds its routing into
    `routed`, the experts it copied into `fetched`; a forward is bracketed by `begin` (publishes finished copies,
    zeroes both) and `end` (an asynchronous copy of them to the host), and `settle` reads those copies once they
    have landed: it hands the cache the experts copied into spares (`ExpertCache.adopt`), counts lookups, hits and
    misses against the table the forward saw and, in lru mode without a lookahead buffer (with one: for the forwards
    enqueued `bringing_in`), brings the other experts it used into the cache (least recently used out), so the next
    forwards find them in slots. Big batches (prefill) and gate-prefetch take `OffloadedExperts`' host-managed waves
    instead."""

    HOST_BUFFERS = 8  # forwards whose routing may be in flight to the host at once

    def __init__(self, f: GGUFFile, cfg: ModelConfig, plan: MemoryPlan, device: torch.device,
                 options: OffloadOptions, progress: bool) -> None:
        self.f, self.cfg, self.plan, self.device, self.options = f, cfg, plan, device, options
        self.mode = options.mode
        self.layers = moe_layers(f, cfg)
        self.layouts = {i: record_layout(f, cfg, i) for i in self.layers}
        self.counters = OffloadCounters()
        self.store = ExpertStore(f, self.layouts, cfg.n_expert, device, options.pin, progress)
        self.cache: ExpertCache = None  # type: ignore[assignment]  # made by `start`, after the weights
        self.cpu_experts: CpuExperts | None = None  # with hybrid on (`start`)
        self.hybrid = HybridChoice(False)
        self.experts: dict[int, OffloadedExperts] = {}
        self._pointers: dict[int, tuple[torch.Tensor, SlotPool, SpareSlots | None]] = {}

    def make_experts(self, cfg: ModelConfig, layer: int, w: Any) -> OffloadedExperts:
        """The `ExpertsFactory` given to `load_transformer`: nothing of the experts goes to the device."""
        w.bar.update(sum(w.f.tensor(expert_tensor_name(layer, p)).n_bytes for p in EXPERT_PARTS))
        self.experts[layer] = OffloadedExperts(self, layer, self.layouts[layer])
        return self.experts[layer]

    def start(self, n_slots: int, transformer: Transformer) -> None:
        opts = self.options
        partition = "layer" if opts.policy == "lru" else "global"
        n_spare = (spares_per_layer(n_slots, len(self.layers), self.cfg.n_expert_used, opts.spare_slots,
                                    opts.lookahead) if self.mode == "lru" else 0)
        if self.mode == "lru" and opts.spare_slots is not None and n_spare < opts.spare_slots:
            log.warning("--spare-slots %d: each MoE layer's %d slots hold %d beside a token's %d experts; using %d",
                        opts.spare_slots, n_slots // len(self.layers), n_spare, self.cfg.n_expert_used, n_spare)
        self.cache = ExpertCache(self.store, n_slots, self.plan.slot_bytes, self.layers, self.device,
                                 opts.policy, partition, opts.profile, self.counters, n_layer=self.cfg.n_layer,
                                 n_spare=n_spare)
        cuda = self.device.type == "cuda"
        # a forward's routing: tokens per (layer, expert), of those the ones the CPU computed (hybrid), and the
        # experts copied into spare slots (slot + 1)
        self._routing = torch.zeros((3, self.cfg.n_layer, self.cfg.n_expert), dtype=torch.int32, device=self.device)
        self.routed, self.cpu_routed, self.fetched = self._routing
        self._on_cpu = torch.zeros((self.cfg.n_layer, self.cfg.n_expert), dtype=torch.bool, device=self.device)
        self._ones = torch.ones(residency_max_tokens(self.cfg) * self.cfg.n_expert_used, dtype=torch.int32,
                                device=self.device)
        # whether routing repeats (REUSED_SHARE; until decode steps have shown otherwise, the order measured at the
        # usual scale)
        self.routing_repeats = True
        self._reused: float | None = None  # the average share (REUSED_SHARE)
        self._last_step: np.ndarray | None = None  # the experts of the last settled forward, if a decode step
        self._free_hosts = [torch.empty_like(self._routing, device="cpu", pin_memory=cuda)
                            for _ in range(self.HOST_BUFFERS)]
        self._in_flight: list[tuple[torch.cuda.Event | None, torch.Tensor, np.ndarray, bool]] = []
        self._bringing_in = False  # inside `bringing_in`
        self._seen = self.cache.published.copy()
        self.last_used = np.zeros_like(self._seen)  # the experts the last settled forward used (residency path)
        self.last_missed = np.zeros_like(self._seen)  # ... of them, those it read in place (not in a slot)
        if self.mode == "gate-prefetch":
            moes = [b.ffn for b in transformer.blocks if isinstance(b.ffn, MoE)]
            for cur, nxt in zip(moes, moes[1:]):
                if isinstance(cur.experts, OffloadedExperts):
                    cur.experts.next_router, cur.experts.next_layer = nxt.router, nxt.layer
        if opts.policy == "static-hot":
            self.cache.warm()
        hybrid = opts.hybrid if self.mode != "gate-prefetch" else "off"  # its waves never hand experts over
        self.cpu_experts, self.hybrid = start_hybrid(hybrid, self.store, self.layouts, self.cfg, self.device,
                                                     residency_max_tokens(self.cfg))

    # -- the residency path (no host synchronisation) ---------------------------------------------------
    def from_residency(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s routed experts for a small batch, each from its slot or from host memory, or with hybrid
        on computed by the CPU (`runtime.hybrid`: which misses it takes, and whether the spare slots take theirs
        first) while the GPU's experts run."""
        routed, cpu = self.routed[layer], self.cpu_experts
        if cpu is None or x.shape[0] > cpu.max_tokens:
            out = moe_ffn(x, ids, weights, self.expert_table(layer, ids))
            self._pace_reads(layer, routed, None)
            return out
        on_cpu = self._on_cpu[layer]
        routed.index_add_(0, ids.reshape(-1), self._ones[:ids.numel()])  # the split's token counts
        spares = self._layer_pointers(layer)[2]
        cpu.post(layer, x, ids, weights, self.cache.table[layer], routed, self.hybrid.costs_ns(), on_cpu,
                 self.cpu_routed[layer], spares)
        out = moe_ffn(x, ids, weights, self.expert_table(layer, ids, on_cpu))
        self._pace_reads(layer, routed, on_cpu)  # the CPU works on meanwhile, as it would beside a slower link
        cpu.collect(out, ids, on_cpu)
        return out

    def _pace_reads(self, layer: int, routed: torch.Tensor, on_cpu: torch.Tensor | None) -> None:
        """With `pace_transfers`: the layer's reads in place take as long as they would over the slower link."""
        if not self.cache.pace_ns_per_byte:
            return
        read = (routed > 0) & (self.cache.table[layer] < 0)
        if on_cpu is not None:
            read &= ~on_cpu
        read |= self.fetched[layer] > 0  # copied into a spare slot by the table kernel
        n_bytes = read.sum(dtype=torch.int64) * self.layouts[layer].nbytes
        pace(n_bytes.reshape(1), 0, self.cache.pace_ns_per_byte, self.device)

    def pace_transfers(self, gbps: float) -> float:
        """Benchmark only: make every expert transfer (copies into slots, reads in place) as slow as a PCIe link of
        `gbps` GB/s, by a wait after each of (bytes × (1/gbps - 1/the measured rate)); returns the rate measured
        here (GB/s; no wait where it is slower than `gbps`). Call before the first forward: CUDA graphs keep the
        pacing they were captured with."""
        if self.device.type != "cuda":
            raise SpecterError("pacing stands for a slower PCIe link: it needs a CUDA device")
        if not gbps > 0:
            raise SpecterError(f"a PCIe rate must be more than 0 GB/s, not {gbps}")
        layer = self.layers[0]
        nbytes = self.layouts[layer].nbytes
        measured = nbytes / (1000 * self.store.copy_us(layer, self.device))  # bytes per ns = GB/s
        self.cache.pace_ns_per_byte = max(0.0, 1 / gbps - 1 / measured)
        if self.hybrid.copy_us is not None and gbps < measured:  # the split weighs the slower link: bytes at gbps
            self.hybrid.link_us = nbytes / (1000 * gbps)
        return measured

    def expert_table(self, layer: int, ids: torch.Tensor, on_cpu: torch.Tensor | None = None) -> ExpertTable:
        """The grouped kernel's pointer table of `layer` for a forward routed `ids`, computed on the device from the
        residency table; the same kernel first copies misses into the layer's free spare slots (lru) and adds the
        routing into `routed`. With `on_cpu` (a hand-off's, which counted the routing itself), the experts the CPU
        computes get no pointer (the kernel skips them) and no spare."""
        host, pool, spares = self._layer_pointers(layer)
        ptrs = residency_pointers(self.cache.table[layer], host, pool, ids,
                                  self.routed[layer] if on_cpu is None else None, spares, on_cpu)
        return ExpertTable(ptrs, self.experts[layer].types, self.cfg.n_embd, self.cfg.n_ff_exp, (self.cache.pool,))

    def _layer_pointers(self, layer: int) -> tuple[torch.Tensor, SlotPool, SpareSlots | None]:
        """(host addresses [3, n_expert] on the device, where the layer's records lie in the slot pool, its spare
        slots) of `layer`, made once (before a CUDA graph reads them: `prepare_graphs`)."""
        if layer in self._pointers:
            return self._pointers[layer]
        host = torch.tensor(self.store.addresses(layer), dtype=torch.int64)
        parts = self.layouts[layer].parts
        pool = SlotPool(self.cache.pool.data_ptr(), self.plan.slot_bytes, tuple(p.offset for p in parts),
                        tuple(p.nbytes for p in parts))
        cache = self.cache
        spares = None if not cache.n_spare else SpareSlots(cache.spares[layer, :cache.n_spare], self.fetched[layer],
                                                           cache.arrivals[layer:layer + 1])
        self._pointers[layer] = (host.to(self.device), pool, spares)
        return self._pointers[layer]

    def prepare_graphs(self) -> None:
        """Everything a captured forward reads, made now: every layer pinned and its pointers on the device."""
        for layer in self.layers:
            self._layer_pointers(layer)

    def begin(self) -> None:
        """Before a forward: the spare slots kept or lent to the cache (REUSED_SHARE), the copies that have landed
        published; `routed` counts this forward's routing."""
        self.settle()
        if self.cache.n_spare and self._spares_wanted() != self.cache.spares_kept:
            if self.cache.spares_kept:  # every forward that may have copied into a spare adopted first (a wait)
                self.settle(wait=True)
            self.cache.keep_spares(self._spares_wanted())
        self.cache.publish()
        self._seen = self.cache.published.copy()  # the table this forward reads, for its hits and misses
        self._routing.zero_()
        if self.cpu_experts is not None:
            self.cpu_experts.arm()

    def _spares_wanted(self) -> bool:
        """Whether the spare slots are kept: unless hybrid is on and routing does not repeat (REUSED_SHARE)."""
        return self.routing_repeats or self.cpu_experts is None

    def adopt_spares(self) -> None:
        """After a forward that no `end` follows (a CUDA graph's warm-up, whose routing is not counted): adopt
        the experts it copied into spare slots, waiting for it, before the next `begin` clears the record."""
        if self.cache.n_spare:
            self._adopt(self.fetched.cpu().numpy())

    def _adopt(self, fetched: np.ndarray) -> None:
        """Hand the cache the experts a forward's table kernels copied into spare slots (`fetched`: slot + 1)."""
        for layer, e in zip(*np.nonzero(fetched)):
            self.cache.adopt((int(layer), int(e)), int(fetched[layer, e]) - 1)

    def end(self) -> None:
        """After a forward was enqueued: its routing goes to the host without waiting (read by `settle`), and
        refills of slots wait for its kernels."""
        self.cache.mark_reads()
        if not self._free_hosts:
            self.settle(wait=True, keep=self.HOST_BUFFERS - 1)
        host = self._free_hosts.pop()
        host.copy_(self._routing, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        bring_in = self.mode == "lru" and (self._bringing_in or not self.options.lookahead)
        self._in_flight.append((event, host, self._seen, bring_in))

    @contextmanager
    def bringing_in(self) -> Iterator[None]:
        """Forwards enqueued inside bring the experts they used into the cache (lru mode), as they do without a
        lookahead buffer: a speculative decoder's plain steps, whose misses no lookahead prefetches."""
        self._bringing_in = True
        try:
            yield
        finally:
            self._bringing_in = False

    def settle(self, wait: bool = False, keep: int = 0) -> None:
        """Account for the forwards whose routing has reached the host (with `wait`: all but `keep`)."""
        cache, c = self.cache, self.counters
        while len(self._in_flight) > keep:
            event, host, seen, bring_in = self._in_flight[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self._in_flight.pop(0)
            counts, on_cpu, fetched = host.numpy()
            self._adopt(fetched)  # before the bring-in below finds them missing
            used = self.last_used = counts > 0
            if self.cpu_experts is not None:  # only hybrid's order and bring-in depend on it
                self._track_repeats(counts)
            self._free_hosts.append(host)
            self.last_missed = used & ~seen
            read_in_place = used & ~seen & ~(on_cpu > 0) & ~(fetched > 0)
            c.cache_lookups += int(used.sum())
            c.cache_hits += int((used & seen).sum())
            c.cache_misses += int((used & ~seen).sum())
            c.cpu_expert_pairs += int(on_cpu.sum())
            for layer in map(int, np.flatnonzero(used.any(1))):
                keys = [(layer, int(e)) for e in np.flatnonzero(used[layer])]
                c.zero_copy_bytes += self.layouts[layer].nbytes * int(read_in_place[layer].sum())
                cache.count_uses(keys)
                if bring_in:  # hits refreshed first (no miss evicts them), misses brought in for next time
                    cache.request(sorted(keys, key=lambda k: k not in cache.where), prefetch=False,
                                  by_uses=not self.routing_repeats)  # (REUSED_SHARE)

    def _track_repeats(self, counts: np.ndarray) -> None:
        """Update `routing_repeats` (REUSED_SHARE) from a settled forward's routing counts: decode steps (one token)
        only, each against the step before it, so that a verification's or a prefill's many experts do not pass for
        repetition."""
        used = counts > 0
        step = int(counts.sum()) == self.cfg.n_expert_used * len(self.layers)
        before, self._last_step = self._last_step, used if step else None
        if before is None or not step:
            return
        share = float((used & before).sum()) / int(used.sum())
        self._reused = share if self._reused is None else self._reused + (share - self._reused) / REUSE_FORWARDS
        self.routing_repeats = self._reused >= REUSED_SHARE

    def stats(self, start: OffloadCounters) -> OffloadCounters:
        """Counters since `start`. Waits for the device once to read the copy timings (end of a generation)."""
        self.settle(wait=True)
        self.cache.collect(sync=True)
        if self.cpu_experts is not None:
            self.cpu_experts.check()
            self.counters.cpu_expert_s = self.cpu_experts.busy_s()
            self.counters.cpu_wait_s = self.cpu_experts.waited_s()
        return self.counters.since(start)

    def close(self) -> None:
        if self.cpu_experts is not None:
            self.cpu_experts.close()
        self.store.close()


def load_offloaded(f: GGUFFile, device: torch.device, ctx_size: int, progress: bool, gpu_budget: int | str | None,
                   offload: str | None, cache_policy: str | None = None,
                   routing_profile: RoutingProfile | str | None = None, pin: str = "background",
                   draft: GGUFFile | None = None, hybrid: str | None = None,
                   spare_slots: int | None = None) -> tuple[Transformer, OffloadRuntime | None, MemoryPlan | None]:
    """Plan the budget (counting the experts of `draft` when speculative decoding will hold them), then load:
    the plain way when the model fits (and no mode is forced), else with offloaded experts. Without a budget on
    CUDA, a model that does not fit the device's free memory is offloaded within it (`fitted_budget`). `hybrid`:
    HYBRID_CHOICES (`runtime.hybrid`; default DEFAULT_HYBRID). `spare_slots`: per MoE layer, lru mode
    (`OffloadRuntime`; default `default_spare_slots`).
    Returns (transformer, runtime or None, plan or None: no budget was given or needed)."""
    from specter_gguf.models import check_architecture, load_transformer

    check_architecture(f)
    if offload is not None and offload not in OFFLOAD_CHOICES:
        raise SpecterError(f"unknown --offload mode '{offload}'; choose one of {', '.join(MODES)} or none")
    if cache_policy is not None and cache_policy not in POLICIES:
        raise SpecterError(f"unknown cache policy '{cache_policy}'; choose one of {', '.join(POLICIES)}")
    if hybrid is not None:
        check_hybrid_mode(hybrid)
    if spare_slots is not None and not 0 <= spare_slots <= MAX_SPARES:
        raise SpecterError(f"--spare-slots takes 0 to {MAX_SPARES} slots per MoE layer, not {spare_slots}")
    cache_options = " and ".join(name for name, value in (("--cache-policy", cache_policy),
                                                          ("--routing-profile", routing_profile),
                                                          ("--hybrid on", "on" if hybrid == "on" else None),
                                                          ("--spare-slots", spare_slots))
                                 if value is not None)
    if gpu_budget is None:
        fit = fitted_budget(f, device, ctx_size, draft) if device.type == "cuda" else None
        if fit is None:
            if offload not in (None, "none"):
                raise SpecterError(f"--offload {offload} needs a GPU memory budget: give --gpu-budget SIZE")
            if cache_options:
                raise SpecterError(f"{cache_options}: only for offloaded experts, and without a budget the whole model "
                                   f"is loaded on {device}: give --gpu-budget SIZE to offload them")
            return load_transformer(f, device, progress), None, None
        need = (f"the model needs {format_size(fit.whole_model)} on {device} at a context of "
                f"{ctx_size} tokens and {format_size(fit.budget + FIT_MARGIN)} is free")
        if offload == "none":
            raise SpecterError(f"{need}; drop --offload none to offload its routed experts, or lower -c/--ctx-size")
        log.warning("%s: its routed experts are offloaded within a budget of %s (the free memory less a %s "
                    "margin); --gpu-budget sets another", need, format_size(fit.budget), format_size(FIT_MARGIN))
        gpu_budget = fit.budget
    plan = plan_memory(f, gpu_budget, ctx_size, device.type, draft=draft)
    if offload is None:
        offload = "none" if plan.fits_all else "lru"
    if spare_slots and offload not in ("lru", "none"):
        raise SpecterError(f"--spare-slots: only with --offload lru (--offload {offload} keeps no slot for a miss to "
                           "be copied into as a forward runs)")
    if hybrid == "on" and offload == "gate-prefetch":
        raise SpecterError("--hybrid on: not with --offload gate-prefetch, whose layers copy in every expert they use; "
                           "use --offload lru")
    if offload == "none":
        if not plan.fits_all:
            raise SpecterError(f"the model needs {format_size(plan.whole_model)} on the "
                               f"device, more than the budget {format_size(plan.budget)}; offload its experts "
                               f"(--offload lru) or raise --gpu-budget")
        if cache_options:
            raise SpecterError(f"{cache_options}: only for offloaded experts, and the model fits the budget "
                               f"{format_size(plan.budget)} whole: give --offload lru (or a smaller budget)")
        return load_transformer(f, device, progress), None, plan
    plan.check()
    where = "the routing profile"
    if isinstance(routing_profile, (str, bytes)) or hasattr(routing_profile, "__fspath__"):
        where = str(routing_profile)
        routing_profile = RoutingProfile.load(routing_profile)  # type: ignore[arg-type]
    policy = cache_policy or ("static-hot" if routing_profile is not None else "lru")
    cfg = ModelConfig.from_gguf(f)
    if routing_profile is not None:
        routing_profile.check(str(f.path), cfg.n_layer, cfg.n_expert, where)
    options = OffloadOptions(offload, policy, routing_profile, pin, lookahead=draft is not None,
                             hybrid=hybrid or DEFAULT_HYBRID,
                             spare_slots=spare_slots)
    runtime = OffloadRuntime(f, cfg, plan, device, options, progress)
    try:
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        transformer = load_transformer(f, device, progress, make_experts=runtime.make_experts,
                                       host_embedding=plan.host_embedding > 0)
        if device.type == "cuda":  # size the pool from what the weights really took
            n_slots = slots_after_load(plan, torch.cuda.memory_allocated(device) - before)
        else:
            n_slots = plan.n_slots
        need = plan.n_moe_layers * plan.top_k
        if n_slots < need:
            raise SpecterError(f"after loading, the non-expert weights took more than planned: {n_slots} expert "
                               f"slots fit in {format_size(plan.budget)}, at least {need} are needed; raise "
                               f"--gpu-budget")
        plan.n_slots = n_slots
        runtime.start(n_slots, transformer)
    except BaseException:
        runtime.close()
        raise
    return transformer, runtime, plan
