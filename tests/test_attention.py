"""The native attention of a few queries over the KV cache (`kernels.decode_attention`, native
`specter_decode_attention`) against what `layers.attend` (torch SDPA) computes with the mask `Positions.window`
builds, on fresh random data:

- CPU, float32: q [H, T, d] over the first S keys of a cache [H_kv, capacity, d] (capacity > S), T in 1, 2, 9, 16,
  heads 16/16, 32/4, 4/2, head_dim 64 and 128, windows 1, 5, 256, 300, positions such that the first token sees
  key 0 alone and the last the whole window; error max |out - ref| / max |ref| <= TOL_F32 = 1e-5 (float32 sums in
  another order than SDPA's); float16 caches (f16 in and out) within one f16 rounding of the float32 reference on
  the same values (2^-11 relative) plus TOL_F32;
- keys after every token's position poisoned with NaN change nothing (bitwise), and each token's result is
  bitwise the one it gets alone;
- argument errors (head_dim not a multiple of 32 or above 256, more than 16 tokens, heads not a multiple of the KV
  heads, a window past the capacity, a position outside the window on the CPU, a short workspace, a type other
  than F16/F32) raise SpecterError;
- CUDA (skipped without a GPU and a CUDA build): the same shapes, float16 caches against the CPU op on the same
  values (TOL_F16_CPU = 2e-3 of max |ref|: each rounds its float32 result to f16 once) and against torch SDPA on
  the GPU (TOL_F16_SDPA = 5e-3: SDPA's fp16 kernel rounds the softmax weights too), float32 caches against the CPU
  op (TOL_F32); results bitwise the same on a second call and per token alone; positions outside the window
  clamped; the op captured in a CUDA graph and replayed with other positions gives the eager results bitwise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specter_gguf import kernels, native
from specter_gguf.errors import SpecterError
from specter_gguf.layers import Positions, attend
from tests.test_kernels import CUDA_OK

TOL_F32 = 1e-5
TOL_F16_CPU = 2e-3
TOL_F16_SDPA = 5e-3
HEADS = [(16, 16), (32, 4), (4, 2)]
TOKENS = [1, 2, 9, 16]
WINDOWS = [1, 5, 256, 300]

needs_cuda = pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU visible to torch and a libspecter built with CUDA")


def positions(T: int, S: int, rng: np.random.Generator) -> torch.Tensor:
    """T positions in [0, S): the first 0 (one key seen), the last S - 1 (the whole window), the others random."""
    if T == 1:
        return torch.tensor([S - 1])
    p = np.sort(rng.integers(0, S, T))
    p[0], p[-1] = 0, S - 1
    return torch.from_numpy(p)


def make(H: int, Hkv: int, T: int, d: int, S: int, rng: np.random.Generator, dtype: torch.dtype = torch.float32,
         device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [H, T, d], caches [Hkv, capacity, d] with capacity > S (the rows past S are NaN: never read), positions."""
    cap = S + 7
    q = torch.from_numpy(rng.standard_normal((H, T, d)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((Hkv, cap, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((Hkv, cap, d)).astype(np.float32))
    k[:, S:], v[:, S:] = float("nan"), float("nan")
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), positions(T, S, rng).to(device)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: int, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """What `Attention` computes without the native op: `attend` with the mask of `Positions.window`."""
    return attend(q, k[:, :S], v[:, :S], Positions.window(pos, S).attn_bias(k.dtype), scale)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# ---- CPU -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
def test_cpu_matches_sdpa(heads: tuple[int, int], d: int) -> None:
    H, Hkv = heads
    rng = np.random.default_rng(H * 1000 + Hkv * 10 + d)
    for S in WINDOWS:
        for T in TOKENS:
            q, k, v, pos = make(H, Hkv, T, d, S, rng)
            scale = 1.0 / math.sqrt(d)
            out = kernels.decode_attention(q, k, v, S, pos, scale)
            assert out.shape == (H, T, d) and out.dtype == torch.float32
            err = rel_err(out, sdpa(q, k, v, S, pos, scale))
            assert err <= TOL_F32, f"S={S} T={T}: error {err:.2e}"
            if T == 1:  # Positions.at's single query: no mask at all
                err = rel_err(out, attend(q, k[:, :S], v[:, :S], None, scale))
                assert err <= TOL_F32, f"S={S} T=1 without a mask: error {err:.2e}"


@pytest.mark.parametrize("heads", HEADS[1:], ids=lambda h: f"{h[0]}-{h[1]}")
def test_cpu_float16_cache(heads: tuple[int, int]) -> None:
    H, Hkv = heads
    rng = np.random.default_rng(H + Hkv)
    for S, T in ((5, 2), (300, 9), (256, 1)):
        q, k, v, pos = make(H, Hkv, T, 128, S, rng, torch.float16)
        out = kernels.decode_attention(q, k, v, S, pos, 0.1)
        assert out.dtype == torch.float16
        ref = sdpa(q.float(), k.float(), v.float(), S, pos, 0.1)
        bound = ref.abs() * 2.0 ** -11 + TOL_F32 * ref.abs().max()
        assert ((out.float() - ref).abs() <= bound).all(), f"S={S} T={T}"


def test_cpu_tokens_independent_and_tail_unread() -> None:
    rng = np.random.default_rng(3)
    q, k, v, pos = make(4, 2, 9, 64, 300, rng)
    pos = pos.clamp(max=200)  # keys 201 .. 299 seen by nobody
    out = kernels.decode_attention(q, k, v, 300, pos, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[:, 201:], v2[:, 201:] = float("nan"), float("nan")
    assert torch.equal(kernels.decode_attention(q, k2, v2, 300, pos, 0.125), out)
    for t in range(9):
        alone = kernels.decode_attention(q[:, t:t + 1].contiguous(), k, v, 300, pos[t:t + 1], 0.125)
        assert torch.equal(alone[:, 0], out[:, t]), t


def _native(kv_type: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, T: int, H: int, Hkv: int, d: int,
            S: int, cap: int, pos: torch.Tensor, ws_bytes: int | None = None) -> int:
    f, lb = native.ffi(), native.lib()
    need = ws_bytes
    if need is None:
        out = f.new("size_t *")
        need = int(out[0]) if lb.specter_decode_attention_workspace_size(T, H, d, S, out) == 0 else 0
    ws = torch.empty(max(need, 1), dtype=torch.uint8)
    o = torch.empty(max(H * T * d, 1))
    p = lambda t: f.cast("void *", t.data_ptr())  # noqa: E731
    return lb.specter_decode_attention(kv_type, p(q), p(k), p(v), T, H, Hkv, d, S, cap,
                                       f.cast("int64_t *", pos.data_ptr()), 0.1, p(ws), need, p(o), 1)


def test_cpu_argument_errors() -> None:
    rng = np.random.default_rng(5)
    q, k, v, pos = make(4, 2, 2, 64, 5, rng)
    with pytest.raises(SpecterError):
        kernels.decode_attention(q, k, v, 5, torch.tensor([0, 5]), 0.1)  # position past the window
    with pytest.raises(SpecterError):
        kernels.decode_attention(q, k, v, 5, torch.tensor([-1, 3]), 0.1)
    with pytest.raises(SpecterError):
        kernels.decode_attention(q, k, v, k.shape[1] + 1, pos, 0.1)  # window past the capacity
    with pytest.raises(SpecterError):
        kernels.decode_attention(q.half(), k, v, 5, pos, 0.1)  # dtypes differ
    with pytest.raises(SpecterError):
        kernels.decode_attention(q, k, v, 5, pos, 0.1, workspace=torch.empty(16, dtype=torch.uint8))
    for d in (48, 16, 288):  # not a multiple of 32, or past 256
        qd, kd, vd, pd = make(4, 2, 2, d, 5, rng)
        with pytest.raises(SpecterError):
            kernels.decode_attention(qd, kd, vd, 5, pd, 0.1)
    q17, k17, v17, p17 = make(4, 2, 17, 64, 20, rng)
    with pytest.raises(SpecterError):
        kernels.decode_attention(q17, k17, v17, 20, p17, 0.1)  # more than 16 tokens
    q3, k3, v3, p3 = make(6, 4, 2, 64, 5, rng)
    with pytest.raises(SpecterError):
        kernels.decode_attention(q3, k3, v3, 5, p3, 0.1)  # 6 heads over 4 KV heads
    # the native codes: bad shape, bad arguments, a type other than F16/F32, a short workspace, T = 0
    cap = k.shape[1]
    assert _native(native.F32, q, k, v, 2, 4, 2, 64, 5, cap, pos) == 0
    assert _native(native.F32, q, k, v, 2, 4, 2, 48, 5, cap, pos) == -3
    assert _native(native.F32, q, k, v, 2, 4, 3, 64, 5, cap, pos) == -1
    assert _native(native.F32, q, k, v, 2, 4, 2, 64, 0, cap, pos) == -1
    assert _native(native.F32, q, k, v, 2, 4, 2, 64, cap + 1, cap, pos) == -1
    assert _native(native.BF16, q, k, v, 2, 4, 2, 64, 5, cap, pos) == -2
    assert _native(native.F32, q, k, v, 2, 4, 2, 64, 5, cap, pos, ws_bytes=64) == -1
    assert _native(native.F32, q, k, v, 0, 4, 2, 64, 5, cap, pos) == 0


# ---- CUDA ----------------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
def test_cuda_matches_cpu_and_sdpa(heads: tuple[int, int], d: int) -> None:
    H, Hkv = heads
    rng = np.random.default_rng(H * 1000 + Hkv * 10 + d + 1)
    for S in WINDOWS:
        for T in TOKENS:
            q, k, v, pos = make(H, Hkv, T, d, S, rng, torch.float16)
            scale = 1.0 / math.sqrt(d)
            cpu = kernels.decode_attention(q, k, v, S, pos, scale)
            qc, kc, vc, pc = (x.cuda() for x in (q, k, v, pos))
            out = kernels.decode_attention(qc, kc, vc, S, pc, scale)
            again = kernels.decode_attention(qc, kc, vc, S, pc, scale)
            ref = sdpa(qc, kc, vc, S, pc, scale)
            torch.cuda.synchronize()
            assert out.dtype == torch.float16 and torch.equal(out, again), f"S={S} T={T}: not deterministic"
            assert not torch.isnan(out).any(), f"S={S} T={T}"
            err_cpu, err_sdpa = rel_err(out.cpu(), cpu), rel_err(out, ref)
            assert err_cpu <= TOL_F16_CPU, f"S={S} T={T}: {err_cpu:.2e} from the CPU op"
            assert err_sdpa <= TOL_F16_SDPA, f"S={S} T={T}: {err_sdpa:.2e} from SDPA"
            q32, k32, v32 = q.float(), k.float(), v.float()
            out32 = kernels.decode_attention(q32.cuda(), k32.cuda(), v32.cuda(), S, pc, scale)
            err32 = rel_err(out32.cpu(), kernels.decode_attention(q32, k32, v32, S, pos, scale))
            assert err32 <= TOL_F32, f"S={S} T={T} float32: {err32:.2e} from the CPU op"


@needs_cuda
@pytest.mark.parametrize("d", [32, 96, 256])
def test_cuda_other_head_dims_and_long_windows(d: int) -> None:
    rng = np.random.default_rng(d)
    for S, T in ((4096, 9), (2100, 1), (17000, 2)):  # 64 splits of 64 keys; 33 of 64; 67 of 256
        q, k, v, pos = make(4, 2, T, d, S, rng)
        out = kernels.decode_attention(q.cuda(), k.cuda(), v.cuda(), S, pos.cuda(), 0.1)
        err = rel_err(out.cpu(), kernels.decode_attention(q, k, v, S, pos, 0.1))
        assert err <= TOL_F32, f"d={d} S={S} T={T}: {err:.2e}"


@needs_cuda
def test_cuda_tokens_independent_tail_unread_positions_clamped() -> None:
    rng = np.random.default_rng(11)
    S = 1000
    q, k, v, pos = (x.cuda() for x in make(16, 16, 9, 128, S, rng, torch.float16))
    pos = pos.clamp(max=700)  # keys 701 .. 999 seen by nobody
    out = kernels.decode_attention(q, k, v, S, pos, 0.088)
    k2, v2 = k.clone(), v.clone()
    k2[:, 701:], v2[:, 701:] = float("nan"), float("nan")  # seen by nobody
    assert torch.equal(kernels.decode_attention(q, k2, v2, S, pos, 0.088), out)
    for t in range(9):
        alone = kernels.decode_attention(q[:, t:t + 1].contiguous(), k, v, S, pos[t:t + 1], 0.088)
        assert torch.equal(alone[:, 0], out[:, t]), t
    # clamped into the window: past it every key, below 0 key 0 alone
    clamp = kernels.decode_attention(q[:, :2].contiguous(), k, v, S, torch.tensor([S + 5, -3], device="cuda"), 0.088)
    want = kernels.decode_attention(q[:, :2].contiguous(), k, v, S, torch.tensor([S - 1, 0], device="cuda"), 0.088)
    assert torch.equal(clamp, want)


@needs_cuda
def test_cuda_graph_replays_with_other_positions() -> None:
    rng = np.random.default_rng(13)
    S, T = 512, 9
    q, k, v, pos = (x.cuda() for x in make(16, 16, T, 128, S, rng, torch.float16))
    ws = torch.empty(kernels.decode_attention_workspace_size(T, 16, 128, S), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(q)
    static_pos = pos.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.decode_attention(q, k, v, S, static_pos, 0.088, out=out, workspace=ws)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.decode_attention(q, k, v, S, static_pos, 0.088, out=out, workspace=ws)
    for start in (0, 100, 300, S - T):
        new = torch.arange(start, start + T, device="cuda")
        static_pos.copy_(new)
        graph.replay()
        want = kernels.decode_attention(q, k, v, S, new, 0.088)
        torch.cuda.synchronize()
        assert torch.equal(out, want), start
        err = rel_err(out, sdpa(q, k, v, S, new, 0.088))
        assert err <= TOL_F16_SDPA, f"start {start}: {err:.2e} from SDPA"


@needs_cuda
def test_cuda_model_forwards_match_sdpa(shipped_model, monkeypatch) -> None:
    """The shipped model (head_dim 64) on CUDA: forwards of 8, 1, 1 and 7 tokens (prefill of a short prompt, decode
    steps, a verification) as `Attention` chooses (the one-token ones native) and all through the native op, against
    the same forwards through SDPA (`decode_attention_supported` patched off), both over the same f16 cache: per position max |a - b| / max |b| <= 1e-2 (test_engine_gpu's bound
    for CUDA against the CPU)."""
    from specter_gguf import layers
    from specter_gguf.engine import Model

    tr = Model.load(shipped_model, device="cuda", progress=False).transformer
    chunks = [torch.tensor(c, device="cuda") for c in ([5, 17, 300, 42, 7, 99, 1, 2], [11], [12], list(range(20, 27)))]

    @torch.inference_mode()
    def logits() -> list[torch.Tensor]:
        cache = tr.new_cache(64)
        return [tr.forward(c, cache) for c in chunks]

    calls = []
    native_op = layers.decode_attention
    monkeypatch.setattr(layers, "decode_attention", lambda *a, **kw: calls.append(1) or native_op(*a, **kw))
    default = logits()
    assert len(calls) == 2 * len(tr.blocks)  # the one-token steps; several queries over <= 256 keys take SDPA
    calls.clear()
    monkeypatch.setattr(layers, "_SDPA_MAX_KEYS", 0)  # every forward of <= 16 tokens on the native op
    ours = logits()
    assert len(calls) == len(chunks) * len(tr.blocks)
    monkeypatch.setattr(layers, "decode_attention_supported", lambda T, d: False)
    ref = logits()
    for a, b in zip([*default, *ours], [*ref, *ref]):
        rel = ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()
        assert rel <= 1e-2, f"T={a.shape[0]}: {rel:.2e}"
