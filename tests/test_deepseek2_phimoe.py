"""DeepSeek-V2 (`deepseek2`, multi-head latent attention) and Phi-3.5-MoE (`phimoe`) against llama.cpp.

Same bar as the foundation's parity tests (tests/test_parity.py): per position, max|ours - ref| / max|ref|;
F32/F16 files median <= 2e-3 and max <= 5e-3; quantized files (Q8_0, Q4_K_M, Q2_K, llama.cpp's quantizer)
median <= 2.5e-2 and max <= 1.5e-1. Presets (specter_gguf.synthetic):

- tiny-deepseek2: q_lora_rank, a dense first layer, a shared expert, group-limited softmax routing with
  scaled weights, YaRN (factor 40 from 4096, mscale_all_dim 0.707) — every file type;
- tiny-deepseek2-lite (no q_lora_rank, plain softmax, two shared experts), tiny-deepseek2-sigmoid (sigmoid
  gating + exp_probs_b selection bias, renormalized), tiny-deepseek2-kvb (legacy unsplit attn_kv_b);
- tiny-phimoe: biases, RMS norm + bias, longrope factors and attention factor — every file type.

Also: a 96-token sequence (YaRN at long positions; one pass against llama.cpp, and prefill + token-by-token
decode through the latent cache equal to one pass, with a speculative-style rollback), Phi-3's long/short
factor choice by context size, greedy 32 tokens on F16, the routing variants against a brute-force
reference, and (with SPECTER_REAL_SHAPES=1) 1-layer real-shape files of both models.
`pytest -s tests/test_deepseek2_phimoe.py` prints the measured table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from llama_reference import (FLOAT_MAX, FLOAT_MEDIAN, NEAR_TIE, PROMPT, QUANT_MAX, QUANT_MEDIAN,  # noqa: E402
                             LlamaRefs, assert_flips_are_near_ties, closing, context_params, dequantized_copy,
                             llama_routing, our_model, parity_tokens, position_errors, routing_differences,
                             run_routed)

from specter_gguf import layers  # noqa: E402
from specter_gguf.config import ModelConfig  # noqa: E402
from specter_gguf.engine import Model  # noqa: E402
from specter_gguf.gguf_file import GGUFFile  # noqa: E402
from specter_gguf.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
N_CTX = 128  # llama.cpp pads it to 256: Phi-3's short factors (tiny-phimoe's original context is 256)
N_THREADS = 2

CASES = ([(p, k) for p in ("tiny-deepseek2", "tiny-phimoe") for k in ("f32", "f16", "q8_0", "q4_k_m", "q2_k")]
         + [(p, k) for p in ("tiny-deepseek2-lite", "tiny-deepseek2-sigmoid") for k in ("f16", "q4_k_m")]
         + [("tiny-deepseek2-kvb", "f16")])
RESULTS: dict[tuple[str, str], tuple[float, float]] = {}


@pytest.fixture(scope="module")
def refs() -> LlamaRefs:
    """llama.cpp references, one Llama per (file, context size), N_THREADS threads."""
    yield from closing(LlamaRefs(N_CTX, n_threads=N_THREADS), RESULTS, lambda k: f"{k[0]:24s} {k[1]:7s}")


@pytest.fixture(scope="module")
def models() -> dict[tuple[Path, int], Model]:
    return {}


# ------------------------------------------------------------------- routing: llama.cpp's, ours, forced

NEAR_TIE_QUANT = 0.05  # quantized files: llama.cpp's 8-bit activations perturb routers by ~1e-2


def check_against_llama_cpp(m: Model, path: Path, llm: llama_cpp.Llama, tokens: list[int], ref: np.ndarray,
                            quantized: bool, label: str, ref_exact: np.ndarray | None = None
                            ) -> tuple[float, float]:
    """The bounds, per position. A routing choice where llama.cpp differs must be a near tie of our router
    (or follow an earlier flip at that position). Float files: with llama.cpp's routing forced the float bound
    holds everywhere. Quantized files: `ref_exact` is llama.cpp on an F32 copy of the file's dequantized
    weights, which we must match at the float bounds (our arithmetic is exact); a position above the quantized
    maximum must then be a near-tie routing flip or one where llama.cpp's own 8-bit-activation result
    (`ref` against `ref_exact`) is already that far off."""
    logits, our_ids, margins = run_routed(m, tokens)
    err = position_errors(logits, ref)
    med, mx = float(np.median(err)), float(err.max())
    ref_ids, _ = llama_routing(llm, tokens, context_params(N_CTX, N_THREADS))
    assert set(ref_ids) == set(our_ids), f"MoE layers {sorted(ref_ids)} vs ours {sorted(our_ids)}"
    diffs = routing_differences(our_ids, ref_ids)
    note = ", ".join(f"layer {lay} pos {pos} (margin {margins[lay][pos]:.2e})" for lay, pos in diffs)
    print(f"\n{label}: median {med:.2e} max {mx:.2e}; routing differs at {len(diffs)}: {note}")
    # a flip is a near tie or follows a flip in a lower layer at the same position
    assert_flips_are_near_ties(diffs, margins, NEAR_TIE_QUANT if quantized else NEAR_TIE, label,
                               earlier_positions=False)
    if not quantized:
        assert med <= FLOAT_MEDIAN, f"{label}: median {med:.2e} > {FLOAT_MEDIAN}"
        if diffs:
            forced, _, _ = run_routed(m, tokens, force=ref_ids)
            ferr = position_errors(forced, ref)
            print(f"  with llama.cpp's routing forced: median {np.median(ferr):.2e} max {ferr.max():.2e}")
            assert ferr.max() <= FLOAT_MAX, f"{label}: with llama.cpp's routing forced still {ferr.max():.2e}"
        else:
            assert mx <= FLOAT_MAX, f"{label}: max {mx:.2e} > {FLOAT_MAX}"
        return med, mx
    assert ref_exact is not None
    exact = position_errors(logits, ref_exact)
    own = position_errors(ref, ref_exact)  # llama.cpp's quantized-activation path against its own exact result
    print(f"  vs llama.cpp on the dequantized F32 copy: median {np.median(exact):.2e} max {exact.max():.2e}; "
          f"llama.cpp itself (quantized file vs F32 copy): max {own.max():.2e}")
    assert np.median(exact) <= FLOAT_MEDIAN and exact.max() <= FLOAT_MAX, f"{label}: not exact on its weights"
    assert med <= QUANT_MEDIAN, f"{label}: median {med:.2e} > {QUANT_MEDIAN}"
    flipped = {pos for _, pos in diffs}
    for pos in np.nonzero(err > QUANT_MAX)[0]:
        assert pos in flipped or own[pos] > QUANT_MAX, (
            f"{label}: pos {pos} error {err[pos]:.2e} with the same routing and llama.cpp's own deviation "
            f"{own[pos]:.2e}")
    return med, mx


# ------------------------------------------------------------------------------------------ logits parity


@pytest.mark.parametrize("preset,kind", CASES)
def test_logits_match_llama_cpp(preset: str, kind: str, tiny_models, refs: LlamaRefs, models,
                                tmp_path: Path) -> None:
    path = tiny_models[(preset, kind)]
    m = our_model(models, path, N_CTX)
    toks = parity_tokens(m, 24, seed=7)
    assert m.tokenize(PROMPT, add_bos=False) == refs.get(path).tokenize(PROMPT.encode(), add_bos=False,
                                                                           special=False)
    ref = refs.logits(path, toks)
    quantized = kind not in ("f32", "f16")
    exact = None
    if quantized:
        copy = dequantized_copy(path, tmp_path / f"{path.stem}-as-f32.gguf")
        exact = refs.logits(copy, toks)
    RESULTS[(preset, kind)] = check_against_llama_cpp(m, path, refs.get(path), toks, ref, quantized,
                                                      f"{preset} {kind}", exact)


def test_quantized_deepseek2_really_uses_k_quants(tiny_models) -> None:
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(tiny_models[("tiny-deepseek2", "q4_k_m")]).tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K" and types["blk.1.attn_v_b.weight"] != "F16"
    assert "blk.1.attn_k_b.weight" in types and "blk.0.ffn_gate.weight" in types  # split MLA, dense layer 0


# ------------------------------------------------------------------- long sequence, latent cache, decode


@pytest.mark.parametrize("preset", ["tiny-deepseek2", "tiny-phimoe"])
def test_long_sequence_and_incremental_decode(preset: str, tiny_models, refs: LlamaRefs, models) -> None:
    path = tiny_models[(preset, "f16")]
    m = our_model(models, path, N_CTX)
    toks = parity_tokens(m, 96, seed=11)
    t = m.transformer
    one_pass = m.logits(toks)
    RESULTS[(preset + " (96 tokens)", "f16")] = check_against_llama_cpp(
        m, path, refs.get(path), toks, refs.logits(path, toks), False, f"{preset} f16, 96 tokens")

    # prefill 40, then one token at a time through the cache
    cache = t.new_cache(N_CTX)
    ids = torch.tensor(toks)
    steps = [t.forward(ids[:40], cache).numpy()]
    for i in range(40, 96):
        steps.append(t.forward(ids[i:i + 1], cache).numpy())
    inc = np.concatenate(steps)
    assert cache.length == 96
    e = position_errors(inc, one_pass)
    assert e.max() <= 1e-4, f"incremental decode differs from one pass: max {e.max():.2e}"

    # speculative-style rollback: drop the last 30, decode them again as one batch of 30
    cache.truncate(66)
    again = t.forward(ids[66:], cache).numpy()
    assert position_errors(again, one_pass[66:]).max() <= 1e-4

    if preset.startswith("tiny-deepseek2"):
        c = m.config
        # the latent cache: one [latent | rope key] row per token and layer, no values, no per-head keys
        assert all(k.shape[0] == 1 and k.shape[2] == c.n_lora_kv + c.rope_dim for k in cache.k)
        assert all(v.shape[2] == 0 for v in cache.v)
        assert c.n_lora_kv + c.rope_dim < c.n_head * (c.head_dim_k_mla + c.head_dim_v_mla)  # 320 vs 1792


def test_phimoe_long_factors_follow_the_context_size(tiny_models, refs: LlamaRefs, models) -> None:
    """llama.cpp uses Phi-3's long factors when its context (padded to 256) exceeds the original 256."""
    path = tiny_models[("tiny-phimoe", "f16")]
    m = our_model(models, path, N_CTX)
    toks = parity_tokens(m, 40, seed=3)
    t = m.transformer
    long_ctx = t.forward(torch.tensor(toks), t.new_cache(512)).numpy()
    short_ctx = t.forward(torch.tensor(toks), t.new_cache(N_CTX)).numpy()
    assert position_errors(long_ctx, short_ctx).max() > 1e-2  # the factors matter on this model
    err = position_errors(long_ctx, refs.logits(path, toks, n_ctx=512))
    assert np.median(err) <= FLOAT_MEDIAN and err.max() <= FLOAT_MAX, f"long factors: max {err.max():.2e}"


