"""The fused ops of a decode step (native/include/specter_kernels.h) against numpy float64 references, on fresh
random data, on the CPU and (when a GPU is visible) on CUDA:

- `qmatmul_swiglu`: silu(x gate^T) * (x up^T) for stacked [gate; up] weights; error max |y - ref| / max |ref|
  <= TOL_SWIGLU = 1e-5 (fp32 sums of exact weight values, then SiLU);
- `rms_norm`: the norm (and the residual sum) within TOL_NORM = 1e-6 relative of float64, also in place;
- `moe_topk`: ids equal to a stable descending sort of the logits (ties to the lower index), weights within
  TOL_TOPK = 1e-6 relative of the float64 softmax (renormalized / scaled as asked);
- `moe_route`: the router's product and its top-k in one call, bitwise `qmatmul` followed by `moe_topk`;
- `rms_norm` of a residual sum with a shared expert: x + routed + shared * sigmoid(gate) from a strided gate column
  (or ungated), the sum within TOL_GATED = 1e-6 relative of float64 and the norm within TOL_NORM, also in place;
- `rope_kv`: q, k rotated (NeoX and adjacent pairs, partial rotation, biases, per-head RMS norms) and stored with v
  at the given
  positions of a NaN-poisoned cache; float32 outputs within TOL_ROPE = 1e-6 relative of float64, float16 outputs
  within one f16 rounding (2^-11 relative) of it; the cache rows of other positions stay untouched;
- `sample_chain`: ids equal to the top C of a stable descending sort (ties to the lower id, across the CUDA kernel's
  chunks too), probs within TOL_CHAIN = 1e-12 relative of float64 numpy (0 exactly where the filters drop), the
  draw exactly the rule of `sampling.draw_rows` on the probs it returned; CUDA's ids and tokens equal the CPU's,
  its probs within 1e-14 relative; argument errors are SPECTER_ERR_INVALID_ARG before anything runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from specter_gguf import kernels, native
from specter_gguf.errors import SpecterError
from tests.test_kernels import CUDA_OK, DEVICES, make_weight, qt

TOL_SWIGLU = 1e-5
TOL_TOPK = 1e-6
TOL_ROPE = 1e-6
TOL_NORM = 1e-6
TOL_GATED = 1e-6
TOL_CHAIN = 1e-12


def _stream(device: str):
    return native.ffi().cast("void *", torch.cuda.current_stream().cuda_stream) if device == "cuda" else None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- SwiGLU GEMV ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [GT.Q4_K, GT.Q6_K, GT.Q5_0, GT.Q8_0, GT.F16, GT.F32], ids=lambda t: t.name)
def test_qmatmul_swiglu(device: str, qtype: GT) -> None:
    rng = np.random.default_rng(7000 + int(qtype))
    n, k = 37, 512  # n: not a multiple of the rows per CTA
    raw, wv = make_weight(qtype, 2 * n, k, rng)
    w = qt(raw, qtype, (2 * n, k), device)
    f, lb = native.ffi(), native.lib()
    for m in (1, 2, 5, 8, 9, 20):
        x = rng.standard_normal((m, k)).astype(np.float32)
        xt = torch.from_numpy(x).to(device)
        y = torch.full((m, n), float("nan"), device=device)  # poisoned: an unwritten element shows
        args = (int(qtype), f.cast("void *", w.data.data_ptr()), n, k, native.F32, f.cast("void *", xt.data_ptr()),
                m, f.cast("float *", y.data_ptr()))
        code = (lb.specter_cuda_qmatmul_swiglu(*args, _stream(device)) if device == "cuda"
                else lb.specter_qmatmul_swiglu(*args, 2))
        _sync(device)
        assert code == 0, native.error_string(code)
        g, u = x.astype(np.float64) @ wv[:n].T.astype(np.float64), x.astype(np.float64) @ wv[n:].T.astype(np.float64)
        ref = g / (1 + np.exp(-g)) * u
        got = y.cpu().numpy()
        assert np.isfinite(got).all(), f"m={m}: unwritten outputs"
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= TOL_SWIGLU, f"{qtype.name} m={m}: error {err:.2e}"
        # the Python wrapper gives the same values
        assert torch.equal(kernels.qmatmul_swiglu(xt, w).cpu(), y.cpu())


def test_qmatmul_swiglu_needs_stacked_rows() -> None:
    rng = np.random.default_rng(1)
    raw, _ = make_weight(GT.Q8_0, 3, 64, rng)
    with pytest.raises(Exception, match="stacked"):
        kernels.qmatmul_swiglu(torch.zeros(1, 64), qt(raw, GT.Q8_0, (3, 64), "cpu"))


# ---- RMS norm of a residual sum ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [64, 2048, 5000])  # 5000: past the CUDA kernel's values kept in registers
def test_rms_norm(device: str, n: int) -> None:
    rng = np.random.default_rng(n)
    x, delta = (rng.standard_normal((3, n)).astype(np.float32) for _ in range(2))
    weight, bias = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    eps = 1e-6
    t = {k: torch.from_numpy(v).to(device) for k, v in dict(x=x, delta=delta, weight=weight, bias=bias).items()}

    def ref(s: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        s = s.astype(np.float64)
        y = s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * weight
        return y if b is None else y + b

    total, y = kernels.rms_norm(t["x"], t["weight"], eps)
    assert total is None
    assert np.abs(y.cpu().numpy() - ref(x, None)).max() / np.abs(ref(x, None)).max() <= TOL_NORM
    total, y = kernels.rms_norm(t["x"], t["weight"], eps, delta=t["delta"], bias=t["bias"])
    s = x.astype(np.float64) + delta
    np.testing.assert_array_equal(total.cpu().numpy(), x + delta)
    assert np.abs(y.cpu().numpy() - ref(s, bias)).max() / np.abs(ref(s, bias)).max() <= TOL_NORM
    # in place: y and the sum over x's own storage, as the header allows
    f, lb = native.ffi(), native.lib()
    xs = t["x"].clone()
    p = lambda a: f.cast("float *", a.data_ptr())  # noqa: E731
    args = (p(xs), p(t["delta"]), f.NULL, f.NULL, 0, p(t["weight"]), f.NULL, 3, n, eps, p(xs), p(xs))
    code = lb.specter_cuda_rms_norm(*args, _stream(device)) if device == "cuda" else lb.specter_rms_norm(*args, 2)
    _sync(device)
    assert code == 0
    assert np.abs(xs.cpu().numpy() - ref(s, None)).max() / np.abs(ref(s, None)).max() <= TOL_NORM


# ---- MoE top-k ----------------------------------------------------------------------------------------------

def topk_reference(logits: np.ndarray, k: int, normalize: bool, scale: float) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # stable: ties to the lower index
    lg = logits.astype(np.float64)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    w = np.take_along_axis(p, order, 1)
    if normalize:
        w = w / np.maximum(w.sum(1, keepdims=True), 6.103515625e-5)
    if scale not in (0.0, 1.0):
        w = w * scale
    return order, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k", [(8, 2), (60, 4), (64, 6), (160, 8), (16, 16), (256, 8), (300, 8)])
def test_moe_topk(device: str, E: int, k: int) -> None:
    rng = np.random.default_rng(E * 100 + k)
    T = 13
    wide = rng.standard_normal((T, E + 3)).astype(np.float32) * 2
    wide[3, 5:9] = wide[3, 1]  # ties
    wide[4, :E] = 0.5  # a row of ties
    logits = torch.from_numpy(wide).to(device)[:, :E]  # strided rows, as a slice of a wider product
    for normalize, scale in ((False, 0.0), (True, 0.0), (True, 2.5), (False, 1.0)):
        ids, w = kernels.moe_topk(logits, k, normalize, scale)
        ref_ids, ref_w = topk_reference(wide[:, :E], k, normalize, scale)
        assert ids.dtype == torch.int32 and ids.shape == (T, k)
        np.testing.assert_array_equal(ids.cpu().numpy(), ref_ids)
        np.testing.assert_allclose(w.cpu().numpy(), ref_w, rtol=TOL_TOPK, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_topk_never_picks_nan(device: str) -> None:
    logits = torch.tensor([[0.1, float("nan"), 0.3, -1.0]], device=device)
    ids, _ = kernels.moe_topk(logits, 4)
    assert ids.cpu().tolist() == [[2, 0, 3, -1]]


def test_moe_topk_rejects_bad_arguments() -> None:
    with pytest.raises(Exception, match="top 5 of 4"):
        kernels.moe_topk(torch.zeros(2, 4), 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wtype", [GT.F32, GT.F16, GT.Q8_0])
def test_moe_route_is_the_product_and_its_topk(device: str, wtype: GT) -> None:
    """moe_route's logits are qmatmul's and its routing moe_topk's of them, bitwise, for 1..12 tokens (on CUDA up
    to 8 in one launch, more in two), over a router with a shared expert's gate stacked under it; its counter is
    back at 0 after every call, so calls repeat exactly."""
    rng = np.random.default_rng(int(wtype))
    E, k, n_embd = 60, 4, 256
    raw, _ = make_weight(wtype, E + 1, n_embd, rng)
    w = qt(raw, wtype, (E + 1, n_embd), device)
    if wtype != GT.Q8_0:  # float routers are torch tensors in the model
        w = w.dequantize(torch.float32 if wtype == GT.F32 else torch.float16)
    done = torch.zeros(1, dtype=torch.int32, device=device)
    for T in (1, 2, 3, 5, 8, 9, 12):
        x = torch.from_numpy(rng.standard_normal((T, n_embd)).astype(np.float32)).to(device)
        for normalize, scale in ((False, 0.0), (True, 2.5)):
            logits, ids, weights = kernels.moe_route(x, w, E, k, normalize, scale, done)
            want = kernels.qmatmul(x, w)
            want_ids, want_w = kernels.moe_topk(want[:, :E], k, normalize, scale)
            assert torch.equal(logits, want) and torch.equal(ids, want_ids) and torch.equal(weights, want_w), T
            again = kernels.moe_route(x, w, E, k, normalize, scale, done)
            assert all(torch.equal(a, b) for a, b in zip(again, (logits, ids, weights))), T
            assert int(done.item()) == 0


# ---- a shared expert behind its gate, added by the norm ---------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_rms_norm_adds_a_shared_expert(device: str, T: int, gated: bool) -> None:
    rng = np.random.default_rng(T + 10 * gated)
    n, E, eps = 2048, 60, 1e-6
    x, routed, shared = (rng.standard_normal((T, n)).astype(np.float32) for _ in range(3))
    weight = rng.standard_normal(n).astype(np.float32)
    logits = rng.standard_normal((T, E + 1)).astype(np.float32) * 4  # the router's product with the gate's row
    g = 1 / (1 + np.exp(-logits[:, E:].astype(np.float64))) if gated else 1.0
    s = x.astype(np.float64) + routed + shared.astype(np.float64) * g
    ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * weight
    xt, r, sh, lg, wt = (torch.from_numpy(a).to(device) for a in (x, routed, shared, logits, weight))
    gate = lg[:, E:] if gated else None
    total, y = kernels.rms_norm(xt, wt, eps, delta=r, shared=sh, gate=gate)
    assert np.abs(total.cpu().numpy() - s).max() / np.abs(s).max() <= TOL_GATED
    assert np.abs(y.cpu().numpy() - ref).max() / np.abs(ref).max() <= TOL_NORM
    # in place: y and the sum over the shared expert's own storage, as the header allows
    f, lb = native.ffi(), native.lib()
    p = lambda a: f.cast("float *", a.data_ptr()) if a is not None else f.NULL  # noqa: E731
    args = (p(xt), p(r), p(sh), p(gate), E + 1, p(wt), f.NULL, T, n, eps, f.NULL, p(sh))
    code = lb.specter_cuda_rms_norm(*args, _stream(device)) if device == "cuda" else lb.specter_rms_norm(*args, 2)
    _sync(device)
    assert code == 0
    np.testing.assert_array_equal(sh.cpu().numpy(), y.cpu().numpy())
    with pytest.raises(Exception, match="rms_norm"):
        kernels.rms_norm(xt, wt, eps, delta=r, shared=sh[:, 1:], gate=gate)
    with pytest.raises(Exception, match="rms_norm"):
        kernels.rms_norm(xt, wt, eps, shared=r)
    args = (p(xt), f.NULL, p(sh), f.NULL, 0, p(wt), f.NULL, T, n, eps, f.NULL, p(y))  # a shared expert needs a delta
    code = lb.specter_cuda_rms_norm(*args, _stream(device)) if device == "cuda" else lb.specter_rms_norm(*args, 2)
    assert code == lb.SPECTER_ERR_INVALID_ARG


# ---- RoPE + KV cache store -------------------------------------------------------------------------------

def rope_reference(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int,
                   neox: bool) -> np.ndarray:
    """x [T, heads, head_dim] float64, rotated."""
    out = x.copy()
    half = rope_dim // 2
    ia = np.arange(half) if neox else 2 * np.arange(half)
    ib = ia + half if neox else ia + 1
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    out[..., ia] = x[..., ia] * c - x[..., ib] * s
    out[..., ib] = x[..., ib] * c + x[..., ia] * s
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
@pytest.mark.parametrize("rope_dim", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("norm", [False, True], ids=["nonorm", "norm"])
@pytest.mark.parametrize("d", [64, 96, 640], ids=["d64", "d96", "d640"])  # CUDA: 1 warp, part of 2, strided pairs
def test_rope_kv(device: str, neox: bool, rope_dim: int, bias: bool, norm: bool, d: int) -> None:
    rng = np.random.default_rng(rope_dim + 2 * neox + 4 * bias + 8 * norm + d)
    T, H, Hkv, cap, n_pos = 3, 4, 2, 24, 32
    pos = np.array([5, 17, 3])
    wide = rng.standard_normal((T, (H + 2 * Hkv) * d + 8)).astype(np.float32)  # q | k | v | padding: strided
    q_np, k_np, v_np = wide[:, :H * d], wide[:, H * d:(H + Hkv) * d], wide[:, (H + Hkv) * d:(H + 2 * Hkv) * d]
    biases = [rng.standard_normal(n).astype(np.float32) if bias else None for n in (H * d, Hkv * d, Hkv * d)]
    angles = rng.uniform(-np.pi, np.pi, (n_pos, rope_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    norms = (*rng.uniform(0.5, 2.0, (2, d)).astype(np.float32), 1e-6) if norm else None
    dt = torch.tensor(wide, device=device)
    q, k, v = dt[:, :H * d], dt[:, H * d:(H + Hkv) * d], dt[:, (H + Hkv) * d:(H + 2 * Hkv) * d]

    def with_bias(x: np.ndarray, b: np.ndarray | None, heads: int, weight: np.ndarray | None = None) -> np.ndarray:
        x = (x.astype(np.float64) + (0 if b is None else b.astype(np.float64))).reshape(T, heads, d)
        if weight is None:
            return x
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + norms[2]) * weight.astype(np.float64)

    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    q_in, k_in = (with_bias(x, b, n, w) for x, b, n, w in ((q_np, biases[0], H, norms and norms[0]),
                                                           (k_np, biases[1], Hkv, norms and norms[1])))
    ref_q = rope_reference(q_in, pos, c64, s64, rope_dim, neox).transpose(1, 0, 2)
    ref_k = rope_reference(k_in, pos, c64, s64, rope_dim, neox).transpose(1, 0, 2)
    ref_v = with_bias(v_np, biases[2], Hkv).transpose(1, 0, 2)
    dtypes = [torch.float32] + ([torch.float16] if device == "cuda" else [])
    for dtype in dtypes:
        k_cache = torch.full((Hkv, cap, d), float("nan"), dtype=dtype, device=device)
        v_cache = torch.full((Hkv, cap, d), float("nan"), dtype=dtype, device=device)
        q_out = kernels.rope_kv(q, k, v, [None if b is None else torch.from_numpy(b).to(device) for b in biases],
                                torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device),
                                torch.from_numpy(pos).to(device), d, rope_dim, neox, k_cache, v_cache,
                                norms and (torch.from_numpy(norms[0]).to(device), torch.from_numpy(norms[1]).to(device),
                                           norms[2]))
        _sync(device)
        assert q_out.dtype == dtype and q_out.shape == (H, T, d)
        got = [q_out.double().cpu().numpy(), k_cache[:, pos].double().cpu().numpy(),
               v_cache[:, pos].double().cpu().numpy()]
        for name, g, ref in zip("qkv", got, (ref_q, ref_k, ref_v)):
            if dtype == torch.float32:
                err = np.abs(g - ref).max() / np.abs(ref).max()
                assert err <= TOL_ROPE, f"{name} ({dtype}): error {err:.2e}"
            else:  # one f16 rounding of the float32 result
                assert (np.abs(g - ref) <= np.abs(ref) * 2.0 ** -11 + 1e-6).all(), f"{name} ({dtype})"
        untouched = np.setdiff1d(np.arange(cap), pos)
        assert torch.isnan(k_cache[:, untouched]).all() and torch.isnan(v_cache[:, untouched]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rope_kv_position_outside_the_cache(device: str) -> None:
    """The CPU refuses a position past the cache; CUDA (positions unread by the host) writes nothing."""
    d = 8
    q, k, v = (torch.ones(1, d, device=device) for _ in range(3))
    tables = torch.ones(16, d // 2, device=device)
    k_cache = torch.zeros(1, 4, d, device=device)
    v_cache = torch.zeros(1, 4, d, device=device)
    args = (q, k, v, [None] * 3, tables, tables, torch.tensor([4], device=device), d, d, True, k_cache, v_cache)
    if device == "cpu":
        with pytest.raises(Exception, match="rope_kv"):
            kernels.rope_kv(*args)
    else:
        kernels.rope_kv(*args)
        torch.cuda.synchronize()
        assert not k_cache.any() and not v_cache.any()


# ---- the sampling chain -------------------------------------------------------------------------------------

OFF_P, OFF_MIN_P = 2.0, -np.inf  # top_p and log(min_p) when off (sampling.chain_knobs)
KNOBS = [(1.0, OFF_P, OFF_MIN_P), (0.5, 0.9, OFF_MIN_P), (2.0, OFF_P, np.log(0.05)), (1.0, 0.95, np.log(0.05))]


def chain_reference(logits: np.ndarray, C: int, knobs: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """The chain of specter_kernels.h in float64 numpy, row by row: (ids ascending, probs)."""
    temperature, top_p, log_min_p = knobs
    R, V = logits.shape
    ids, probs = np.zeros((R, C), np.int64), np.zeros((R, C))
    for r in range(R):
        v = logits[r].astype(np.float64)
        top = np.lexsort((np.arange(V), -v))[:C]  # logit desc, id asc (-0.0 ties with 0.0)
        vals = v[top]
        e = np.exp(vals - vals[0])
        n_p = int((np.cumsum(e / np.cumsum(e)[-1]) < top_p).sum()) + 1  # sums in order, as the header says
        n_m = max(1, int((vals >= vals[0] + log_min_p).sum()))
        m = min(C, n_p, n_m)
        f = np.exp((vals[:m] - vals[0]) / temperature)
        p = np.zeros(C)
        p[:m] = f / np.cumsum(f)[-1]
        order = np.argsort(top)
        ids[r], probs[r] = top[order], p[order]
    return ids, probs


def draw_reference(ids: np.ndarray, probs: np.ndarray, uniforms: np.ndarray) -> list[int]:
    """`sampling.draw_rows`' rule: the first id whose cumulative probability exceeds u * total, at most the last
    positive one."""
    out = []
    for i, p, u in zip(ids, probs, uniforms):
        cdf = np.cumsum(p)
        at = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        out.append(int(i[min(at, int(np.flatnonzero(p > 0).max(initial=0)))]))
    return out


def sample(logits: torch.Tensor, C: int, knobs: tuple, uniforms: np.ndarray | None = None):
    device = logits.device
    k = torch.tensor(knobs, dtype=torch.float64, device=device)
    u = None if uniforms is None else torch.from_numpy(uniforms).to(device)
    ids, probs, tokens = kernels.sample_chain(logits, C, k, u)
    return ids.cpu().numpy(), probs.cpu().numpy(), None if tokens is None else tokens.cpu().tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R", [1, 9])
@pytest.mark.parametrize("C", [1, 40, 256])
def test_sample_chain(device: str, R: int, C: int) -> None:
    """Random logits over 5 of the CUDA kernel's chunks (the last one partial), rows strided as a slice of a wider
    tensor, every knob combination (temperature 0.5 / 1 / 2, top_p and min_p on and off)."""
    rng = np.random.default_rng(R * 1000 + C)
    V = 4 * 4096 + 1000
    wide = (rng.standard_normal((R, V + 5)) * 3).astype(np.float32)
    logits = torch.from_numpy(wide).to(device)[:, :V]
    uniforms = rng.random(R)
    for knobs in KNOBS:
        ids, probs, tokens = sample(logits, C, knobs, uniforms)
        ref_ids, ref_probs = chain_reference(wide[:, :V], C, knobs)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(probs, ref_probs, rtol=TOL_CHAIN, atol=0)
        assert tokens == draw_reference(ids, probs, uniforms)
        no_draw = sample(logits, C, knobs)
        np.testing.assert_array_equal(no_draw[0], ids)
        np.testing.assert_array_equal(no_draw[1], probs)


@pytest.mark.parametrize("device", DEVICES)
def test_sample_chain_ties_go_to_the_lower_id(device: str) -> None:
    """Ties at the top_k boundary and among the candidates, within a chunk and across chunks of the CUDA kernel."""
    rng = np.random.default_rng(5)
    V, C = 3 * 4096 + 100, 40
    rows = np.full((6, V), -1.0, np.float32)
    rows[0] = 0.0  # every logit ties: ids 0 .. C-1, uniform
    rows[1] = np.arange(V) % 4  # the top value on every fourth id
    rows[2, rng.choice(V, 10, replace=False)] = 5.0  # 10 above the boundary, then 50 ties over all the chunks
    rows[2, np.sort(rng.choice(np.flatnonzero(rows[2] < 0), 50, replace=False))] = 0.5
    zeros = np.sort(rng.choice(V, 50, replace=False))
    rows[3, zeros[::2]], rows[3, zeros[1::2]] = 0.0, -0.0  # -0.0 ties with 0.0
    rows[4] = np.round(rng.standard_normal(V) * 2) / 2  # a few values, many ties each
    rows[5, 4096:] = 2.0  # ties only in the chunks after the first
    logits = torch.from_numpy(rows).to(device)
    uniforms = rng.random(6)
    for knobs in KNOBS:
        ids, probs, tokens = sample(logits, C, knobs, uniforms)
        ref_ids, ref_probs = chain_reference(rows, C, knobs)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(probs, ref_probs, rtol=TOL_CHAIN, atol=0)
        assert tokens == draw_reference(ids, probs, uniforms)
    assert ids[0].tolist() == list(range(C)) and ids[5].tolist() == list(range(4096, 4096 + C))


@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU visible to torch and a libspecter built with CUDA")
@pytest.mark.parametrize("C", [40, 256])
def test_sample_chain_cuda_equals_cpu(C: int) -> None:
    """The same candidates, the same drawn tokens and probs within 1e-14 relative (exp may differ by an ulp) on the
    CPU and CUDA, at Qwen's vocabulary of 151,936."""
    rng = np.random.default_rng(C)
    wide = (rng.standard_normal((9, 151936)) * 3).astype(np.float32)
    uniforms = rng.random(9)
    for knobs in KNOBS:
        cpu = sample(torch.from_numpy(wide), C, knobs, uniforms)
        cuda = sample(torch.from_numpy(wide).cuda(), C, knobs, uniforms)
        np.testing.assert_array_equal(cuda[0], cpu[0])
        np.testing.assert_allclose(cuda[1], cpu[1], rtol=1e-14, atol=0)
        assert cuda[2] == cpu[2]


