"""Models whose widths are no multiple of 256 (real files: Qwen1.5-MoE's expert width 1408, DeepSeek-V2-Lite's
128-wide attn_k_b): llama.cpp's quantizer cannot use K-quants for those rows and falls back to the 32-element
block types (Q4_K -> Q5_0, Q5_K -> Q5_1, Q2_K/Q3_K -> Q4_0, Q6_K -> Q8_0; the q4_1 mix writes Q4_1).

Tiny random-weight models with such widths are written by the synthetic writer, quantized by llama.cpp's own
quantizer (`specter_gguf.quantize.quantize_gguf`), and:
- the files really hold the fallback types;
- our engine loads them and its CPU logits match llama.cpp's on the same file within the quantized bounds of
  tests/test_parity.py (per position max|ours - ref| / max|ref|: median <= 2.5e-2, max <= 1.5e-1);
- on CUDA (where available) its logits match the CPU engine's within tests/test_engine_gpu.py's bounds.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

llama_cpp = pytest.importorskip("llama_cpp")

from llama_reference import QUANT_MAX, QUANT_MEDIAN, LlamaRefs, parity_tokens, position_errors  # noqa: E402

from specter_gguf import native  # noqa: E402
from specter_gguf.engine import Model  # noqa: E402
from specter_gguf.quantize import quantize_gguf  # noqa: E402
from specter_gguf.synthetic.shapes import PRESETS, ModelShape  # noqa: E402
from specter_gguf.synthetic.writer import write_synthetic  # noqa: E402

CUDA_MEDIAN, CUDA_MAX = 5e-3, 1e-2
N_CTX = 64

# Qwen1.5-MoE style (qwen2moe): expert and shared-expert widths 320 = 10 blocks of 32, no multiple of 256,
# so every ffn_down*'s rows fall back; the other weights' rows are n_embd = 256 wide and keep their K-quant.
SHAPES: dict[str, ModelShape] = {
    "qwen2moe-ff320": dataclasses.replace(PRESETS["tiny-qwen2moe"], n_ff_exp=320, n_ff_shexp=320, n_ff=320,
                                          name="tiny-qwen2moe-ff320"),
    # DeepSeek-V2-Lite style: qk_nope 128 (head_dim 192 = 128 + 64 rope), so attn_k_b's rows are 128 wide
    "deepseek2-lite-nope128": dataclasses.replace(PRESETS["tiny-deepseek2-lite"], head_dim=192, n_ff_exp=320,
                                                  name="tiny-deepseek2-lite-nope128"),
}

# mix -> the 32-element block types the file must contain (on top of what the mix uses elsewhere)
EXPECTED = {
    "q4_k_m": {GT.Q5_0},  # Q4_K -> Q5_0 (and Q6_K -> Q8_0 where the mix raises ffn_down)
    "q5_k_s": {GT.Q5_1},  # Q5_K -> Q5_1
    "q2_k": {GT.Q4_0},    # Q2_K / Q3_K -> Q4_0
    "q4_1": {GT.Q4_1},    # the legacy mix itself
}
CASES = [("qwen2moe-ff320", k) for k in EXPECTED] + [("deepseek2-lite-nope128", "q4_k_m")]

CUDA_OK = torch.cuda.is_available() and native.has_cuda()


class Files:
    """Lazily written and quantized models: [(shape, kind)] -> Path."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[tuple[str, str], Path] = {}

    def __getitem__(self, key: tuple[str, str]) -> Path:
        shape, kind = key
        if key not in self.paths:
            path = self.root / f"{shape}-{kind}.gguf"
            if kind == "f16":
                write_synthetic(path, SHAPES[shape], "f16", seed=0)
            else:
                quantize_gguf(self[(shape, "f16")], path, kind, n_threads=2)
            self.paths[key] = path
        return self.paths[key]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("fallback-models"))


@pytest.fixture(scope="module")
def llamas() -> LlamaRefs:
    """llama.cpp on the quantized files, one Llama per file (2 threads, context and batch N_CTX)."""
    refs = LlamaRefs(N_CTX, n_threads=2)
    yield refs
    refs.close()


def tensor_types(path: Path) -> dict[str, GT]:
    return {t.name: GT(t.tensor_type) for t in gguf.GGUFReader(path).tensors}


def test_shapes_need_fallback() -> None:
    for name, s in SHAPES.items():
        assert s.n_ff_exp % 256 != 0 and s.n_ff_exp % 32 == 0, name
    assert SHAPES["deepseek2-lite-nope128"].head_dim - SHAPES["deepseek2-lite-nope128"].qk_rope_dim == 128


@pytest.mark.parametrize("shape,kind", CASES)
def test_quantized_file_holds_fallback_types(files: Files, shape: str, kind: str) -> None:
    types = tensor_types(files[(shape, kind)])
    counts = Counter(types.values())
    assert EXPECTED[kind] <= set(counts), f"{shape} {kind}: types {dict(counts)}"
    legacy = {GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0}
    for name, t in types.items():
        if name.endswith("ffn_down_exps.weight"):  # rows of n_ff_exp = 320
            assert t in legacy, (name, t)
        if name.endswith("attn_k_b.weight"):  # rows of qk_nope = 128
            assert t in legacy | {GT.F16, GT.F32}, (name, t)
    if shape.startswith("deepseek2"):
        assert any(n.endswith("attn_k_b.weight") and t in legacy for n, t in types.items()), types


@pytest.mark.parametrize("shape,kind", CASES)
def test_logits_match_llama_cpp(files: Files, llamas: LlamaRefs, shape: str, kind: str) -> None:
    path = files[(shape, kind)]
    m = Model.load(path, device="cpu", progress=False)
    v = m.config.n_vocab
    tokens = parity_tokens(m, 24, llamas[path], fixed=[0, v - 1, 7, 7], seed=1234)
    ours = m.logits(tokens)
    ref = llamas.logits(path, tokens)
    err = position_errors(ours, ref)
    med, mx = float(np.median(err)), float(err.max())
    print(f"\n{shape} {kind} vs llama.cpp: median {med:.2e} max {mx:.2e}")
    assert med <= QUANT_MEDIAN and mx <= QUANT_MAX, f"{shape} {kind}: median {med:.2e} max {mx:.2e}"


@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU and libspecter built with CUDA")
@pytest.mark.parametrize("shape,kind", CASES)
def test_cuda_logits_match_cpu(files: Files, shape: str, kind: str) -> None:
    path = files[(shape, kind)]
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 900, size=24)]
    cpu = Model.load(path, device="cpu", progress=False).logits(tokens)
    cuda = Model.load(path, device="cuda", progress=False).logits(tokens)
    err = position_errors(cuda, cpu)
    med, mx = float(np.median(err)), float(err.max())
    print(f"\n{shape} {kind} cuda vs cpu: median {med:.2e} max {mx:.2e}")
    assert med <= CUDA_MEDIAN and mx <= CUDA_MAX, f"{shape} {kind}: median {med:.2e} max {mx:.2e}"
