"""Quantize a GGUF file with llama.cpp's own quantizer (through llama-cpp-python).

Drafts are made from the target this way, so their blocks are bit-for-bit what llama.cpp would produce.
llama.cpp prints its own per-tensor progress to stderr while it works. Routers (`ffn_gate_inp`) and 1-D
tensors stay F32, and llama.cpp's type mixes (e.g. Q4_K_M keeps some tensors at Q6_K) apply. K-quants need
every weight's input dimension to be a multiple of 256; otherwise llama.cpp falls back to other types.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SpecterError
from .gguf_file import GGUFFile, model_name
from .outputs import check_output_file

# llama_ftype values, checked against llama.h of llama-cpp-python 0.3.36 (vendor/llama.cpp/include).
FTYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q2_k": 10,
    "q3_k_s": 11,
    "q3_k_m": 12,
    "q3_k_l": 13,
    "q4_k_s": 14,
    "q4_k_m": 15,
    "q5_k_s": 16,
    "q5_k_m": 17,
    "q6_k": 18,
    "iq3_s": 26,
    "iq3_m": 27,
    "iq4_nl": 25,
    "iq4_xs": 30,
    "bf16": 32,
}

# llama.cpp's quantizer makes these only with an importance matrix (IQ1/IQ2 and IQ3_XXS tensors), which it takes
# from llama-quantize's --imatrix file alone: such files are made with llama-quantize, and load here.
NEEDS_IMATRIX = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs")

_DTYPE_SUFFIXES = ("-f32", "-f16", "-bf16", ".f32", ".f16", ".bf16", "_f32", "_f16", "_bf16")


def ftype_for(qtype: str) -> int:
    """llama_ftype number for a type name such as 'q4_k_m' (case-insensitive)."""
    key = qtype.strip().lower()
    if key in NEEDS_IMATRIX:
        raise SpecterError(needs_imatrix_message(key))
    if key not in FTYPES:
        raise SpecterError(f"unknown quantization type {qtype!r}; valid types: {', '.join(FTYPES)}")
    return FTYPES[key]


def needs_imatrix_message(qtype: str) -> str:
    return (f"{qtype} needs an importance matrix, which llama.cpp's quantizer takes only from llama-quantize: make the "
            f"file with `llama-quantize --imatrix IMATRIX.gguf MODEL OUT {qtype.upper()}` and give it here (it loads; "
            f"as a draft, --draft OUT); or pick a type without one: {', '.join(FTYPES)}")


def quantized_path(src: str | Path, qtype: str) -> Path:
    """Where a quantized copy of `src` goes by default: `dir/<name without -f16>-<qtype>.gguf` (`model_name`: a split
    model's name, less the split suffix)."""
    src = Path(src)
    stem = model_name(src)
    for suf in _DTYPE_SUFFIXES:
        if stem.lower().endswith(suf):
            stem = stem[: -len(suf)]
            break
    return src.with_name(f"{stem}-{qtype.strip().lower()}.gguf")


def quantized_types(f: GGUFFile) -> list[str]:
    """The block-quantized tensor types of the GGUF file `f` (e.g. ["Q8_0"]): llama.cpp's quantizer converts such
    tensors only when allowed to requantize."""
    from gguf import GGML_QUANT_SIZES

    return sorted({t.type.name for t in f.tensors.values() if GGML_QUANT_SIZES[t.type][0] > 1})


def quantize_gguf(src: str | Path, dst: str | Path, qtype: str, n_threads: int = 0,
                  allow_requantize: bool = False) -> None:
    """Quantize GGUF `src` to `dst` as `qtype` (e.g. 'q8_0', 'q4_k_m', 'q2_k') with llama.cpp.

    `n_threads` <= 0 lets llama.cpp use all hardware threads. `allow_requantize` (llama-quantize's
    --allow-requantize) lets the source be already quantized (e.g. a Q8_0 target made into a Q2_K draft); without
    it a quantized source is refused before llama.cpp starts. Raises SpecterError for an unknown type, a missing or
    unreadable source (our reader's reason), or a failed quantization (llama.cpp's reason is on stderr).
    """
    ftype = ftype_for(qtype)
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise SpecterError(f"cannot quantize: source GGUF {src} not found")
    if src.resolve() == dst.resolve():
        raise SpecterError(f"cannot quantize {src} onto itself; choose another output path")
    check_output_file(dst, f"cannot quantize: the output {dst}", create_folder=True)  # its folder is made
    if not allow_requantize and (types := quantized_types(GGUFFile(src))):
        raise SpecterError(f"cannot quantize {src}: it is quantized already ({', '.join(types)} tensors); start from "
                           "its F32/F16/BF16 file, or allow requantizing (--allow-requantize; quality suffers)")
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SpecterError("quantization needs llama-cpp-python: pip install llama-cpp-python") from e

    dst.parent.mkdir(parents=True, exist_ok=True)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(n_threads) if n_threads and n_threads > 0 else (os.cpu_count() or 1)
    params.allow_requantize = bool(allow_requantize)
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), params)
    if rc != 0:
        try:
            dst.unlink()
        except FileNotFoundError:
            pass
        raise SpecterError(f"llama.cpp failed to quantize {src} to {qtype} (code {rc}); see its message above")


def quantize_with_progress(src: str | Path, dst: str | Path, qtype: str, *, show: bool = True, desc: str | None = None,
                           n_threads: int = 0, allow_requantize: bool = False) -> list[str]:
    """`quantize_gguf` with a progress bar over tensors (on stderr when `show`); returns llama.cpp's closing size
    lines. A failure names llama.cpp's own reasons."""
    from .progress import llama_quantize_progress

    progress = None
    try:
        with llama_quantize_progress(show=show, desc=desc or f"{qtype} {Path(dst).name}") as progress:
            quantize_gguf(src, dst, qtype, n_threads=n_threads, allow_requantize=allow_requantize)
    except SpecterError:
        reasons = [r.split("failed to quantize: ", 1)[-1] for r in (progress.errors if progress else [])]
        if not reasons:
            raise
        raise SpecterError(f"llama.cpp failed to quantize {src} to {qtype}: {'; '.join(reasons)}") from None
    return progress.summary
