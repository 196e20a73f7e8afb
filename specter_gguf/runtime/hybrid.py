"""Hybrid expert execution: a forward's routed experts that have no slot on the device, computed by the host's
CPU from the expert store instead of read over PCIe (the native `specter_cpu_experts_*`).

A MoE layer of a small batch (decoding, verification) hands the host the (token, expert) pairs of some of its
experts without a slot: the ones with the fewest tokens (a CPU pays per token, a read over PCIe once per expert),
as many as make the CPU and the link finish their shares about together, by the costs measured at start-up
(`HybridChoice.costs_ns`). One kernel chooses them on the device from the residency table and the layer's own
routing and writes their pairs to pinned host memory for the worker thread (`CpuExperts.post`), so it works
inside a CUDA graph; the layer's pointer table then leaves them out. The GPU runs the other experts meanwhile,
then one kernel waits for the worker's sum and adds it (`CpuExperts.collect`, `OffloadRuntime.from_residency`). A
layer that hands nothing over pays for the two kernels only: the second reads no host memory then.

What the link carries depends on whether routing repeats from token to token (`offload.REUSED_SHARE`, judged by
the host from the decode steps it has read back, taken to repeat until they show otherwise):
- where it repeats, the spare slots take their misses before the split, and lru brings in every expert a forward
  used, the CPU's too: they will be wanted again. (Measured with the split first and the CPU's left out instead,
  at the usual scale, 16 GiB, H100: hits fell from 93% to 81% / 87% and a token took 7.45 / 5.99 ms instead of
  3.47 / 3.77, greedy / sampled.)
- where it does not, the spare slots join their layers' cache (`ExpertCache.keep_spares`): the split weighs every
  miss, the link's share is read in place, and lru brings in after the forward only the experts (the CPU's too)
  used more often lately (`cache.USES_HALVED_AFTER`) than the least recently used one they would evict: the split
  halves the link's bytes where it gives the CPU half the misses, and without repetition a copy of each miss mostly
  evicts an expert as likely to be wanted next, while the copies share PCIe with the reads in place. (Measured on
  lifetime counts, before they halved, at --attn-output-scale 0.3, 16 GiB, H100: 13.39 / 12.92 ms a token, greedy /
  sampled, against 17.05 / 17.10 bringing in every miss of the link's and none of the CPU's, whose copies kept the
  copy stream busy 18.5 ms a token; the link moved 196 / 156 MiB a token instead of 589, and hits rose from 51% to
  58% / 62%; docs/BENCHMARKS.md 2026-12-07 22:25.)
At the usual scale, routing repeats and the same build keeps the spares and brings in every expert used (3.59 /
3.84 ms a token at 16 GiB against 3.61 / 3.90 before bringing in by uses existed, same call).

The CPU's sum of an expert agrees with the GPU's to float32 rounding (different summation orders); on the CPU
device both are the same native function.

`--hybrid auto`, the default, measures at start-up, on CUDA and for experts of at least 1 MiB, one expert's
feed-forward for one token on the CPU (hand-off included) against copying the expert's record to the device, and
turns hybrid on where the split would ever give the CPU an expert: where the CPU's one-token expert takes less than
two copies (of a layer's two one-token misses, the CPU then takes one; an H100 host measured 379 µs against 319).
On that host hybrid on was 5-34% faster than transfers alone in every row of 2026-12-05 23:51 but one, 4% slower
where the cache hit 99.2% (docs/BENCHMARKS.md). `on` turns it on whatever the measurement (the split still weighs it),
`off` keeps every miss on PCIe.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from specter_gguf import native
from specter_gguf.config import ModelConfig
from specter_gguf.errors import SpecterError
from specter_gguf.kernels import WAIT_TIMEOUT_NS, SpareSlots, _aligned, _call, _ptr, _spare_slots
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime.budget import RecordLayout, moe_layers, record_layout
from specter_gguf.runtime.store import ExpertStore

HYBRID_CHOICES = ("auto", "on", "off")
DEFAULT_HYBRID = "auto"
EVERY_MISS = (0, 0, 1)  # split costs (ns) under which the CPU computes every missed expert
MEASURED_TOKENS = 8  # the start-up measurement times an expert for one token and for this many
# auto measures only experts of at least this size: a smaller one crosses PCIe in tens of microseconds, where the
# measurement is mostly latency on both sides and its outcome a coin toss from load to load
AUTO_MIN_RECORD_BYTES = 1 << 20
# beside a GPU, the worker polls without pause this long after a post (an answer, an `arm`): a forward's layers post
# a few hundred microseconds apart and the host enqueues forwards milliseconds ahead of the GPU reaching them. Beside
# a forward on the CPU it sleeps between posts instead: a spinning thread would take a core from the products.
HOT_NS = 50_000_000


def check_mode(mode: str) -> None:
    """Refuse a `--hybrid` mode that is not one of HYBRID_CHOICES, naming them."""
    if mode not in HYBRID_CHOICES:
        raise SpecterError(f"unknown --hybrid mode '{mode}'; choose one of {', '.join(HYBRID_CHOICES)}")


class CpuExperts:
    """The native worker that computes the experts a forward of up to `max_tokens` tokens hands the host (module
    docstring), with its mailbox in pinned host memory (CUDA) or plain host memory (CPU)."""

    def __init__(self, store: ExpertStore, layouts: dict[int, RecordLayout], cfg: ModelConfig, device: torch.device,
                 max_tokens: int, n_threads: int = 0) -> None:
        f, lb = native.ffi(), native.lib()
        self.device, self.d_model, self.top_k, self.max_tokens = device, cfg.n_embd, cfg.n_expert_used, max_tokens
        size = f.new("size_t *")
        native.check(lb.specter_cpu_experts_mailbox_size(max_tokens, cfg.n_expert_used, cfg.n_embd, size),
                     "the CPU experts' mailbox size")
        # 256 bytes of slack: the mailbox starts at an address aligned to 256
        self._buffer = torch.empty(int(size[0]) + 256, dtype=torch.uint8, pin_memory=device.type == "cuda")
        start = -self._buffer.data_ptr() % 256
        self.mailbox = self._buffer[start:start + int(size[0])]
        handle = f.new("specter_cpu_experts **")
        native.check(lb.specter_cpu_experts_new(cfg.n_layer, cfg.n_expert, cfg.n_embd, cfg.n_ff_exp, cfg.n_expert_used,
                                                max_tokens, _ptr(self.mailbox), self.mailbox.numel(), n_threads,
                                                HOT_NS if device.type == "cuda" else 0, handle),
                     "starting the CPU experts' worker")
        self._handle = handle[0]
        self.waited_ns = torch.zeros(1, dtype=torch.int64, device=device)  # collects' waits for answers (`waited_s`)
        # the worker stops before its mailbox is freed: when this object goes, or at the interpreter's exit
        self._stop = weakref.finalize(self, _free, lb, self._handle, self._buffer)
        try:
            for layer, layout in layouts.items():
                tables = [f.new("uint64_t[]", row) for row in store.addresses(layer)]
                gate, up, down = (int(p.type) for p in layout.parts)
                native.check(lb.specter_cpu_experts_set_layer(self._handle, layer, tables[0], gate, tables[1], up,
                                                              tables[2], down), f"the CPU experts of layer {layer}")
        except BaseException:
            self.close()
            raise

    @property
    def handle(self) -> Any:
        if not self._stop.alive:
            raise SpecterError("the CPU experts' worker was stopped (its runtime was closed)")
        return self._handle

    def arm(self) -> None:
        """Keep the worker polling without pause: forwards that post are about to be enqueued."""
        native.check(native.lib().specter_cpu_experts_arm(self.handle), "arming the CPU experts' worker")

    def post(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
             routed: torch.Tensor, costs: tuple[int, int, int], on_cpu: torch.Tensor, cpu_routed: torch.Tensor,
             spares: SpareSlots | None = None) -> None:
        """Hand the worker layer `layer`'s pairs of the missed experts that the CPU computes (native
        `specter_cpu_experts_post`, on the device: no host synchronisation): of those the layer routes `routed`
        (int32 [n_expert]) tokens to that have no slot (`slot_of` < 0, int64), the fewest-token ones, as many as make
        the later of the CPU's and the link's finish the earliest by `costs` (ns: an expert's part paid once, a
        token's, the link's per expert; EVERY_MISS gives the CPU every miss). Writes those experts into `on_cpu`
        (bool [n_expert]) and their token counts into `cpu_routed` (int32); the GPU's pointer table then skips them
        (`kernels.residency_pointers`' `skip`). With the layer's `spares`, the misses those spares will take are
        the link's before the split."""
        T = x.shape[0]
        x32 = _aligned(x.float())
        ids32, w32 = ids.to(torch.int32).contiguous(), weights.float().contiguous()
        args = (self.handle, layer, _ptr(x32, "float *"), _ptr(ids32, "int32_t *"), _ptr(w32, "float *"), T,
                _ptr(slot_of, "int64_t *"), _ptr(routed, "int32_t *"),
                native.ffi().new("specter_hybrid_costs *", costs), _spare_slots(spares), _ptr(on_cpu, "uint8_t *"),
                _ptr(cpu_routed, "int32_t *"))
        _call("cpu_experts_post", args, self.device, f"handing layer {layer}'s experts to the CPU")

    def collect(self, out: torch.Tensor, ids: torch.Tensor, on_cpu: torch.Tensor) -> None:
        """`out` [T, n_embd] float32 += the worker's sum for the last post (of `ids`, which wrote `on_cpu`), once it
        has come, in the rows of the tokens with a pair on the CPU; the time spent waiting for it is counted
        (`waited_s`)."""
        ids32 = ids.to(torch.int32).contiguous()
        args = (self.handle, _ptr(out, "float *"), _ptr(ids32, "int32_t *"), _ptr(on_cpu, "uint8_t *"), out.shape[0],
                WAIT_TIMEOUT_NS, _ptr(self.waited_ns, "int64_t *"))
        _call("cpu_experts_collect", args, self.device, "the CPU experts' answer")

    def busy_s(self) -> float:
        """The time the worker has spent computing since it started."""
        ns = native.ffi().new("int64_t *")
        native.check(native.lib().specter_cpu_experts_busy_ns(self.handle, ns), "the CPU experts' busy time")
        return ns[0] / 1e9

    def waited_s(self) -> float:
        """The time collects have waited for the worker's answers since it started: on CUDA the GPU's (reads the
        device: at the end of a generation)."""
        return int(self.waited_ns.item()) / 1e9

    def check(self) -> None:
        """Raise the first error the worker met (it answers zeros after one)."""
        native.check(native.lib().specter_cpu_experts_status(self.handle), "the CPU experts' worker")

    def close(self) -> None:
        self._stop()


def _free(lib: Any, handle: Any, mailbox: torch.Tensor) -> None:
    """Stop the worker and free its handle; `mailbox` is only held until then."""
    lib.specter_cpu_experts_free(handle)


@dataclass
class HybridChoice:
    """What `--hybrid` decided at start-up, the measurement behind it (µs), and the costs by which each MoE layer
    splits its missed experts between the CPU and the link (`costs_ns`). The CPU's time for an expert of t tokens is
    modelled as `cpu_us_per_expert + t * cpu_us_per_token` (its weights are read once, then each token adds its
    products), from the times measured for one token and for MEASURED_TOKENS."""

    on: bool
    cpu_us_per_expert: float | None = None  # an expert's feed-forward on the CPU: the part paid once
    cpu_us_per_token: float | None = None   # ... and the part paid per token
    copy_us: float | None = None  # one expert's record copied to the device, measured
    link_us: float | None = None  # the link's time for one expert that the split weighs: copy_us, or a paced link's
    why: str = ""  # the reason, where nothing was measured

    def costs_ns(self) -> tuple[int, int, int]:
        """The split's costs for `CpuExperts.post` (ns); unmeasured (the CPU device), EVERY_MISS."""
        if self.cpu_us_per_token is None:
            return EVERY_MISS
        return (round(1000 * self.cpu_us_per_expert), round(1000 * self.cpu_us_per_token),
                max(1, round(1000 * self.link_us)))

    def describe(self) -> str:
        if self.cpu_us_per_token is None:
            return "hybrid " + ("on" if self.on else "off") + (f" ({self.why})" if self.why else "")
        paced = f", paced to {self.link_us:.0f} µs" if self.link_us != self.copy_us else ""
        measured = (f"an expert on the CPU {self.cpu_us_per_expert:.0f} µs + {self.cpu_us_per_token:.0f} µs a token, "
                    f"its copy to the device {self.copy_us:.0f} µs{paced}")
        if not self.on:
            return (f"hybrid off ({measured}: the CPU takes two copies' time or more for one token, so the split "
                    "would never give it an expert)")
        return (f"hybrid on ({measured}: each MoE layer of a decode step, a verification or a short prefill splits "
                "its missed experts between the CPU, fewest tokens first, and the link, so that both finish together)")


def measure(cpu: CpuExperts, store: ExpertStore, layer: int, reps: int = 5) -> tuple[float, float, float]:
    """(µs of one expert's feed-forward on the CPU for one token and for MEASURED_TOKENS, hand-off included: medians
    of `reps` after a warm-up; µs to copy its record to the device, `ExpertStore.copy_us`), expert 0 of `layer`.
    CUDA only."""
    dev = cpu.device
    times = []
    for T in (1, MEASURED_TOKENS):
        x = torch.randn(T, cpu.d_model, device=dev) * 0.1
        ids = torch.full((T, cpu.top_k), -1, dtype=torch.int32, device=dev)
        ids[:, 0] = 0
        weights = torch.ones(ids.shape, device=dev)
        no_slot = torch.full((store.n_expert,), -1, dtype=torch.int64, device=dev)
        routed = torch.zeros(store.n_expert, dtype=torch.int32, device=dev)
        routed[0] = T
        on_cpu = torch.zeros(store.n_expert, dtype=torch.bool, device=dev)
        cpu_routed = torch.zeros_like(routed)
        out = torch.zeros(T, cpu.d_model, device=dev)
        seconds = []
        cpu.arm()
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            cpu.post(layer, x, ids, weights, no_slot, routed, EVERY_MISS, on_cpu, cpu_routed)
            cpu.collect(out, ids, on_cpu)
            torch.cuda.synchronize(dev)
            seconds.append(time.perf_counter() - t0)
        times.append(sorted(seconds[1:])[reps // 2] * 1e6)
    cpu.check()
    return times[0], times[1], store.copy_us(layer, dev)


def worth_it(cpu_one_token_us: float, link_us: float) -> bool:
    """Whether the split would ever give the CPU an expert: of a layer's two one-token misses it takes one when the
    CPU's time for it is under the link's for both (`cpu_takes` in native/src/cpu_experts.h)."""
    return cpu_one_token_us < 2 * link_us


def start_hybrid(mode: str, store: ExpertStore, layouts: dict[int, RecordLayout], cfg: ModelConfig,
                 device: torch.device, max_tokens: int) -> tuple[CpuExperts | None, HybridChoice]:
    """The worker (for forwards of up to `max_tokens` tokens) and the choice for `--hybrid mode` (one of
    HYBRID_CHOICES: `runtime.offload.load_offloaded` checks it before loading). On the CPU device `auto` is off (the
    experts run on the CPU either way) and `on` hands every missed expert to the worker (the same algorithm as on a
    GPU, which the CPU build tests); `auto` is off too for experts under AUTO_MIN_RECORD_BYTES, and wherever the
    CPU takes two copies' time or more for one token (`worth_it`)."""
    if mode == "off":
        return None, HybridChoice(False)
    if mode == "auto" and device.type != "cuda":
        return None, HybridChoice(False, why="auto: on the CPU device every expert runs on the CPU either way")
    if mode == "auto" and max(r.nbytes for r in layouts.values()) < AUTO_MIN_RECORD_BYTES:
        return None, HybridChoice(False, why=f"auto: experts under {AUTO_MIN_RECORD_BYTES >> 20} MiB cross PCIe in "
                                  "tens of microseconds")
    cpu = CpuExperts(store, layouts, cfg, device, max_tokens)
    if device.type != "cuda":
        return cpu, HybridChoice(True, why=f"--hybrid on: every missed expert of a batch of up to {max_tokens} "
                                 "tokens")
    try:
        one, many, copy_us = measure(cpu, store, min(layouts))
    except BaseException:
        cpu.close()
        raise
    per_token = max(0.0, (many - one) / (MEASURED_TOKENS - 1))
    choice = HybridChoice(mode == "on" or worth_it(one, copy_us), max(0.0, one - per_token), per_token, copy_us,
                          copy_us)
    if not choice.on:
        cpu.close()
        return None, choice
    return cpu, choice


def probe_hybrid(f: GGUFFile, mode: str, device: torch.device, max_tokens: int) -> HybridChoice:
    """What `--hybrid mode` would choose for `f` on `device` (`plan`): the start-up measurement of a load, over one
    MoE layer's experts only (pinned for it, then freed)."""
    cfg = ModelConfig.from_gguf(f)
    layer = moe_layers(f, cfg)[0]
    layouts = {layer: record_layout(f, cfg, layer)}
    store = ExpertStore(f, layouts, cfg.n_expert, device, pin="lazy", progress=False)
    try:
        cpu, choice = start_hybrid(mode, store, layouts, cfg, device, max_tokens)
        if cpu is not None:
            cpu.close()
        return choice
    finally:
        store.close()
