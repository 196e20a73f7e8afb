"""The layers every architecture is built from.

Activations (the residual stream, norms, router probabilities, logits) are float32. A product with a weight kept
in its GGUF encoding (`QuantizedTensor`: quantized types, and F16/BF16 matrices on the CPU, `weights.load_tensor`)
runs on the native kernels (fp32 accumulation); one with a torch weight runs through torch in the weight's dtype
on CUDA (fp16/bf16 tensor cores, fp32 accumulation) and in float32 on the CPU, except that a few rows of x on
CUDA take the native GEMV kernel (`matmul`).
Every forward takes a batch of T new tokens at positions `pos .. pos+T-1`: T is the prompt in prefill (or a chunk
of it under a GPU budget), 1 in plain decoding, and k+1 when a speculative engine verifies k drafted tokens in one
pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specter_gguf.config import ModelConfig
from specter_gguf.errors import SpecterError
from specter_gguf.kernels import (GEMV_MAX_ROWS, ExpertTable, QuantizedTensor, decode_attention,
                                  decode_attention_supported, moe_ffn, moe_route, moe_topk, qmatmul, qmatmul_swiglu,
                                  rms_norm, rope_kv)


_FLOAT_GEMV_MAX_ROWS = 8  # one pass of the native GEMV; past it cuBLAS, which reads a float weight once


def _gemv(x: torch.Tensor, w: torch.Tensor | QuantizedTensor) -> bool:
    """Whether x @ w.T runs on the native GEMV: a quantized weight at the rows the native kernels give it, a float
    one for one GEMV pass on CUDA (where cuBLAS would run a GEMM plus a split-K reduction: 14 us for the reduction
    of a 60-expert router alone, measured on the H200), and on the CPU always, as F16 matrices there (torch's
    threads would take turns with ours on the cores: README, limits)."""
    if isinstance(w, QuantizedTensor):
        return x.numel() <= GEMV_MAX_ROWS * x.shape[-1]
    return not w.is_cuda or x.numel() <= _FLOAT_GEMV_MAX_ROWS * x.shape[-1]


def matmul(x: torch.Tensor, w: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """x @ w.T in float32 out; w is [out, in] as GGUF stores it. A quantized weight runs on the native kernels
    in its GGUF encoding (fp32 accumulation), a float one through torch (cuBLAS) unless `_gemv` says otherwise."""
    if isinstance(w, QuantizedTensor) or _gemv(x, w):
        return qmatmul(x, w)
    return F.linear(x.to(w.dtype), w).float()


@dataclass
class Linear:
    weight: torch.Tensor              # [out, in]
    bias: torch.Tensor | None = None  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight)
        return y if self.bias is None else y + self.bias.float()


def _stack(a: Linear, b: Linear) -> Linear | None:
    """One Linear computing [a x | b x] when the weights share a type and width (None otherwise): GGUF rows are
    independent, so quantized matrices stack byte-wise. A missing bias of one of them is zeros."""
    wa, wb = a.weight, b.weight
    if isinstance(wa, QuantizedTensor) and isinstance(wb, QuantizedTensor):
        if wa.ggml_type != wb.ggml_type or wa.ndim != 2 or wa.shape[1:] != wb.shape[1:] or wa.device != wb.device:
            return None
        w: torch.Tensor | QuantizedTensor = QuantizedTensor(torch.cat([wa.data, wb.data]), wa.ggml_type,
                                                            (wa.shape[0] + wb.shape[0], wa.shape[1]))
    elif (isinstance(wa, torch.Tensor) and isinstance(wb, torch.Tensor) and wa.dtype == wb.dtype
          and wa.shape[1:] == wb.shape[1:] and wa.device == wb.device):
        w = torch.cat([wa, wb])
    else:
        return None
    if a.bias is None and b.bias is None:
        return Linear(w)
    biases = [m.bias.float() if m.bias is not None else torch.zeros(m.weight.shape[0], device=wa.device)
              for m in (a, b)]
    return Linear(w, torch.cat(biases))


@dataclass
class Projections:
    """Linear maps of one input (q, k, v; gate, up) in as few matrix products as their weights allow: `of`
    stacks consecutive weights of one type once, at load; a call splits each product back into the maps'
    outputs. Fewer, larger products: fewer kernel launches in a decode step (on the CPU, stacking copies the
    memory-mapped weights into memory)."""

    products: list[Linear]
    sizes: list[list[int]]  # output widths of the maps each product holds

    @classmethod
    def of(cls, *maps: Linear) -> Projections:
        products: list[Linear] = []
        sizes: list[list[int]] = []
        for m in maps:
            stacked = _stack(products[-1], m) if products else None
            if stacked is None:
                products.append(m)
                sizes.append([m.weight.shape[0]])
            else:
                products[-1] = stacked
                sizes[-1].append(m.weight.shape[0])
        return cls(products, sizes)

    @classmethod
    def split(cls, linear: Linear, sizes: list[int]) -> Projections:
        """The maps of one stored matrix whose rows are the maps' outputs one after another."""
        return cls([linear], [list(sizes)])

    def unbiased(self) -> tuple[Projections, list[torch.Tensor | None]]:
        """The same products without biases, and each map's bias (float32; None: none) to add elsewhere."""
        biases: list[torch.Tensor | None] = []
        for linear, sizes in zip(self.products, self.sizes):
            biases.extend(linear.bias.float().split(sizes) if linear.bias is not None else [None] * len(sizes))
        return Projections([Linear(linear.weight) for linear in self.products], self.sizes), biases

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for linear, sizes in zip(self.products, self.sizes):
            y = linear(x)
            out.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else [y])
        return out


