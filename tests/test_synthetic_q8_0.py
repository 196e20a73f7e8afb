"""Synthetic models written directly in Q8_0 (`write_synthetic(..., "q8_0")`, `make_synthetic.py --dtype q8_0`,
`bench.py --target-type q8_0`):

- the file's tensor types are the documented ones (matrices Q8_0; routers and 1-D tensors F32; matrices whose
  rows are not a multiple of 32 F16) and general.file_type is LLAMA_FTYPE_MOSTLY_Q8_0;
- our vectorized quantizer (`synthetic.q8_0.q8_0_blocks`) equals gguf's reference (`gguf.quants.quantize`, which is
  ggml's quantize_row_q8_0_ref) bit for bit, and the file's blocks are exactly gguf's quantization of the F32
  file of the same seed;
- our engine loads the file and its CPU logits match llama.cpp's on it within the quantized bounds of
  tests/test_parity.py (per position max|ours - ref| / max|ref|: median <= 2.5e-2, max <= 1.5e-1), and match
  llama.cpp on an F32 copy of the dequantized weights within the float bounds;
- the benchmark makes a Q8_0 target and requantizes drafts from it (llama-quantize --allow-requantize).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from built_files import BuiltFiles  # noqa: E402

from specter_gguf.bench import model_files  # noqa: E402
from specter_gguf.bench.model_files import estimate_bytes, gguf_weight_type, make_draft, make_target  # noqa: E402
from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.gguf_file import GGUFFile  # noqa: E402
from specter_gguf.synthetic import q8_0  # noqa: E402
from specter_gguf.synthetic.architectures import tensor_specs  # noqa: E402
from specter_gguf.synthetic.bpe import tiny_tokenizer  # noqa: E402
from specter_gguf.synthetic.q8_0 import q8_0_blocks, quantize_q8_0  # noqa: E402
from specter_gguf.synthetic.shapes import PRESETS, TINY_ARCH_PRESETS  # noqa: E402
from specter_gguf.synthetic.writer import data_bytes, tensor_type, write_synthetic  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ARCHS = list(TINY_ARCH_PRESETS)  # qwen2moe, qwen3moe, llama (Mixtral), olmoe
N_CTX = 64


class Files(BuiltFiles):
    """Lazily written models: [(preset, dtype)] -> Path (seed 0)."""

    def accepts(self, preset: str, dtype: str) -> bool:
        return True

    def build(self, preset: str, dtype: str) -> Path:
        return write_synthetic(self.root / f"{preset}-{dtype}.gguf", preset, dtype, seed=0).path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("q8_0-models"))


def _types(path: Path) -> dict[str, GT]:
    return {t.name: GT(t.tensor_type) for t in gguf.GGUFReader(path).tensors}


# ------------------------------------------------------------------------------------------- quantizer


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    halves = np.arange(-127, 129, dtype=np.float32).reshape(8, 32) / 2  # x / d lands on .5: roundf's ties
    ties = rng.integers(-254, 255, (64, 32)).astype(np.float32) / 2 * np.float32(0.37)
    zeros_and_one = np.zeros((4, 64), np.float32)
    zeros_and_one[1, 40] = -3.0  # one non-zero block between all-zero blocks (d = 0: q = 0)
    return [
        rng.standard_normal((64, 256), dtype=np.float32) * 0.02,  # like the writer's matrices
        rng.standard_normal((3, 5, 96), dtype=np.float32) * 1e3,  # 3-D (experts), large values
        rng.standard_normal((16, 64), dtype=np.float32) * 1e-6,
        rng.standard_normal((2, 32), dtype=np.float32).astype(np.float16).astype(np.float32),
        halves, ties, zeros_and_one,
    ]


@pytest.mark.parametrize("i", range(len(_cases())))
def test_q8_0_quantizer_equals_gguf_reference(i: int) -> None:
    a = _cases()[i]
    ref = gguf_quantize(a, GT.Q8_0)
    ours = quantize_q8_0(a)
    assert ours.dtype == ref.dtype == np.uint8 and ours.shape == ref.shape
    assert np.array_equal(ours, ref), f"{int((ours != ref).sum())} bytes differ"
    # the same through the torch entry point the writer uses
    assert np.array_equal(q8_0_blocks(torch.from_numpy(a)).numpy(), ref)


def test_q8_0_quantizer_chunks_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    a = np.random.default_rng(3).standard_normal((37, 320), dtype=np.float32)
    ref = gguf_quantize(a, GT.Q8_0)
    monkeypatch.setattr(q8_0, "_Q8_0_CHUNK_BLOCKS", 7)  # chunk borders inside rows
    assert np.array_equal(quantize_q8_0(a), ref)
    if torch.cuda.is_available():  # the writer quantizes on its generating device
        big = np.random.default_rng(4).standard_normal((1 << 12, 1024), dtype=np.float32) * 0.02
        for c in [a, big, *_cases()]:
            got = q8_0_blocks(torch.from_numpy(c).cuda()).cpu().numpy()
            ref_c = gguf_quantize(c, GT.Q8_0)
            assert np.array_equal(got, ref_c), f"CUDA: {int((got != ref_c).sum())} bytes differ"
    with pytest.raises(SpecterError, match="multiple of 32"):
        quantize_q8_0(np.zeros((2, 48), np.float32))


# ------------------------------------------------------------------------------------------ the file


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_file_types(files: Files, arch: str) -> None:
    preset = TINY_ARCH_PRESETS[arch]
    path = files[(preset, "q8_0")]
    r = gguf.GGUFReader(path)
    assert r.fields["general.file_type"].contents() == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    types = _types(path)
    specs = tensor_specs(PRESETS[preset], len(tiny_tokenizer().tokens))
    assert set(types) == {s.name for s in specs}
    for s in specs:
        want = GT.F32 if (len(s.ne) == 1 or "ffn_gate_inp." in s.name) else GT.Q8_0
        assert types[s.name] == want, (s.name, s.ne, types[s.name])
        assert tensor_type(s, "q8_0") == want.name
    assert {"token_embd.weight", "output.weight"} <= {n for n, t in types.items() if t == GT.Q8_0}
    assert any("ffn_gate_exps" in n and t == GT.Q8_0 for n, t in types.items())
    data = sum(int(t.n_bytes) for t in r.tensors)
    assert data == data_bytes(PRESETS[preset], len(tiny_tokenizer().tokens), "q8_0")
    assert path.stat().st_size < files[(preset, "f16")].stat().st_size * 0.6


def test_rows_not_a_multiple_of_32_stay_f16(tmp_path: Path) -> None:
    shape = dataclasses.replace(PRESETS["tiny-qwen3moe"], n_layer=1, n_ff_exp=48, name="ff48")
    types = _types(write_synthetic(tmp_path / "ff48.gguf", shape, "q8_0").path)
    assert types["blk.0.ffn_down_exps.weight"] == GT.F16  # rows of n_ff_exp = 48
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_up_exps.weight"] == GT.Q8_0  # rows of 256
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == GT.F32


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_q8_0_file_is_gguf_quantization_of_the_f32_file(files: Files, arch: str) -> None:
    preset = TINY_ARCH_PRESETS[arch]
    q8 = {t.name: t for t in gguf.GGUFReader(files[(preset, "q8_0")]).tensors}
    f32 = {t.name: t for t in gguf.GGUFReader(files[(preset, "f32")]).tensors}
    n_q = 0
    for name, t in q8.items():
        x = np.asarray(f32[name].data)
        if GT(t.tensor_type) == GT.Q8_0:
            assert np.array_equal(np.asarray(t.data), gguf_quantize(x, GT.Q8_0)), name
            n_q += 1
        else:
            assert np.array_equal(np.asarray(t.data), x), name
    assert n_q > 10


# ------------------------------------------------------------------------------- engine vs llama.cpp


@pytest.fixture(scope="module")
def llamas():
    pytest.importorskip("llama_cpp")
    from llama_reference import LlamaRefs

    refs = LlamaRefs(N_CTX, n_threads=2)
    yield refs
    refs.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_logits_match_llama_cpp_on_q8_0_file(files: Files, llamas, arch: str, tmp_path: Path) -> None:
    from llama_reference import (FLOAT_MAX, FLOAT_MEDIAN, QUANT_MAX, QUANT_MEDIAN, dequantized_copy,
                                 parity_tokens, position_errors)

    from specter_gguf.engine import Model

    path = files[(TINY_ARCH_PRESETS[arch], "q8_0")]
    m = Model.load(path, device="cpu", progress=False)
    v = m.config.n_vocab
    tokens = parity_tokens(m, 24, llamas[path], fixed=[0, v - 1, 7, 7], seed=1234)
    ours = m.logits(tokens)
    err = position_errors(ours, llamas.logits(path, tokens))
    med, mx = float(np.median(err)), float(err.max())
    print(f"\n{arch} q8_0 (written directly) vs llama.cpp: median {med:.2e} max {mx:.2e}")
    assert med <= QUANT_MEDIAN and mx <= QUANT_MAX, f"{arch}: median {med:.2e} max {mx:.2e}"
    # llama.cpp on the file's exact weights (an F32 copy: no 8-bit activations) agrees at the float bounds
    err = position_errors(ours, llamas.logits(dequantized_copy(path, tmp_path / "as-f32.gguf"), tokens))
    med, mx = float(np.median(err)), float(err.max())
    assert med <= FLOAT_MEDIAN and mx <= FLOAT_MAX, f"{arch} vs dequantized copy: median {med:.2e} max {mx:.2e}"


# ----------------------------------------------------------------------------- scripts and benchmark


def test_make_synthetic_q8_0_with_requantized_draft(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    out = tmp_path / "m-q8_0.gguf"
    cmd = [sys.executable, str(REPO / "scripts/make_synthetic.py"), "--preset", "tiny-qwen3moe", "--layers", "1",
           "--dtype", "q8_0", "--quantize", "q2_k", "--threads", "2", "--no-progress", "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert Counter(_types(out).values()).keys() == {GT.Q8_0, GT.F32}
    draft = _types(tmp_path / "m-q8_0-q2_k.gguf")
    assert draft["blk.0.ffn_gate_exps.weight"] == GT.Q2_K


def test_estimate_bytes_by_type() -> None:
    f16 = estimate_bytes("qwen3-30b-a3b", None, 151936, "f16")
    q8 = estimate_bytes("qwen3-30b-a3b", None, 151936, "q8_0")
    assert 30e9 < q8 < 34e9 and 0.53 < q8 / f16 < 0.54  # ~32 GB: 34 bytes per 32 values, routers/norms F32


def test_bench_makes_q8_0_target_and_requantized_draft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp")
    logs: list[str] = []
    target = make_target("tiny-qwen3moe", 1, tmp_path, "cpu", None, logs.append, target_type="q8_0")
    assert target.name == "tiny-qwen3moe-l1-q8_0.gguf" and "--dtype q8_0" in logs[0]
    assert gguf_weight_type(GGUFFile(target)) == ("q8_0", True)
    assert make_target("tiny-qwen3moe", 1, tmp_path, "cpu", None, logs.append, target_type="q8_0") == target
    assert logs[-1].startswith("reusing")
    with pytest.raises(SpecterError, match="target type"):
        make_target("tiny-qwen3moe", 1, tmp_path, "cpu", None, logs.append, target_type="q4_k")

    # llama-cpp-python's quantizer (no llama-quantize built): requantized from Q8_0
    draft = make_draft(target, "q2_k", None, logs.append)
    assert draft.name == "tiny-qwen3moe-l1-q8_0-q2_k.gguf" and "requantizing" in logs[-2]
    assert _types(draft)["blk.0.ffn_up_exps.weight"] == GT.Q2_K

    # the llama-quantize tool gets --allow-requantize for a quantized source, and not for an F16 one
    calls: list[list[str]] = []
    monkeypatch.setattr(model_files, "check_call", lambda cmd, timeout: (calls.append(list(cmd)),
                                                                          Path(cmd[-3]).write_bytes(b"x")))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-quantize").write_text("")
    make_draft(target, "q4_k_m", tmp_path / "bin", logs.append)
    f16 = write_synthetic(tmp_path / "t-f16.gguf", PRESETS["tiny-qwen3moe"].with_layers(1), "f16").path
    make_draft(f16, "q4_k_m", tmp_path / "bin", logs.append)
    assert calls[0][1:] == ["--allow-requantize", str(target), str(tmp_path / "tiny-qwen3moe-l1-q8_0-q4_k_m.gguf"),
                            "Q4_K_M", calls[0][-1]]
    assert "--allow-requantize" not in calls[1] and calls[1][1] == str(f16)
