"""GGUF-typed weights as torch tensors, and the native kernels over them (native/include/specter_kernels.h).

- `QuantizedTensor`: the raw GGUF bytes of a tensor (uint8, on the CPU or a CUDA device), its ggml type and its
  logical shape `[..., rows, cols]`; `expert(i)` is a zero-copy view of one matrix of a 3-D tensor.
- `qmatmul(x, w)`: `x @ w.T` in float32 with `w` a `QuantizedTensor` (any GGUF type the library handles).
- `moe_ffn(x, ids, weights, experts)`: the routed-expert feed-forward of a whole MoE layer in a few launches,
  from device-resident routing; experts given by an `ExpertTable` of per-expert addresses, so contiguous
  expert tensors, GPU cache slots and a quantized draft copy all run on the same kernel.
- The fused ops of a decode step, each one kernel where torch would launch several: `qmatmul_swiglu` (a
  feed-forward's gate, up and silu(gate) * up), `rms_norm` (with the residual add before it, which may include a
  shared expert behind its sigmoid gate), `moe_topk` (softmax routing), `moe_route` (the router's product and its
  routing), `rope_kv` (q/k/v biases, RoPE, the KV cache store), `decode_attention` (a few queries over the KV
  cache: decode, draft and verification steps), `sample_chain` (llama.cpp's sampling chain and a draw per row: the
  sampled verdict of speculative decoding).

CUDA calls are enqueued on `torch.cuda.current_stream()` and never synchronise the host (capturable in a
CUDA graph when the caller passes a preallocated `workspace` / `out`); CPU calls use
`torch.get_num_threads()` threads. Results are deterministic.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from specter_gguf import native
from specter_gguf.errors import SpecterError

ALGO_AUTO, ALGO_GEMV, ALGO_TILED = 0, 1, 2
GEMV_MAX_ROWS = 32  # ALGO_AUTO's GEMV kernel takes up to this many rows of x
FLOAT_TYPES = {torch.float32: native.F32, torch.float16: native.F16, torch.bfloat16: native.BF16}
_TORCH_OF = {native.F32: torch.float32, native.F16: torch.float16, native.BF16: torch.bfloat16}


def _ffi() -> Any:
    return native.ffi()


def _ptr(t: torch.Tensor, ctype: str = "void *") -> Any:
    return _ffi().cast(ctype, t.data_ptr())


def _float_ptr(t: torch.Tensor | None) -> Any:
    return _ffi().NULL if t is None else _ptr(t, "float *")


def _stream(device: torch.device) -> Any:
    return _ffi().cast("void *", torch.cuda.current_stream(device).cuda_stream)


def _call(name: str, args: tuple, device: torch.device, what: str) -> None:
    """The native `specter_<name>(*args)` on the CPU with torch's thread count, or `specter_cuda_<name>` on the
    device's current stream; raises with `what` on an error code."""
    lb = native.lib()
    if device.type == "cuda":
        code = getattr(lb, f"specter_cuda_{name}")(*args, _stream(device))
    else:
        code = getattr(lb, f"specter_{name}")(*args, torch.get_num_threads())
    native.check(code, what)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and 16-byte aligned (a fresh copy when it is not)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def row_bytes(ggml_type: int, cols: int) -> int:
    elems, nbytes = native.block_size(ggml_type)
    if cols % elems:
        raise SpecterError(f"row length {cols} is not a multiple of ggml type {ggml_type}'s block of {elems}")
    return cols // elems * nbytes


