"""Shared fixtures: tiny random-weight MoE models of every architecture, built once per test session.

``tiny_models[(arch, kind)]`` is the path of a GGUF, built on first use into a session cache directory
under pytest's tmp dir and reused by every later test:

- ``arch``: a GGUF ``general.architecture`` of :data:`specter_gguf.synthetic.shapes.TINY_ARCH_PRESETS`
  (``qwen2moe``, ``qwen3moe``, ``llama`` = Mixtral-style, ``olmoe``);
- ``kind``: ``f32`` or ``f16`` (written by the synthetic writer, same seed: the F16 file is the F32 one
  rounded), or ``q8_0`` / ``q4_k_m`` / ``q2_k`` / ``iq4_xs`` / ``iq4_nl`` / ``iq3_s`` (llama.cpp's model quantizer
  applied to the F16 file), or ``iq1_s`` / ``iq1_m`` / ``iq2_xxs`` / ``iq2_xs`` / ``iq2_s`` / ``iq3_xxs`` (the F16
  file with its routed experts quantized by llama.cpp's block quantizer with an importance matrix, as
  llama-quantize --imatrix makes such files, the matrix here the weights' own: tests/ggml_quantizer.py). The quantized kinds need llama-cpp-python
  and skip the test without it.

``shipped_model`` is models/tiny-qwen2moe.gguf, the model that ships with the repository: a small MoE trained on
the Python standard library (docs/TINY_MODEL.md; 4 layers, context 512). The random-weight model that shipped
before it is ``tiny_models[("qwen2moe", "f16")]`` (the same preset and seed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from built_files import BuiltFiles

from specter_gguf.engine import SHIPPED_MODEL
from specter_gguf.synthetic.shapes import PRESETS, TINY_ARCH_PRESETS
from specter_gguf.synthetic.writer import write_synthetic

TINY_WRITTEN = ("f32", "f16")
TINY_QUANTIZED = ("q8_0", "q4_k_m", "q2_k", "iq4_xs", "iq4_nl", "iq3_s")
TINY_IQ_EXPERTS = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs")
TINY_KINDS = TINY_WRITTEN + TINY_QUANTIZED + TINY_IQ_EXPERTS
TINY_SEED = 0


class TinyModels(BuiltFiles):
    """Lazily built, cached tiny models: ``[(arch, kind)] -> Path``."""

    archs = tuple(TINY_ARCH_PRESETS)
    kinds = TINY_KINDS

    def accepts(self, arch: str, kind: str) -> bool:
        # `arch` may also name a preset directly (e.g. "tiny-deepseek2-lite"); iteration covers the archs
        return TINY_ARCH_PRESETS.get(arch, arch) in PRESETS and kind in TINY_KINDS

    def build(self, arch: str, kind: str) -> Path:
        preset = TINY_ARCH_PRESETS.get(arch, arch)
        path = self.root / f"{preset}-{kind}.gguf"
        if kind in TINY_WRITTEN:
            write_synthetic(path, preset, kind, seed=TINY_SEED)
            return path
        pytest.importorskip("llama_cpp")
        if kind in TINY_IQ_EXPERTS:
            from gguf import GGMLQuantizationType

            from ggml_quantizer import experts_copy

            return experts_copy(self[(arch, "f16")], path, GGMLQuantizationType[kind.upper()])
        from specter_gguf.quantize import quantize_gguf

        quantize_gguf(self[(arch, "f16")], path, kind, n_threads=2)
        return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def shipped_model() -> Path:
    if not SHIPPED_MODEL.is_file():
        pytest.fail(f"{SHIPPED_MODEL} is missing; make it with the command in models/README.md")
    return SHIPPED_MODEL
