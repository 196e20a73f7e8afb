"""The GPU memory plan: how one `--gpu-budget` figure is split before anything is loaded.

    budget = non-expert weights + KV cache (whole context) + workspace + CUDA runtime + draft experts
             + speculation + expert-cache slots

- **non-expert weights**: every tensor except the routed experts, at the size it takes on the device
  (`device_bytes`: the file's bytes — `weights.load_tensor` keeps quantized tensors quantized), plus on CUDA the
  worst case of the caching allocator's rounding (`allocator_tails`), so that the minimum budget loads however
  the blocks fall. The runtime re-measures after loading (`torch.cuda.memory_allocated`) and sizes the slot pool
  from what was really allocated. Not the token embedding where the experts are offloaded on CUDA: it stays in
  pinned host memory, each step's rows read in place (`host_embedding`; llama.cpp keeps its input layer on the CPU
  too), unless the LM head is the same matrix (tied embeddings). A plain load (the whole model fits) takes it onto
  the device.
- **KV cache**: keys and values of every layer for the whole context, in the cache's dtype (fp16 on CUDA).
- **workspace**: the transient memory of one forward over `prefill_chunk` tokens (the engine prefills long
  prompts in chunks of that size when offloading) at the full context, as `workspace_bytes` follows the code:
  attention reads the KV cache in place, so only its [chunk, context] mask grows with the context.
- **CUDA runtime**: what the process holds on the device beyond torch's allocations: the CUDA context, cuBLAS's
  workspace and the caching allocator's reserve (CUDA only; nvidia-smi showed 0.8 GiB more than torch's peak
  allocation for a small model on the H200, 0.99 GiB for Qwen3-30B-A3B shapes decoding from the expert cache,
  2026-12-01).
- **draft experts**: the routed experts of a `--draft` GGUF (its file bytes: the draft stays quantized on
  the GPU).
- **speculation** (with a draft, on CUDA): what the speculative decoder holds beyond the plain decoder's: 3/8
  GiB for its CUDA graphs at one verification depth (draft steps, the verification) and their share of the
  allocator's reserve, the verdict buffers, plus `VERIFY_GRAPHS_PER_LAYER` for every layer and every further depth
  up to `MAX_DEPTH` (`--n-draft auto` verifies at each depth that may win, and each captures its own graphs).
  Without the quarter GiB, Qwen3-30B-A3B shapes went 0.10-0.19 GiB over 16 and 24 GiB budgets (nvidia-smi on the
  H200, 2026-12-01: 1.08-1.10 GiB beyond torch's peak, and torch's peak 0.07-0.09 GiB past what the plan gave it),
  where decoding from the expert cache fitted; with it alone, depth auto after a verification at every depth went
  91 and 89 MiB over 16 and 24 GiB (2026-12-03: 165 MB more than a fixed depth of 8 with the same model, 0.49 MB
  per layer and further depth; the plan takes 0.625 MiB). The quarter GiB became 3/8 when the graphs began to
  reserve the KV cache's whole context before their first capture: Qwen1.5-MoE shapes then went 19 MiB over 16 GiB
  (2026-12-04, nvidia-smi 1.09 GiB beyond torch's peak with speculation, 0.86 without: the graphs' pool reserve),
  where the half of the cache not yet grown had hidden it.
- **slots**: what is left, in whole slots. A slot holds one routed expert's gate|up|down record in the
  target's GGUF type (the largest record over the layers: Q4_K_M files mix types between layers).

**Minimum budget** = non-expert weights + KV + workspace + CUDA runtime + draft experts + speculation + `top_k`
slots for every MoE layer: a prompt's chunk goes through the slots `top_k` experts at a time or more, and the
per-layer LRU of Mixtral-offloading keeps each layer's slots apart. (A chunk that needs more distinct experts than
a layer has slots runs in waves; small batches read the experts the cache lacks from host memory; correctness
never needs more than `top_k` slots per layer.) A smaller budget is refused before loading, naming this minimum.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from specter_gguf.config import ModelConfig, check_draft
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import (EXPERT_PARTS, FLOAT_TYPES, GGUFFile, GGUFTensor, expert_tensor_name,
                                    is_routed_expert)
from specter_gguf.kernels import (DECODE_ATTN_MAX_TOKENS, decode_attention_supported, decode_attention_workspace_size,
                                  moe_workspace_size)
from specter_gguf.layers import ResidentExperts
from specter_gguf.sizes import GiB, MiB, format_size, parse_size

SLOT_ALIGN = 256          # bytes: slot and part offsets (vector loads, any element type)
WORKSPACE_SLACK = 1.1     # small tensors the estimate leaves out (measured on the H200: tests/test_memory_gpu.py)
CUDA_RUNTIME = 1 * GiB
SPECULATION = 3 * GiB // 8  # with a draft on CUDA, at one verification depth: see the module docstring
VERIFY_GRAPHS_PER_LAYER = 5 * MiB // 8  # and for each layer at every further depth
VERIFY_ROWS = 17          # logits rows a forward returns at most: a verification of 16 drafted tokens
FIT_MARGIN = 1 * GiB      # left free when the budget is the device's free memory (llama.cpp's --fit leaves 1 GiB)
DEFAULT_PREFILL_CHUNK = 256


def speculation_bytes(n_layer: int) -> int:
    """The speculative decoder's device memory beyond the plain decoder's for a model of `n_layer` layers on CUDA
    (the module docstring)."""
    from specter_gguf.speculation.depth import MAX_DEPTH  # not at the top: the speculation package imports this one

    return SPECULATION + (MAX_DEPTH - 1) * n_layer * VERIFY_GRAPHS_PER_LAYER


def _slots_in(free: int, slot_bytes: int, n_experts_total: int) -> int:
    """Whole expert slots in `free` bytes, at most one per expert (none without experts)."""
    return max(0, min(n_experts_total, free // slot_bytes)) if slot_bytes else 0


def _align(n: int) -> int:
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def moe_layers(f: GGUFFile, cfg: ModelConfig) -> list[int]:
    """Layers with routed experts (leading dense layers have none)."""
    return [i for i in range(cfg.n_layer) if f.has_tensor(expert_tensor_name(i, "gate"))]


def n_elements(t: GGUFTensor) -> int:
    return int(np.prod(t.shape, dtype=np.int64))


def device_bytes_of(n_bytes: int) -> int:
    """Bytes an allocation of `n_bytes` takes: rounded up to the 512-byte blocks of PyTorch's caching allocator."""
    return (n_bytes + 511) // 512 * 512


