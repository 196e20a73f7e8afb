"""The native library's CPU dequantization against the reference, bit for bit.

Every test quantizes fresh random floats with a real quantizer (gguf's numpy quantizers for
F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, llama.cpp's own `ggml_quantize_chunk` for the K-quants and IQ types, with an
importance matrix where it needs one), dequantizes the bytes
with specter's native library and with `gguf.quants.dequantize` (which equals ggml's C code), and
requires the two results to be identical bit for bit: same float32 bit patterns, hence
`np.array_equal` holds too. Outputs are poisoned with NaN first so an unwritten element shows.

llama-cpp-python is a hard dependency of these tests: without it the K-quant tests fail, never skip.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.constants import GGML_QUANT_SIZES

from ggml_quantizer import ggml_base as load_ggml_base
from ggml_quantizer import ggml_quantize
from specter_gguf import native
from specter_gguf.errors import SpecterError

GGUF_QUANTIZED = [GT.F16, GT.BF16, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0]
# 32-element block types llama.cpp falls back to when a row is not a multiple of 256
LEGACY_QUANTS = [GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0]
K_QUANTS = [GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K]
IQ_QUANTS = [GT.IQ1_S, GT.IQ1_M, GT.IQ2_XXS, GT.IQ2_XS, GT.IQ2_S, GT.IQ3_XXS, GT.IQ3_S, GT.IQ4_NL, GT.IQ4_XS]
ALL_TYPES = [GT.F32, *GGUF_QUANTIZED, *K_QUANTS, *IQ_QUANTS]
# the round trip's least cosine between a row and its dequantized copy, with margin: over 60 draws of these rows
# (normal, with outliers) the least was 0.58-0.59 for IQ1_S and IQ2_XXS, 0.73-0.82 for IQ1_M, IQ2_XS and IQ2_S,
# 0.88-0.91 for Q2_K and the IQ3 types, 0.98 or more for the rest. A quantizer that wrote nothing scores 0 (or NaN).
ROUND_TRIP_COSINE = {GT.IQ1_S: 0.3, GT.IQ2_XXS: 0.3, GT.IQ1_M: 0.5, GT.IQ2_XS: 0.5, GT.IQ2_S: 0.5, GT.Q2_K: 0.7,
                     GT.IQ3_XXS: 0.7, GT.IQ3_S: 0.7}


# ---------------------------------------------------------------------------------------------
# quantizers

@pytest.fixture(scope="module")
def ggml_base() -> ctypes.CDLL:
    return load_ggml_base()


def quantize(qtype: GT, x: np.ndarray, ggml_lib: ctypes.CDLL | None) -> np.ndarray:
    if qtype == GT.F32:
        return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)
    if qtype in K_QUANTS or qtype in IQ_QUANTS:
        assert ggml_lib is not None
        return ggml_quantize(ggml_lib, qtype, x)
    return gguf.quants.quantize(x, qtype)


def random_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Normal data with per-row scales over several decades, a few outliers and exact zeros."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 2, size=(rows, 1))).astype(np.float32)
    x[rng.random((rows, n)) < 0.002] *= 40
    x[rng.random((rows, n)) < 0.01] = 0
    x[0, : min(n, 256)] = 0  # an all-zero block
    return x


@pytest.fixture
def rng() -> np.random.Generator:
    seed = np.random.SeedSequence().entropy  # fresh data every run; printed on failure
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def assert_bitwise_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert not np.isnan(ours).any(), "an output element was left unwritten (still NaN)"
    same = ours.view(np.uint32 if ours.dtype == np.float32 else np.uint16) == \
        ref.view(np.uint32 if ref.dtype == np.float32 else np.uint16)
    if not same.all():
        i = np.argwhere(~same)[0]
        pytest.fail(f"{(~same).sum()} elements differ, first at {tuple(i)}: ours {ours[tuple(i)]!r} "
                    f"reference {ref[tuple(i)]!r}")
    assert np.array_equal(ours, ref)


def _needs_ggml(qtype: GT) -> bool:
    return qtype in K_QUANTS or qtype in IQ_QUANTS


# ---------------------------------------------------------------------------------------------
# bit-exact dequantization

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(qtype: GT, rng: np.random.Generator, request: pytest.FixtureRequest) -> None:
    lib = request.getfixturevalue("ggml_base") if _needs_ggml(qtype) else None
    rows, n = 37, 1024
    x = random_rows(rng, rows, n)
    q = quantize(qtype, x, lib)
    assert q.nbytes == rows * (n // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])
    ref = gguf.quants.dequantize(q, qtype).astype(np.float32, copy=False)
    assert ref.shape == (rows, n)
    # the quantizer did real work: each row's round trip keeps its direction
    x64, r64 = x.astype(np.float64), ref.astype(np.float64)
    cosine = (x64 * r64).sum(1) / np.sqrt((x64 * x64).sum(1) * (r64 * r64).sum(1))
    assert cosine.min() >= ROUND_TRIP_COSINE.get(qtype, 0.9), cosine.min()

    out = np.full((rows, n), np.nan, dtype=np.float32)
    got = native.dequantize(q, int(qtype), (rows, n), n_threads=1, out=out)
    assert got is out
    assert_bitwise_equal(got, ref)
    # the same bytes as one flat buffer
    assert_bitwise_equal(native.dequantize(q.reshape(-1), int(qtype), (rows, n)), ref)


@pytest.mark.parametrize("qtype", LEGACY_QUANTS, ids=lambda t: t.name)
def test_dequantize_llama_quantized_legacy(qtype: GT, rng: np.random.Generator, ggml_base: ctypes.CDLL) -> None:
    """The legacy block types as llama.cpp's own quantizer writes them (what real GGUF files hold)."""
    rows, n = 19, 1408  # Qwen1.5-MoE's expert width: not a multiple of 256
    x = random_rows(rng, rows, n)
    q = ggml_quantize(ggml_base, qtype, x)
    ref = gguf.quants.dequantize(q, qtype).astype(np.float32, copy=False)
    assert np.abs(ref - x).sum() <= 0.3 * np.abs(x).sum()
    out = np.full((rows, n), np.nan, dtype=np.float32)
    assert_bitwise_equal(native.dequantize(q, int(qtype), (rows, n), out=out), ref)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_f16_output(qtype: GT, rng: np.random.Generator, request: pytest.FixtureRequest) -> None:
    lib = request.getfixturevalue("ggml_base") if _needs_ggml(qtype) else None
    rows, n = 9, 512
    x = random_rows(rng, rows, n)
    q = quantize(qtype, x, lib)
    ref = gguf.quants.dequantize(q, qtype).astype(np.float32, copy=False).astype(np.float16)
    out = np.full((rows, n), np.nan, dtype=np.float16)
    got = native.dequantize(q, int(qtype), (rows, n), out_dtype=np.float16, out=out)
    assert_bitwise_equal(got, ref)