# ------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("preset", ["tiny-deepseek2", "tiny-deepseek2-lite", "tiny-phimoe"])
def test_greedy_tokens_match_llama_cpp(preset: str, tiny_models, refs: LlamaRefs, models) -> None:
    path = tiny_models[(preset, "f16")]
    m = our_model(models, path, N_CTX)
    llm = refs.get(path)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=False)
    expected = refs.greedy(path, prompt, 32)
    gen = m.generate(prompt, n_predict=32, sampling=SamplingParams(temperature=0)).wait()
    assert gen.tokens == expected, f"{preset}:\n ours      {gen.tokens}\n llama.cpp {expected}"


# ------------------------------------------------------------------------------------- config, routing


def test_config_reads_mla_yarn_and_routing(tiny_models) -> None:
    c = ModelConfig.from_gguf(GGUFFile(tiny_models[("tiny-deepseek2", "f16")]))
    assert (c.n_lora_q, c.n_lora_kv, c.head_dim_k_mla, c.head_dim_v_mla, c.rope_dim) == (256, 256, 320, 128, 64)
    assert c.mla_split_kv_b and c.n_leading_dense == 1 and c.n_ff_shexp == 256
    assert (c.n_expert_groups, c.n_group_used, c.expert_weights_scale) == (4, 2, 2.5)
    assert c.rope_scaling == "yarn" and c.rope_ext_factor == 1.0 and c.n_ctx_orig_yarn == 4096
    assert abs(c.rope_freq_scale - 1 / 40) < 1e-9 and abs(c.rope_yarn_log_mul - 0.707) < 1e-6
    assert abs(c.rope_attn_factor - 1 / (1 + 0.1 * np.log(40))) < 1e-6  # llama.cpp's deepseek2 special case
    lite = ModelConfig.from_gguf(GGUFFile(tiny_models[("tiny-deepseek2-kvb", "f16")]))
    assert not lite.mla_split_kv_b and lite.head_dim_k_mla == 320 and lite.head_dim_v_mla == 128
    s = ModelConfig.from_gguf(GGUFFile(tiny_models[("tiny-deepseek2-sigmoid", "f16")]))
    assert s.expert_gating_func == "sigmoid" and s.expert_weights_norm
    p = ModelConfig.from_gguf(GGUFFile(tiny_models[("tiny-phimoe", "f16")]))
    assert p.rope_scaling == "longrope" and abs(p.rope_attn_factor - np.sqrt(1.5)) < 1e-6


