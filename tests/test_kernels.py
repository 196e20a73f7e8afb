"""The native matrix kernels (native/include/specter_kernels.h) against numpy float64 on the reference values.

Every test makes fresh random weights in GGUF encoding, takes their exact values from `gguf.quants.dequantize`
(bit-exact with ggml), and compares the kernels with a float64 computation on those values:

- weights: F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 from gguf's own quantizer; K-quants (Q2_K..Q6_K) as *valid random blocks*:
  random quant and scale bytes with the fp16 super-block scales set to small finite values (no llama.cpp
  needed, so the GPU machine runs these too); F32 as is;
- outputs are poisoned with NaN (workspaces with 0xFF bytes) before each run, so an unwritten element shows;
- error measure: max |y - ref| / max_row( sum |x| |w| ) (the size of the terms summed), thresholds:
    * fp32 paths (CPU, CUDA GEMV, CUDA MoE): TOL_FP32 = 2e-6 for every type (the weights are exact, only the
      float32 summation order differs: ~sqrt(k) * 2^-24 per unit of the terms' size; on CUDA the offset types
      Q5_1/Q2_K/Q4_K/Q5_K round d*(128+bias)+m once more, ~2^-24 of 128*d per weight: native/src/cuda/quant.cuh);
    * CUDA tiled path (x and the dequantized weights rounded to f16, fp32 accumulation): TOL_F16 = 1.5e-3
      (each term's factors carry <= 2^-11 relative error);
  the MoE layer is compared by max |y - ref| / max |ref| with TOL_MOE = 1e-4 (fp32 through two matrix products
  and SiLU);
- GPU row dequantization must be bit-exact (f32) and equal the reference rounded to f16 (f16 output).
CUDA tests run when torch sees a GPU and the library was built with CUDA (skipped otherwise, saying so).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.constants import GGML_QUANT_SIZES

from specter_gguf import kernels, native
from specter_gguf.errors import SpecterError
from specter_gguf.kernels import ExpertTable, QuantizedTensor
from specter_gguf.layers import Embedding

TOL_FP32 = 2e-6
TOL_F16 = 1.5e-3
TOL_MOE = 1e-4
ERR_BAD_SHAPE = -3

IQ_GRID_TYPES = [GT.IQ1_S, GT.IQ1_M, GT.IQ2_XXS, GT.IQ2_XS, GT.IQ2_S, GT.IQ3_XXS, GT.IQ3_S]
QUANT_TYPES = [GT.Q8_0, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.IQ4_NL,
               GT.IQ4_XS, *IQ_GRID_TYPES]
FLOAT_TYPES = [GT.F16, GT.BF16, GT.F32]
ALL_TYPES = QUANT_TYPES + FLOAT_TYPES
M_VALUES = [1, 2, 3, 7, 8, 9, 16, 33, 64]

# Types made of random blocks (gguf's quantizer has no K-quants or IQ types): the offsets of their fp16 (super-)block
# scale fields (d, and dmin where there is one), set to small scales (IQ1_M's d is spread over its scale words)
RANDOM_BLOCK_SCALES = {GT.Q2_K: (80, 82), GT.Q3_K: (108,), GT.Q4_K: (0, 2), GT.Q5_K: (0, 2), GT.Q6_K: (208,),
                       GT.IQ4_NL: (0,), GT.IQ4_XS: (0,), GT.IQ1_M: (),
                       **{t: (0,) for t in IQ_GRID_TYPES if t != GT.IQ1_M}}


def _has_cuda() -> bool:
    try:
        return torch.cuda.is_available() and native.has_cuda()
    except SpecterError:
        return False


CUDA_OK = _has_cuda()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA_OK, reason="needs a CUDA GPU visible to torch and a libspecter built with CUDA"))]


def make_weight(qtype: GT, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF bytes uint8 [rows, row_bytes], exact float32 values [rows, cols])."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    if qtype in RANDOM_BLOCK_SCALES:
        raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
        def small_scales() -> np.ndarray:
            return (rng.uniform(0.5e-3, 4e-3, size=raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])).astype(np.float16)

        for off in RANDOM_BLOCK_SCALES[qtype]:
            raw[:, off:off + 2] = small_scales().view(np.uint8).reshape(-1, 2)
        if qtype == GT.IQ1_M:  # its fp16 d is the top nibbles of the four 16-bit scale words (bytes 48..55)
            d = small_scales().view(np.uint16)
            words = raw[:, 48:56].copy().view(np.uint16)
            for i in range(4):
                words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
            raw[:, 48:56] = words.view(np.uint8)
        raw = raw.reshape(rows, -1)
    elif qtype == GT.F32:
        raw = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    values = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    assert np.isfinite(values).all()
    return raw, values


def qt(raw: np.ndarray, qtype: GT, shape: tuple[int, ...], device: str) -> QuantizedTensor:
    return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)), int(qtype), shape).to(device)


def _stream(device: str):
    return native.ffi().cast("void *", torch.cuda.current_stream().cuda_stream) if device == "cuda" else None


def raw_qmatmul(w: QuantizedTensor, x: torch.Tensor, algo: int = 0) -> tuple[int, torch.Tensor]:
    """The C entry point on a NaN-poisoned output: (status, y)."""
    f, lb = native.ffi(), native.lib()
    n, k = w.shape
    m = x.shape[0]
    y = torch.full((m, n), float("nan"), dtype=torch.float32, device=w.device)
    xt = native.F16 if x.dtype == torch.float16 else native.F32
    args = (w.ggml_type, f.cast("void *", w.data.data_ptr()), n, k, xt, f.cast("void *", x.data_ptr()), m,
            f.cast("float *", y.data_ptr()), algo)
    if w.device.type == "cuda":
        code = lb.specter_cuda_qmatmul(*args, _stream("cuda"))
        torch.cuda.synchronize()
    else:
        code = lb.specter_qmatmul(*args, 2)
    return code, y


def rel_err_terms(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    scale = (np.abs(x64) @ np.abs(w64).T).max()
    return float(np.abs(y.astype(np.float64) - ref).max() / scale)


# ---------------------------------------------------------------------------------------------
# Y = X . W^T

def _shape_for(qtype: GT) -> tuple[int, int]:
    # n = 67 rows: not a multiple of the GEMV's 2 rows or the tile's 64; k: 2 K-quant blocks, or a
    # non-multiple of the tile's 128 for the 32-blocks and float types.
    block = GGML_QUANT_SIZES[qtype][0]
    if block == 256:
        return 67, 512
    return (67, 544) if block == 32 else (67, 520)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_qmatmul(device: str, qtype: GT) -> None:
    rng = np.random.default_rng(1000 + int(qtype))
    n, k = _shape_for(qtype)
    raw, wv = make_weight(qtype, n, k, rng)
    w = qt(raw, qtype, (n, k), device)
    algos = [(0, None)] if device == "cpu" else [(1, TOL_FP32), (2, TOL_F16), (0, None)]
    for m in M_VALUES:
        x = rng.standard_normal((m, k)).astype(np.float32)
        for algo, tol in algos:
            if tol is None:
                tol = TOL_F16 if device == "cuda" and m > kernels.GEMV_MAX_ROWS else TOL_FP32
            code, y = raw_qmatmul(w, torch.from_numpy(x).to(device), algo)
            assert code == 0, native.error_string(code)
            y = y.cpu().numpy()
            assert np.isfinite(y).all(), f"{qtype.name} m={m} algo={algo}: unwritten or non-finite outputs"
            err = rel_err_terms(y, x, wv)
            assert err <= tol, f"{qtype.name} m={m} algo={algo}: error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [GT.F16, GT.BF16, GT.F32], ids=lambda t: t.name)
def test_qmatmul_odd_k_float(device: str, qtype: GT) -> None:
    """Float weights with a row length that is no multiple of 4/8 (the scalar kernel variants)."""
    rng = np.random.default_rng(7)
    n, k = 5, 37
    raw, wv = make_weight(qtype, n, k, rng)
    w = qt(raw, qtype, (n, k), device)
    for m in (1, 3, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        for algo in ((0,) if device == "cpu" else (1, 2)):
            code, y = raw_qmatmul(w, torch.from_numpy(x).to(device), algo)
            assert code == 0
            assert rel_err_terms(y.cpu().numpy(), x, wv) <= (TOL_F16 if algo == 2 else TOL_FP32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_qmatmul_takes_torch_float_weights(device: str, dtype: torch.dtype) -> None:
    """A float torch tensor as the weight (the engine's small products of float weights on CUDA) gives what the
    same bytes as a QuantizedTensor give, bit for bit."""
    rng = np.random.default_rng(11)
    w = torch.from_numpy(rng.standard_normal((48, 96)).astype(np.float32)).to(dtype).to(device)
    as_gguf = kernels.QuantizedTensor(w.view(torch.uint8).reshape(-1), kernels.FLOAT_TYPES[dtype], (48, 96))
    x = torch.from_numpy(rng.standard_normal((3, 96)).astype(np.float32)).to(device)
    y = kernels.qmatmul(x, w)
    assert y.shape == (3, 48) and torch.equal(y, kernels.qmatmul(x, as_gguf))
    assert torch.allclose(y, x @ w.float().T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_qmatmul_f16_input_and_python_api(device: str) -> None:
    rng = np.random.default_rng(3)
    raw, wv = make_weight(GT.Q4_K, 64, 256, rng)
    w = qt(raw, GT.Q4_K, (64, 256), device)
    x = rng.standard_normal((2, 5, 256)).astype(np.float16)
    y = kernels.qmatmul(torch.from_numpy(x).to(device), w)
    assert y.shape == (2, 5, 64) and y.dtype == torch.float32
    err = rel_err_terms(y.reshape(10, 64).cpu().numpy(), x.reshape(10, 256).astype(np.float32), wv)
    assert err <= TOL_FP32  # 10 rows: the GEMV on CUDA too (f16 inputs are exact in float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype,k", [(GT.Q4_K, 512), (GT.Q8_0, 544), (GT.F16, 520), (GT.BF16, 520), (GT.IQ4_XS, 512),
                                     (GT.IQ4_NL, 544), (GT.IQ2_XXS, 512), (GT.IQ3_S, 512), (GT.IQ1_M, 512)],
                         ids=lambda v: v.name if isinstance(v, GT) else str(v))
def test_gemv_rows_independent_of_batch(device: str, qtype: GT, k: int) -> None:
    """GEMV: each output row depends on its input row only (bitwise), whatever m is (on CUDA passes of 8 rows
    and a remainder: 9 = 8 + 1, 14 = 8 + 6, 19 = 16 + 3; on the CPU a few rows of x take the fused decode-and-dot
    of a row, many a dequantized row, a float row's tail of k % 16 included); and runs repeat exactly."""
    rng = np.random.default_rng(5)
    raw, _ = make_weight(qtype, 96, k, rng)
    w = qt(raw, qtype, (96, k), device)
    x = torch.from_numpy(rng.standard_normal((19, k)).astype(np.float32)).to(device)
    _, full = raw_qmatmul(w, x, 1)
    _, again = raw_qmatmul(w, x, 1)
    assert torch.equal(full, again)
    for m in (1, 3, 5, 8, 9, 14):
        _, part = raw_qmatmul(w, x[:m].contiguous(), 1)
        assert torch.equal(part, full[:m])
    _, last = raw_qmatmul(w, x[-1:].contiguous(), 1)
    assert torch.equal(last, full[-1:])


@pytest.mark.parametrize("device", DEVICES)
def test_bad_shapes_rejected(device: str) -> None:
    f, lb = native.ffi(), native.lib()
    buf = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    y = torch.zeros(1 << 14, dtype=torch.float32, device=device)
    p, yp = f.cast("void *", buf.data_ptr()), f.cast("float *", y.data_ptr())
    st = _stream(device)
    for qtype, k in ((GT.Q4_K, 128), (GT.Q6_K, 300), (GT.Q8_0, 48), (GT.Q4_0, 33), (GT.Q4_1, 48), (GT.Q5_0, 40),
                     (GT.Q5_1, 16)):
        if device == "cuda":
            assert lb.specter_cuda_qmatmul(int(qtype), p, 4, k, 0, p, 1, yp, 0, st) == ERR_BAD_SHAPE
            assert lb.specter_cuda_dequantize_rows(int(qtype), p, yp, 2, k, st) == ERR_BAD_SHAPE
        else:
            assert lb.specter_qmatmul(int(qtype), p, 4, k, 0, p, 1, yp, 0, 1) == ERR_BAD_SHAPE
    # MoE: d_model 128 is no multiple of Q4_K's 256
    tab = f.cast("uint64_t *", buf.data_ptr())
    ids = f.cast("int32_t *", buf.data_ptr())
    args = (yp, 1, 128, ids, yp, 1, 1, 256, tab, int(GT.Q4_K), tab, int(GT.Q4_K), tab, int(GT.Q4_K), p, 1 << 16,
            yp, 0)
    code = lb.specter_cuda_moe_ffn(*args, st) if device == "cuda" else lb.specter_moe_ffn(*args, 1)
    assert code == ERR_BAD_SHAPE
    with pytest.raises(SpecterError):
        kernels.qmatmul(torch.zeros(1, 128, device=device), QuantizedTensor(buf[:144], int(GT.Q4_K), (1, 256)))


# ---------------------------------------------------------------------------------------------
# row dequantization

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_and_rows(device: str, qtype: GT) -> None:
    rng = np.random.default_rng(2000 + int(qtype))
    n, k = _shape_for(qtype)
    raw, wv = make_weight(qtype, n, k, rng)
    w = qt(raw, qtype, (n, k), device)
    if qtype != GT.F32:  # (F32 is not a QuantizedTensor type the engine makes, but works)
        d32 = w.dequantize(torch.float32).cpu().numpy()
        assert d32.view(np.uint32).tobytes() == wv.view(np.uint32).tobytes(), "f32 dequantization not bit-exact"
        d16 = w.dequantize(torch.float16).cpu().numpy()
        assert np.array_equal(d16.view(np.uint16), wv.astype(np.float16).view(np.uint16))
    ids = torch.tensor([3, 0, 66, 3, 17], dtype=torch.int64)
    rows = w[ids.to(device)].cpu().numpy()
    assert np.array_equal(rows, wv[ids.numpy()])
    bad = w.rows(torch.tensor([1, -1, n], device=device)).cpu().numpy()
    assert np.array_equal(bad[0], wv[1]) and np.isnan(bad[1:]).all()
    part = w[10:30]  # a row slice (fused qkv split) is a view that computes on its own
    assert part.shape == (20, k) and part.data.data_ptr() == w.data.data_ptr() + 10 * w.row_bytes
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32)).to(device)
    assert rel_err_terms(kernels.qmatmul(x, part).cpu().numpy(), x.cpu().numpy(), wv[10:30]) <= TOL_FP32


