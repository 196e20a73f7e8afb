"""The public engine: load a GGUF MoE model once, then compute logits or generate text many times; read a model
file's hyperparameters or plan its GPU memory without loading it. The CLI and the server use only this module's API
(with `sampling`, `chat` and `api`)."""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch

from specter_gguf.config import ModelConfig, check_draft
from specter_gguf.errors import ContextFullError, SpecterError
from specter_gguf.decoding import Decoder, PlainDecoder, StepDecoder
from specter_gguf.gguf_file import GGUFFile, is_routed_expert
from specter_gguf.layers import ExpertSource, KVCache, RoutingObserver, Transformer
from specter_gguf.models import check_architecture
from specter_gguf.runtime.budget import MemoryPlan, plan_memory
from specter_gguf.runtime.cache import POLICIES  # the values of Model.load's cache_policy
from specter_gguf.runtime.hybrid import DEFAULT_HYBRID, HYBRID_CHOICES, HybridChoice, probe_hybrid  # ... of its hybrid
from specter_gguf.runtime.hybrid import check_mode as check_hybrid_mode
from specter_gguf.runtime.offload import OFFLOAD_CHOICES, load_offloaded  # ... and of its offload
from specter_gguf.runtime.offload import MAX_SPARES, SPARES_WITH_LOOKAHEAD  # ... and of its spare_slots
from specter_gguf.runtime.offload import residency_max_tokens
from specter_gguf.runtime.routing import DeviceRoutingCounts, RoutingProfile
from specter_gguf.sampling import Sampler, SamplingParams
from specter_gguf.sizes import format_size, parse_size
from specter_gguf.speculation.depth import (  # ... and of its n_draft: 1 to MAX_FIXED_DEPTH or "auto"
    MAX_DEPTH, MAX_FIXED_DEPTH, parse_depth)
from specter_gguf.speculation.draft_files import DRAFT_TYPES, draft_file_or_type, resolve_draft  # its draft: file or type
from specter_gguf.tokenizer import IdsOnlyTokenizer, Tokenizer

__all__ = ["Model", "Generation", "GenerationStats", "SHIPPED_MODEL", "SHIPPED_DRAFT", "resolve_device", "tpot_ms",
           "read_config", "FileSummary", "summarize_file", "plan_budget", "MemoryPlan", "ModelConfig",
           "RoutingProfile", "OFFLOAD_CHOICES", "POLICIES", "HYBRID_CHOICES", "DEFAULT_HYBRID", "plan_hybrid",
           "MAX_SPARES", "SPARES_WITH_LOOKAHEAD",
           "MAX_DEPTH", "MAX_FIXED_DEPTH", "parse_depth", "DRAFT_TYPES", "draft_file_or_type", "resolve_draft"]

log = logging.getLogger(__name__)

SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen2moe.gguf"
SHIPPED_DRAFT = "q4_k_m"  # the CLI's draft for the shipped model (made on first use: speculation.draft_files)
# the summary says the draft did not pay where depth auto ran plain steps in this share of a generation's iterations,
# of at least this many (a short generation's few iterations are mostly the chooser's first measurements)
DRAFT_IDLE_SHARE, DRAFT_IDLE_AFTER = 0.75, 16


def resolve_device(device: str | None) -> torch.device:
    """`None` picks CUDA when present, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise SpecterError(f"unknown device '{device}'; use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecterError("--device cuda was asked for but PyTorch sees no CUDA GPU; use --device cpu")
    return torch.device(device)


def _open_model(path: str | os.PathLike[str]) -> GGUFFile:
    """`path` opened and checked, its architecture one we run."""
    f = GGUFFile(path)
    check_architecture(f)
    return f


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The hyperparameters of the model in `path`, checked as `Model.load` checks them; nothing is loaded."""
    return ModelConfig.from_gguf(_open_model(path))


@dataclass(frozen=True)
class FileSummary:
    """What a GGUF file holds, from its header (no tensor data is read)."""

    path: Path
    n_files: int                   # more than one: a split model, opened from its first file (`GGUFFile.paths`)
    file_bytes: int                # all its files'
    name: str | None               # general.name
    architecture: str              # general.architecture, whether we run it or not
    n_tensors: int
    bytes_by_type: dict[str, int]  # tensor bytes per GGML type name, the largest first
    routed_expert_bytes: int
    other_bytes: int               # every tensor that is not a routed expert


def summarize_file(path: str | os.PathLike[str]) -> FileSummary:
    """`path`'s `FileSummary`; its hyperparameters are `read_config`'s."""
    f = GGUFFile(path)
    by_type: Counter[str] = Counter()
    experts = other = 0
    for t in f.tensors.values():
        by_type[t.type.name] += t.n_bytes
        if is_routed_expert(t.name):
            experts += t.n_bytes
        else:
            other += t.n_bytes
    return FileSummary(f.path, len(f.paths), f.file_bytes, f.get("general.name"), f.architecture, len(f.tensors),
                       dict(by_type.most_common()), experts, other)