@dataclass
class RMSNorm:
    weight: torch.Tensor
    eps: float
    bias: torch.Tensor | None = None  # added after the weight (llama.cpp's phimoe: RMS norm with a bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, bias=self.bias)[1]

    def add(self, x: torch.Tensor, delta: torch.Tensor | SharedSum) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it) in one pass: a block's residual add and the norm that follows it."""
        if isinstance(delta, SharedSum):
            return rms_norm(x, self.weight, self.eps, delta=delta.routed, bias=self.bias, shared=delta.shared,
                            gate=delta.gate)
        return rms_norm(x, self.weight, self.eps, delta=delta, bias=self.bias)


@dataclass
class SharedSum:
    """A MoE layer's output with a shared expert, left unsummed: routed + shared * sigmoid(gate) (gate None: routed +
    shared). The norm that reads the residual stream next adds it in its own kernel (`RMSNorm.add`), which saves a
    kernel in the chain of every such layer."""

    routed: torch.Tensor                # [T, n_embd]
    shared: torch.Tensor                # [T, n_embd]
    gate: torch.Tensor | None = None    # [T, 1] logits (qwen2moe)

    def __getitem__(self, rows: slice) -> SharedSum:
        return SharedSum(self.routed[rows], self.shared[rows], None if self.gate is None else self.gate[rows])


_ROPE_BLOCK = 4096  # positions whose angles are computed at once (in float64) when a RoPE table grows