@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU visible to torch and a libspecter built with CUDA")
@pytest.mark.parametrize("qtype", [GT.F16, GT.Q4_K, GT.Q8_0], ids=lambda t: t.name)
def test_rows_read_in_place_from_pinned_host_memory(qtype: GT) -> None:
    """A token embedding left in pinned host memory (offloaded experts) gives the device the rows its device copy
    gives, bit for bit, in a CUDA graph too (a draft step's); one in pageable memory is refused."""
    rng = np.random.default_rng(77 + int(qtype))
    n, k = 300, 512
    raw, _ = make_weight(qtype, n, k, rng)
    host = qt(raw, qtype, (n, k), "cpu")
    dev = host.to("cuda")
    embedding = Embedding(QuantizedTensor(host.data.pin_memory(), int(qtype), (n, k)), dev.device)
    ids = torch.tensor([5, 0, n - 1, 5, 17], device="cuda")
    assert torch.equal(embedding(ids), dev.rows(ids))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        embedding(ids)  # warm-up before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embedding(ids)
    ids.copy_(torch.tensor([1, 2, 3, n - 2, 4], device="cuda"))
    graph.replay()
    assert torch.equal(out, dev.rows(ids))
    with pytest.raises(SpecterError, match="pinned host memory"):
        Embedding(host, dev.device)