def plan_budget(path: str | os.PathLike[str], gpu_budget: int | str, ctx_size: int | None = None,
                device: str = "cuda", draft: str | os.PathLike[str] | None = None) -> MemoryPlan:
    """How `Model.load(path, gpu_budget=..., draft=...)` would split `gpu_budget` on `device` ("cuda" or "cpu"),
    no weights loaded (a `draft` type not made yet is made, as a load would): non-expert weights, KV cache,
    workspace, draft experts, expert-cache slots (`runtime.budget`). A budget below the minimum is planned too:
    `MemoryPlan.check()` refuses it."""
    parse_size(gpu_budget)  # a size the user got wrong fails before the file is read
    f = _open_model(path)
    ctx = _context(ModelConfig.from_gguf(f), ctx_size)
    draft_file = GGUFFile(resolve_draft(path, draft)) if draft is not None else None
    plan = plan_memory(f, gpu_budget, ctx, device, draft_file)  # refuses a draft of another model first
    if draft_file is not None:
        _warn_if_no_smaller(f, draft_file)
    return plan


def plan_hybrid(path: str | os.PathLike[str], hybrid: str, device: str = "cuda") -> HybridChoice:
    """What `Model.load(path, hybrid=...)` would choose on `device` for offloaded experts, measured as a load
    measures it (`runtime.hybrid.probe_hybrid`: one layer's experts are read for it)."""
    check_hybrid_mode(hybrid)
    f = _open_model(path)
    return probe_hybrid(f, hybrid, resolve_device(device), residency_max_tokens(ModelConfig.from_gguf(f)))


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    """The stop strings of a `stop` argument or OpenAI-style field: none, one text or a list of texts."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise SpecterError("'stop' must be a text or a list of texts")
    return list(stop)


def _warn_if_no_smaller(target: GGUFFile, draft: GGUFFile) -> None:
    """A draft is worth its room on the device only where its experts are smaller than the model's (`--draft f16`
    on an F16 model makes a full-size copy): say so, it runs all the same."""
    target_bytes, draft_bytes = target.routed_expert_bytes, draft.routed_expert_bytes
    if 0 < target_bytes <= draft_bytes:
        log.warning("the draft %s keeps experts of %s on the device, no fewer bytes than the model's own (%s): "
                    "speculation with it only adds work; a quantized draft such as q4_k_m or q2_k is smaller",
                    draft.path.name, format_size(draft_bytes), format_size(target_bytes))


def _context(cfg: ModelConfig, ctx_size: int | None) -> int:
    """The context a run uses for `ctx_size` (`ModelConfig.context_size`), with llama.cpp's warning past the
    context the model was trained on (RoPE positions past it are untried)."""
    ctx = cfg.context_size(ctx_size)
    if ctx > cfg.n_ctx_train:
        log.warning("the context of %d tokens exceeds the %d the model was trained on; text past %d tokens may "
                    "degrade", ctx, cfg.n_ctx_train, cfg.n_ctx_train)
    return ctx


def tpot_ms(decode_s: float, generated: int) -> float | None:
    """Time per output token: the decode phase (first generated token to last) per decode step; None without a
    decode step or decode time."""
    steps = generated - 1
    return 1000.0 * decode_s / steps if steps > 0 and decode_s > 0 else None


@dataclass
class GenerationStats:
    """Timings of one generation. `prefill_s` runs from the start to the first generated token, `decode_s`
    from there to the last; TPOT and tokens/s describe the decode phase."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ctx_size: int = 0                   # the context the model ran with
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # expert offloading (None when the model runs without it; see specter_gguf.runtime.metrics)
    offload: str | None = None          # the --offload mode
    cache_policy: str | None = None
    cache_slots: int | None = None
    cache_lookups: int | None = None
    cache_hits: int | None = None
    cache_misses: int | None = None
    cache_evictions: int | None = None
    prefetches: int | None = None
    bytes_copied: int | None = None     # host -> device, whole generation (prefill included)
    zero_copy_bytes: int | None = None  # experts read in place from host memory by the kernels
    spare_slots: int | None = None      # slots per MoE layer kept for misses to be copied into as forwards run
    spare_fetches: int | None = None    # ... missed experts copied into them (bytes counted in bytes_copied)
    spares_lent: bool | None = None     # ... lent to their layers' cache at the end (hybrid: routing did not repeat)
    hybrid: bool | None = None          # missed experts of small batches computed on the CPU (runtime.hybrid)
    cpu_expert_pairs: int | None = None  # ... the (token, expert) pairs it computed
    cpu_expert_s: float | None = None    # ... the time its worker spent on them
    cpu_wait_s: float | None = None      # ... the time forwards waited for its answers (on CUDA the GPU's)
    copy_s: float | None = None         # time copies took on the copy stream
    copy_exposed_s: float | None = None  # time compute waited for copies
    copy_hidden_s: float | None = None   # copy_s - copy_exposed_s: overlapped with compute
    peak_gpu_bytes: int | None = None   # torch.cuda.max_memory_allocated since the model was loaded
    # speculative decoding (None without a draft; see specter_gguf.speculation)
    draft_accepted: int | None = None   # drafted tokens the target accepted and the generation handed out (a stop
                                        # string may end it among an iteration's accepted ones)
    gpu_s: float | None = None          # the GPU's time in the decode forwards (CUDA events around the steps, or
                                        # drafting and verification: their waits for copies and the CPU included)
    draft_s: float | None = None        # time spent drafting (GPU time on CUDA)
    verify_s: float | None = None       # time spent verifying, the lookahead's prefetch planning included
    iterations: list[tuple[int, int, float]] | None = None  # each pass in order: depth, drafts kept, verification s
    prefetched: int | None = None       # experts the lookahead buffer copied in ahead of verifications
    prefetched_used: int | None = None  # ... that the verification then used
    verify_missing: int | None = None   # (layer, expert) pairs the verifications used that were prefetched
                                        # for them or read in place: what they would have missed without it
    prefetch_late: int | None = None    # prefetched experts the verification read in place: copy not landed
    prefetch_refused: int | None = None  # experts the lookahead counted that found no evictable slot
    expert_agreement: float | None = None  # share of the draft's chosen experts the target chose too, on the
                                           # drafted positions the verifications checked (speculation.agreement)
    expert_agreement_layers: list[float | None] | None = None  # the same per layer (None: a dense layer)

    @property
    def draft_tokens(self) -> int | None:
        """Tokens drafted (from `iterations`)."""
        return None if self.iterations is None else sum(k for k, _, _ in self.iterations)

    @property
    def draft_rounds(self) -> int | None:
        """Verification passes, depth auto's plain steps included (from `iterations`)."""
        return None if self.iterations is None else len(self.iterations)

    @property
    def depth_rounds(self) -> dict[int, int] | None:
        """Verification passes per draft depth, in the order the depths were first run (from `iterations`)."""
        return None if self.iterations is None else dict(Counter(k for k, _, _ in self.iterations))

    @property
    def depth_verify_s(self) -> dict[int, float] | None:
        """Their verification time per draft depth (from `iterations`)."""
        if self.iterations is None:
            return None
        seconds: dict[int, float] = {}
        for k, _, verify_s in self.iterations:
            seconds[k] = seconds.get(k, 0.0) + verify_s
        return seconds

    @property
    def cache_hit_rate(self) -> float | None:
        return self.cache_hits / self.cache_lookups if self.cache_lookups else None

    @property
    def bytes_copied_per_token(self) -> float | None:
        total = self.prompt_tokens + self.generated_tokens
        return self.bytes_copied / total if self.bytes_copied is not None and total else None

    @property
    def bytes_moved_per_token(self) -> float | None:
        """Expert bytes over PCIe per token: copies into slots and reads in place."""
        total = self.prompt_tokens + self.generated_tokens
        if self.bytes_copied is None or not total:
            return None
        return (self.bytes_copied + (self.zero_copy_bytes or 0)) / total

    @property
    def hidden_copy_share(self) -> float | None:
        return self.copy_hidden_s / self.copy_s if self.copy_s else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def prefetch_precision(self) -> float | None:
        """Of the experts prefetched for verifications, the share they used."""
        return self.prefetched_used / self.prefetched if self.prefetched else None

    @property
    def prefetch_recall(self) -> float | None:
        """Of the experts verifications would have missed without the lookahead, the share it prefetched."""
        return self.prefetched_used / self.verify_missing if self.verify_missing else None

    @property
    def mean_accepted_len(self) -> float | None:
        """Tokens per verification pass: the accepted drafted ones plus the target's own."""
        return (self.draft_accepted + self.draft_rounds) / self.draft_rounds if self.draft_rounds else None

    @property
    def draft_step_ms(self) -> float | None:
        """One drafted token's forward (GPU time on CUDA)."""
        return 1000.0 * self.draft_s / self.draft_tokens if self.draft_tokens and self.draft_s is not None else None

    @property
    def other_s(self) -> float | None:
        """Decode time outside drafting and verification: the host's reads and bookkeeping between them, the
        plain steps at the end of the context."""
        if self.draft_s is None or self.verify_s is None:
            return None
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    @property
    def tpot_ms(self) -> float | None:
        """None without a decode step to time (-n 0 or 1: the first token comes with the prefill)."""
        return tpot_ms(self.decode_s, self.generated_tokens)

    @property
    def tokens_per_s(self) -> float | None:
        t = self.tpot_ms
        return 1000.0 / t if t else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "draft_tokens": self.draft_tokens, "draft_rounds": self.draft_rounds,
                "depth_rounds": self.depth_rounds, "depth_verify_s": self.depth_verify_s,
                "tpot_ms": self.tpot_ms, "tokens_per_s": self.tokens_per_s,
                "cache_hit_rate": self.cache_hit_rate, "bytes_copied_per_token": self.bytes_copied_per_token,
                "bytes_moved_per_token": self.bytes_moved_per_token,
                "hidden_copy_share": self.hidden_copy_share, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_len": self.mean_accepted_len, "prefetch_precision": self.prefetch_precision,
                "prefetch_recall": self.prefetch_recall, "draft_step_ms": self.draft_step_ms,
                "other_s": self.other_s}

    def summary(self) -> str:
        """One line: tokens, context, prefill, TPOT, tokens/s; with offloading the cache's hit rate, bytes copied per
        token and hidden copy share; with a draft its acceptance; on CUDA the peak memory (`to_dict` has every
        figure)."""
        decode = (f"TPOT {self.tpot_ms:.2f} ms, {self.tokens_per_s:.1f} tokens/s" if self.tpot_ms is not None
                  else "no decode step to time")  # the first token comes with the prefill
        text = (f"prompt {self.prompt_tokens} tokens, generated {self.generated_tokens} "
                f"token{'' if self.generated_tokens == 1 else 's'}, context "
                f"{self.ctx_size}, prefill {self.prefill_s * 1000:.1f} ms, {decode}")
        if self.offload is not None:
            text += (f"; offload {self.offload} ({self.cache_policy}, {self.cache_slots} slots): cache hit rate "
                     f"{100 * (self.cache_hit_rate or 0):.1f}%, {format_size(self.bytes_moved_per_token or 0)} "
                     f"moved per token ({format_size(self.bytes_copied_per_token or 0)} copied), "
                     f"{100 * (self.hidden_copy_share or 0):.0f}% of copy time hidden")
            if self.spare_slots:
                text += (f", {self.spare_fetches} misses copied into spare slots ({self.spare_slots} a layer"
                         f"{', lent to the cache at the end: routing did not repeat' if self.spares_lent else ''})")
            if self.hybrid:
                text += (f", {self.cpu_expert_pairs} (token, expert) pairs computed on the CPU in "
                         f"{1000 * (self.cpu_expert_s or 0):.1f} ms (the forwards waited "
                         f"{1000 * (self.cpu_wait_s or 0):.1f} ms for them)")
        if self.draft_rounds:
            plain = (self.depth_rounds or {}).get(0, 0)
            accepted = (f"{self.draft_accepted} of {self.draft_tokens} drafted tokens accepted "
                        f"({100 * (self.acceptance_rate or 0):.1f}%, " if self.draft_tokens else "no token drafted (")
            text += (f"; speculative: {accepted}{self.draft_tokens / self.draft_rounds:.1f} drafted per "
                     f"verification{f', {plain} of {self.draft_rounds} of them plain steps (depth 0)' if plain else ''}"
                     f"), {self.mean_accepted_len:.2f} tokens per verification, per "
                     f"iteration {1000 * (self.draft_s or 0) / self.draft_rounds:.2f} ms drafting, "
                     f"{1000 * (self.verify_s or 0) / self.draft_rounds:.2f} ms verifying and "
                     f"{1000 * (self.other_s or 0) / self.draft_rounds:.2f} ms other")
            if self.expert_agreement is not None:
                text += f", expert-id agreement {100 * self.expert_agreement:.1f}%"
            if self.prefetch_precision is not None:
                text += (f", prefetch precision {100 * self.prefetch_precision:.0f}% recall "
                         f"{100 * (self.prefetch_recall or 0):.0f}%")
            if self.draft_rounds >= DRAFT_IDLE_AFTER and plain >= DRAFT_IDLE_SHARE * self.draft_rounds:
                text += ("; depth auto found drafting slower than plain steps in most iterations: decoding without "
                         "the draft may be faster (an offloaded model's expert cache then gets the draft's memory)")
        if self.gpu_s is not None and self.generated_tokens > 1:
            text += f"; the GPU {1000 * self.gpu_s / (self.generated_tokens - 1):.2f} ms a decode step"
        if self.peak_gpu_bytes is not None:
            text += f"; peak GPU memory {format_size(self.peak_gpu_bytes)}"
        return text


