"""The GPU memory plan: how one `--gpu-budget` figure is split before anything is loaded.

    budget = non-expert weights + KV cache (whole context) + workspace + draft experts + expert-cache slots

- **non-expert weights**: every tensor except the routed experts, at the size it takes on the device
  (`device_bytes`: the file's bytes — `weights.load_tensor` keeps quantized tensors quantized). The runtime
  re-measures after loading (`torch.cuda.memory_allocated`) and sizes the slot pool from what was really
  allocated.
- **KV cache**: keys and values of every layer for the whole context, in the cache's dtype (fp16 on CUDA).
- **workspace**: activations of one forward over `prefill_chunk` tokens (the engine prefills long prompts in
  chunks of that size when offloading), the repeated keys/values and attention scores at the full context, the
  logits of the chunk, the dequantized weights of one expert, plus a fixed margin (cuBLAS workspace, the
  caching allocator's rounding). Deliberately generous: the budget is a promise.
- **draft experts**: the routed experts of a `--draft` GGUF (its file bytes: the draft stays quantized on
  the GPU).
- **slots**: what is left, in whole slots. A slot holds one routed expert's gate|up|down record in the
  target's GGUF type (the largest record over the layers: Q4_K_M files mix types between layers).

**Minimum budget** = non-expert weights + KV + workspace + draft experts + `top_k` slots for every MoE layer:
one decoding token needs `top_k` experts per layer at once, and the per-layer LRU of Mixtral-offloading keeps
each layer's slots apart. (A batch of tokens — prefill, verification — that needs more distinct experts than a
layer has slots runs in waves; correctness never needs more than `top_k` per layer.) A smaller budget is
refused before loading, naming this minimum.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from specter_gguf.config import ModelConfig
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile, GGUFTensor

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SLOT_ALIGN = 256          # bytes: slot and part offsets (vector loads, any element type)
WORKSPACE_MARGIN = 256 * MiB
DEFAULT_PREFILL_CHUNK = 256
EXPERT_PARTS = ("gate", "up", "down")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?|[kmgt]i?b?)?\s*$")
_UNITS = {"": 1, "b": 1, "k": KiB, "kb": 1000, "kib": KiB, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": GiB, "gb": 10**9, "gib": GiB, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes of "16GiB", "16G" (= GiB), "1.5GB" (= 1.5e9), "12000MiB", "1024" (bytes) — the same reading
    as the benchmark harness."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise SpecterError(f"cannot read the size {text!r}: write e.g. 16GiB, 12000MiB, 1.5GB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _align(n: int) -> int:
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def expert_tensor_name(layer: int, part: str) -> str:
    return f"blk.{layer}.ffn_{part}_exps.weight"


def is_routed_expert(name: str) -> bool:
    return name.endswith("_exps.weight")


def moe_layers(f: GGUFFile, cfg: ModelConfig) -> list[int]:
    """Layers with routed experts (leading dense layers have none)."""
    return [i for i in range(cfg.n_layer) if f.has_tensor(expert_tensor_name(i, "gate"))]


def n_elements(t: GGUFTensor) -> int:
    return int(np.prod(t.shape, dtype=np.int64))


def device_bytes(t: GGUFTensor, device_type: str) -> int:
    """Bytes `t` takes on the device once `weights.load_tensor` has put it there: its file bytes (float types
    as stored, quantized ones kept quantized as `kernels.QuantizedTensor`), rounded up to the 512-byte blocks of
    PyTorch's caching allocator."""
    return (t.n_bytes + 511) // 512 * 512


@dataclass(frozen=True)
class PartLayout:
    """One matrix of an expert record: `offset` bytes into the record, `type` as held in the slot."""

    name: str           # gate / up / down
    type: T
    shape: tuple[int, int]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RecordLayout:
    """A layer's expert record gate|up|down, contiguous, each part aligned to SLOT_ALIGN bytes."""

    parts: tuple[PartLayout, ...]
    nbytes: int

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(p.type.name for p in self.parts)


def record_layout(f: GGUFFile, cfg: ModelConfig, layer: int) -> RecordLayout:
    """Layout of one expert record of `layer`: its gate, up and down matrices in the file's GGUF types."""
    e, ff, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    parts, offset = [], 0
    for part, shape in zip(EXPERT_PARTS, ((ff, d), (ff, d), (d, ff))):
        t = f.tensor(expert_tensor_name(layer, part), (e, *shape))
        nbytes = t.n_bytes // e
        parts.append(PartLayout(part, t.type, shape, offset, nbytes))
        offset = _align(offset + nbytes)
    return RecordLayout(tuple(parts), offset)


