"""llama.cpp's own block quantizer (`ggml_quantize_chunk` of llama-cpp-python's libggml-base), for test data in the
types gguf's numpy quantizers lack: the K-quants and the IQ types.

llama.cpp's model quantizer (`llama_model_quantize`, what `specter-gguf quantize` drives) makes IQ1/IQ2 and IQ3_XXS
tensors only with an importance matrix, which it takes from llama-quantize's --imatrix file alone. `experts_copy`
makes files of those types as llama-quantize --imatrix does, with the same `ggml_quantize_chunk` on a model's routed
experts; its importance matrix is each matrix's own columns' mean squares, where llama-imatrix measures the mean
squares of the matrix's inputs (the blocks are valid either way; their quality differs).
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from gguf_edit import rewrite

# ggml's quantizer refuses these without an importance matrix (per-column weights of the squared error)
NEEDS_IMPORTANCE = (GGMLQuantizationType.IQ1_S, GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ2_XS)


def ggml_base() -> ctypes.CDLL:
    """llama-cpp-python's libggml-base with the quantizer's signatures; fails the test where it is missing."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llama-cpp-python is not installed: it is a hard test dependency (its libggml-base "
                    "quantizes the K-quant and IQ test data): pip install llama-cpp-python")
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    libs = sorted(lib_dir.glob("libggml-base.*"))
    if not libs:
        pytest.fail(f"no libggml-base in {lib_dir}: llama-cpp-python's install is broken")
    lib = ctypes.CDLL(str(libs[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def ggml_quantize(lib: ctypes.CDLL, qtype: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, bytes_per_row]. The types that need an importance matrix get x's columns'
    mean squares as one."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    out = np.zeros((rows, n // elems * nbytes), dtype=np.uint8)
    importance = np.ascontiguousarray((x * x).mean(axis=0) + 1e-6, dtype=np.float32)
    lib.ggml_quantize_init(int(qtype))
    written = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n,
                                      importance.ctypes.data if qtype in NEEDS_IMPORTANCE else None)
    assert written == out.nbytes
    return out


def experts_copy(src: Path, dst: Path, qtype: GGMLQuantizationType) -> Path:
    """A copy of the F32/F16 GGUF `src` at `dst` whose routed experts (`*_exps.weight`) are quantized to `qtype`
    by llama.cpp's quantizer; every other tensor as in `src`."""
    lib = ggml_base()
    tensors = {}
    for t in GGUFReader(src).tensors:
        if not t.name.endswith("_exps.weight"):
            continue
        assert t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16), (t.name, t.tensor_type.name)
        data = np.asarray(t.data, dtype=np.float32)  # [experts, rows, row length]
        raw = np.stack([ggml_quantize(lib, qtype, expert) for expert in data])
        tensors[t.name] = (raw, qtype)
    assert tensors, f"{src} has no routed expert tensors"
    return rewrite(src, dst, tensors=tensors)