def test_f16_rounding_edges() -> None:
    """float -> half rounding (via F32 input) matches numpy: ties, subnormals, overflow, signs."""
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.996, 65520.0, 70000.0, -1e6, np.inf, -np.inf,
            2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 3 * 2.0**-25, 2.0**-14, 2.0**-14 - 2.0**-25,
            1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 6.1e-5, 1e-8, 0.1, 1 / 3]
    rng = np.random.default_rng()
    x = np.concatenate([np.array(vals, dtype=np.float32),
                        rng.standard_normal(4000).astype(np.float32) * np.float32(1e-4),
                        rng.standard_normal(4000).astype(np.float32) * np.float32(3e4)])
    x = np.concatenate([x, np.zeros((-len(x)) % 8, np.float32)]).reshape(8, -1)
    got = native.dequantize(x.view(np.uint8), int(GT.F32), x.shape, out_dtype=np.float16)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    assert_bitwise_equal(got, ref)


def test_every_half_value() -> None:
    """All 65536 F16 bit patterns (subnormals, inf, nan payloads) and BF16 ones convert exactly."""
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    got = native.dequantize(h.view(np.uint8), int(GT.F16), h.shape)
    assert (got.view(np.uint32) == h.view(np.float16).astype(np.float32).view(np.uint32)).all()
    got = native.dequantize(h.view(np.uint8), int(GT.BF16), h.shape)
    assert (got.view(np.uint32) == h.astype(np.uint32) << 16).all()