def kv_bytes(cfg: ModelConfig, ctx: int, device_type: str) -> int:
    """Keys and values of the whole context, as `Transformer.new_cache` allocates them."""
    per = 2 if device_type == "cuda" else 4
    lora = getattr(cfg, "n_lora_kv", 0)
    if lora:  # MLA (deepseek2): one latent + rope key per token and layer, no values
        return cfg.n_layer * (lora + cfg.rope_dim) * ctx * per
    return 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * ctx * per


def workspace_bytes(cfg: ModelConfig, ctx: int, chunk: int, device_type: str) -> int:
    """Peak transient memory of one forward over `chunk` tokens at a context of `ctx` (see the docstring)."""
    T_, d, f32 = chunk, cfg.n_embd, 4
    kvb = 2 if device_type == "cuda" else 4
    nq, nkv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    widest = max(d, nq, cfg.n_ff, cfg.n_ff_exp, cfg.n_ff_shexp)
    resid = 8 * T_ * d * f32
    attn = (2 * T_ * (nq + 2 * nkv) * f32                      # q, k, v and their rotated copies
            + 2 * cfg.n_head * ctx * cfg.head_dim * kvb         # keys/values repeated to every query head
            + 2 * cfg.n_head * T_ * ctx * f32 + T_ * ctx        # scores, softmax, mask
            + 2 * cfg.n_head_kv * ctx * cfg.head_dim * kvb // max(cfg.n_layer, 1) * 2)  # one layer's KV regrown
    ffn = (2 * T_ * cfg.n_expert * f32                          # router
           + 4 * T_ * max(cfg.n_ff_exp, cfg.n_ff_shexp, cfg.n_ff) * f32 + 2 * T_ * d * f32
           + 3 * cfg.n_ff_exp * d * f32                         # one expert dequantized (dense path)
           + T_ * cfg.n_expert_used * (cfg.n_ff_exp + d) * f32  # moe_ffn workspace (per-pair activations)
           + T_ * widest * 2)                                   # half-precision casts of the input
    logits = 2 * T_ * cfg.n_vocab * f32
    return int(1.5 * (resid + attn + ffn + logits)) + WORKSPACE_MARGIN


@dataclass
class MemoryPlan:
    """The split of a GPU budget (bytes). `n_slots` of `n_experts_total` routed experts fit in the cache."""

    budget: int
    device: str
    ctx_size: int
    prefill_chunk: int
    non_expert: int
    kv_cache: int
    workspace: int
    draft_experts: int
    slot_bytes: int
    slot_types: tuple[str, ...]
    n_moe_layers: int
    n_expert: int
    top_k: int
    n_experts_total: int
    resident_expert_bytes: int   # all routed experts loaded the plain way (no offloading)
    n_slots: int
    minimum: int
    fits_all: bool               # the whole model fits: no offloading needed

    @property
    def fixed(self) -> int:
        return self.non_expert + self.kv_cache + self.workspace + self.draft_experts

    @property
    def slots_bytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def cached_fraction(self) -> float:
        return self.n_slots / self.n_experts_total if self.n_experts_total else 1.0

    def check(self) -> None:
        """Refuse a budget below the minimum, naming it."""
        if self.budget < self.minimum:
            raise SpecterError(
                f"GPU budget {format_size(self.budget)} is too small: the minimum for this model at a context of "
                f"{self.ctx_size} tokens is {format_size(self.minimum)} ({self.minimum} bytes: non-expert weights "
                f"{format_size(self.non_expert)} + KV cache {format_size(self.kv_cache)} + workspace "
                f"{format_size(self.workspace)}"
                + (f" + draft experts {format_size(self.draft_experts)}" if self.draft_experts else "")
                + f" + {self.top_k} expert slots per MoE layer × {self.n_moe_layers} layers of "
                f"{format_size(self.slot_bytes)}); raise --gpu-budget or lower -c/--ctx-size")

    def describe(self) -> str:
        rows = [("non-expert weights", self.non_expert), ("KV cache", self.kv_cache),
                ("workspace", self.workspace)]
        if self.draft_experts:
            rows.append(("draft experts", self.draft_experts))
        rows.append((f"expert cache ({self.n_slots} slots × {format_size(self.slot_bytes)})", self.slots_bytes))
        lines = [f"GPU budget {format_size(self.budget)} on {self.device}, context {self.ctx_size} tokens "
                 f"(prefill chunk {self.prefill_chunk})"]
        lines += [f"  {name:<44} {format_size(n):>12}  {100 * n / self.budget:5.1f}%" for name, n in rows]
        unused = self.budget - self.fixed - self.slots_bytes
        lines.append(f"  {'unassigned':<44} {format_size(unused):>12}  {100 * unused / self.budget:5.1f}%")
        lines.append(f"experts cached: {self.n_slots} of {self.n_experts_total} "
                     f"({100 * self.cached_fraction:.1f}%; {self.n_moe_layers} MoE layers × {self.n_expert} "
                     f"experts, top-{self.top_k}); slot = gate|up|down in {'/'.join(self.slot_types)}")
        lines.append(f"minimum budget {format_size(self.minimum)} ({self.minimum} bytes)")
        if self.fits_all:
            lines.append("the whole model fits: no offloading needed (all experts resident)")
        elif self.budget < self.minimum:
            lines.append("budget below the minimum: it would be refused")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fixed": self.fixed, "slots_bytes": self.slots_bytes,
                "cached_fraction": self.cached_fraction}


