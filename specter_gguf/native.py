"""Loader and thin Python API for the native library (libspecter), through cffi in ABI mode.

The library is searched for, in order: the file named by the environment variable
``SPECTER_NATIVE_LIB``; next to this package (``pip install .`` and in-place editable installs put
it there); a hand-made CMake build in ``<repo>/build``. Its C declarations are read from the
headers installed with it (``include/*.h``, falling back to the source tree's ``native/include``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SpecterError

_PKG_DIR = Path(__file__).resolve().parent
_REPO_DIR = _PKG_DIR.parent
_LIB_NAMES = {"win32": "specter.dll", "darwin": "libspecter.dylib"}
LIB_NAME = _LIB_NAMES.get(sys.platform, "libspecter.so")
_FIX = "reinstall with `pip install .` (needs cmake and a C++ compiler)"

# ggml type ids (same numbering as ggml.h / gguf.GGMLQuantizationType).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M = 16, 17, 18, 19, 20, 21, 22, 23, 29
BF16 = 30

_lock = threading.Lock()
_handle: tuple[Any, Any] | None = None  # (ffi, lib)


def _candidates() -> list[Path]:
    env = os.environ.get("SPECTER_NATIVE_LIB")
    if env:
        return [Path(env)]  # an explicit choice is never second-guessed
    return [_PKG_DIR / LIB_NAME, _REPO_DIR / "build" / LIB_NAME]


def _header_dirs(lib_path: Path) -> list[Path]:
    return [lib_path.parent / "include", _PKG_DIR / "include", _REPO_DIR / "native" / "include"]


def _cdef_text(header_dir: Path) -> str:
    """The declarations between the CDEF markers of every header, specter.h first."""
    headers = sorted(header_dir.glob("*.h"), key=lambda p: (p.name != "specter.h", p.name))
    parts = []
    for h in headers:
        text = h.read_text(encoding="utf-8")
        m = re.search(r"/\*\s*SPECTER_CDEF_BEGIN\s*\*/(.*?)/\*\s*SPECTER_CDEF_END\s*\*/", text, re.S)
        if not m:
            continue
        lines = [ln for ln in m.group(1).splitlines() if not ln.lstrip().startswith("#")]
        parts.append(re.sub(r"\bSPECTER_API\b", "", "\n".join(lines)))
    return "\n".join(parts)


def _load() -> tuple[Any, Any]:
    try:
        import cffi
    except ImportError as e:  # pragma: no cover - cffi is a declared dependency
        raise SpecterError(f"specter-gguf needs the `cffi` package ({e}): run `pip install cffi`") from None
    tried = _candidates()
    path = next((p for p in tried if p.is_file()), None)
    if path is None:
        where = ", ".join(str(p) for p in tried)
        raise SpecterError(f"specter-gguf's native library was not built (looked for {where}): {_FIX}")
    header_dir = next((d for d in _header_dirs(path) if (d / "specter.h").is_file()), None)
    if header_dir is None:
        raise SpecterError(f"specter-gguf's native headers are missing next to {path}: {_FIX}")
    ffi = cffi.FFI()
    try:
        ffi.cdef(_cdef_text(header_dir))
    except Exception as e:
        raise SpecterError(f"specter-gguf's native headers in {header_dir} could not be parsed ({e}): {_FIX}") from None
    try:
        lib = ffi.dlopen(str(path))
        version = ffi.string(lib.specter_version()).decode()
    except Exception as e:  # OSError from dlopen, AttributeError for a missing symbol
        msg = str(e).replace("\n", " ")
        raise SpecterError(f"specter-gguf's native library {path} could not be loaded ({msg}): {_FIX}") from None
    pkg_version = getattr(sys.modules.get(__package__ or ""), "__version__", None)
    if pkg_version and version != pkg_version:  # a stale build left behind by an older checkout
        raise SpecterError(
            f"specter-gguf's native library {path} is version {version}, the package is {pkg_version}: {_FIX}"
        )
    return ffi, lib


def _handle_pair() -> tuple[Any, Any]:
    global _handle
    if _handle is None:
        with _lock:
            if _handle is None:
                _handle = _load()
    return _handle


def ffi() -> Any:
    """The cffi FFI object the library was loaded with (for ``ffi.cast``/``ffi.from_buffer``)."""
    return _handle_pair()[0]


def lib() -> Any:
    """The loaded library (cached); raises SpecterError naming the fix when it is missing or broken."""
    return _handle_pair()[1]


def error_string(code: int) -> str:
    """The library's description of a status code."""
    f, lb = _handle_pair()
    return f.string(lb.specter_error_string(code)).decode()