# ---------------------------------------------------------------------------------------------
# grouped MoE

def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def moe_reference(x, ids, wts, gate, up, down) -> np.ndarray:
    """float64 loop over tokens and slots; gate/up/down [E, rows, cols] float arrays; ids < 0 skipped."""
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        xt = x[t].astype(np.float64)
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0 or e >= gate.shape[0]:
                continue
            a = silu(gate[e].astype(np.float64) @ xt) * (up[e].astype(np.float64) @ xt)
            out[t] += wts[t, j] * (down[e].astype(np.float64) @ a)
    return out


def make_experts(types: tuple[GT, GT, GT], E: int, d: int, f: int, rng: np.random.Generator):
    mats = []
    for qtype, (rows, cols) in zip(types, ((f, d), (f, d), (d, f))):
        raw, val = make_weight(qtype, E * rows, cols, rng)
        mats.append((raw.reshape(E, rows, -1), val.reshape(E, rows, cols)))
    return mats


def routing(T: int, E: int, top_k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts per token (top-k), expert 0 shared by every token, weights in (0, 1)."""
    ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, E), top_k - 1, replace=False)])
                    for _ in range(T)]).astype(np.int32)
    for t in range(T):
        rng.shuffle(ids[t])
    return ids, rng.uniform(0.1, 1.0, size=(T, top_k)).astype(np.float32)


def run_moe(x, ids, wts, table: ExpertTable, device: str, accumulate_into: np.ndarray | None = None):
    T, d = x.shape
    need = kernels.moe_workspace_size(T, ids.shape[1], table.n_expert, d, table.n_ff)
    ws = torch.full((need,), 0xFF, dtype=torch.uint8, device=device)
    if accumulate_into is None:
        out = torch.full((T, d), float("nan"), dtype=torch.float32, device=device)
    else:
        out = torch.from_numpy(accumulate_into.astype(np.float32)).to(device)
    kernels.moe_ffn(torch.from_numpy(x).to(device), torch.from_numpy(ids).to(device),
                    torch.from_numpy(wts).to(device), table, out=out, workspace=ws,
                    accumulate=accumulate_into is not None)
    return out.cpu().numpy()


MOE_TYPES = [(t, t, t) for t in ALL_TYPES] + [(GT.Q4_K, GT.Q4_K, GT.Q6_K), (GT.Q4_K, GT.Q8_0, GT.Q5_K),
                                              (GT.Q2_K, GT.Q3_K, GT.Q4_0), (GT.Q4_K, GT.Q4_K, GT.Q5_0),
                                              (GT.Q4_1, GT.Q5_1, GT.Q5_0), (GT.IQ2_XXS, GT.IQ2_XXS, GT.IQ3_S),
                                              (GT.IQ1_S, GT.IQ1_S, GT.IQ2_XS)]


def moe_experts(types: tuple[GT, GT, GT], E: int, d: int, f: int, rng: np.random.Generator, device: str):
    """Random experts of `types` on `device`: their ExpertTable, the float values (gate, up, down) and the raw
    (gate, up, down) data."""
    (gr, gv), (ur, uv), (dr, dv) = make_experts(types, E, d, f, rng)
    gate, up, down = (qt(r, t, v.shape, device) for (r, v), t in zip(((gr, gv), (ur, uv), (dr, dv)), types))
    return ExpertTable.from_tensors(gate, up, down), (gv, uv, dv), (gr, ur, dr)


def moe_cases(table: ExpertTable, values, E: int, d: int, cases, rng: np.random.Generator, device: str) -> list:
    """For each (T, top_k) of `cases`: random x and routing, the layer's output checked for unwritten values and
    against the float64 reference (TOL_MOE); returns the (x, ids, weights, y) of each for the caller's own checks."""
    out = []
    for T, top_k in cases:
        x = rng.standard_normal((T, d)).astype(np.float32)
        ids, wts = routing(T, E, top_k, rng)
        ref = moe_reference(x, ids, wts, *values)
        y = run_moe(x, ids, wts, table, device)
        assert np.isfinite(y).all(), f"T={T}: unwritten outputs"
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert err <= TOL_MOE, f"T={T} top_k={top_k}: error {err:.2e}"
        out.append((x, ids, wts, y))
    return out


def assert_alone_equal(x, ids, wts, y, t: int, table: ExpertTable, device: str) -> None:
    """Token t alone gives bitwise its result in the batch."""
    alone = run_moe(x[t:t + 1].copy(), ids[t:t + 1].copy(), wts[t:t + 1].copy(), table, device)
    assert np.array_equal(alone[0], y[t])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("types", MOE_TYPES, ids=lambda ts: "-".join(t.name for t in ts))
def test_moe_ffn(device: str, types: tuple[GT, GT, GT]) -> None:
    rng = np.random.default_rng(3000 + sum(int(t) for t in types))
    E, d, f = 8, 256, 512
    table, values, _ = moe_experts(types, E, d, f, rng, device)
    for x, ids, wts, y in moe_cases(table, values, E, d, ((1, 2), (3, 4), (8, 2), (5, 6), (17, 4)), rng, device):
        assert np.array_equal(run_moe(x, ids, wts, table, device), y), "not deterministic"
        for t in (0, len(x) - 1):
            assert_alone_equal(x, ids, wts, y, t, table, device)


# llama.cpp's mixes for an expert width that is no multiple of 256 (Qwen1.5-MoE's 1408): gate/up rows of
# d_model stay K-quants, the down rows of d_ff fall back to 32-element block types.
FALLBACK_MOE_TYPES = [(GT.Q4_K, GT.Q4_K, GT.Q5_0), (GT.Q2_K, GT.Q2_K, GT.Q4_1), (GT.Q6_K, GT.Q6_K, GT.Q8_0),
                      (GT.Q5_K, GT.Q5_K, GT.Q5_1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("types", FALLBACK_MOE_TYPES, ids=lambda ts: "-".join(t.name for t in ts))
def test_moe_ffn_fallback_width(device: str, types: tuple[GT, GT, GT]) -> None:
    rng = np.random.default_rng(4000 + sum(int(t) for t in types))
    E, d, f = 6, 256, 352  # f = 11 blocks of 32: no multiple of 256 or of the tile's 128
    table, values, raw = moe_experts(types, E, d, f, rng, device)
    moe_cases(table, values, E, d, ((1, 2), (5, 3), (19, 4)), rng, device)
    # the down matrices alone, through qmatmul (GEMV and, on CUDA, the tiled GEMM)
    x = rng.standard_normal((40, f)).astype(np.float32)
    wd = qt(raw[2][1], types[2], (d, f), device)
    for m in (1, 3, 40):
        xm = torch.from_numpy(x[:m]).to(device)
        for algo in ((0, 1, 2) if device == "cuda" else (0,)):
            code, y = raw_qmatmul(wd, xm, algo)
            assert code == 0
            tol = TOL_F16 if device == "cuda" and (algo == 2 or (algo == 0 and m > kernels.GEMV_MAX_ROWS)) else TOL_FP32
            assert rel_err_terms(y.cpu().numpy(), x[:m], values[2][1]) <= tol, (m, algo)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [GT.F16, GT.F32], ids=lambda t: t.name)
def test_moe_ffn_rows_that_leave_a_cta_short(device: str, qtype: GT) -> None:
    """Widths that no CTA's rows divide (34 gate/up rows, 66 down rows): a CTA of several tokens' passes takes four
    batches of rows and the grid's last one stops short; every output is written, the same as alone."""
    rng = np.random.default_rng(12)
    E, d, f = 5, 66, 34
    table, values, _ = moe_experts((qtype, qtype, qtype), E, d, f, rng, device)
    for x, ids, wts, y in moe_cases(table, values, E, d, ((1, 2), (3, 2), (9, 3)), rng, device):
        assert_alone_equal(x, ids, wts, y, len(x) - 1, table, device)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_float_tensors(device: str) -> None:
    """Float experts given as torch tensors (the engine's F16/BF16/F32 path)."""
    rng = np.random.default_rng(11)
    E, d, f, T, top_k = 6, 64, 96, 5, 2
    x = rng.standard_normal((T, d)).astype(np.float32)
    ids, wts = routing(T, E, top_k, rng)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        g, u, dn = (torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype)
                    for i, s in enumerate(((E, f, d), (E, f, d), (E, d, f))))
        ref = moe_reference(x, ids, wts, *(t.float().numpy() for t in (g, u, dn)))
        table = ExpertTable.from_tensors(*(t.to(device) for t in (g, u, dn)))
        y = run_moe(x, ids, wts, table, device)
        assert np.abs(y - ref).max() / np.abs(ref).max() <= TOL_MOE, dtype


@pytest.mark.parametrize("device", DEVICES)
def test_moe_pointer_tables(device: str) -> None:
    """Experts in permuted 'cache slots' give bitwise the contiguous result; zero addresses and ids < 0 are
    skipped; accumulate adds."""
    rng = np.random.default_rng(21)
    E, d, f, T, top_k = 8, 256, 256, 9, 3
    types = (GT.Q4_K, GT.Q4_K, GT.Q6_K)
    mats = make_experts(types, E, d, f, rng)
    contiguous = [qt(r, t, v.shape, device) for (r, v), t in zip(mats, types)]
    base = ExpertTable.from_tensors(*contiguous)
    perm = rng.permutation(E)  # slot s holds expert perm[s]
    slots = [qt(r[perm], t, v.shape, device) for (r, v), t in zip(mats, types)]
    where = np.argsort(perm)   # expert e lives in slot where[e]
    addrs = [[s.data.data_ptr() + int(where[e]) * s.data[0].numel() for e in range(E)] for s in slots]
    table = ExpertTable(torch.tensor(addrs, dtype=torch.int64).to(device), tuple(int(t) for t in types), d, f,
                        keep=tuple(s.data for s in slots))
    x = rng.standard_normal((T, d)).astype(np.float32)
    ids, wts = routing(T, E, top_k, rng)
    y = run_moe(x, ids, wts, base, device)
    assert np.array_equal(run_moe(x, ids, wts, table, device), y)
    ref = moe_reference(x, ids, wts, *(v for _, v in mats))
    assert np.abs(y - ref).max() / np.abs(ref).max() <= TOL_MOE

    # expert 0 (every token's) not resident: zero address; and one slot masked with id -1
    table.ptrs[:, 0] = 0
    masked = ids.copy()
    masked[2, 1] = -1
    expect_ids = masked.copy()
    expect_ids[expect_ids == 0] = -1
    ref2 = moe_reference(x, expect_ids, wts, *(v for _, v in mats))
    y2 = run_moe(x, masked, wts, table, device)
    assert np.abs(y2 - ref2).max() / np.abs(ref2).max() <= TOL_MOE
    # the rest, accumulated on top: equals the whole layer
    only0 = np.where(ids == 0, 0, -1).astype(np.int32)
    only0[2, 1] = ids[2, 1]
    y3 = run_moe(x, only0, wts, base, device, accumulate_into=y2)
    assert np.abs(y3 - ref).max() / np.abs(ref).max() <= TOL_MOE
    # one token alone (CUDA: its own two-launch path) skips and accumulates bitwise as the batch does
    for t in (0, 2):
        alone = run_moe(x[t:t + 1].copy(), masked[t:t + 1].copy(), wts[t:t + 1].copy(), table, device)
        assert np.array_equal(alone[0], y2[t])
        alone = run_moe(x[t:t + 1].copy(), only0[t:t + 1].copy(), wts[t:t + 1].copy(), base, device,
                        accumulate_into=y2[t:t + 1].copy())
        assert np.array_equal(alone[0], y3[t])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_expert", [6, 300])
def test_residency_pointers(device: str, n_expert: int) -> None:
    """Each expert's three addresses from its slot (pool base + slot * slot bytes + the part's offset) or, without a
    slot, from host memory; the routing counted into `routed` on top of what it held, ids out of range not counted;
    the CPU and CUDA kernels alike (more experts than a CTA's threads: 300)."""
    rng = np.random.default_rng(5)
    slot_of = torch.from_numpy(np.where(rng.random(n_expert) < 0.5, rng.integers(0, 50, n_expert), -1))
    host = torch.from_numpy(rng.integers(1 << 40, 1 << 41, (3, n_expert)))
    pool = kernels.SlotPool(1 << 36, 3 << 20, (0, 1 << 20, 2 << 20), (1 << 20, 1 << 20, 1 << 20))
    ids = torch.from_numpy(rng.integers(-1, n_expert + 2, (9, 4)).astype(np.int32))
    routed = torch.from_numpy(rng.integers(0, 3, n_expert).astype(np.int32))
    expect_routed = routed.clone()
    for e in ids.flatten().tolist():
        if 0 <= e < n_expert:
            expect_routed[e] += 1
    expect = torch.stack([torch.where(slot_of >= 0, pool.base + slot_of * pool.slot_bytes + off, host[part])
                          for part, off in enumerate(pool.part_offsets)])
    routed_dev = routed.to(device)
    ptrs = kernels.residency_pointers(slot_of.to(device), host.to(device), pool, ids.to(device), routed_dev)
    assert torch.equal(ptrs.cpu(), expect)
    assert torch.equal(routed_dev.cpu(), expect_routed)
    # the experts the CPU computes (`skip`) get no pointer; without `routed` nothing is counted
    skip = torch.from_numpy(rng.random(n_expert) < 0.3)
    ptrs = kernels.residency_pointers(slot_of.to(device), host.to(device), pool, ids.to(device), None,
                                      skip=skip.to(device))
    assert torch.equal(ptrs.cpu(), expect.masked_fill(skip, 0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_expert,part_bytes", [(6, (48, 48, 40)), (300, (1 << 18, 1 << 18, 1 << 18))])
def test_residency_pointers_copy_misses_into_spares(device: str, n_expert: int, part_bytes: tuple) -> None:
    """With spare slots the table call first copies the routed experts that have no slot (-1; not those whose copy
    is on its way, below -1), in ascending order, into the usable spares (>= 0) in ascending order: their bytes
    land in the slots' parts, the residency row names the slots, `fetched` gets slot + 1, the spares used become -1,
    and their pointers are the slots'. Everything else in the pool is left as it was; a miss beyond the spares is
    read in place, and a miss the CPU computes takes none. Parts of 40 bytes take the byte-wise copy; 256 KiB ones
    the 16-byte one over every CTA."""
    rng = np.random.default_rng(7)
    record = sum(part_bytes)
    offsets = (0, part_bytes[0], part_bytes[0] + part_bytes[1])
    slot_bytes, n_slots = record + 64, 12
    records = torch.from_numpy(rng.integers(0, 256, (n_expert, record), dtype=np.uint8))
    records = records.pin_memory() if device == "cuda" else records
    host = torch.tensor([[records.data_ptr() + e * record + off for e in range(n_expert)] for off in offsets])
    before = torch.from_numpy(rng.integers(0, 256, n_slots * slot_bytes, dtype=np.uint8))
    pool_mem = before.to(device)
    pool = kernels.SlotPool(pool_mem.data_ptr(), slot_bytes, offsets, part_bytes)
    slot_of = torch.full((n_expert,), -1, dtype=torch.int64)
    slot_of[1], slot_of[4] = 0, -2 - 5            # 1 resident in slot 0; 4's copy into slot 5 on its way
    start = slot_of.clone()
    spare_slots = torch.tensor([7, -1, 9, 11])    # spare 1 used already: 7, 9 and 11 are usable
    ids = torch.tensor([[5, 1], [2, 4], [3, 5], [0, 1]], dtype=torch.int32)  # misses 0, 2, 3, 5
    fetched = torch.zeros(n_expert, dtype=torch.int32)
    spares = kernels.SpareSlots(spare_slots.to(device), fetched.to(device), torch.zeros(1, dtype=torch.int32,
                                                                                        device=device))
    routed = torch.zeros(n_expert, dtype=torch.int32, device=device)
    row = slot_of.to(device)
    ptrs = kernels.residency_pointers(row, host.to(device), pool, ids.to(device), routed, spares)
    copied = {0: 7, 2: 9, 3: 11}  # 5 finds no spare left: read in place
    expect_row = slot_of.clone()
    expect_fetched = torch.zeros(n_expert, dtype=torch.int32)
    expect_pool = before.clone()
    for e, slot in copied.items():
        expect_row[e], expect_fetched[e] = slot, slot + 1
        for off, n in zip(offsets, part_bytes):
            expect_pool[slot * slot_bytes + off:slot * slot_bytes + off + n] = records[e, off:off + n]
    assert torch.equal(row.cpu(), expect_row)
    assert torch.equal(spares.fetched.cpu(), expect_fetched)
    assert spares.slots.cpu().tolist() == [-1, -1, -1, -1]
    assert spares.arrivals.item() == 0
    assert torch.equal(pool_mem.cpu(), expect_pool)
    expect_ptrs = torch.stack([torch.where(expect_row >= 0, pool.base + expect_row * slot_bytes + off, host[part])
                               for part, off in enumerate(offsets)])
    assert torch.equal(ptrs.cpu(), expect_ptrs)
    assert routed.cpu().tolist()[:6] == [1, 2, 1, 1, 1, 2]
    assert kernels.MAX_SPARES == native.lib().SPECTER_MAX_SPARES  # the Python side's limit is the library's
    # no usable spare left: the next call copies nothing and reads 5 in place again
    ptrs = kernels.residency_pointers(row, host.to(device), pool, ids.to(device), routed, spares)
    assert torch.equal(row.cpu(), expect_row) and torch.equal(pool_mem.cpu(), expect_pool)
    assert ptrs[0, 5].item() == host[0, 5].item()
    # a miss the CPU computes (`skip`) takes no spare: the next miss does, and the skipped one gets no pointer
    row, spares.slots[:] = start.to(device), torch.tensor([7, 9, -1, -1])
    skip = torch.zeros(n_expert, dtype=torch.bool)
    skip[2] = True
    ptrs = kernels.residency_pointers(row, host.to(device), pool, ids.to(device), routed, spares, skip.to(device))
    assert [int(row[e]) for e in (0, 2, 3, 5)] == [7, -1, 9, -1]
    assert ptrs[:, 2].tolist() == [0, 0, 0] and ptrs[0, 5].item() == host[0, 5].item()


# ---------------------------------------------------------------------------------------------
# engine integration

@pytest.mark.parametrize("device", DEVICES)
def test_resident_experts_native_matches_dense(device: str) -> None:
    from specter_gguf.layers import ResidentExperts, matmul

    rng = np.random.default_rng(31)
    E, d, f, T, top_k = 4, 256, 256, 6, 2
    types = (GT.Q4_K, GT.Q4_K, GT.Q6_K)
    mats = make_experts(types, E, d, f, rng)
    gate, up, down = (qt(r, t, v.shape, device) for (r, v), t in zip(mats, types))
    experts = ResidentExperts(gate, up, down)
    x = torch.from_numpy(rng.standard_normal((T, d)).astype(np.float32)).to(device)
    ids_np, wts_np = routing(T, E, top_k, rng)
    ids, wts = torch.from_numpy(ids_np).long().to(device), torch.from_numpy(wts_np).to(device)
    native_out = experts(x, ids, wts).cpu().numpy()
    dense = experts._dense(x, ids, wts).cpu().numpy()
    ref = moe_reference(x.cpu().numpy(), ids_np, wts_np, *(v for _, v in mats))
    assert np.abs(native_out - ref).max() / np.abs(ref).max() <= TOL_MOE
    assert np.abs(dense - ref).max() / np.abs(ref).max() <= TOL_MOE  # float32 weights on both devices
    y = matmul(x, gate.expert(1)).cpu().numpy()
    assert rel_err_terms(y, x.cpu().numpy(), mats[0][1][1]) <= TOL_FP32