@dataclass
class Generation:
    """A generation in progress: iterate to stream text pieces; afterwards `text`, `tokens`,
    `finish_reason` ("stop" at an end-of-generation token or a stop string, "length" at the token limit
    or a full context, None when it was closed before its end) and `stats` hold the result."""

    prompt_tokens: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    _pieces: Iterator[str] | None = None

    def __iter__(self) -> Iterator[str]:
        assert self._pieces is not None, "a Generation is made by Model.generate"
        return self._pieces

    def wait(self) -> Generation:
        """Run to the end without streaming; returns self."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop the generation where it is (e.g. after Ctrl-C); `stats` then describe what it generated."""
        assert self._pieces is not None, "a Generation is made by Model.generate"
        self._pieces.close()


class Model:
    """A GGUF Mixture-of-Experts model on one device. `Model.load(path)` then `generate` / `logits`."""

    def __init__(self, path: Path, transformer: Transformer, tokenizer: Tokenizer | IdsOnlyTokenizer,
                 ctx_size: int) -> None:
        self.path, self.transformer, self.tokenizer, self.ctx_size = path, transformer, tokenizer, ctx_size
        self.config = transformer.config
        self.device = transformer.embedding.device
        self.offload: Any = None      # specter_gguf.runtime.OffloadRuntime when experts are offloaded
        self.memory_plan: Any = None  # specter_gguf.runtime.MemoryPlan when a GPU budget was given
        self.prefill_chunk: int | None = None  # prompts are evaluated in chunks of this many tokens (budget)
        self.cuda_graphs = False      # decode steps replay CUDA graphs (specter_gguf.cuda_graphs)
        self.decoder: Decoder = PlainDecoder()  # produces the tokens after the prompt (specter_gguf.decoding)
        # sees the routing of every forward of a generation (e.g. runtime.DeviceRoutingCounts for a profile)
        self.routing_observer: RoutingObserver | None = None
        # one KV cache (and its decode graphs) reused by generation after generation; a generation started
        # while another is still running gets a cache of its own and decodes eagerly
        self._cache: KVCache | None = None
        self._cache_in_use = False
        self._generations: list[weakref.ref[Generation]] = []  # those close() ends first

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, device: str | None = None,
             ctx_size: int | None = None, progress: bool = True, gpu_budget: int | str | None = None,
             offload: str | None = None, cache_policy: str | None = None,
             routing_profile: str | os.PathLike[str] | Any = None, cuda_graphs: bool = True,
             draft: str | os.PathLike[str] | None = None, n_draft: int | Literal["auto"] | None = None,
             tokenizer: Tokenizer | IdsOnlyTokenizer | None = None, hybrid: str | None = None,
             spare_slots: int | None = None) -> Model:
        """Load `path` (default: the small model shipped in `models/`) onto `device` ("cpu", "cuda";
        default CUDA when present). `ctx_size`: tokens of context; default min(the model's training context,
        4096) as llama.cpp; 0: the model's training context.

        `gpu_budget` (bytes or "16GiB") plans the device memory (`specter_gguf.runtime.budget`) and refuses a
        budget below the minimum before loading; without one, a model that does not fit the free memory of a
        CUDA device runs offloaded within that free memory less a margin (`runtime.offload.load_offloaded`).
        `offload`: "on-demand", "lru", "gate-prefetch" (routed experts in host memory, a device expert cache),
        "none"; default: lru when the model does not fit the budget, none otherwise. `cache_policy`: lru (default),
        lfu, static-hot (needs `routing_profile`, a `RoutingProfile` or its JSON file). `cuda_graphs`: replay each
        decode step as a CUDA graph (on CUDA; not with gate-prefetch, whose planning reads every layer's routing on
        the host). `hybrid` ("auto", "on", "off"; offloaded experts): the experts a decode step, a verification or a
        short prefill misses are split between the CPU and PCIe by their measured costs (`runtime.hybrid`); auto
        turns it on where a measurement at load says the CPU computes an expert for one token in less than two
        copies' time (the default; off on the CPU device and for experts under 1 MiB). `spare_slots` (lru, 0 to
        MAX_SPARES; default twice the experts a token uses, at most MAX_SPARES and half the layer's slots beyond
        one token's experts, SPARES_WITH_LOOKAHEAD with a draft): slots per MoE layer kept free for a forward to
        copy the experts it misses into as it computes them (0: misses are read in place, and copied into the cache
        after the forward).
        `draft`: a quantized copy of the model (e.g. `specter-gguf quantize MODEL --type q4_k_m`), or a type
        ("q2_k", "q3_k_m", "q4_k_m", "q8_0", ...: the draft is made from the model on first use and kept,
        `speculation.draft_files`), whose routed experts share the device and draft `n_draft` tokens per
        verification (`speculation`; default "auto": a depth chosen each iteration from the measured acceptance and
        costs, `speculation.depth`); the budget counts them.
        `tokenizer`: used instead of the file's own (read by llama.cpp through llama-cpp-python); an
        `IdsOnlyTokenizer` serves callers that give and read token ids only where llama-cpp-python is missing."""
        path = Path(path) if path is not None else SHIPPED_MODEL
        dev = resolve_device(device)
        f = _open_model(path)
        cfg = ModelConfig.from_gguf(f)
        ctx = _context(cfg, ctx_size)
        if draft is None and n_draft is not None:
            raise SpecterError("--n-draft needs a draft (--draft DRAFT.gguf)")
        if n_draft is not None:
            n_draft = parse_depth(n_draft)
        draft_file = GGUFFile(resolve_draft(path, draft, progress)) if draft is not None else None
        if draft_file is not None:
            check_draft(f, draft_file)  # before the target's weights load (minutes for a big file)
            _warn_if_no_smaller(f, draft_file)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        transformer, runtime, plan = load_offloaded(f, dev, ctx, progress, gpu_budget, offload, cache_policy,
                                                    routing_profile, draft=draft_file, hybrid=hybrid,
                                                    spare_slots=spare_slots)
        model = cls(path, transformer, tokenizer if tokenizer is not None else Tokenizer.from_gguf(path), ctx)
        model.offload, model.memory_plan = runtime, plan
        model.cuda_graphs = cuda_graphs and dev.type == "cuda" and (runtime is None or runtime.mode != "gate-prefetch")
        model.prefill_chunk = plan.prefill_chunk if plan is not None else None
        if draft_file is not None:
            from specter_gguf.speculation import SpeculativeDecoder

            model.decoder = SpeculativeDecoder.load(model, draft_file, "auto" if n_draft is None else n_draft)
        elif model.cuda_graphs:
            model.decoder = StepDecoder()
        log.info("loaded %s: %s, %d layers, %d experts (top-%d), on %s, context %d tokens, %s", f.path, cfg.arch,
                 cfg.n_layer, cfg.n_expert, cfg.n_expert_used, dev, ctx,
                 "CUDA graphs" if model.cuda_graphs else "eager steps")
        if plan is not None:
            log.info("%s budget %s: %s", "GPU" if dev.type == "cuda" else "memory", format_size(plan.budget),
                     "the whole model fits" if runtime is None else
                     f"experts offloaded ({runtime.mode}, {runtime.options.policy} cache of {plan.n_slots} of "
                     f"{plan.n_experts_total} experts; {runtime.hybrid.describe()})")
        if model.draft is not None:
            log.info("speculative decoding with the experts of %s", model.draft)
        return model

    def close(self) -> None:
        """Free what the model holds (weights, KV cache, CUDA graphs, the expert cache and its pinned host memory)
        and stop its workers (expert pinning, CPU experts), as llama-cpp-python's `Llama.close`: then it generates
        no more; a generation not yet iterated to its end is closed first (it ends where it is). `with
        Model.load(...) as model:` closes it at the end of the block."""
        for ref in self._generations:
            if (gen := ref()) is not None:
                gen.close()
        self._generations = []
        if self.offload is not None:
            self.offload.close()
        self.offload = self.transformer = self._cache = None  # type: ignore[assignment]
        self.decoder, self.routing_observer = PlainDecoder(), None
        gc.collect()  # what reference cycles held goes now, not at the collector's next pass
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the allocator's cached blocks go back to the device

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def offload_mode(self) -> str | None:
        """The offloading mode the routed experts run in ("lru", ...); None when they all sit on the device."""
        return self.offload.mode if self.offload is not None else None

    @property
    def draft(self) -> str | None:
        """The file name of the draft speculative decoding takes its experts from, and its depth ("q2_k.gguf, depth
        auto"); None without a draft."""
        from specter_gguf.speculation import SpeculativeDecoder  # not at the top: it imports this module

        d = self.decoder
        if not isinstance(d, SpeculativeDecoder):
            return None
        return f"{d.name}, depth {'auto' if d.auto_depth else d.n_draft}"

    def record_routing(self) -> None:
        """Count the experts each layer routes to in the generations from now on (`routing_profile` gives them)."""
        self.routing_observer = DeviceRoutingCounts(self.config.n_layer, self.config.n_expert, self.device)

    def routing_profile(self) -> RoutingProfile:
        """The experts counted since `record_routing`, as a routing profile of this model's file (what
        `Model.load(routing_profile=...)` takes for the static-hot cache policy)."""
        counts = self.routing_observer
        if not isinstance(counts, DeviceRoutingCounts):
            raise SpecterError("no routing was recorded: call record_routing() before generating")
        profile = counts.profile()
        profile.model = str(self.path)
        return profile

    @property
    def reusable_cache(self) -> KVCache | None:
        """The KV cache generation after generation reuses (decoders keep their CUDA graphs over it)."""
        return self._cache

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False, experts: ExpertSource = None,
                observe: RoutingObserver | None = None) -> torch.Tensor:
        """`Transformer.forward` for the decoders: an offloaded model's expert runtime brackets it."""
        if self.offload is not None:
            self.offload.begin()
        logits = self.transformer.forward(tokens, cache, last_only, experts, observe)
        if self.offload is not None:
            self.offload.end()
        return logits

    # -- tokens ----------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise SpecterError(f"tokenize takes text (a str), not {type(text).__name__}")
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(self._token_ids(tokens))

    def _token_ids(self, tokens: Any) -> list[int]:
        """`tokens` as a list of token ids of the vocabulary, or one error line naming what is wrong."""
        if isinstance(tokens, (np.ndarray, torch.Tensor)):
            tokens = tokens.tolist()
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise SpecterError(f"token ids must be a list of integers, not {type(tokens).__name__}")
        bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
        if bad is not None:
            raise SpecterError(f"token ids must be integers, got {bad!r}")
        out = [int(t) for t in tokens]
        wrong = next((t for t in out if not 0 <= t < self.config.n_vocab), None)
        if wrong is not None:
            raise SpecterError(f"token id {wrong} is out of range: the vocabulary has {self.config.n_vocab} tokens")
        return out

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids of `prompt` (text, tokenized, or token ids, checked), at least one."""
        if self.transformer is None:
            raise SpecterError(f"{self.path.name} was closed: load it again to generate")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self._token_ids(prompt)
        if not ids:
            raise SpecterError("no tokens to evaluate: the prompt is empty")
        return ids

    # -- evaluation ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, tokens: str | Sequence[int]) -> np.ndarray:
        """float32 logits [n_tokens, n_vocab] of one forward pass over `tokens` (token ids, or text, tokenized as
        `generate` does) from an empty context."""
        ids = self._prompt_ids(tokens)
        cache = self.transformer.new_cache(len(ids))
        out = self.forward(torch.tensor(ids, dtype=torch.long, device=self.device), cache).cpu().numpy()
        if not np.isfinite(out).all():  # corrupt weights (a flipped exponent bit) give NaN or Inf, not an error
            raise SpecterError(f"{self.path}: the forward pass gave non-finite logits (NaN or Inf); the weights are "
                               f"corrupt or overflow — download or convert the model again")
        return out

    def generate(self, prompt: str | Sequence[int], n_predict: int = 128,
                 sampling: SamplingParams | None = None, stop: str | Sequence[str] | None = (),
                 ignore_eos: bool = False) -> Generation:
        """Generate up to `n_predict` tokens (-1: until the end of generation or a full context) after
        `prompt` (text, or token ids used as they are). Iterate the result to stream text. `stop`: a text or
        texts that end the generation. `ignore_eos`: an end-of-generation token does not end the generation
        (llama-server's option of that name; the benchmark generates exactly `n_predict` tokens)."""
        if isinstance(n_predict, bool) or not isinstance(n_predict, (int, np.integer)) or n_predict < -1:
            raise SpecterError(f"n_predict must be a whole number of tokens, -1 for no limit, got {n_predict!r}")
        SamplingParams.check(sampling)
        if not isinstance(ignore_eos, bool):
            raise SpecterError(f"ignore_eos must be True or False, not {ignore_eos!r}")
        stop = stop_list(stop)
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) >= self.ctx_size:
            n = len(prompt_ids)
            raise ContextFullError(f"the prompt has {n} token{'s' * (n != 1)} but the context holds {self.ctx_size}; "
                                   f"shorten it or raise -c/--ctx-size")
        gen = Generation(prompt_tokens=prompt_ids)
        gen.stats.prompt_tokens, gen.stats.ctx_size = len(prompt_ids), self.ctx_size
        sampler = Sampler(sampling or SamplingParams())
        if not sampler.params.greedy and sampler.params.seed is None:  # as llama.cpp prints its sampler's seed
            log.info("sampling seed %d (drawn at random: give it as the seed to repeat this generation)", sampler.seed)
        gen._pieces = self._run(gen, int(n_predict), sampler, stop, ignore_eos)
        self._generations = [ref for ref in self._generations if ref() is not None] + [weakref.ref(gen)]
        return gen

    # -- chat and llama-cpp-python–shaped results (specter_gguf/chat.py, specter_gguf/api.py) ------------
    def chat(self, messages: Sequence[dict[str, Any]], n_predict: int = -1, sampling: SamplingParams | None = None,
             stop: str | Sequence[str] | None = ()) -> Generation:
        """Generate the assistant's reply to OpenAI-style `messages`, prompted through the file's chat
        template (or the built-in ChatML one). Iterate the result to stream text. `stop`: as for `generate`."""
        from specter_gguf.chat import start_chat

        return start_chat(self, messages, n_predict=n_predict, sampling=sampling, stop=stop)

    def create_completion(self, prompt: str | Sequence[int], **kwargs: Any) -> Any:
        """llama-cpp-python's `Llama.create_completion`: a `text_completion` dict, or chunks with stream=True."""
        from specter_gguf.api import create_completion

        return create_completion(self, prompt, **kwargs)

    def create_chat_completion(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> Any:
        """llama-cpp-python's `Llama.create_chat_completion`: a `chat.completion` dict, or chunks with stream=True."""
        from specter_gguf.api import create_chat_completion

        return create_chat_completion(self, messages, **kwargs)

    __call__ = create_completion

    @torch.inference_mode()
    def _run(self, gen: Generation, n_predict: int, sampler: Sampler, stop: list[str],
             ignore_eos: bool) -> Iterator[str]:
        cache = self._claim_cache()
        try:
            yield from self._decode(gen, n_predict, sampler, stop, ignore_eos, cache)
        finally:
            if cache is self._cache:
                self._cache_in_use = False

    def _claim_cache(self) -> KVCache:
        """The model's reusable KV cache, emptied; a fresh one when a generation is already using it."""
        if self._cache_in_use:
            return self.transformer.new_cache(self.ctx_size)
        if self._cache is None:
            self._cache = self.transformer.new_cache(self.ctx_size)
        self._cache.truncate(0)
        self._cache_in_use = True
        return self._cache

    def _decode(self, gen: Generation, n_predict: int, sampler: Sampler, stop: list[str], ignore_eos: bool,
                cache: KVCache) -> Iterator[str]:
        limit = n_predict if n_predict >= 0 else self.ctx_size
        stats = gen.stats
        decoder = self.tokenizer.stream(continuation=True)  # generated text continues the prompt
        history = list(gen.prompt_tokens)
        emitted = 0  # characters of gen.text already yielded
        stops = _StopScan(stop)
        counters = self.offload.counters.snapshot() if self.offload is not None else None
        start = time.perf_counter()
        prompt = torch.tensor(gen.prompt_tokens, dtype=torch.long, device=self.device)  # checked by generate
        step = self.prefill_chunk or len(prompt)  # chunks keep the workspace within a GPU budget
        for first in range(0, len(prompt), step):
            logits = self.forward(prompt[first:first + step], cache, last_only=True,
                                  observe=self.routing_observer)[-1]
        tokens = self.decoder.tokens(self, logits, cache, sampler, history, stats, limit)
        first_token_at = None
        try:
            cut = None
            while gen.finish_reason is None:
                if len(gen.tokens) >= limit:
                    if first_token_at is None:  # -n 0 (llama.cpp's reading): the prompt evaluated, nothing made
                        float(logits[0])  # waits for the prefill
                        stats.prefill_s = time.perf_counter() - start
                    gen.finish_reason = "length"
                    break
                token = next(tokens, None)
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                    stats.prefill_s = first_token_at - start
                if token is None:  # the context is full
                    gen.finish_reason = "length"
                    break
                if not ignore_eos and self.tokenizer.is_eog(token):
                    gen.finish_reason = "stop"
                    break
                gen.tokens.append(token)
                history.append(token)
                gen.text += decoder.push(token)
                cut = _find_stop(gen.text, stops)
                if cut is not None:
                    gen.text, gen.finish_reason = gen.text[:cut], "stop"
                safe = len(gen.text) if gen.finish_reason else len(gen.text) - _stop_prefix_len(stops)
                if safe > emitted:
                    yield gen.text[emitted:safe]
                    emitted = safe
            if cut is None:  # a stop string ends the text; otherwise complete a dangling UTF-8 sequence
                tail = decoder.flush()
                gen.text += tail
                if len(gen.text) > emitted:
                    yield gen.text[emitted:]
        finally:  # also when the generation is closed or interrupted: the stats describe what it made
            tokens.close()  # the decoder's own figures (drafting, verification) are final
            stats.generated_tokens = len(gen.tokens)
            if first_token_at is not None:
                stats.decode_s = time.perf_counter() - first_token_at
            if counters is not None:
                self._offload_stats(stats, counters)
            if self.device.type == "cuda":
                stats.peak_gpu_bytes = int(torch.cuda.max_memory_allocated(self.device))

    def _offload_stats(self, stats: GenerationStats, start: Any) -> None:
        c = self.offload.stats(start)  # waits for the device once, after the last token, to read copy timings
        stats.offload, stats.cache_policy = self.offload.mode, self.offload.options.policy
        stats.cache_slots = self.offload.cache.n_slots
        stats.cache_lookups, stats.cache_hits, stats.cache_misses = c.cache_lookups, c.cache_hits, c.cache_misses
        stats.cache_evictions, stats.prefetches, stats.bytes_copied = c.cache_evictions, c.prefetches, c.bytes_copied
        stats.zero_copy_bytes = c.zero_copy_bytes
        stats.spare_slots, stats.spare_fetches = self.offload.cache.n_spare, c.spare_fetches
        stats.spares_lent = bool(self.offload.cache.n_spare) and not self.offload.cache.spares_kept
        stats.hybrid, stats.cpu_expert_pairs = self.offload.hybrid.on, c.cpu_expert_pairs
        stats.cpu_expert_s, stats.cpu_wait_s = c.cpu_expert_s, c.cpu_wait_s
        stats.copy_s, stats.copy_exposed_s = c.copy_s, min(c.copy_exposed_s, c.copy_s)
        stats.copy_hidden_s = c.copy_s - stats.copy_exposed_s


class _StopScan:
    """Stop strings searched in a text that only grows at its end: one Knuth-Morris-Pratt automaton per string,
    fed each new character once, so the work is linear in the text and the stop strings (a slice or `find` per
    token would be quadratic in a long stop string)."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stop) if s]
        self.fail = [_kmp_table(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # per string: the longest prefix of it that ends the text scanned
        self.scanned = 0                      # characters of the text fed so far


def _kmp_table(s: str) -> list[int]:
    """fail[k]: the longest proper prefix of s[:k + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


def _find_stop(text: str, scan: _StopScan) -> int | None:
    """Index in `text` where the earliest stop string begins, feeding `scan` the characters new since its last
    call (a match can only end in them: the text before was scanned already)."""
    best = None
    for n, (s, fail) in enumerate(zip(scan.stops, scan.fail)):
        k = scan.state[n]
        for i in range(scan.scanned, len(text)):
            c = text[i]
            while k and c != s[k]:
                k = fail[k - 1]
            if c == s[k]:
                k += 1
            if k == len(s):
                start = i + 1 - len(s)
                best = start if best is None else min(best, start)
                break
        scan.state[n] = k
    scan.scanned = len(text)
    return best


def _stop_prefix_len(scan: _StopScan) -> int:
    """Length of the longest end of the text scanned that could still grow into a stop string (held back)."""
    return max(scan.state, default=0)