@pytest.mark.parametrize("device", DEVICES)
def test_sample_chain_survives_nonfinite_logits(device: str) -> None:
    """NaN and infinite logits give unspecified results, but never a failure or an id outside the row."""
    V, C = 5000, 40
    rows = np.random.default_rng(9).standard_normal((4, V)).astype(np.float32)
    rows[0, ::7] = np.nan
    rows[1, 3] = np.inf
    rows[2] = -np.inf
    rows[3, 100:200] = -np.nan
    ids, probs, tokens = sample(torch.from_numpy(rows).to(device), C, KNOBS[3], np.full(4, 0.5))
    assert ((ids >= 0) & (ids < V)).all() and (np.diff(ids, axis=1) > 0).all()
    assert all(t in row for t, row in zip(tokens, ids.tolist()))


@pytest.mark.parametrize("device", DEVICES)
def test_sample_chain_rejects_bad_arguments(device: str) -> None:
    """Through the raw ABI: SPECTER_ERR_INVALID_ARG for every bad size or missing pointer, before anything runs;
    through the wrapper: a SpecterError."""
    f, lb = native.ffi(), native.lib()
    V, C, R = 1000, 40, 2
    logits = torch.zeros(R, V, device=device)
    knobs = torch.tensor(KNOBS[0], dtype=torch.float64, device=device)
    uniforms = torch.zeros(R, dtype=torch.float64, device=device)
    ids = torch.zeros(R, 300, dtype=torch.int64, device=device)
    probs = torch.zeros(R, 300, dtype=torch.float64, device=device)
    tokens = torch.zeros(R, dtype=torch.int64, device=device)
    ws = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    good = dict(logits=f.cast("float *", logits.data_ptr()), n_rows=R, n_vocab=V, row_stride=V, n_candidates=C,
                knobs=f.cast("double *", knobs.data_ptr()), uniforms=f.cast("double *", uniforms.data_ptr()),
                ids=f.cast("int64_t *", ids.data_ptr()), probs=f.cast("double *", probs.data_ptr()),
                tokens=f.cast("int64_t *", tokens.data_ptr()), workspace=f.cast("void *", ws.data_ptr()),
                workspace_bytes=ws.numel())

    def call(**change) -> int:
        args = tuple({**good, **change}.values())
        code = lb.specter_cuda_sample_chain(*args, _stream(device)) if device == "cuda" else \
            lb.specter_sample_chain(*args, 1)
        _sync(device)
        return code

    assert call() == 0 and call(n_rows=0, logits=f.NULL) == 0
    bad = [dict(n_candidates=0), dict(n_candidates=257), dict(n_vocab=30, row_stride=30),
           dict(n_vocab=262145, row_stride=262145), dict(row_stride=V - 1), dict(n_rows=65536), dict(n_rows=-1),
           dict(logits=f.NULL), dict(knobs=f.NULL), dict(ids=f.NULL), dict(probs=f.NULL), dict(tokens=f.NULL),
           dict(workspace=f.NULL), dict(workspace_bytes=kernels.sample_chain_workspace_size(R, V, C) - 1)]
    for change in bad:
        assert call(**change) == lb.SPECTER_ERR_INVALID_ARG, change
    assert call(uniforms=f.NULL, tokens=f.NULL) == 0  # no draw: no tokens needed
    for C_bad in (257, V + 1):
        with pytest.raises(SpecterError, match="sample"):
            kernels.sample_chain(logits, C_bad, knobs)
    with pytest.raises(SpecterError, match="ids"):
        kernels.sample_chain(logits, C, knobs, ids=ids[:, :C].int())