def check(code: int, what: str = "native call") -> None:
    """Raise SpecterError with the library's message if ``code`` is not SPECTER_OK (0)."""
    if code != 0:
        raise SpecterError(f"{what} failed: {error_string(code)} (code {code})")


def version() -> str:
    """The native library's version string."""
    f, lb = _handle_pair()
    return f.string(lb.specter_version()).decode()


def has_cuda() -> bool:
    """True when the native library was built with CUDA kernels."""
    return bool(lib().specter_has_cuda())


def cuda_device_count() -> int:
    """CUDA devices visible to the library (0 in a CPU-only build or without a driver)."""
    f, lb = _handle_pair()
    out = f.new("int *")
    check(lb.specter_cuda_device_count(out), "specter_cuda_device_count")
    return int(out[0])


def block_size(ggml_type: int) -> tuple[int, int]:
    """(elements, bytes) of one block of ``ggml_type``; SpecterError for a type we do not handle."""
    f, lb = _handle_pair()
    elems, nbytes = f.new("int64_t *"), f.new("size_t *")
    check(lb.specter_type_block_size(int(ggml_type), elems, nbytes), f"block size of ggml type {ggml_type}")
    return int(elems[0]), int(nbytes[0])


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...], n_threads: int = 0,
               out_dtype: Any = np.float32, out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize raw GGUF tensor bytes into a float32 (or float16) array of ``shape``.

    ``shape`` is in numpy order: its last dimension is the row length (ggml's ne[0]). ``data`` holds
    whole rows: a uint8 array of shape ``[..., bytes_per_row]`` as ``gguf``'s ``ReaderTensor.data``
    gives for quantized types, a flat buffer of any dtype, or (for F32/F16/BF16) an array with the
    tensor's own element dtype. Bit-exact with ``gguf.quants.dequantize``. ``n_threads <= 0`` uses
    all cores. ``out_dtype=np.float16`` rounds each value to half (nearest even). ``out``: a
    C-contiguous, writable array of ``shape`` and ``out_dtype`` to write into (returned).
    """
    f, lb = _handle_pair()
    shape = tuple(int(d) for d in shape)
    if not shape or any(d < 0 for d in shape):
        raise SpecterError(f"dequantize: bad tensor shape {shape}")
    row_len = shape[-1]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    elems, blk_bytes = block_size(ggml_type)
    if row_len % elems:
        raise SpecterError(
            f"dequantize: row length {row_len} is not a multiple of ggml type {ggml_type}'s block of {elems}"
        )
    need = n_rows * (row_len // elems) * blk_bytes
    src = np.ascontiguousarray(data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8))
    if src.nbytes != need:
        raise SpecterError(f"dequantize: {src.nbytes} bytes given, shape {shape} of ggml type {ggml_type} needs {need}")
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.float32, np.float16):
        raise SpecterError(f"dequantize: out_dtype must be float32 or float16, not {out_dtype}")
    if out is None:
        out = np.empty(shape, dtype=out_dtype)
    elif out.shape != shape or out.dtype != out_dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise SpecterError(f"dequantize: out must be a writable C-contiguous {out_dtype} array of shape {shape}")
    if need == 0:
        return out
    src_ptr = f.cast("const void *", f.from_buffer(src.reshape(-1).view(np.uint8)))
    if out_dtype == np.float32:
        dst = f.cast("float *", f.from_buffer(out.reshape(-1), require_writable=True))
        code = lb.specter_dequantize_rows(int(ggml_type), src_ptr, dst, n_rows, row_len, int(n_threads))
    else:
        dst = f.cast("uint16_t *", f.from_buffer(out.reshape(-1).view(np.uint16), require_writable=True))
        code = lb.specter_dequantize_rows_f16(int(ggml_type), src_ptr, dst, n_rows, row_len, int(n_threads))
    check(code, f"dequantize (ggml type {ggml_type}, shape {shape})")
    return out