class QuantizedTensor:
    """A GGUF tensor kept in its file encoding: `data` is uint8 `[*shape[:-1], row_bytes]`."""

    __slots__ = ("data", "ggml_type", "shape")

    def __init__(self, data: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> None:
        shape = tuple(int(s) for s in shape)
        if len(shape) < 1 or any(s < 0 for s in shape):
            raise SpecterError(f"QuantizedTensor: bad shape {shape}")
        rb = row_bytes(int(ggml_type), shape[-1])
        if data.dtype != torch.uint8 or data.numel() != int(np.prod(shape[:-1], dtype=np.int64)) * rb:
            raise SpecterError(f"QuantizedTensor: {data.numel()} bytes of {data.dtype} do not hold shape {shape} "
                               f"of ggml type {ggml_type}")
        self.data = data.contiguous().reshape(*shape[:-1], rb)
        self.ggml_type = int(ggml_type)
        self.shape = shape

    @classmethod
    def from_numpy(cls, data: np.ndarray, ggml_type: int, shape: Sequence[int]) -> QuantizedTensor:
        """Zero-copy wrapper of raw bytes (e.g. a memory-mapped GGUF tensor, never written)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mapping
            raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        return cls(raw, ggml_type, shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def row_bytes(self) -> int:
        return self.data.shape[-1]

    def __repr__(self) -> str:
        return f"QuantizedTensor(type={self.ggml_type}, shape={self.shape}, device={self.device})"

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedTensor:
        device = torch.device(device)
        if device == self.device:
            return self
        return QuantizedTensor(self.data.to(device, non_blocking=non_blocking), self.ggml_type, self.shape)

    def expert(self, i: int) -> QuantizedTensor:
        """Matrix `i` of a 3-D tensor (a view)."""
        if self.ndim != 3:
            raise SpecterError(f"expert() needs a 3-D tensor, not shape {self.shape}")
        return QuantizedTensor(self.data[i], self.ggml_type, self.shape[1:])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All values as float32 or float16 (bit-exact with ggml; f16 rounds to nearest even)."""
        if dtype not in (torch.float32, torch.float16):
            raise SpecterError(f"dequantize: dtype must be float32 or float16, not {dtype}")
        if self.device.type == "cpu":
            np_dtype = np.float32 if dtype == torch.float32 else np.float16
            return torch.from_numpy(native.dequantize(self.data.numpy(), self.ggml_type, self.shape,
                                                      n_threads=torch.get_num_threads(), out_dtype=np_dtype))
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        lb = native.lib()
        if dtype == torch.float32:
            code = lb.specter_cuda_dequantize_rows(self.ggml_type, _ptr(self.data), _ptr(out, "float *"), rows,
                                                   self.shape[-1], _stream(self.device))
        else:
            code = lb.specter_cuda_dequantize_rows_f16(self.ggml_type, _ptr(self.data), _ptr(out, "uint16_t *"),
                                                       rows, self.shape[-1], _stream(self.device))
        native.check(code, f"dequantize on {self.device} (ggml type {self.ggml_type}, shape {self.shape})")
        return out

    def rows(self, ids: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """float32 rows `ids` of a 2-D tensor (embedding lookup) on `device` (default: the tensor's): only those
        rows are dequantized. A tensor in pinned host memory (`weights.load_pinned`; the caller's to ensure: this
        runs inside CUDA graph captures) gives its rows to a CUDA `device`, whose kernel reads them in place."""
        if self.ndim != 2:
            raise SpecterError(f"rows() needs a 2-D tensor, not shape {self.shape}")
        device = self.device if device is None else torch.device(device)
        if device.type == self.device.type and device.index is None:  # "cuda": the tensor's own GPU
            device = self.device
        if device != self.device and (device.type, self.device.type) != ("cuda", "cpu"):
            raise SpecterError(f"rows() on {device} of a tensor on {self.device}: only pinned host memory is read "
                               f"from another device")
        idx = ids.to(device, torch.int32).contiguous()
        out = torch.empty((*ids.shape, self.shape[1]), dtype=torch.float32, device=device)
        args = (self.ggml_type, _ptr(self.data), self.shape[0], self.shape[1], _ptr(idx, "int32_t *"), idx.numel(),
                _ptr(out, "float *"))
        _call("get_rows", args, device, "embedding rows")
        return out

    def __getitem__(self, index: Any) -> Any:
        """`qt[e]` of a 3-D tensor is `expert(e)`; `qt[a:b]` the QuantizedTensor of leading-dimension entries
        a..b-1 (rows of a 2-D tensor, experts of a 3-D one; a view); `qt[ids]` of a 2-D tensor dequantizes rows
        `ids` (float32)."""
        if isinstance(index, int) and self.ndim == 3:
            return self.expert(index)
        if isinstance(index, slice):
            if index.step not in (None, 1):
                raise SpecterError("QuantizedTensor slices must be contiguous (step 1)")
            part = self.data[index]
            return QuantizedTensor(part, self.ggml_type, (part.shape[0], *self.shape[1:]))
        if isinstance(index, int):
            return self.rows(torch.tensor([index]))[0]
        if isinstance(index, torch.Tensor):
            return self.rows(index)
        raise SpecterError(f"QuantizedTensor cannot be indexed with {type(index).__name__}")


def _ggml_type_of(w: QuantizedTensor | torch.Tensor) -> int:
    if isinstance(w, QuantizedTensor):
        return w.ggml_type
    if w.dtype not in FLOAT_TYPES:
        raise SpecterError(f"no ggml type for a weight of dtype {w.dtype}")
    return FLOAT_TYPES[w.dtype]


def qmatmul(x: torch.Tensor, w: QuantizedTensor | torch.Tensor, algo: int = ALGO_AUTO) -> torch.Tensor:
    """`x @ w.T` in float32: x `[..., k]` (float32 or float16), w `[n, k]` a 2-D `QuantizedTensor` or a float32 /
    float16 / bfloat16 tensor.

    On CUDA, m = rows of x <= GEMV_MAX_ROWS runs the GEMV kernel (weights decoded in registers, fp32 FMA: each
    output row then depends only on its own input row, whatever m is), larger m the tiled f16 tensor-core kernel
    (x rounded to f16); `algo` forces one of them."""
    return _matmul(x, w, int(algo), swiglu=False)


def qmatmul_swiglu(x: torch.Tensor, w: QuantizedTensor | torch.Tensor) -> torch.Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` in float32 for w = `[gate; up]` (`[2n, k]`, gate and up stacked): a
    feed-forward's SwiGLU in one pass over the weights, on the GEMV kernel (as `qmatmul` with ALGO_GEMV)."""
    if w.shape[0] % 2:
        raise SpecterError(f"qmatmul_swiglu needs gate and up stacked (an even row count), not shape {tuple(w.shape)}")
    return _matmul(x, w, ALGO_GEMV, swiglu=True)


def _matmul(x: torch.Tensor, w: QuantizedTensor | torch.Tensor, algo: int, swiglu: bool) -> torch.Tensor:
    if w.ndim != 2:
        raise SpecterError(f"qmatmul needs a 2-D weight, not shape {tuple(w.shape)}")
    n, k = w.shape
    n = n // 2 if swiglu else n
    if x.shape[-1] != k:
        raise SpecterError(f"qmatmul: x has {x.shape[-1]} columns, the weight {k}")
    w_type, w_data = (w.ggml_type, w.data) if isinstance(w, QuantizedTensor) else (_ggml_type_of(w), _aligned(w))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.device != w.device:
        raise SpecterError(f"qmatmul: x is on {x2.device}, the weight on {w.device}")
    if x2.dtype not in (torch.float32, torch.float16):
        x2 = x2.float()
    x2 = _aligned(x2)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=w.device)
    args = (w_type, _ptr(w_data), n, k, FLOAT_TYPES[x2.dtype], _ptr(x2), m, _ptr(y, "float *"))
    name = "qmatmul_swiglu" if swiglu else "qmatmul"
    _call(name, args if swiglu else (*args, algo), w.device,
          f"{name} (ggml type {w_type}, [{m}, {k}] x {tuple(w.shape)}^T)")
    return y.reshape(*lead, n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, shared: torch.Tensor | None = None,
             gate: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """RMS norm over the last dimension of float32 x `[..., n]` times `weight` (plus `bias`); with `delta`, of the
    residual sum x + d, which is returned too: (x + d or None, normed). d is delta, plus `shared` (a MoE layer's
    shared expert, rows like x) times the sigmoid of its `gate` logits `[T, 1]` (rows may be strided, e.g. a column
    of a wider product; None: ungated). One kernel on CUDA."""
    n = x.shape[-1]
    xs = x.float().contiguous()
    ds = None if delta is None else delta.float().contiguous()
    ss = None if shared is None else shared.float().contiguous()
    wt, bs = weight.float().contiguous(), None if bias is None else bias.float().contiguous()
    rows = xs.numel() // max(n, 1)
    if ds is not None and ds.shape != xs.shape:
        raise SpecterError(f"rms_norm: delta {tuple(ds.shape)} does not match x {tuple(xs.shape)}")
    if ss is not None and (ds is None or ss.shape != xs.shape):
        raise SpecterError(f"rms_norm: a shared expert's rows {tuple(ss.shape)} need a delta and the shape of x "
                           f"{tuple(xs.shape)}")
    if gate is not None and (ss is None or gate.shape != (rows, 1) or gate.dtype != torch.float32):
        raise SpecterError(f"rms_norm: a gate needs a shared expert and float32 logits [{rows}, 1], not "
                           f"{gate.dtype} {tuple(gate.shape)}")
    y = torch.empty_like(xs)
    total = torch.empty_like(xs) if ds is not None else None
    p = _float_ptr
    args = (p(xs), p(ds), p(ss), p(gate), 0 if gate is None else gate.stride(0), p(wt), p(bs), rows, n, float(eps),
            p(total), p(y))
    _call("rms_norm", args, x.device, f"rms_norm (rows of {n})")
    return total, y


def moe_topk(logits: torch.Tensor, top_k: int, normalize: bool = False,
             scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing of logits `[T, n_expert]` (float32; rows may be strided, e.g. a slice of a wider product):
    the `top_k` experts by logit, descending (ties: lower index first), as int32 ids `[T, top_k]`, and their
    softmax probabilities `[T, top_k]` (float32), renormalized to sum 1 when `normalize`, then times `scale`
    unless it is 0 or 1. One kernel on CUDA."""
    if logits.ndim != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise SpecterError(f"moe_topk needs float32 logits [T, n_expert] with contiguous rows, not "
                           f"{logits.dtype} {tuple(logits.shape)}")
    T, n_expert = logits.shape
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    args = (_ptr(logits, "float *"), T, n_expert, logits.stride(0) if T > 1 else n_expert, top_k, int(normalize),
            float(scale), _ptr(ids, "int32_t *"), _ptr(weights, "float *"))
    _call("moe_topk", args, logits.device, f"moe_topk (top {top_k} of {n_expert} experts)")
    return ids, weights


def moe_route(x: torch.Tensor, w: torch.Tensor | QuantizedTensor, n_expert: int, top_k: int, normalize: bool,
              scale: float, done: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's product and its routing in one call: (logits = x @ w.T `[T, n_rows]` as `qmatmul` computes
    them, and `moe_topk` of their first `n_expert` columns: ids, weights). w may have rows past n_expert (a
    shared expert's gate stacked under the router). On CUDA up to 8 tokens take one launch (more take two),
    which uses `done` (a zeroed int32 `[1]` on the device, left at 0; calls sharing one must not overlap); the CPU
    does not use it."""
    n_rows, k = w.shape
    if x.ndim != 2 or x.shape[1] != k or x.dtype != torch.float32:
        raise SpecterError(f"moe_route needs float32 x [T, {k}], not {x.dtype} {tuple(x.shape)}")
    if x.device != w.device or (x.is_cuda and (done is None or done.device != x.device or done.dtype != torch.int32)):
        raise SpecterError("moe_route: x, the weight and (on CUDA) the int32 `done` counter must share a device")
    w_type, w_data = (w.ggml_type, w.data) if isinstance(w, QuantizedTensor) else (_ggml_type_of(w), _aligned(w))
    x2 = _aligned(x)
    T = x2.shape[0]
    logits = torch.empty((T, n_rows), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    args = (w_type, _ptr(w_data), n_rows, k, _float_ptr(x2), T, n_expert, top_k, int(normalize), float(scale),
            _float_ptr(logits), _ptr(ids, "int32_t *"), _float_ptr(weights),
            _ffi().NULL if done is None else _ptr(done, "uint32_t *"))
    _call("moe_route", args, x.device, f"moe_route (top {top_k} of {n_expert} experts, ggml type {w_type})")
    return logits, ids, weights


def rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: tuple[torch.Tensor | None, ...],
            cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, head_dim: int, rope_dim: int, neox: bool,
            k_cache: torch.Tensor, v_cache: torch.Tensor,
            norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """The attention inputs of T tokens in one kernel: q `[T, n_head * head_dim]`, k, v `[T, n_head_kv *
    head_dim]` (float32, contiguous rows) plus their biases (`bias` = (q, k, v), None: none); with `norms` = (q
    weight, k weight, eps) each head of q and k RMS-normalized (weights of head_dim); the first `rope_dim`
    features of each head of q and k rotated by the angles of positions `pos` (int64 `[T]`) from the tables cos,
    sin `[n_pos, ..., rope_dim/2]` (neox: pairs (i, i + rope_dim/2), else (2i, 2i+1)); k and v stored at those
    positions of k_cache, v_cache `[n_head_kv, capacity, head_dim]`. Returns q as `[n_head, T, head_dim]` in the
    caches' dtype (float16 or float32)."""
    T = q.shape[0]
    n_head, n_head_kv = q.shape[1] // head_dim, k.shape[1] // head_dim
    dtype = k_cache.dtype
    if dtype not in (torch.float16, torch.float32) or v_cache.dtype != dtype:
        raise SpecterError(f"rope_kv: the KV cache must be float16 or float32, not {k_cache.dtype}/{v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise SpecterError("rope_kv: the KV cache and the RoPE tables must be contiguous")
    rows = [t if t.dtype == torch.float32 and t.stride(-1) == 1 else t.float().contiguous() for t in (q, k, v)]
    biases = [None if b is None else b.float().contiguous() for b in bias]
    q_norm = k_norm = None
    eps = 0.0
    if norms is not None:
        q_norm, k_norm, eps = norms[0].float().contiguous(), norms[1].float().contiguous(), norms[2]
        if not q_norm.numel() == k_norm.numel() == head_dim:
            raise SpecterError(f"rope_kv: the q and k norms must weigh one head ({head_dim} features)")
    q_out = torch.empty((n_head, T, head_dim), dtype=dtype, device=q.device)
    strides = [r.stride(0) if T > 1 else r.shape[1] for r in rows]
    p = _float_ptr
    args = (p(rows[0]), strides[0], p(rows[1]), strides[1], p(rows[2]), strides[2], *(p(b) for b in biases),
            p(q_norm), p(k_norm), eps, T, n_head, n_head_kv, head_dim, rope_dim, int(neox), p(cos), p(sin),
            cos.shape[0], _ptr(pos, "int64_t *"), FLOAT_TYPES[dtype], _ptr(q_out), _ptr(k_cache), _ptr(v_cache),
            k_cache.shape[1])
    _call("rope_kv", args, q.device,
          f"rope_kv (T={T}, {n_head}/{n_head_kv} heads of {head_dim}: a position outside the KV cache?)")
    return q_out


DECODE_ATTN_MAX_TOKENS = 16     # decode_attention takes at most this many query tokens
DECODE_ATTN_MAX_HEAD_DIM = 256  # and head dims that are multiples of 32 up to this


def decode_attention_supported(n_tokens: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes `n_tokens` queries with heads of `head_dim` features."""
    return 1 <= n_tokens <= DECODE_ATTN_MAX_TOKENS and head_dim % 32 == 0 and 32 <= head_dim <= DECODE_ATTN_MAX_HEAD_DIM


def decode_attention_workspace_size(n_tokens: int, n_head: int, head_dim: int, n_keys: int) -> int:
    """Bytes of scratch `decode_attention` needs (preallocate it once to capture the call in a CUDA graph)."""
    f, lb = native.ffi(), native.lib()
    out = f.new("size_t *")
    native.check(lb.specter_decode_attention_workspace_size(n_tokens, n_head, head_dim, n_keys, out),
                 f"decode attention workspace size (T={n_tokens}, {n_head} heads of {head_dim}, {n_keys} keys)")
    return int(out[0])


def decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, keys: int, pos: torch.Tensor,
                     scale: float, *, out: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a few queries q `[n_head, T, head_dim]` over the first `keys` positions of the KV cache storage
    k_store, v_store `[n_head_kv, capacity, head_dim]` (what `rope_kv` writes; the same dtype as q, float16 or
    float32): query t of head h sees the keys j <= pos[t] (int64 `[T]` on the device) of KV head
    h / (n_head / n_head_kv), softmax(scale * q.k) in float32. Returns `[n_head, T, head_dim]` in q's dtype; what
    `layers.attend` computes with the mask `Positions.window` builds. T <= DECODE_ATTN_MAX_TOKENS, head_dim a multiple
    of 32 up to DECODE_ATTN_MAX_HEAD_DIM. On CUDA two kernels (flash-decoding: key splits, then their combination),
    no host synchronisation; a position outside [0, keys) is clamped there (past the window: every key), refused on
    the CPU."""
    H, T, d = q.shape
    dtype = q.dtype
    if dtype not in (torch.float16, torch.float32) or k_store.dtype != dtype or v_store.dtype != dtype:
        raise SpecterError(f"decode_attention: q and the KV cache must share a dtype, float16 or float32, not "
                           f"{q.dtype}/{k_store.dtype}/{v_store.dtype}")
    if k_store.ndim != 3 or v_store.shape != k_store.shape or k_store.shape[2] != d:
        raise SpecterError(f"decode_attention: the KV cache {tuple(k_store.shape)}/{tuple(v_store.shape)} does not "
                           f"fit q {tuple(q.shape)}")
    if not (k_store.is_contiguous() and v_store.is_contiguous()):
        raise SpecterError("decode_attention: the KV cache must be contiguous")
    if pos.shape != (T,) or pos.device != q.device or k_store.device != q.device or v_store.device != q.device:
        raise SpecterError(f"decode_attention: positions {tuple(pos.shape)} on {pos.device} and the KV cache on "
                           f"{k_store.device} do not fit q {tuple(q.shape)} on {q.device}")
    n_kv, capacity = k_store.shape[0], k_store.shape[1]
    qs = q.contiguous()
    ps = pos.to(torch.int64).contiguous()
    need = decode_attention_workspace_size(T, H, d, keys)
    if workspace is None:
        workspace = torch.empty(max(need, 1), dtype=torch.uint8, device=q.device)
    elif workspace.numel() < need or workspace.device != q.device:
        raise SpecterError(f"decode_attention: the workspace must hold {need} bytes on {q.device}")
    if out is None:
        out = torch.empty((H, T, d), dtype=dtype, device=q.device)
    elif out.shape != (H, T, d) or out.dtype != dtype or not out.is_contiguous() or out.device != q.device:
        raise SpecterError(f"decode_attention: out must be a contiguous {dtype} [{H}, {T}, {d}] tensor on {q.device}")
    args = (FLOAT_TYPES[dtype], _ptr(qs), _ptr(k_store), _ptr(v_store), T, H, n_kv, d, keys, capacity,
            _ptr(ps, "int64_t *"), float(scale), _ptr(workspace), workspace.numel(), _ptr(out))
    _call("decode_attention", args, q.device,
          f"decode_attention (T={T}, {H}/{n_kv} heads of {d}, {keys} of {capacity} keys: a position outside them?)")
    return out


SAMPLE_MAX_CANDIDATES = 256  # sample_chain ranks at most this many candidates (top_k)
SAMPLE_MAX_VOCAB = 262144    # of at most this many logits a row


def sample_chain_fits(n_vocab: int, n_candidates: int, device: torch.device) -> bool:
    """Whether `sample_chain` takes the top `n_candidates` of `n_vocab` logits on `device`."""
    return (1 <= n_candidates <= min(n_vocab, SAMPLE_MAX_CANDIDATES) and n_vocab <= SAMPLE_MAX_VOCAB
            and (device.type == "cpu" or (device.type == "cuda" and native.has_cuda())))


def sample_chain_workspace_size(n_rows: int, n_vocab: int, n_candidates: int) -> int:
    """Bytes of scratch `sample_chain` needs (preallocate it once to capture the call in a CUDA graph)."""
    f, lb = native.ffi(), native.lib()
    out = f.new("size_t *")
    native.check(lb.specter_sample_chain_workspace_size(n_rows, n_vocab, n_candidates, out),
                 f"sample chain workspace size ({n_rows} rows, top {n_candidates} of {n_vocab} logits)")
    return int(out[0])


def sample_chain(logits: torch.Tensor, n_candidates: int, knobs: torch.Tensor, uniforms: torch.Tensor | None = None,
                 *, ids: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                 tokens: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """llama.cpp's sampling chain without penalties (top_k, top_p, min_p, temperature, softmax: specter_kernels.h,
    `sampling.chain_probabilities`) for each row of float32 `logits` `[R, n_vocab]` (contiguous rows, any row
    stride) over its top C = `n_candidates` logits, in float64, with `knobs` (`sampling.chain_knobs`, on the logits'
    device): (ids `[R, C]` int64 ascending, probs `[R, C]` float64, 0 for the candidates the filters dropped; and
    with `uniforms` (float64 `[R]` in [0, 1)) one token a row `[R]` int64, drawn as `sampling.draw_rows` draws, else
    None). Ties at the top_k boundary and among the candidates go to the lower id. `ids`, `probs`, `tokens` (e.g. a
    view of a step's outputs) and the `workspace` (uint8, `sample_chain_workspace_size` bytes) are written when given
    (preallocated: CUDA graphs). On CUDA two kernels, no host synchronisation."""
    if logits.ndim != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise SpecterError(f"sample_chain needs float32 logits [rows, n_vocab] with contiguous rows, not "
                           f"{logits.dtype} {tuple(logits.shape)}")
    R, n_vocab = logits.shape
    C, dev = n_candidates, logits.device

    def buffer(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
        if t is None:
            return torch.empty(shape, dtype=dtype, device=dev)
        if t.shape != shape or t.dtype != dtype or not t.is_contiguous() or t.device != dev:
            raise SpecterError(f"sample_chain: {name} must be a contiguous {dtype} {list(shape)} tensor on {dev}")
        return t

    need = sample_chain_workspace_size(R, n_vocab, C)
    buffer(knobs, (3,), torch.float64, "knobs")
    ids, probs = buffer(ids, (R, C), torch.int64, "ids"), buffer(probs, (R, C), torch.float64, "probs")
    if uniforms is not None:
        buffer(uniforms, (R,), torch.float64, "uniforms")
        tokens = buffer(tokens, (R,), torch.int64, "tokens")
    if workspace is None:
        workspace = torch.empty(max(need, 1), dtype=torch.uint8, device=dev)
    elif workspace.numel() < need or workspace.device != dev:
        raise SpecterError(f"sample_chain: the workspace must hold {need} bytes on {dev}")
    null = _ffi().NULL
    args = (_float_ptr(logits), R, n_vocab, logits.stride(0) if R > 1 else n_vocab, C, _ptr(knobs, "double *"),
            null if uniforms is None else _ptr(uniforms, "double *"), _ptr(ids, "int64_t *"), _ptr(probs, "double *"),
            null if uniforms is None else _ptr(tokens, "int64_t *"), _ptr(workspace), workspace.numel())
    _call("sample_chain", args, dev, f"sample_chain ({R} rows, top {C} of {n_vocab} logits)")
    return ids, probs, tokens if uniforms is not None else None


WAIT_TIMEOUT_NS = 30 * 10**9  # a counter never raised is a bug: the device traps rather than hangs


def wait_counter(counter: torch.Tensor, base: torch.Tensor, offset: int, waited_ns: torch.Tensor | None = None) -> None:
    """Work enqueued after this on the device's current stream runs once `counter` >= `base` + `offset` (int64 [1]
    tensors on the device: `counter` raised by other work, such as a fill after copies on another stream); the
    nanoseconds waited are added to `waited_ns`. Captured in a CUDA graph, each replay waits for the values of its
    own time. On the CPU nothing runs meanwhile: the condition must hold already (SpecterError otherwise)."""
    waited = _ffi().NULL if waited_ns is None else _ptr(waited_ns, "int64_t *")
    args = (_ptr(counter, "int64_t *"), _ptr(base, "int64_t *"), offset, WAIT_TIMEOUT_NS, waited)
    _call("wait_counter", args, counter.device, f"the wait for copies (offset {offset})")


def pace(n_bytes: torch.Tensor | None, extra_bytes: int, ns_per_byte: float, device: torch.device) -> None:
    """Work enqueued after this on the device's current stream starts (`n_bytes` (an int64 tensor on the device,
    read when the wait runs; None: 0) + `extra_bytes`) * `ns_per_byte` nanoseconds later: a benchmark's slower
    PCIe link (`OffloadRuntime.pace_transfers`). CUDA only."""
    if device.type != "cuda":
        raise SpecterError("pacing stands for a slower PCIe link: it needs a CUDA device")
    count = _ffi().NULL if n_bytes is None else _ptr(n_bytes, "int64_t *")
    code = native.lib().specter_cuda_pace(count, int(extra_bytes), float(ns_per_byte), _stream(device))
    native.check(code, "pacing a transfer")


@dataclass(frozen=True)
class SlotPool:
    """Where an offload cache's slots lie on the device: from address `base`, `slot_bytes` each, an expert record's
    gate, up and down parts `part_offsets` bytes into its slot, `part_bytes` long."""

    base: int
    slot_bytes: int
    part_offsets: tuple[int, int, int]
    part_bytes: tuple[int, int, int]


MAX_SPARES = 8  # spare slots of one layer's table call, at most (native SPECTER_MAX_SPARES)


@dataclass(frozen=True)
class SpareSlots:
    """Free slots that a layer's `residency_pointers` copies its missed experts into (native `specter_spare_slots`,
    device tensors): `slots` (int64 [n_spare]: a free slot, or -1 once used), `fetched` (int32 [n_expert]: set to
    slot + 1 for each expert copied), `arrivals` (int32 [1]: 0 between calls)."""

    slots: torch.Tensor
    fetched: torch.Tensor
    arrivals: torch.Tensor


def _spare_slots(spares: SpareSlots | None) -> Any:
    """`spares` as the native `specter_spare_slots *` (NULL for None)."""
    ffi = _ffi()
    return ffi.NULL if spares is None else ffi.new("specter_spare_slots *", (
        _ptr(spares.slots, "int64_t *"), spares.slots.numel(), _ptr(spares.fetched, "int32_t *"),
        _ptr(spares.arrivals, "uint32_t *")))


def residency_pointers(slot_of: torch.Tensor, host_ptrs: torch.Tensor, pool: SlotPool, ids: torch.Tensor,
                       routed: torch.Tensor | None, spares: SpareSlots | None = None,
                       skip: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE layer's pointer table for `moe_ffn` (int64 [3, n_expert], a fresh tensor): expert e from its slot in
    `pool` where `slot_of[e]` >= 0 (int64 [n_expert], the residency table's row; below -1: a copy on its way), else
    from its record in host memory (`host_ptrs`, int64 [3, n_expert]: read in place), or not at all where `skip`
    (bool [n_expert]: the experts the CPU computes) marks it; and `routed` (int32 [n_expert], unless None) += the
    layer's routing `ids` (int32), counted per expert. With `spares`, first the routed experts with `slot_of` -1
    that `skip` does not mark, in ascending order, are copied into the usable spare slots and entered in `slot_of`
    (native `specter_expert_table`). One kernel on CUDA."""
    n_expert = slot_of.shape[0]
    ids32 = ids.to(torch.int32).contiguous()
    ptrs = torch.empty((3, n_expert), dtype=torch.int64, device=slot_of.device)
    ffi = _ffi()
    args = (_ptr(slot_of, "int64_t *"), _ptr(host_ptrs, "int64_t *"),
            ffi.new("specter_slot_pool *", (pool.base, pool.slot_bytes, list(pool.part_offsets),
                                            list(pool.part_bytes))), n_expert,
            _ptr(ids32, "int32_t *"), ids32.numel(), ffi.NULL if skip is None else _ptr(skip, "uint8_t *"),
            _spare_slots(spares),
            ffi.NULL if routed is None else _ptr(routed, "int32_t *"), _ptr(ptrs, "int64_t *"))
    _call("expert_table", args, slot_of.device, "the layer's pointer table")
    return ptrs


@dataclass
class ExpertTable:
    """A layer's experts as addresses: `ptrs[0|1|2, e]` is the address of expert e's gate | up | down matrix
    (int64, on the device the kernels run on) in its ggml type (`types`): gate and up `[n_ff, n_embd]`, down
    `[n_embd, n_ff]`. A zero address (any of the three) makes expert e contribute nothing. The offload runtime
    builds a new table for every call rather than rewriting one (`OffloadRuntime.expert_table` computes `ptrs`
    on the device from the cache's residency table, no host sync; a host-managed wave makes one from its slots);
    addresses must be 16-byte aligned and the memory must outlive the kernels that read it (`keep` holds the
    tensors it came from)."""

    ptrs: torch.Tensor
    types: tuple[int, int, int]
    n_embd: int
    n_ff: int
    keep: tuple = ()

    @property
    def n_expert(self) -> int:
        return self.ptrs.shape[1]

    @property
    def device(self) -> torch.device:
        return self.ptrs.device

    @classmethod
    def from_tensors(cls, gate: QuantizedTensor | torch.Tensor, up: QuantizedTensor | torch.Tensor,
                     down: QuantizedTensor | torch.Tensor) -> ExpertTable:
        """From 3-D expert tensors `[n_expert, rows, cols]`: QuantizedTensors or float32/float16/bfloat16."""
        mats = (gate, up, down)
        if any(len(m.shape) != 3 for m in mats):
            raise SpecterError(f"expert tensors must be 3-D, got shapes {[tuple(m.shape) for m in mats]}")
        n_expert, n_ff, n_embd = (int(s) for s in gate.shape)
        want = ((n_expert, n_ff, n_embd), (n_expert, n_ff, n_embd), (n_expert, n_embd, n_ff))
        if any(tuple(m.shape) != w for m, w in zip(mats, want)):
            raise SpecterError(f"expert tensor shapes {[tuple(m.shape) for m in mats]} do not fit gate/up/down")
        devices = {m.device for m in mats}
        if len(devices) != 1:
            raise SpecterError(f"expert tensors are on several devices: {devices}")
        rows = []
        keep = []
        for m in mats:
            if isinstance(m, QuantizedTensor):
                base, stride = m.data.data_ptr(), m.data[0].numel() if n_expert else 0
                keep.append(m.data)
            else:
                if not m.is_contiguous():
                    raise SpecterError("float expert tensors must be contiguous")
                base, stride = m.data_ptr(), m.stride(0) * m.element_size()
                keep.append(m)
            rows.append([base + e * stride for e in range(n_expert)])
        ptrs = torch.tensor(rows, dtype=torch.int64).to(gate.device)
        return cls(ptrs, tuple(_ggml_type_of(m) for m in mats), n_embd, n_ff, tuple(keep))



def moe_workspace_size(n_tokens: int, top_k: int, n_expert: int, n_embd: int, n_ff: int) -> int:
    """Bytes of scratch `moe_ffn` needs (preallocate it once to capture the call in a CUDA graph)."""
    f, lb = native.ffi(), native.lib()
    out = f.new("size_t *")
    native.check(lb.specter_moe_workspace_size(n_tokens, top_k, n_expert, n_embd, n_ff, out), "moe workspace size")
    return int(out[0])


def moe_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            gate: ExpertTable | QuantizedTensor | torch.Tensor, up: QuantizedTensor | torch.Tensor | None = None,
            down: QuantizedTensor | torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            accumulate: bool = False, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """`sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)` with `e = ids[t, j]`, float32 `[T, n_embd]`.

    x `[T, n_embd]`; ids `[T, top_k]` (any integer dtype, expert indices; out-of-range ids contribute
    nothing); weights `[T, top_k]`. Experts: an `ExpertTable`, or 3-D gate/up/down tensors. `out` (float32,
    contiguous) is written, or added to with `accumulate=True`."""
    table = gate if isinstance(gate, ExpertTable) else ExpertTable.from_tensors(gate, up, down)
    dev = table.device
    T, d = x.shape
    if d != table.n_embd or ids.shape != weights.shape or ids.shape[0] != T:
        raise SpecterError(f"moe_ffn: x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)} "
                           f"do not fit experts of n_embd {table.n_embd}")
    top_k = ids.shape[1]
    x32 = _aligned(x.to(dev, torch.float32))
    ids32 = ids.to(dev, torch.int32).contiguous()
    w32 = weights.to(dev, torch.float32).contiguous()
    need = moe_workspace_size(T, top_k, table.n_expert, d, table.n_ff)
    if workspace is None:
        workspace = torch.empty(max(need, 1), dtype=torch.uint8, device=dev)
    elif workspace.numel() < need or workspace.device != dev:
        raise SpecterError(f"moe_ffn: the workspace must hold {need} bytes on {dev}")
    if out is None:
        if accumulate:
            raise SpecterError("moe_ffn: accumulate=True needs `out`")
        out = torch.empty((T, d), dtype=torch.float32, device=dev)
    elif out.shape != (T, d) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != dev:
        raise SpecterError(f"moe_ffn: out must be a contiguous float32 [{T}, {d}] tensor on {dev}")
    p = _ptr(table.ptrs, "uint64_t *")
    n_expert = table.n_expert
    gp, upp, dp = (p + i * n_expert for i in range(3))
    gt, ut, dt = table.types
    args = (_ptr(x32, "float *"), T, d, _ptr(ids32, "int32_t *"), _ptr(w32, "float *"), top_k, n_expert, table.n_ff,
            gp, gt, upp, ut, dp, dt, _ptr(workspace), workspace.numel(), _ptr(out, "float *"), int(accumulate))
    _call("moe_ffn", args, dev, f"moe_ffn (types {table.types}, T={T}, top_k={top_k})")
    return out