@dataclass
class Rope:
    """Rotary position embedding of the first `dim` features of each head. `neox` rotates the pairs
    (i, i + dim/2); otherwise adjacent pairs (2i, 2i+1) as in the original LLaMA ("norm" in llama.cpp).
    cos/sin of every position are computed once into a table on the device that grows with the sequence, so
    a forward gathers its rows once instead of recomputing the angles in every layer."""

    dim: int
    base: float
    neox: bool
    freq_scale: float = 1.0
    _cos: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _sin: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _at: Positions | None = field(default=None, init=False, repr=False, compare=False)
    _cos_at: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _sin_at: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, dim/2] (float32) of the angles at `positions` (computed in float64)."""
        inv_freq = self.base ** (-torch.arange(0, self.dim, 2, dtype=torch.float64, device=positions.device) / self.dim)
        angles = (positions.double()[:, None] * self.freq_scale) * inv_freq[None, :]  # [T, dim/2]
        return angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]

    def table(self, n_pos: int, device: torch.device, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [capacity, 1, dim/2] of positions 0 .. capacity-1, capacity >= n_pos, grown on demand by
        doubling up to `limit` (the context size). The new rows are computed a block at a time, so growing costs
        the old and new tables and no more."""
        old = self._cos if self._cos is not None and self._cos.device == device else None
        have = 0 if old is None else old.shape[0]
        if have >= n_pos:
            return self._cos, self._sin
        capacity = max(n_pos, min(2 * have, limit or 2 * have), min(256, limit or 256))
        cos = torch.empty((capacity, 1, self.dim // 2), device=device)
        sin = torch.empty_like(cos)
        if old is not None:
            cos[:have], sin[:have] = old, self._sin
        for start in range(have, capacity, _ROPE_BLOCK):
            stop = min(start + _ROPE_BLOCK, capacity)
            cos[start:stop], sin[start:stop] = self.tables(torch.arange(start, stop, device=device))
        self._cos, self._sin, self._at = cos, sin, None
        return cos, sin

    def __call__(self, x: torch.Tensor, at: Positions) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] of the tokens at positions `at.ids` (attention that caches per-head keys
        rotates inside the `rope_kv` kernel instead)."""
        self.table(at.keys, x.device)
        if self._at is not at:  # gathered once per forward, shared by every layer (and q and k)
            cos, sin = self._cos[at.ids], self._sin[at.ids]
            self._at, self._cos_at, self._sin_at = at, _pairs(cos, cos, self.neox), _pairs(-sin, sin, self.neox)
        return _rotate(x, self.dim, self.neox, self._cos_at, self._sin_at)


def _pairs(first: torch.Tensor, second: torch.Tensor, neox: bool) -> torch.Tensor:
    """[..., dim/2] halves laid out as the rotated pairs: (i, i + dim/2) with neox, else (2i, 2i+1)."""
    return torch.cat([first, second], -1) if neox else torch.stack([first, second], -1).flatten(-2)


def _rotate(x: torch.Tensor, dim: int, neox: bool, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `dim` features of each head of x [T, heads, head_dim]: x cos + swap(x) sin, where swap
    exchanges the two members of each pair and cos/sin [T, 1, dim] are laid out like the pairs (the sign of the
    rotation in sin): three kernels instead of a slice, four products and two concatenations."""
    rot = x[..., :dim].float()
    swapped = rot.roll(dim // 2, dims=-1) if neox else rot.unflatten(-1, (dim // 2, 2)).flip(-1).flatten(-2)
    out = torch.addcmul(rot * cos, swapped, sin)
    return out if dim == x.shape[-1] else torch.cat([out, x[..., dim:].float()], dim=-1)


# cuDNN's attention builds an execution plan for every new key length (4.6 ms of host time per call, measured
# on the H200 in decoding, where the length grows by one each step); the other backends need no plan.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Scaled dot-product attention of q [H, T, d] over keys [H_kv, S, d] and values [H_kv, S, d_v], each key/value
    head serving H / H_kv query heads (grouped-query attention; MLA's latent cache is one shared head), with an
    additive `mask` [T, S] or None. The query heads of a group form one batch entry over which keys and values are
    broadcast with stride 0, so neither repeated keys/values nor [H, T, S] scores are materialised: PyTorch's
    fused kernels (flash attention on the CPU, memory-efficient attention on CUDA; measured on the H200, where
    those take no grouped keys/values) read the cache in place. Returns [H, T, d_v]."""
    H, T, d = q.shape
    n_kv, S, _ = keys.shape
    group = H // n_kv
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q.reshape(n_kv, group, T, d), keys[:, None].expand(n_kv, group, S, d),
                                             values[:, None].expand(n_kv, group, S, values.shape[-1]),
                                             attn_mask=mask, scale=scale)
    return out.reshape(H, T, -1)


@dataclass(eq=False)
class Positions:
    """Where a forward's T new tokens go: their positions `ids` [T] (on the device), how many cached keys
    attention reads (`keys`: positions 0 .. keys-1) and the mask [T, keys] of the keys each query may see
    (None: all of them)."""

    ids: torch.Tensor
    keys: int
    mask: torch.Tensor | None
    _bias: torch.Tensor | None = field(default=None, init=False, repr=False)

    def attn_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive bias (0 or -inf) in `dtype`, made once per forward (sdpa would convert a
        boolean mask in every layer)."""
        if self.mask is None:
            return None
        if self._bias is None or self._bias.dtype != dtype:
            # rows 16-aligned (a view of a wider buffer): the fused attention kernels take it as it is, where an
            # unaligned bias is padded into a copy per layer (seen on the H200: [T, keys] in every layer)
            T, keys = self.mask.shape
            wide = torch.full((T, -(-keys // 16) * 16), float("-inf"), dtype=dtype, device=self.mask.device)
            self._bias = wide[:, :keys].masked_fill_(self.mask, 0.0)  # no [T, keys] temporary
        return self._bias

    @classmethod
    def at(cls, pos: int, T: int, device: torch.device) -> Positions:
        """Tokens at pos .. pos+T-1 after a cache of pos tokens: query i sees keys 0 .. pos+i (a single query
        sees every key: no mask)."""
        ids = torch.arange(pos, pos + T, device=device)
        return cls(ids, pos + T, None) if T == 1 else cls.window(ids, pos + T)

    @classmethod
    def window(cls, ids: torch.Tensor, keys: int) -> Positions:
        """Tokens at the device positions `ids`, attending over a fixed window of `keys` cached keys (a CUDA
        graph's static shape); the mask hides keys after each token's position."""
        return cls(ids, keys, torch.arange(keys, device=ids.device)[None, :] <= ids[:, None])


class KVCache:
    """Keys and values of every layer for the tokens seen so far, shared by whoever extends the sequence.
    `length` counts committed tokens; `truncate` rolls back (rejected speculative tokens). Storage grows on
    demand up to `max_len` so a long context costs memory only when used."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, max_len: int,
                 device: torch.device, dtype: torch.dtype, v_dim: int | None = None) -> None:
        # v_dim: width of the values when it differs from the keys'; 0 stores no values (MLA's latent cache:
        # the values are the first kv_lora_rank features of the cached keys)
        self.max_len, self.device, self.dtype = max_len, device, dtype
        self.shape = (n_head_kv, 0, head_dim)
        v_shape = (n_head_kv, 0, head_dim if v_dim is None else v_dim)
        self.k: list[torch.Tensor] = [torch.empty(self.shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v: list[torch.Tensor] = [torch.empty(v_shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def check_fits(self, n_tokens: int) -> None:
        """Refuse a sequence of `n_tokens` longer than the context."""
        if n_tokens > self.max_len:
            raise SpecterError(f"context full: {n_tokens} tokens exceed the context size {self.max_len}; "
                               f"raise it with -c/--ctx-size")

    def reserve(self, needed: int) -> bool:
        """Make room for `needed` positions (at most `max_len`); True when the storage moved (which
        invalidates CUDA graphs captured over the old storage)."""
        if needed <= self.capacity:
            return False
        capacity = min(self.max_len, max(needed, 2 * self.capacity, 256))
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                # zeros, not garbage: a CUDA graph's attention window covers positions not written yet, masked
                # out, and a masked NaN still poisons the softmax-weighted sum (0 * NaN)
                new = torch.zeros((old.shape[0], capacity, old.shape[2]), device=self.device, dtype=self.dtype)
                new[:, :old.shape[1]] = old
                store[i] = new
        return True

    def storage(self, layer: int, at: Positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s key and value storage [heads, capacity, head_dim], with room for the positions of `at`
        (for a kernel that writes them in place)."""
        self.check_fits(at.keys)
        self.reserve(at.keys)
        return self.k[layer], self.v[layer]

    def update(self, layer: int, at: Positions, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([T, heads, head_dim]) at positions `at.ids` and return the keys/values attention reads
        (positions 0 .. at.keys-1)."""
        self.storage(layer, at)
        self.k[layer].index_copy_(1, at.ids, k.transpose(0, 1).to(self.dtype))
        self.v[layer].index_copy_(1, at.ids, v.transpose(0, 1).to(self.dtype))
        return self.k[layer][:, :at.keys], self.v[layer][:, :at.keys]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


# Native decode attention against torch's SDPA on the H200 (Qwen1.5-MoE shape, CUDA graphs; us per layer): one
# query 9.9 / 12.9 over 256 keys, 17.0 / 44.8 over 1,024; nine queries 15.4 / 13.4 over 256 keys, 25.9 / 46.5 over
# 1,024. So several queries take SDPA up to this many keys.
_SDPA_MAX_KEYS = 256


@dataclass
class Attention:
    """Grouped-query attention; optional RMSNorm of q and k, either per head (weight of head_dim) or over
    all heads at once (weight of heads*head_dim), as the weight's size says. The q/k/v biases, per-head norms, RoPE
    and the KV cache store run in one kernel (`rope_kv`); norms over all heads run before it, the biases with the
    projections then. On CUDA one query (decode and draft steps), or a few over more than `_SDPA_MAX_KEYS` keys
    (verifications later in a sequence), attend in the native `decode_attention`, and on the CPU up to
    DECODE_ATTN_MAX_TOKENS queries (its threads are ours: torch's SDPA there took 86% of a decode step's time on a
    2-core machine, its threads contending with the native kernels'); more queries (prefill) and, on CUDA, a few over
    a short window in torch's SDPA (`attend`)."""

    n_head: int
    n_head_kv: int
    head_dim: int
    qkv: Projections  # q, k, v
    wo: Linear
    rope: Rope
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    bias: list[torch.Tensor | None] = field(default_factory=lambda: [None, None, None], init=False, repr=False)

    def __post_init__(self) -> None:
        if self.q_norm is None or self._head_norms() is not None:
            self.qkv, self.bias = self.qkv.unbiased()

    def _head_norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q weight, k weight, eps) of per-head q/k norms that `rope_kv` applies; None: none, or norms it cannot."""
        q, k = self.q_norm, self.k_norm
        if q is None or k is None or q.bias is not None or k.bias is not None or q.eps != k.eps:
            return None
        return (q.weight, k.weight, q.eps) if q.weight.numel() == k.weight.numel() == self.head_dim else None

    def __call__(self, x: torch.Tensor, layer: int, at: Positions, cache: KVCache) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x)
        head_norms = self._head_norms()
        if self.q_norm is not None and head_norms is None:
            q = self.q_norm(q.view(T, -1, self.q_norm.weight.numel())).view(T, -1)
            k = self.k_norm(k.view(T, -1, self.k_norm.weight.numel())).view(T, -1)
        k_store, v_store = cache.storage(layer, at)
        cos, sin = self.rope.table(at.keys, x.device, cache.max_len)
        q = rope_kv(q, k, v, self.bias, cos, sin, at.ids, self.head_dim, self.rope.dim, self.rope.neox, k_store,
                    v_store, head_norms)  # [n_head, T, head_dim] in the cache's dtype
        scale = 1.0 / math.sqrt(self.head_dim)
        if decode_attention_supported(T, self.head_dim) and (not q.is_cuda or T == 1 or at.keys > _SDPA_MAX_KEYS):
            # query t sees keys <= at.ids[t], what the mask of `Positions.window` says (and `Positions.at` with one
            # query: ids = [keys - 1], no mask)
            out = decode_attention(q, k_store, v_store, at.keys, at.ids, scale)
        else:
            keys, values = k_store[:, :at.keys], v_store[:, :at.keys]
            out = attend(q, keys, values, at.attn_bias(keys.dtype), scale)
        return self.wo(out.transpose(0, 1).reshape(T, -1))


@dataclass
class FeedForward:
    """SwiGLU feed-forward: down(silu(gate x) * up x)."""

    gate_up: Projections
    down: torch.Tensor | QuantizedTensor

    @classmethod
    def of(cls, gate: torch.Tensor | QuantizedTensor, up: torch.Tensor | QuantizedTensor,
           down: torch.Tensor | QuantizedTensor, stack: bool = True) -> FeedForward:
        """From the three matrices; `stack` puts gate and up in one matrix when their types allow (a copy: worth
        it for weights loaded once, not for matrices made per call)."""
        maps = (Linear(gate), Linear(up))
        return cls(Projections.of(*maps) if stack else Projections(list(maps), [[gate.shape[0]], [up.shape[0]]]),
                   down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        stacked = self.gate_up.products[0] if len(self.gate_up.products) == 1 else None
        if stacked is not None and stacked.bias is None and _gemv(x, stacked.weight):
            act = qmatmul_swiglu(x, stacked.weight)  # one kernel for gate, up and silu(gate) * up
        else:
            gate, up = self.gate_up(x)
            act = F.silu(gate) * up
        return matmul(act, self.down)


@dataclass
class Router:
    """Chooses `n_used` experts per token. llama.cpp semantics: softmax over all experts, top-k of the
    probabilities; optionally renormalized to sum 1, then scaled."""

    weight: torch.Tensor  # [n_expert, n_embd]
    n_used: int
    normalize: bool
    scale: float = 0.0
    _done: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    softmax_topk: ClassVar[bool] = True  # `route` is moe_topk's routing, which moe_route computes with the product

    def __post_init__(self) -> None:
        if self.weight.device.type == "cuda":  # moe_route's counter, made before any CUDA graph captures a call
            self._done = torch.zeros(1, dtype=torch.int32, device=self.weight.device)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.choose(x)[1:]

    def choose(self, x: torch.Tensor, weight: torch.Tensor | QuantizedTensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, ids, weights): x's product with `weight` (default the router's; it may have rows stacked under
        the router's, e.g. a shared expert's gate) and the routing of its first n_expert columns. On the native GEMV
        (decode, draft and verification steps) one call computes both: `moe_route`, one launch on CUDA."""
        w = self.weight if weight is None else weight
        n_expert = self.weight.shape[0]
        if self.softmax_topk and x.dtype == torch.float32 and _gemv(x, w):
            return moe_route(x, w, n_expert, self.n_used, self.normalize, self.scale, self._done)
        logits = matmul(x, w)
        return (logits, *self.route(logits[:, :n_expert]))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, n_used] (int32) and weights [T, n_used] for router logits [T, n_expert]."""
        return moe_topk(logits, self.n_used, self.normalize, self.scale)


class Experts(Protocol):
    """Where a layer's routed experts live and how they run. `ResidentExperts` holds them all on the compute
    device (the target's, or the quantized draft's copy: `speculation.draft`); the offload runtime's
    `OffloadedExperts` serves them from host memory through the GPU expert cache."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ResidentExperts:
    """All routed experts of one layer as [n_expert, out, in] tensors (QuantizedTensor or float), on the compute
    device. The native grouped kernel (`kernels.moe_ffn`) runs the whole layer from the device-resident routing:
    no per-expert Python loop, no host sync, deterministic, each token's result independent of the batch.

    The dense torch path (tokens grouped by expert, one torch GEMM per selected expert) is kept only for big
    batches (prefill): once experts average `DENSE_MIN_TOKENS_PER_EXPERT` tokens or more, a blocked BLAS / tensor
    core GEMM over the expert's tokens beats the kernel's GEMV-style passes (8 tokens per pass over the weights),
    and a host sync and per-expert launches cost little against that much work."""

    gate: torch.Tensor | QuantizedTensor  # [E, n_ff_exp, n_embd]
    up: torch.Tensor | QuantizedTensor    # [E, n_ff_exp, n_embd]
    down: torch.Tensor | QuantizedTensor  # [E, n_embd, n_ff_exp]
    _table: ExpertTable | None = field(default=None, init=False, repr=False, compare=False)

    DENSE_MIN_TOKENS_PER_EXPERT = 16

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n_expert = self.gate.shape[0]
        if ids.numel() >= self.DENSE_MIN_TOKENS_PER_EXPERT * n_expert:
            return self._dense(x, ids, weights)
        if self._table is None:
            self._table = ExpertTable.from_tensors(self.gate, self.up, self.down)
        return moe_ffn(x, ids, weights, self._table)

    @staticmethod
    def _matrix(w: torch.Tensor | QuantizedTensor, expert: int) -> torch.Tensor:
        if isinstance(w, QuantizedTensor):
            # float32, not f16: prefill activations of real models reach f16's range in silu(gate)*up
            return w.expert(expert).dequantize(torch.float32)
        return w[expert]

    def _dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate.shape[0]).tolist()  # the one host sync of the layer
        out = torch.zeros_like(x, dtype=torch.float32)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // ids.shape[1]
            ffn = FeedForward.of(*(self._matrix(w, expert) for w in (self.gate, self.up, self.down)), stack=False)
            y = ffn(x[tokens])
            out.index_add_(0, tokens, y * weights.flatten()[slots, None])
        return out


RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor], None]
"""Called by each MoE layer with (layer index, expert ids [T, k], weights [T, k]); tensors stay on the
compute device, so an observer that does not read them back causes no host synchronisation. On CUDA its work is
enqueued on a side stream (`Beside`) that the layer joins before its output is used."""

ExpertSource = Sequence[Experts | None] | None
"""A forward's routed experts, indexed by layer (None entries, dense layers: the layer's own); None: every MoE
layer's own."""


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # by (device index, priority)
_Result = TypeVar("_Result")


def held_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """The process's CUDA stream of `device` at `priority` (lower is more urgent), made on first use."""
    key = (torch.cuda.current_device() if device.index is None else device.index, priority)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key[0], priority=priority)
    return _STREAMS[key]


# Steps of at most this many tokens (decode, draft and verification steps) run a MoE layer's shared expert and
# observer beside its routed experts, whose chain of small kernels leaves the memory idle. A prefill chunk's products
# keep it busy on their own, and on a side stream their temporaries are held apart from the main stream's: the peak
# allocation of a tiny qwen2moe's prefill at a context of 4096 rose from 18.4 to 50.4 MiB, its transient part to
# 39.8 MiB, 4.5x the plan's workspace (H200, tests/test_memory_gpu.py, 2026-12-02).
BESIDE_MAX_TOKENS = GEMV_MAX_ROWS


class Beside:
    """Work that runs beside the current CUDA stream: `run(work)` enqueues work() on a second stream after what the
    current stream holds so far, and `join()` makes the current stream's later work wait for all of it (call it
    before a result is used). The second stream has the lowest priority: where both want the SMs, the current
    stream's kernels start first (a CUDA graph captures on a higher-priority stream: `cuda_graphs`). On the CPU, or
    when not `concurrent`, `run` calls work() in line and `join` does nothing."""

    def __init__(self, device: torch.device, concurrent: bool = True) -> None:
        self.main: torch.cuda.Stream | None = None
        self.side: torch.cuda.Stream | None = None
        self.used = False  # a join without work would wait for the side stream's older (perhaps uncaptured) work
        if device.type == "cuda" and concurrent:
            main = torch.cuda.current_stream(device)
            side = held_stream(main.device, priority=0)
            if side != main:
                self.main, self.side = main, side

    def run(self, work: Callable[[], _Result]) -> _Result:
        if self.side is None:
            return work()
        self.used = True
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            return work()

    def join(self) -> None:
        if self.used:
            self.main.wait_stream(self.side)


@dataclass
class MoE:
    layer: int
    router: Router
    experts: Experts  # the layer's own routed experts; a forward may run it with others (the draft's)
    shared: FeedForward | None = None
    shared_gate: torch.Tensor | None = None  # [1, n_embd]: sigmoid gate of the shared expert (qwen2moe)
    _gates: torch.Tensor | QuantizedTensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # the shared expert's gate as one more row of the router's product when their types allow (one matrix
        # product instead of two); the router and the gate keep views of their rows (no memory used twice)
        n_expert = self.router.weight.shape[0]
        stacked = _stack(Linear(self.router.weight), Linear(self.shared_gate)) if self.shared_gate is not None else None
        if stacked is not None:
            self._gates = stacked.weight
            self.router.weight, self.shared_gate = self._gates[:n_expert], self._gates[n_expert:]
        else:
            self._gates = self.router.weight

    def __call__(self, x: torch.Tensor, experts: Experts | None = None,
                 observe: RoutingObserver | None = None) -> torch.Tensor | SharedSum:
        """The layer's output for x (with a shared expert, its parts for the next norm to add), its routed experts
        from `experts` (default: its own); `observe` sees the routing. On CUDA, in steps of up to
        `BESIDE_MAX_TOKENS` tokens, the shared expert and the observer run beside the routing and the routed experts:
        neither is needed by them, the shared expert's few large products keep the memory busy while the routed
        experts' chain of small kernels waits on itself, and the observer's copies stay out of that chain."""
        n_expert = self.router.weight.shape[0]
        side = Beside(x.device, concurrent=x.shape[0] <= BESIDE_MAX_TOKENS)
        shared = side.run(lambda: self.shared(x)) if self.shared is not None else None
        logits, ids, weights = self.router.choose(x, self._gates)  # logits [T, n_expert (+ 1)]
        if observe is not None:
            side.run(lambda: observe(self.layer, ids, weights))
        out = (self.experts if experts is None else experts)(x, ids, weights)
        side.join()
        if shared is None:
            return out
        if self.shared_gate is None:
            return SharedSum(out, shared)
        gate = logits[:, n_expert:] if logits.shape[1] > n_expert else matmul(x, self.shared_gate)
        return SharedSum(out, shared, gate)


# ---- issue 6 (deepseek2, phimoe): scaled RoPE, latent attention, routing variants -----------------------


@dataclass
class ScaledRope(Rope):
    """RoPE as ggml_rope_ext computes it (ggml-cpu/ops.cpp `rope_yarn`): per-dimension frequency factors
    (theta / factor), YaRN (a ramp between interpolated and extrapolated angles over the correction dims,
    magnitude 1 + 0.1 ln(1/freq_scale)), and cos/sin scaled by `attn_factor`. `freq_factors_long` replaces
    `freq_factors` when the context (`n_ctx`, set by the attention from its cache) exceeds `n_ctx_orig`, as
    llama.cpp picks Phi-3's long/short factors from the context size."""

    ext_factor: float = 0.0
    attn_factor: float = 1.0
    n_ctx_orig: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_factors: torch.Tensor | None = None       # [dim/2]
    freq_factors_long: torch.Tensor | None = None  # [dim/2]
    n_ctx: int = 0
    _tables_long: bool = field(default=False, init=False, repr=False, compare=False)

    def corr_dims(self) -> tuple[float, float]:
        def corr(n_rot: float) -> float:
            return self.dim * math.log(self.n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(self.base))
        return max(0.0, math.floor(corr(self.beta_fast))), min(self.dim - 1.0, math.ceil(corr(self.beta_slow)))

    def _long(self) -> bool:
        return self.freq_factors_long is not None and -(-self.n_ctx // 256) * 256 > self.n_ctx_orig

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(self.dim // 2, dtype=torch.float64, device=positions.device)
        inv_freq = self.base ** (-2.0 * i / self.dim)
        factors = self.freq_factors_long if self._long() else self.freq_factors
        if factors is not None:
            inv_freq = inv_freq / factors.to(positions.device, torch.float64)
        extrap = positions.double()[:, None] * inv_freq[None, :]  # [T, dim/2]
        theta = extrap * self.freq_scale
        mscale = self.attn_factor
        if self.ext_factor != 0.0:
            low, high = self.corr_dims()
            mix = (1 - ((i - low) / max(0.001, high - low)).clamp(0, 1)) * self.ext_factor
            theta = theta * (1 - mix) + extrap * mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        return (theta.cos() * mscale).float()[:, None, :], (theta.sin() * mscale).float()[:, None, :]

    def table(self, n_pos: int, device: torch.device, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is not None and self._tables_long != self._long():  # the context size changed the factors
            self._cos = self._sin = None
        self._tables_long = self._long()
        return super().table(n_pos, device, limit)


def rope_for(cfg: ModelConfig, neox: bool, dim: int | None = None, freq_factors: torch.Tensor | None = None,
             freq_factors_long: torch.Tensor | None = None) -> Rope:
    """The RoPE llama.cpp applies for this config: plain `Rope` unless YaRN, frequency factors or an
    attention factor are in play."""
    dim = cfg.rope_dim if dim is None else dim
    if (cfg.rope_ext_factor == 0.0 and cfg.rope_attn_factor == 1.0 and freq_factors is None
            and freq_factors_long is None):
        return Rope(dim, cfg.rope_base, neox, cfg.rope_freq_scale)
    return ScaledRope(dim, cfg.rope_base, neox, cfg.rope_freq_scale, ext_factor=cfg.rope_ext_factor,
                      attn_factor=cfg.rope_attn_factor, n_ctx_orig=cfg.n_ctx_orig_yarn,
                      beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow, freq_factors=freq_factors,
                      freq_factors_long=freq_factors_long)


@dataclass
class ContextRopeAttention(Attention):
    """`Attention` whose RoPE depends on the context size (Phi-3 long/short frequency factors)."""

    def __call__(self, x: torch.Tensor, layer: int, at: Positions, cache: KVCache) -> torch.Tensor:
        if isinstance(self.rope, ScaledRope):
            self.rope.n_ctx = cache.max_len
        return super().__call__(x, layer, at, cache)


@dataclass
class LatentAttention:
    """DeepSeek-V2 multi-head latent attention in llama.cpp's absorbed form (src/models/deepseek2.cpp).

    Per token the cache holds only the normalized latent c (kv_lora_rank) and the rotated shared key k_pe
    (rope dims): [c | k_pe]. Queries are absorbed into latent space: q' = [W_kb,h q_nope,h | rope(q_pe,h)],
    score = q' . [c | k_pe] * kq_scale, the head's output W_vb,h (sum_j p_j c_j), then attn_output.
    q comes from attn_q (no q_lora_rank: V2-Lite) or attn_q_a -> RMSNorm -> attn_q_b."""

    n_head: int
    n_nope: int
    n_rot: int
    n_lora_kv: int
    wkv_a: Linear            # [kv_lora_rank + n_rot, n_embd]
    kv_a_norm: RMSNorm       # [kv_lora_rank]
    wk_b: torch.Tensor       # [n_head, kv_lora_rank, n_nope]
    wv_b: torch.Tensor       # [n_head, v_head_dim, kv_lora_rank]
    wo: Linear
    rope: Rope
    kq_scale: float
    wq: Linear | None = None        # [n_head * (n_nope + n_rot), n_embd]
    wq_a: Linear | None = None      # [q_lora_rank, n_embd]
    q_a_norm: RMSNorm | None = None
    wq_b: Linear | None = None      # [n_head * (n_nope + n_rot), q_lora_rank]

    def __call__(self, x: torch.Tensor, layer: int, at: Positions, cache: KVCache) -> torch.Tensor:
        T, H, r = x.shape[0], self.n_head, self.n_lora_kv
        self.rope.table(at.keys, x.device, cache.max_len)  # sized for the context before `rope` gathers from it
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(T, H, self.n_nope + self.n_rot)
        q_pe = self.rope(q[..., self.n_nope:], at)                        # [T, H, n_rot]
        q_abs = torch.stack([matmul(q[:, h, :self.n_nope], self.wk_b[h]) for h in range(H)], dim=1)  # [T, H, r]
        kv = self.wkv_a(x)
        latent = self.kv_a_norm(kv[:, :r])                                        # [T, r]
        k_pe = self.rope(kv[:, r:].view(T, 1, self.n_rot), at)             # [T, 1, n_rot]
        entry = torch.cat([latent[:, None, :], k_pe], dim=-1)                     # [T, 1, r + n_rot]
        keys, _ = cache.update(layer, at, entry, entry[..., :0])                  # [1, L, r + n_rot]
        qq = torch.cat([q_abs, q_pe], dim=-1).transpose(0, 1).to(keys.dtype)      # [H, T, r + n_rot]
        out = attend(qq, keys, keys[..., :r], at.attn_bias(keys.dtype), self.kq_scale).float()  # [H, T, r]
        out = torch.stack([matmul(out[h], self.wv_b[h]) for h in range(H)], dim=1)  # [T, H, v_head]
        return self.wo(out.reshape(T, -1))


@dataclass
class SelectingRouter(Router):
    """llama.cpp's build_moe_ffn routing beyond plain softmax: sigmoid gating, a selection bias
    (`exp_probs_b`, DeepSeek-V3) added for choosing only, and group-limited choice (the experts of the
    `n_group_used` groups with the highest sum of their two best scores). Weights are the unbiased
    probabilities of the chosen experts, optionally renormalized, then scaled."""

    gating: str = "softmax"
    selection_bias: torch.Tensor | None = None  # [n_expert]
    n_groups: int = 0
    n_group_used: int = 0

    softmax_topk: ClassVar[bool] = False

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.sigmoid(logits) if self.gating == "sigmoid" else torch.softmax(logits, dim=-1)
        select = probs if self.selection_bias is None else probs + self.selection_bias.float()
        if self.n_groups > 1:
            groups = select.view(select.shape[0], self.n_groups, -1)
            best = groups.topk(2, dim=-1).values.sum(-1)                     # [T, groups]
            keep = best.topk(self.n_group_used, dim=-1).indices
            drop = torch.ones_like(best, dtype=torch.bool).scatter_(1, keep, False)
            select = groups.masked_fill(drop[..., None], float("-inf")).view_as(probs)
        ids = select.topk(self.n_used, dim=-1).indices
        weights = probs.gather(1, ids)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return ids, weights


@dataclass
class Block:
    layer: int
    attn_norm: RMSNorm
    attn: Attention
    ffn_norm: RMSNorm
    ffn: MoE | FeedForward

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | SharedSum | None, at: Positions, cache: KVCache,
                 experts: Experts | None = None,
                 observe: RoutingObserver | None = None) -> tuple[torch.Tensor, torch.Tensor | SharedSum]:
        """The residual stream enters as x + delta and leaves as (h, ffn output): each residual add is left to
        the norm that reads the sum next, which computes it in the same kernel. `experts`, `observe`: see
        `MoE.__call__` (ignored by a dense layer)."""
        x, normed = self.attn_norm.add(x, delta) if delta is not None else (x, self.attn_norm(x))
        h, normed = self.ffn_norm.add(x, self.attn(normed, self.layer, at, cache))
        return h, self.ffn(normed, experts, observe) if isinstance(self.ffn, MoE) else self.ffn(normed)


@dataclass
class Embedding:
    """Token embedding: float32 rows of `weight` [n_vocab, n_embd] on `device`. The weight is on that device, or,
    where the experts are offloaded, in pinned host memory, whose rows the device's kernel reads in place: a step
    reads a few rows of it, and the bytes go to the expert cache instead (`runtime.budget`)."""

    weight: torch.Tensor | QuantizedTensor
    device: torch.device

    def __post_init__(self) -> None:
        if self.weight.device != self.device and not (isinstance(self.weight, QuantizedTensor)
                                                      and self.weight.data.is_pinned()):
            raise SpecterError(f"the token embedding on {self.weight.device} is neither on {self.device} nor in "
                               f"pinned host memory")

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedTensor):
            return self.weight.rows(tokens, self.device)
        return self.weight[tokens].float()  # a float matrix on the device


@dataclass
class Transformer:
    config: ModelConfig
    embedding: Embedding
    blocks: list[Block]
    output_norm: RMSNorm
    output: Linear

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False, experts: ExpertSource = None,
                observe: RoutingObserver | None = None) -> torch.Tensor:
        """Logits [T, n_vocab] (float32) for `tokens` [T] appended at position `cache.length`; with
        `last_only`, [1, n_vocab] of the last position (prefill needs no more). `experts`: the routed experts of
        each MoE layer by layer index (None: the layers' own); `observe` sees every MoE layer's routing."""
        T = tokens.shape[0]
        logits = self.run(tokens, Positions.at(cache.length, T, tokens.device), cache, last_only, experts, observe)
        cache.length += T
        return logits

    def run(self, tokens: torch.Tensor, at: Positions, cache: KVCache, last_only: bool = False,
            experts: ExpertSource = None, observe: RoutingObserver | None = None) -> torch.Tensor:
        """`forward` at explicit positions, leaving `cache.length` alone (a CUDA graph's body)."""
        x, delta = self.embedding(tokens), None
        for block in self.blocks:
            x, delta = block(x, delta, at, cache, None if experts is None else experts[block.layer], observe)
        rows = slice(-1, None) if last_only else slice(None)
        return self.output(self.output_norm.add(x[rows], delta[rows])[1])

    def new_cache(self, max_len: int) -> KVCache:
        c = self.config
        device = self.embedding.device
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        if c.n_lora_kv > 0:  # MLA: one latent + rope key per token, no per-head keys/values (LatentAttention)
            return KVCache(c.n_layer, 1, c.n_lora_kv + c.rope_dim, max_len, device, dtype, v_dim=0)
        return KVCache(c.n_layer, c.n_head_kv, c.head_dim, max_len, device, dtype)