def with_vectors_capped(cap: str, script: str, folder: Path) -> dict[str, np.ndarray]:
    """Runs `script` (python -c, given `folder` as argv[1]: it reads folder/in.npz, writes folder/out.npz) in a fresh
    process with SPECTER_CPU_VECTORS=`cap` (the library chooses its path once a process), and loads what it wrote."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SPECTER_CPU_VECTORS": cap}
    subprocess.run([sys.executable, "-c", script, str(folder)], env=env, check=True)
    with np.load(folder / "out.npz") as out:
        return dict(out)


# The paths a process can be held to: the scalar code, and AVX2 without the AVX-512 dots (this process takes the
# widest the CPU has).
VECTOR_CAPS = ("none", "avx2")


def skip_a_path_of_our_own(cap: str) -> None:
    """Skips the AVX2 case where the CPU has no AVX-512: there the AVX2 path is this process's own."""
    cpuinfo = Path("/proc/cpuinfo")
    if cap == "avx2" and not (cpuinfo.exists() and " avx512f" in cpuinfo.read_text()):
        pytest.skip("the CPU has no AVX-512F: its AVX2 path is the one this process runs")


@pytest.mark.parametrize("cap", VECTOR_CAPS)
def test_the_vector_path_gives_the_scalar_bits(tmp_path: Path, cap: str) -> None:
    """F16, Q8_0, Q4_K and Q6_K rows decode, and F16/BF16/Q8_0/Q4_K/Q6_K rows are dotted with rows of x, with
    AVX2 (and, for Q4_K, AVX-512) instructions where the CPU has them: the scalar path (SPECTER_CPU_VECTORS=none,
    in a fresh process: the choice is made once) and the AVX2 path (=avx2) give this process's bits, for every half
    value (NaN payloads kept), for Q8_0, Q4_K and Q6_K blocks of random bytes, and for 1, 2, 3, 4, 5 and 9 rows of x
    (rows decoded in registers, four at most a pass, or once into a buffer) times matrices of 520 halfs a row (a
    vector's tail), of 17 Q8_0 blocks and of those Q4_K and Q6_K blocks (the scalar path: the dequantized row's dot
    product); each row of x gets the bits it gets alone."""
    skip_a_path_of_our_own(cap)
    rng = np.random.default_rng(9)
    halfs = np.arange(65536 + 33 * 7, dtype=np.uint32).astype(np.uint16)[: 33 * 1987].reshape(-1, 33)
    blocks = rng.integers(0, 256, (64, 34 * 8), dtype=np.uint8)
    blocks.reshape(-1, 34)[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
    k4 = rng.integers(0, 256, (8, 144 * 4), dtype=np.uint8)
    k4.reshape(-1, 144)[:, :4] = np.frombuffer(np.float16([0.01, 0.002]).tobytes(), np.uint8)  # d, dmin
    k6 = rng.integers(0, 256, (8, 210 * 4), dtype=np.uint8)
    k6.reshape(-1, 210)[:, 208:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # d
    ks = {GT.F16: 520, GT.BF16: 520, GT.Q8_0: 544}
    floats = {t: rng.standard_normal((24, k)).astype(np.float32) for t, k in ks.items()}
    mats = {GT.F16: floats[GT.F16].astype(np.float16).view(np.uint8),
            GT.BF16: (floats[GT.BF16].view(np.uint32) >> 16).astype(np.uint16).view(np.uint8),
            GT.Q8_0: quantize(GT.Q8_0, floats[GT.Q8_0], None)}
    mats[GT.Q4_K], mats[GT.Q6_K] = k4, k6  # 8 rows of 1024
    ks[GT.Q4_K] = ks[GT.Q6_K] = 1024
    xs = {t: rng.standard_normal((9, k)).astype(np.float32) for t, k in ks.items()}
    ms = (1, 2, 3, 4, 5, 9)
    np.savez(tmp_path / "in.npz", halfs=halfs, blocks=blocks, k4=k4, k6=k6,
             **{f"w{int(t)}": m for t, m in mats.items()}, **{f"x{int(t)}": v for t, v in xs.items()})
    script = (
        "import sys, numpy as np, torch; from specter_gguf import kernels, native; d = sys.argv[1]\n"
        "a = np.load(d + '/in.npz')\n"
        f"out = dict(h=native.dequantize(a['halfs'].view(np.uint8), {int(GT.F16)}, a['halfs'].shape),\n"
        f"           b=native.dequantize(a['blocks'], {int(GT.Q8_0)}, (64, 256)),\n"
        f"           k4=native.dequantize(a['k4'], {int(GT.Q4_K)}, (8, 1024)),\n"
        f"           k6=native.dequantize(a['k6'], {int(GT.Q6_K)}, (8, 1024)))\n"
        f"for t, k in {[(int(t), k) for t, k in ks.items()]}:\n"
        "    w = kernels.QuantizedTensor.from_numpy(a[f'w{t}'], t, (a[f'w{t}'].shape[0], k))\n"
        f"    for m in {ms}:\n"
        "        out[f'y{t}_{m}'] = kernels.qmatmul(torch.from_numpy(a[f'x{t}'][:m]), w).numpy()\n"
        "np.savez(d + '/out.npz', **out)\n")
    got = with_vectors_capped(cap, script, tmp_path)
    here = native.dequantize(halfs.view(np.uint8), int(GT.F16), halfs.shape)
    assert np.array_equal(got["h"].view(np.uint32), here.view(np.uint32))  # NaNs: by bits
    assert_bitwise_equal(got["b"], native.dequantize(blocks, int(GT.Q8_0), (64, 256)))
    assert_bitwise_equal(got["k4"], native.dequantize(k4, int(GT.Q4_K), (8, 1024)))
    assert_bitwise_equal(got["k6"], native.dequantize(k6, int(GT.Q6_K), (8, 1024)))
    from specter_gguf import kernels
    import torch

    for t, k in ks.items():
        w = kernels.QuantizedTensor.from_numpy(mats[t], int(t), (mats[t].shape[0], k))
        alone = np.concatenate([kernels.qmatmul(torch.from_numpy(xs[t][i:i + 1]), w).numpy() for i in range(9)])
        for m in ms:
            assert_bitwise_equal(got[f"y{int(t)}_{m}"], kernels.qmatmul(torch.from_numpy(xs[t][:m]), w).numpy())
            assert_bitwise_equal(got[f"y{int(t)}_{m}"], alone[:m])


def test_gguf_reader_layout_3d(ggml_base: ctypes.CDLL, rng: np.random.Generator) -> None:
    """An expert tensor as gguf's reader gives it: uint8 [experts, rows, bytes_per_row]."""
    experts, rows, n = 4, 6, 512
    x = random_rows(rng, experts * rows, n)
    q = ggml_quantize(ggml_base, GT.Q4_K, x).reshape(experts, rows, -1)
    ref = gguf.quants.dequantize(q, GT.Q4_K)
    assert ref.shape == (experts, rows, n)
    assert_bitwise_equal(native.dequantize(q, int(GT.Q4_K), (experts, rows, n)), ref)


@pytest.mark.parametrize("qtype", [GT.Q4_K, GT.Q6_K, GT.Q8_0, GT.F16], ids=lambda t: t.name)
def test_multithreaded_equals_single_threaded(qtype: GT, rng: np.random.Generator,
                                              request: pytest.FixtureRequest) -> None:
    lib = request.getfixturevalue("ggml_base") if _needs_ggml(qtype) else None
    rows, n = 67, 4096  # odd row count: uneven split over threads
    q = quantize(qtype, random_rows(rng, rows, n), lib)
    one = native.dequantize(q, int(qtype), (rows, n), n_threads=1)
    for t in (2, 3, 7, 0, -1):
        out = np.full((rows, n), np.nan, dtype=np.float32)
        assert_bitwise_equal(native.dequantize(q, int(qtype), (rows, n), n_threads=t, out=out), one)
    assert_bitwise_equal(one, gguf.quants.dequantize(q, qtype).astype(np.float32, copy=False))


def test_the_worker_pool_from_threads_and_a_forked_child(rng: np.random.Generator) -> None:
    """The CPU kernels share one pool of worker threads: calls from several Python threads at once (one holds the
    pool, the others start threads of their own) give the single-threaded bits, and so does a child made by
    fork() after the pool started (it has none of its parent's threads: it makes its own pool)."""
    import os
    import threading
    import time
    import warnings

    rows, n = 67, 4096
    q = quantize(GT.Q8_0, random_rows(rng, rows, n), None)
    one = native.dequantize(q, int(GT.Q8_0), (rows, n), n_threads=1)
    native.dequantize(q, int(GT.Q8_0), (rows, n), n_threads=3)  # the pool is running
    results: list[np.ndarray] = []

    def work() -> None:
        for _ in range(20):
            results.append(native.dequantize(q, int(GT.Q8_0), (rows, n), n_threads=3))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 80
    for r in results:
        assert_bitwise_equal(r, one)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python's warning on forking a threaded process
        pid = os.fork()
    if pid == 0:  # the child: exit 0 when the kernels gave the same bits
        same = np.array_equal(native.dequantize(q, int(GT.Q8_0), (rows, n), n_threads=3).view(np.uint32),
                              one.view(np.uint32))
        os._exit(0 if same else 1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's kernel call did not end within 60 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_worker_pool_back_to_back_calls_of_other_sizes(rng: np.random.Generator) -> None:
    """Calls that follow each other at once, with other job counts and thread counts (a worker still spinning
    from one call, or late to it, meets the next): every call gives the single-threaded bits, its rows all
    written."""
    shapes = [(67, 4096), (5, 256), (131, 1024), (16, 32)]
    cases = []
    for rows, n in shapes:
        q = quantize(GT.Q8_0, random_rows(rng, rows, n), None)
        cases.append((q, (rows, n), native.dequantize(q, int(GT.Q8_0), (rows, n), n_threads=1)))
    for i in range(400):
        q, shape, one = cases[i % len(cases)]
        out = np.full(shape, np.nan, dtype=np.float32)
        got = native.dequantize(q, int(GT.Q8_0), shape, n_threads=(2, 3, 0, 7)[i % 4], out=out)
        assert_bitwise_equal(got, one)


# ---------------------------------------------------------------------------------------------
# ABI: type table, error codes

@pytest.mark.parametrize("cap", VECTOR_CAPS)
def test_iq_types_decode_and_dot_alike_on_every_path(tmp_path: Path, ggml_base: ctypes.CDLL, cap: str) -> None:
    """The IQ types' rows decode, and are dotted with 1 to 4 rows of x in registers, with AVX2 where the CPU has it
    (one vector a group of 8 weights; IQ4_NL and IQ4_XS with AVX-512 where it has that: a 16-value table a run),
    without (SPECTER_CPU_VECTORS=none, in a fresh process: a dequantized row's dot product) and with AVX2 only
    (=avx2): the decoders give gguf's dequantization and the products the same bits every way, for 1, 3, 4 and 6
    rows of x (6: the rows dequantized once)."""
    skip_a_path_of_our_own(cap)
    import torch

    from specter_gguf import kernels

    rng = np.random.default_rng(11)
    data = {t: quantize(t, random_rows(rng, 6, 512), ggml_base) for t in IQ_QUANTS}
    x = rng.standard_normal((6, 512)).astype(np.float32)
    ms = (1, 3, 4, 6)
    np.savez(tmp_path / "in.npz", x=x, **{f"q{int(t)}": q for t, q in data.items()})
    script = ("import sys, numpy as np, torch; from specter_gguf import kernels, native; d = sys.argv[1]\n"
              "a = np.load(d + '/in.npz'); out = {}\n"
              "for k in (k for k in a.files if k.startswith('q')):\n"
              "    out[k] = native.dequantize(a[k], int(k[1:]), (6, 512))\n"
              "    w = kernels.QuantizedTensor.from_numpy(a[k], int(k[1:]), (6, 512))\n"
              f"    for m in {ms}:\n"
              "        out[f'{k}_{m}'] = kernels.qmatmul(torch.from_numpy(a['x'][:m]), w).numpy()\n"
              "np.savez(d + '/out.npz', **out)\n")
    capped = with_vectors_capped(cap, script, tmp_path)
    for t, q in data.items():
        ref = gguf.quants.dequantize(q, t).astype(np.float32, copy=False)
        assert_bitwise_equal(capped[f"q{int(t)}"], ref)
        assert_bitwise_equal(native.dequantize(q, int(t), (6, 512)), ref)
        w = kernels.QuantizedTensor.from_numpy(q, int(t), (6, 512))
        for m in ms:
            assert_bitwise_equal(kernels.qmatmul(torch.from_numpy(x[:m]), w).numpy(), capped[f"q{int(t)}_{m}"])


def test_type_ids_and_block_sizes_match_ggml() -> None:
    for qtype in ALL_TYPES:
        assert native.block_size(int(qtype)) == GGML_QUANT_SIZES[qtype], qtype.name
    lb = native.lib()
    assert (lb.SPECTER_TYPE_F32, lb.SPECTER_TYPE_F16, lb.SPECTER_TYPE_Q4_0, lb.SPECTER_TYPE_Q4_1,
            lb.SPECTER_TYPE_Q5_0, lb.SPECTER_TYPE_Q5_1, lb.SPECTER_TYPE_Q8_0,
            lb.SPECTER_TYPE_Q2_K, lb.SPECTER_TYPE_Q3_K, lb.SPECTER_TYPE_Q4_K, lb.SPECTER_TYPE_Q5_K,
            lb.SPECTER_TYPE_Q6_K, lb.SPECTER_TYPE_BF16) == (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30)
    assert (lb.SPECTER_TYPE_IQ1_S, lb.SPECTER_TYPE_IQ1_M, lb.SPECTER_TYPE_IQ2_XXS, lb.SPECTER_TYPE_IQ2_XS,
            lb.SPECTER_TYPE_IQ2_S, lb.SPECTER_TYPE_IQ3_XXS, lb.SPECTER_TYPE_IQ3_S, lb.SPECTER_TYPE_IQ4_NL,
            lb.SPECTER_TYPE_IQ4_XS) == tuple(int(t) for t in IQ_QUANTS)
    assert (native.Q4_1, native.Q5_0, native.Q5_1) == (int(GT.Q4_1), int(GT.Q5_0), int(GT.Q5_1))


def test_iq_grids_header_holds_ggufs_tables() -> None:
    """native/src/iq_grids.h, the IQ1/IQ2/IQ3 codebooks the decoders index, is what scripts/make_iq_grids.py makes
    from the gguf package's tables (the decoders are checked against gguf's dequantizers above)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "make_iq_grids.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_error_codes() -> None:
    f, lb = native.ffi(), native.lib()
    src = f.new("uint8_t[]", 4096)
    dst = f.new("float[]", 4096)
    assert lb.specter_dequantize_rows(lb.SPECTER_TYPE_Q4_K, src, dst, 1, 256, 1) == lb.SPECTER_OK
    # row length not a multiple of the block
    assert lb.specter_dequantize_rows(lb.SPECTER_TYPE_Q4_K, src, dst, 1, 100, 1) == lb.SPECTER_ERR_BAD_SHAPE
    assert lb.specter_dequantize_rows(lb.SPECTER_TYPE_Q8_0, src, dst, 2, 48, 1) == lb.SPECTER_ERR_BAD_SHAPE
    # unknown / unhandled types (TQ1_0 = 34 exists in ggml but is not handled; 4 was removed; 99 does not exist)
    for t in (34, 4, 99, -1):
        assert lb.specter_dequantize_rows(t, src, dst, 1, 256, 1) == lb.SPECTER_ERR_UNSUPPORTED_TYPE
        assert lb.specter_type_block_size(t, f.NULL, f.NULL) == lb.SPECTER_ERR_UNSUPPORTED_TYPE
    # bad arguments
    assert lb.specter_dequantize_rows(lb.SPECTER_TYPE_Q8_0, f.NULL, dst, 1, 32, 1) == lb.SPECTER_ERR_INVALID_ARG
    assert lb.specter_dequantize_rows(lb.SPECTER_TYPE_Q8_0, src, f.NULL, 1, 32, 1) == lb.SPECTER_ERR_INVALID_ARG
    assert lb.specter_dequantize_rows(lb.SPECTER_TYPE_Q8_0, src, dst, -1, 32, 1) == lb.SPECTER_ERR_INVALID_ARG
    assert lb.specter_dequantize_rows(lb.SPECTER_TYPE_Q8_0, f.NULL, f.NULL, 0, 32, 1) == lb.SPECTER_OK
    size = f.new("size_t *")
    assert lb.specter_row_size(lb.SPECTER_TYPE_Q6_K, 512, size) == lb.SPECTER_OK and size[0] == 420
    assert lb.specter_row_size(lb.SPECTER_TYPE_Q6_K, 500, size) == lb.SPECTER_ERR_BAD_SHAPE
    # every code has its own message
    codes = [lb.SPECTER_OK, lb.SPECTER_ERR_INVALID_ARG, lb.SPECTER_ERR_UNSUPPORTED_TYPE, lb.SPECTER_ERR_BAD_SHAPE,
             lb.SPECTER_ERR_OUT_OF_MEMORY, lb.SPECTER_ERR_CUDA, lb.SPECTER_ERR_NO_CUDA, lb.SPECTER_ERR_INTERNAL]
    msgs = {native.error_string(c) for c in codes}
    assert len(msgs) == len(codes) and native.error_string(-12345) == "unknown error code"


def test_python_errors() -> None:
    q = np.zeros((2, 34), np.uint8)
    with pytest.raises(SpecterError, match="not a multiple"):
        native.dequantize(q, int(GT.Q8_0), (2, 31))
    with pytest.raises(SpecterError, match="unsupported ggml tensor type"):
        native.dequantize(q, 34, (2, 32))  # TQ1_0
    with pytest.raises(SpecterError, match="bytes given"):
        native.dequantize(q, int(GT.Q8_0), (3, 32))
    with pytest.raises(SpecterError, match="BAD_SHAPE|not a multiple"):
        native.check(native.lib().SPECTER_ERR_BAD_SHAPE)
    native.check(0)


def test_missing_library_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECTER_NATIVE_LIB", str(tmp_path / "nope.so"))
    with pytest.raises(SpecterError, match="was not built.*pip install") as e:
        native._load()
    assert "\n" not in str(e.value)
    broken = tmp_path / "libspecter.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setenv("SPECTER_NATIVE_LIB", str(broken))
    with pytest.raises(SpecterError, match="could not be loaded.*pip install") as e:
        native._load()
    assert "\n" not in str(e.value)


def test_build_info() -> None:
    import specter_gguf

    assert native.version() == specter_gguf.__version__
    assert isinstance(native.has_cuda(), bool)
    n = native.cuda_device_count()
    assert n >= 0 and (native.has_cuda() or n == 0)