@pytest.mark.parametrize("gating,bias,groups", [("softmax", False, 0), ("softmax", False, 4),
                                                ("sigmoid", True, 4), ("sigmoid", True, 0)])
def test_selecting_router_matches_brute_force(gating: str, bias: bool, groups: int) -> None:
    g = torch.Generator().manual_seed(0)
    E, k, used = 16, 3, 2
    r = layers.SelectingRouter(torch.randn(E, 32, generator=g), k, True, 2.5, gating=gating,
                               selection_bias=torch.randn(E, generator=g) * 0.3 if bias else None,
                               n_groups=groups, n_group_used=used)
    x = torch.randn(20, 32, generator=g)
    ids, w = r(x)
    logits = x @ r.weight.T
    probs = torch.sigmoid(logits) if gating == "sigmoid" else torch.softmax(logits, -1)
    sel = probs + (r.selection_bias if bias else 0)
    for t in range(x.shape[0]):
        allowed = range(E)
        if groups:
            per = E // groups
            score = {gi: sorted(sel[t, gi * per:(gi + 1) * per].tolist())[-2:] for gi in range(groups)}
            best = sorted(range(groups), key=lambda gi: -sum(score[gi]))[:used]
            allowed = [e for e in range(E) if e // per in best]
        want = sorted(allowed, key=lambda e: -float(sel[t, e]))[:k]
        assert set(ids[t].tolist()) == set(want)
        p = probs[t, ids[t]]
        assert torch.allclose(w[t], p / p.sum() * 2.5, atol=1e-6)


# -------------------------------------------------------------------------------------- real shapes


def test_make_synthetic_offers_the_real_shapes() -> None:
    res = subprocess.run([sys.executable, str(REPO / "scripts/make_synthetic.py"), "--help"], capture_output=True,
                         text=True)
    assert "deepseek-v2-lite" in res.stdout and "phi-3.5-moe" in res.stdout


@pytest.mark.skipif(os.environ.get("SPECTER_REAL_SHAPES") != "1",
                    reason="writes 1-layer real-shape files of 2-3.5 GB; set SPECTER_REAL_SHAPES=1")
@pytest.mark.parametrize("preset,vocab", [("deepseek-v2-lite", "ggml-vocab-deepseek-llm.gguf"),
                                          ("phi-3.5-moe", "ggml-vocab-phi-3.gguf")])
def test_one_layer_real_shape_matches_llama_cpp(preset: str, vocab: str, tmp_path: Path) -> None:
    vocab_path = Path(llama_cpp.__file__).parent.parent / "vendor/llama.cpp/models" / vocab
    candidates = [vocab_path, *Path("/tmp/llsrc").glob(f"*/vendor/llama.cpp/models/{vocab}")]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        pytest.skip(f"{vocab} not found (it ships in the llama-cpp-python sdist)")
    out = tmp_path / f"{preset}-1l-f16.gguf"
    res = subprocess.run([sys.executable, str(REPO / "scripts/make_synthetic.py"), "--preset", preset, "--layers",
                          "1", "--dtype", "f16", "--vocab-from", str(found), "--no-progress", "-o", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    m = Model.load(out, device="cpu", ctx_size=N_CTX, progress=False)
    assert any(isinstance(b.ffn, layers.MoE) for b in m.transformer.blocks)
    toks = [int(t) for t in np.random.default_rng(5).integers(0, m.config.n_vocab, 16)]
    llm = llama_cpp.Llama(str(out), logits_all=True, n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, verbose=False)
    try:
        llm.eval(toks)
        err = position_errors(m.logits(toks), np.array(llm.scores[:16], dtype=np.float32))
    finally:
        llm.close()
    print(f"\n{preset} 1 layer f16: median {np.median(err):.2e} max {err.max():.2e}")
    assert np.median(err) <= FLOAT_MEDIAN and err.max() <= FLOAT_MAX