LARGE_POOL_TAIL = 1 << 20


def allocator_tails(sizes: Iterable[int]) -> int:
    """The most PyTorch's caching allocator may add above `device_bytes_of` for allocations of `sizes`: a block of
    its large pool (allocations above 1 MiB) is handed out whole when the rest would be 1 MiB or less. Measured:
    an 8 MiB attention matrix of Qwen1.5-MoE took 8.29 MiB (H200, 2026-12-03)."""
    return sum(LARGE_POOL_TAIL for n in sizes if n > LARGE_POOL_TAIL)


def device_bytes(t: GGUFTensor) -> int:
    """Bytes `t` takes once `weights.load_tensor` has put it on the device: its file bytes on CUDA and on the CPU
    alike (float types as stored, quantized ones kept quantized as `kernels.QuantizedTensor`)."""
    return device_bytes_of(t.n_bytes)


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


def workspace_bytes(cfg: ModelConfig, ctx: int, chunk: int, device_type: str, quantized_experts: bool) -> int:
    """Peak transient memory of one forward over `chunk` tokens at a context of `ctx`, following what the code
    allocates (float32 activations, the cache's dtype in attention): what lives through the forward (the residual
    stream; the [chunk, ctx] attention mask and its additive form; the RoPE tables), plus the larger of a block's
    attention phase (attention reads the KV cache in place, `layers.attend`; the cache grows by doubling, never
    past the whole context's that the KV line counts; on CUDA at least the native decode attention's scratch for
    a verification over the whole context) and its FFN phase (router; routed experts by the grouped
    kernel, whose scratch a prompt's shorter last chunk may need, or by the dense path, which dequantizes one
    expert when `quantized_experts`; shared expert), plus the logits of a verification pass and the sampler's
    copies of them."""
    T, d, f32 = chunk, cfg.n_embd, 4
    kvb = 2 if device_type == "cuda" else 4
    mla = cfg.n_lora_kv > 0
    n_q = cfg.n_head * (cfg.head_dim_k_mla if mla else cfg.head_dim)
    kv_row = cfg.n_lora_kv + cfg.rope_dim if mla else cfg.n_head_kv * cfg.head_dim  # keys of a token and layer
    n_qkv = n_q + (kv_row if mla else 2 * kv_row)
    n_out = cfg.n_head * (kv_row if mla else cfg.head_dim)  # the attended heads' width
    lives = 5 * T * d * f32 + T * -(-ctx // 16) * 16 * (1 + kvb) + 4 * ctx * cfg.rope_dim
    heads = T * n_q * kvb + 2 * T * n_out * kvb + T * d * (kvb + f32)
    if mla:  # absorbed queries and the per-head value products, in float32
        heads += 2 * T * n_out * f32 + 2 * T * cfg.n_head * cfg.head_dim_v_mla * f32
    attention = T * n_qkv * f32 + max(T * d * kvb + T * n_qkv * kvb, heads)
    few = DECODE_ATTN_MAX_TOKENS
    if device_type == "cuda" and not mla and decode_attention_supported(few, cfg.head_dim):
        # a verification's few queries over the whole context in the native op: its key splits and its output
        scratch = decode_attention_workspace_size(few, cfg.n_head, cfg.head_dim, ctx) + few * n_q * kvb
        attention = max(attention, few * n_qkv * f32 + scratch)
    k, E = cfg.n_expert_used, cfg.n_expert
    dense_from = ResidentExperts.DENSE_MIN_TOKENS_PER_EXPERT * E  # routed pairs from which one GEMM per expert
    kernel_T = min(T, -(-dense_from // k) - 1)  # the most tokens the grouped kernel takes (a chunk's tail)
    routed = moe_workspace_size(kernel_T, k, E, d, cfg.n_ff_exp) + kernel_T * d * f32 if kernel_T > 0 else 0
    if T * k >= dense_from:  # every result kept to the sum, one expert's products, dequantized
        routed = max(routed, T * k * d * f32 + T * 3 * cfg.n_ff_exp * (kvb + f32)
                     + 3 * cfg.n_ff_exp * d * f32 * quantized_experts)
    dense_ff = max(cfg.n_ff_shexp if cfg.n_expert_shared else 0, cfg.n_ff if cfg.n_leading_dense else 0)
    swiglu = 4 * T * dense_ff * f32  # gate|up in float32, then silu(gate) and the product
    ffn = T * (E + 1) * (kvb + f32) + 2 * T * d * f32 + max(routed, swiglu)
    logits = VERIFY_ROWS * cfg.n_vocab * 2 * f32 + 4 * cfg.n_vocab * 8
    return int(WORKSPACE_SLACK * (lives + max(attention, ffn) + logits))


@dataclass
class MemoryPlan:
    """The split of a GPU budget (bytes). `n_slots` of `n_experts_total` routed experts fit in the cache."""

    budget: int
    device: str
    ctx_size: int
    n_ctx_train: int             # the model's own context (the default is min(it, 4096))
    prefill_chunk: int
    non_expert: int
    kv_cache: int
    workspace: int
    cuda_runtime: int
    draft_experts: int
    speculation: int
    slot_bytes: int
    slot_types: tuple[str, ...]
    n_moe_layers: int
    n_expert: int
    top_k: int
    n_experts_total: int
    resident_expert_bytes: int   # all routed experts loaded the plain way (no offloading)
    host_embedding: int          # the token embedding, in host memory when offloading (not in non_expert)
    n_slots: int
    minimum: int

    @property
    def fixed(self) -> int:
        return (self.non_expert + self.kv_cache + self.workspace + self.cuda_runtime + self.draft_experts
                + self.speculation)

    @property
    def whole_model(self) -> int:
        """What the plain load (every expert resident, the embedding too) takes on the device."""
        return self.fixed + self.resident_expert_bytes + self.host_embedding

    @property
    def fits_all(self) -> bool:
        """The whole model fits: no offloading needed."""
        return self.whole_model <= self.budget

    @property
    def slots_bytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def cached_fraction(self) -> float:
        return self.n_slots / self.n_experts_total if self.n_experts_total else 1.0

    @property
    def n_slots_without_draft(self) -> int:
        """The slots of the same budget with no draft: what its experts and speculation cost the expert cache."""
        free = self.budget - (self.fixed - self.draft_experts - self.speculation)
        return _slots_in(free, self.slot_bytes, self.n_experts_total)

    def check(self) -> None:
        """Refuse a budget below the minimum, naming it."""
        if self.budget < self.minimum:
            raise SpecterError(
                f"{'GPU' if self.device == 'cuda' else 'memory'} budget {format_size(self.budget)} is too small: the "
                f"minimum for this model at a context of {self.ctx_size} tokens is {format_size(self.minimum)} "
                f"({self.minimum} bytes: non-expert weights {format_size(self.non_expert)} + KV cache "
                f"{format_size(self.kv_cache)} + workspace {format_size(self.workspace)}"
                + (f" + CUDA runtime {format_size(self.cuda_runtime)}" if self.cuda_runtime else "")
                + (f" + draft experts {format_size(self.draft_experts)}" if self.draft_experts else "")
                + (f" + speculation {format_size(self.speculation)}" if self.speculation else "")
                + f" + {self.top_k} expert slots per MoE layer × {self.n_moe_layers} layers of "
                f"{format_size(self.slot_bytes)}); raise --gpu-budget or lower -c/--ctx-size")

    def describe(self) -> str:
        rows = [("non-expert weights", self.non_expert), ("KV cache", self.kv_cache), ("workspace", self.workspace)]
        if self.fits_all and self.host_embedding:  # on the device when nothing is offloaded
            rows.insert(1, ("token embedding", self.host_embedding))
        if self.device == "cuda":
            rows.append(("CUDA context, cuBLAS, allocator reserve", self.cuda_runtime))
        if self.draft_experts:
            rows.append(("draft experts", self.draft_experts))
        if self.speculation:
            rows.append(("speculation: its CUDA graphs and buffers", self.speculation))
        if self.fits_all:  # every expert in its own record's bytes (slots are sized for the largest record)
            rows.append(("routed experts, all resident", self.resident_expert_bytes))
        else:
            rows.append((f"expert cache ({self.n_slots} slots × {format_size(self.slot_bytes)})", self.slots_bytes))
        context = (f"context {self.ctx_size} tokens (the model's own)" if self.ctx_size == self.n_ctx_train else
                   f"context {self.ctx_size} tokens (the model's own is {self.n_ctx_train}: -c 0)")
        lines = [f"{'GPU' if self.device == 'cuda' else 'Memory'} budget {format_size(self.budget)} on "
                 f"{self.device}, {context}, prefill chunk {self.prefill_chunk}"]
        unused = self.budget - (self.whole_model if self.fits_all else self.fixed + self.slots_bytes)
        if unused >= 0:
            lines += [f"  {name:<44} {format_size(n):>12}  {100 * n / self.budget:5.1f}%" for name, n in rows]
            lines.append(f"  {'unassigned':<44} {format_size(unused):>12}  {100 * unused / self.budget:5.1f}%")
        else:  # shares of a budget that cannot hold them would mean nothing
            lines += [f"  {name:<44} {format_size(n):>12}" for name, n in rows]
            lines.append(f"  {'short of the fixed part by':<44} {format_size(-unused):>12}")
        lines.append(f"experts cached: {self.n_slots} of {self.n_experts_total} "
                     f"({100 * self.cached_fraction:.1f}%; {self.n_moe_layers} MoE layers × {self.n_expert} "
                     f"experts, top-{self.top_k}); slot = gate|up|down in {'/'.join(self.slot_types)}")
        without = self.n_slots_without_draft
        if self.draft_experts and without > self.n_slots:
            lines.append(f"without the draft: {without} of {self.n_experts_total} experts cached "
                         f"({100 * without / max(1, self.n_experts_total):.1f}%)")
        if self.host_embedding and not self.fits_all:
            lines.append(f"token embedding in host memory, its rows read in place: {format_size(self.host_embedding)}")
        lines.append(f"minimum budget {format_size(self.minimum)} ({self.minimum} bytes)")
        if self.fits_all:
            lines.append("the whole model fits: no offloading needed (all experts resident)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fixed": self.fixed, "whole_model": self.whole_model, "fits_all": self.fits_all,
                "slots_bytes": self.slots_bytes, "cached_fraction": self.cached_fraction,
                "n_slots_without_draft": self.n_slots_without_draft}


def budget_bytes(given: int | str) -> int:
    """A GPU budget (bytes or a size such as "16GiB", `parse_size`) in bytes, more than 0; else one error naming
    --gpu-budget."""
    try:
        size = parse_size(given)
    except SpecterError as e:
        raise SpecterError(f"--gpu-budget: {e}") from None
    if size <= 0:
        raise SpecterError(f"--gpu-budget {given}: the budget must be more than 0 bytes, e.g. 16GiB")
    return size


def plan_memory(f: GGUFFile, budget: int | str, ctx_size: int | None = None, device_type: str = "cuda",
                draft: GGUFFile | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> MemoryPlan:
    """Split `budget` for `f` (see the module docstring). Reads metadata and tensor headers only."""
    budget = budget_bytes(budget)
    cfg = ModelConfig.from_gguf(f)
    ctx = cfg.context_size(ctx_size)
    layers = moe_layers(f, cfg)
    layouts = [record_layout(f, cfg, i) for i in layers]
    slot = max((r.nbytes for r in layouts), default=0)
    types = tuple(sorted({t for r in layouts for t in r.types}))
    host_embedding = (device_bytes(f.tensor("token_embd.weight"))
                      if device_type == "cuda" and f.has_tensor("output.weight") else 0)
    on_device = [t for t in f.tensors.values() if not is_routed_expert(t.name)
                 and not (host_embedding and t.name == "token_embd.weight")]
    non_expert = sum(device_bytes(t) for t in on_device)
    if device_type == "cuda":  # moe_route's int32 counter of each MoE layer's router (layers.Router): one block
        non_expert += len(layers) * device_bytes_of(4) + allocator_tails(t.n_bytes for t in on_device)
    resident = sum(device_bytes(t) for t in f.tensors.values() if is_routed_expert(t.name))
    draft_bytes = 0
    if draft is not None:
        check_draft(f, draft)
        draft_bytes = draft.routed_expert_bytes
    kv = kv_bytes(cfg, ctx, device_type)
    quantized = any(T[t] not in FLOAT_TYPES for t in types)
    ws = workspace_bytes(cfg, ctx, min(prefill_chunk, ctx), device_type, quantized)
    runtime = CUDA_RUNTIME if device_type == "cuda" else 0
    speculation = speculation_bytes(cfg.n_layer) if device_type == "cuda" and draft is not None else 0
    fixed = non_expert + kv + ws + runtime + draft_bytes + speculation
    total = len(layers) * cfg.n_expert
    n_slots = _slots_in(budget - fixed, slot, total)
    return MemoryPlan(
        budget=budget, device=device_type, ctx_size=ctx, n_ctx_train=cfg.n_ctx_train,
        prefill_chunk=min(prefill_chunk, ctx),
        non_expert=non_expert, kv_cache=kv, workspace=ws, cuda_runtime=runtime, draft_experts=draft_bytes,
        speculation=speculation,
        slot_bytes=slot,
        slot_types=types, n_moe_layers=len(layers), n_expert=cfg.n_expert, top_k=cfg.n_expert_used,
        n_experts_total=total, resident_expert_bytes=resident, host_embedding=host_embedding, n_slots=int(n_slots),
        minimum=fixed + len(layers) * cfg.n_expert_used * slot)


def free_device_memory(device: Any) -> int:
    """Bytes free on the CUDA `device` now: what a load without --gpu-budget plans within (tests cap it)."""
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def fitted_budget(f: GGUFFile, device: Any, ctx_size: int, draft: GGUFFile | None = None) -> MemoryPlan | None:
    """The plan for a budget of the device's free memory less FIT_MARGIN when the model does not fit it (None
    when it fits): how a load without --gpu-budget offloads what must be offloaded."""
    plan = plan_memory(f, max(0, free_device_memory(device) - FIT_MARGIN), ctx_size, "cuda", draft=draft)
    return None if plan.fits_all else plan


def slots_after_load(plan: MemoryPlan, measured_non_expert: int) -> int:
    """Slots that fit once the non-expert weights are on the device and their real size is known."""
    free = plan.budget - (plan.fixed - plan.non_expert + measured_non_expert)
    return _slots_in(free, plan.slot_bytes, plan.n_experts_total)


__all__ = ["MemoryPlan", "plan_memory", "speculation_bytes", "fitted_budget", "free_device_memory",
           "record_layout", "RecordLayout", "PartLayout", "moe_layers", "slots_after_load"]