def plan_memory(f: GGUFFile, budget: int | str, ctx_size: int | None = None, device_type: str = "cuda",
                draft: GGUFFile | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> MemoryPlan:
    """Split `budget` for `f` (see the module docstring). Reads metadata and tensor headers only."""
    budget = parse_size(budget)
    cfg = ModelConfig.from_gguf(f)
    ctx = ctx_size or cfg.n_ctx_train
    layers = moe_layers(f, cfg)
    layouts = [record_layout(f, cfg, i) for i in layers]
    slot = max((r.nbytes for r in layouts), default=0)
    types = tuple(sorted({t for r in layouts for t in r.types}))
    non_expert = sum(device_bytes(t, device_type) for t in f.tensors.values() if not is_routed_expert(t.name))
    resident = sum(device_bytes(t, device_type) for t in f.tensors.values() if is_routed_expert(t.name))
    draft_bytes = 0
    if draft is not None:
        dcfg = ModelConfig.from_gguf(draft)
        if (dcfg.n_layer, dcfg.n_expert, dcfg.n_embd) != (cfg.n_layer, cfg.n_expert, cfg.n_embd):
            raise SpecterError(f"{draft.path}: the draft is not a copy of {f.path} ({dcfg.n_layer} layers, "
                               f"{dcfg.n_expert} experts, hidden {dcfg.n_embd} against {cfg.n_layer}, "
                               f"{cfg.n_expert}, {cfg.n_embd})")
        draft_bytes = sum(t.n_bytes for t in draft.tensors.values() if is_routed_expert(t.name))
    kv = kv_bytes(cfg, ctx, device_type)
    ws = workspace_bytes(cfg, ctx, min(prefill_chunk, ctx), device_type)
    fixed = non_expert + kv + ws + draft_bytes
    total = len(layers) * cfg.n_expert
    n_slots = max(0, min(total, (budget - fixed) // slot)) if slot else 0
    return MemoryPlan(
        budget=budget, device=device_type, ctx_size=ctx, prefill_chunk=min(prefill_chunk, ctx),
        non_expert=non_expert, kv_cache=kv, workspace=ws, draft_experts=draft_bytes, slot_bytes=slot,
        slot_types=types, n_moe_layers=len(layers), n_expert=cfg.n_expert, top_k=cfg.n_expert_used,
        n_experts_total=total, resident_expert_bytes=resident, n_slots=int(n_slots),
        minimum=fixed + len(layers) * cfg.n_expert_used * slot,
        fits_all=fixed + resident <= budget)


def slots_after_load(plan: MemoryPlan, measured_non_expert: int) -> int:
    """Slots that fit once the non-expert weights are on the device and their real size is known."""
    free = plan.budget - (measured_non_expert + plan.kv_cache + plan.workspace + plan.draft_experts)
    return max(0, min(plan.n_experts_total, free // plan.slot_bytes)) if plan.slot_bytes else 0


__all__ = ["parse_size", "format_size", "MemoryPlan", "plan_memory", "record_layout", "RecordLayout",
           "PartLayout", "moe_layers", "slots_after_load"]
