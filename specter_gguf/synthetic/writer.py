"""Writing a random-weight GGUF of a :class:`~specter_gguf.synthetic.shapes.ModelShape` (`write_synthetic`), tensor by
tensor in the layout of `architectures`.

Weights (deterministic from ``seed``; each tensor, and each slab of a large tensor, has its own seed derived
from ``(seed, arch, name, slab)``, so a tensor's values do not depend on which other tensors exist —
changing ``n_layer`` keeps the shared layers identical. Values differ between ``device="cpu"`` and ``"cuda"``
because torch's generators differ):

- matrices (attention, experts, shared expert, embeddings): normal, std ``init_std`` (0.02, like the
  HF initialisers of these models);
- the LM head ``output``: normal, std ``logit_std / sqrt(n_embd)`` so that logits of the final (unit-RMS)
  hidden state have std ~``logit_std`` (2.0) at every width — a peaked, non-uniform next-token
  distribution, which makes greedy decoding less fragile than std 0.02 would at small widths;
- routers ``ffn_gate_inp``: normal, std ``router_logit_std / sqrt(n_embd)`` (router logits std ~1.5), so
  the softmax over experts is far from uniform and top-k choices have real margins;
- RMS norm weights: ``1 + N(0, norm_noise)`` with ``norm_noise`` 0.1 — close to 1 like a trained model's,
  but varied enough that an engine forgetting to multiply by a norm weight fails a parity test;
- biases (qwen2moe q/k/v): normal, std ``init_std``;
- attention's output product ``attn_output``: std ``init_std * attn_output_scale`` (1 by default). With random
  weights attention averages the context almost uniformly, and at std ``init_std`` that average (and the value
  bias it carries) is most of the router's input: consecutive tokens then share most of their experts, far more than
  a trained model's do, which flatters an expert cache. Measured on a 4-layer Qwen1.5-MoE-shaped F16 file, bench
  prompts, 48 generated tokens (2026-12-07): at scale 1 a token's router input had cosine 0.58-0.78 with the one
  before it; consecutive tokens shared 1.6-2.8 of their 4 experts a layer and the 48 tokens used 11-35 of a
  layer's 60. At 0.3 they shared 0.5-0.7 and used 34-52; at 0.1, 0.27-0.35 (chance: 0.27) and 47-58.

1-D tensors (norms, biases, ``ffn_gate_inp_shexp``) and routers are F32, as llama.cpp's converter writes
them; other matrices use the requested type (``f32``, ``f16``, ``bf16`` or ``q8_0``).

``q8_0`` writes the target directly in Q8_0 (LLAMA_FTYPE_MOSTLY_Q8_0): every matrix (2-D or 3-D tensor:
embeddings, attention, experts, shared experts, LM head) is quantized slab by slab as it is generated (`q8_0`), so
no F16 copy ever exists (a Qwen3-30B-A3B-shaped file is ~32 GB instead of 61 GB). Routers and 1-D tensors stay
F32 as above; a matrix whose row length (``ne0``) is not a multiple of 32 (Q8_0's block) is written as F16
(as llama.cpp's converter falls back; none of the presets has one). Writing the whole Qwen3-30B-A3B shape in
Q8_0 with ``device="cuda"`` takes 40 s, 775 M params/s on the H200 machine; on the CPU generation is bound by
torch.randn, ~120 M/s.

Tokenizer: the tiny models carry our small BPE (`bpe`); real-shape models can copy every ``tokenizer.*`` key from
a vocab GGUF (``vocab_from``).

Trained weights (``weights``: every tensor by name, float32 in numpy order, e.g. `tiny_moe.TinyMoE.gguf_weights`)
replace the random ones and are stored in the same types.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from specter_gguf.errors import SpecterError
from specter_gguf.synthetic.architectures import TensorSpec, architecture_metadata, tensor_specs
from specter_gguf.synthetic.bpe import BPETokenizer, tiny_tokenizer
from specter_gguf.synthetic.q8_0 import Q8_0_BLOCK, q8_0_blocks
from specter_gguf.synthetic.shapes import ModelShape, get_preset

DTYPES = ("f32", "f16", "bf16", "q8_0")
# --attn-output-scale's range: below 0.01 F16 keeps the weights (std 0.02 times the scale) only as subnormals, and
# the scale is there to go below 1 (routing that follows the token); 10 bounds the other side generously
ATTN_OUTPUT_SCALES = (0.01, 10.0)
# llama_ftype values (llama.h) recorded in general.file_type.
_FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}

# Elements generated at once for large tensors (slabs along the outermost numpy dimension).
_SLAB_ELEMS = 1 << 26


@dataclass
class WriteResult:
    path: Path
    shape: ModelShape
    dtype: str
    n_vocab: int
    n_params: int
    n_bytes: int  # file size
    seconds: float
    tensors: list[str] = field(default_factory=list)


def _tensor_seed(seed: int, arch: str, name: str, slab: int) -> int:
    h = hashlib.sha256(f"{seed}/{arch}/{name}/{slab}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def partial_path(path: Path) -> Path:
    """Where `write_synthetic` writes the model of `path` until it is complete."""
    return path.with_name(f"{path.name}.partial")


def check_attn_output_scale(scale: float) -> None:
    """Refuse an attention output scale outside ATTN_OUTPUT_SCALES, naming the range."""
    low, high = ATTN_OUTPUT_SCALES
    if not low <= scale <= high:
        raise SpecterError(f"--attn-output-scale must be from {low:g} to {high:g}, not {scale:g}")


def _std(spec: TensorSpec, shape: ModelShape) -> float:
    if spec.init == "router":
        return shape.router_logit_std / math.sqrt(shape.n_embd)
    if spec.init == "output":
        return shape.logit_std / math.sqrt(shape.n_embd)
    if spec.init == "norm":
        return shape.norm_noise
    if spec.name.endswith(".attn_output.weight"):
        return shape.init_std * shape.attn_output_scale
    return shape.init_std


def _storage(spec: TensorSpec, dtype: str) -> Any:
    """The GGMLQuantizationType a tensor is stored as (see the module docstring)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if spec.f32 or dtype == "f32" or (dtype == "q8_0" and len(spec.ne) < 2):
        return Q.F32
    if dtype == "q8_0":
        return Q.Q8_0 if spec.ne[0] % Q8_0_BLOCK == 0 else Q.F16
    return Q.F16 if dtype == "f16" else Q.BF16


def tensor_type(spec: TensorSpec, dtype: str) -> str:
    """The GGML type name ("F32", "F16", "BF16", "Q8_0") `spec` is written as in a `dtype` file."""
    return _storage(spec, dtype).name


def _nbytes(spec: TensorSpec, qtype: Any) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return spec.n_elements // block * size


def data_bytes(shape: ModelShape, n_vocab: int, dtype: str) -> int:
    """Bytes of tensor data in a `dtype` file of `shape` (the file is this plus header and alignment)."""
    return sum(_nbytes(s, _storage(s, dtype)) for s in tensor_specs(shape, n_vocab))


def vocab_metadata_from_gguf(path: str | Path) -> tuple[dict[str, tuple[Any, Any, Any]], int]:
    """Every tokenizer.* key of a GGUF (e.g. llama.cpp's models/ggml-vocab-qwen2.gguf), and n_vocab."""
    import gguf

    path = Path(path)
    if path.is_dir():
        raise SpecterError(f"vocab GGUF {path} is a folder; give a .gguf file (e.g. llama.cpp's "
                           f"models/ggml-vocab-qwen2.gguf)")
    if not path.is_file():
        raise SpecterError(f"vocab GGUF {path} not found")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise SpecterError(f"vocab GGUF {path} is not a readable GGUF file ({e})") from None
    T = gguf.GGUFValueType
    out: dict[str, tuple[Any, Any, Any]] = {}
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == T.ARRAY else None
        if vtype == T.ARRAY and len(f.types) > 2:
            raise SpecterError(f"{path}: nested array key {key} is not supported")
        out[key] = (f.contents(), vtype, sub)
    if "tokenizer.ggml.tokens" not in out:
        raise SpecterError(f"{path} has no tokenizer.ggml.tokens; is it a vocab GGUF?")
    return out, len(out["tokenizer.ggml.tokens"][0])


def _slabs(spec: TensorSpec, shape: ModelShape, dtype: str, seed: int, device: str,
           given: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """The tensor's data as consecutive numpy slabs (row-major, outermost numpy dim split): drawn, or `given`."""
    import torch

    np_shape = spec.numpy_shape
    inner = math.prod(np_shape[1:])
    rows_per = max(1, _SLAB_ELEMS // max(1, inner))
    std = _std(spec, shape)
    qtype = _storage(spec, dtype)
    for slab, r0 in enumerate(range(0, np_shape[0], rows_per)):
        rows = min(rows_per, np_shape[0] - r0)
        if given is not None:
            t = torch.from_numpy(np.ascontiguousarray(given[r0:r0 + rows], dtype=np.float32)).to(device)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(_tensor_seed(seed, shape.arch, spec.name, slab))
            t = torch.randn((rows, *np_shape[1:]), generator=g, device=device, dtype=torch.float32)
            t.mul_(std)
            if spec.init == "norm":
                t.add_(1.0)
        if given is None and spec.init == "rope_long":  # Phi-3 style long factors: smooth, 1 .. 32 over the dimensions
            n = t.numel()
            t = (1.0 + 31.0 * (torch.arange(n, device=device, dtype=torch.float32) / max(n - 1, 1)) ** 3
                 ).reshape(t.shape)
        name = qtype.name
        if name == "F32":
            a = t.cpu().numpy()
        elif name == "F16":
            a = t.to(torch.float16).cpu().numpy()
        elif name == "Q8_0":  # quantized where generated: only 34 bytes per 32 values leave the device
            a = q8_0_blocks(t).cpu().numpy()
        else:  # BF16: raw 16-bit patterns
            a = t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        yield a


def _check_weights(weights: Mapping[str, np.ndarray], specs: list[TensorSpec]) -> None:
    """`weights` holds exactly the layout's tensors, each in its numpy shape."""
    names = {s.name for s in specs}
    if set(weights) != names:
        raise SpecterError(f"trained weights do not match the layout: missing {sorted(names - set(weights))[:3]}, "
                           f"unexpected {sorted(set(weights) - names)[:3]}")
    for s in specs:
        if tuple(weights[s.name].shape) != s.numpy_shape:
            raise SpecterError(f"trained tensor {s.name} has shape {tuple(weights[s.name].shape)}, "
                               f"the layout says {s.numpy_shape}")


def write_synthetic(
    path: str | Path,
    shape: ModelShape | str,
    dtype: str = "f16",
    *,
    seed: int = 0,
    device: str = "cpu",
    vocab_from: str | Path | None = None,
    tokenizer: BPETokenizer | None = None,
    progress: bool = False,
    weights: Mapping[str, np.ndarray] | None = None,
    description: str = "specter-gguf synthetic model: random weights (produces gibberish)",
) -> WriteResult:
    """Write a random-weight GGUF of `shape` (a ModelShape or preset name) to `path`.

    Tensor data is generated and written one tensor (slab) at a time, so memory stays bounded by the
    largest slab (~256 MB of float32, a few times that while quantizing), whatever the model's size.
    `dtype` is the matrices' type: f32, f16, bf16, or q8_0 (quantized slab by slab as generated; routers and
    1-D tensors F32, matrices whose rows are not a multiple of 32 F16 — see the module docstring).
    `vocab_from` copies all tokenizer.* keys of that GGUF; otherwise the tiny BPE tokenizer (or `tokenizer`)
    is used. `weights` (every tensor by name, numpy order) are written instead of random ones.
    """
    t0 = time.perf_counter()
    if isinstance(shape, str):
        shape = get_preset(shape)
    if dtype not in DTYPES:
        raise SpecterError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    import gguf

    from specter_gguf.engine import resolve_device  # (not at the top: the engine is more than a writer needs)

    resolve_device(device)  # an unknown device, or CUDA without a GPU: one error line
    check_attn_output_scale(shape.attn_output_scale)
    path = Path(path)
    if path.is_dir():
        raise SpecterError(f"{path} is a folder: give the model's file path, e.g. {path / 'model.gguf'}")
    path.parent.mkdir(parents=True, exist_ok=True)

    if vocab_from is not None:
        tok_kv, n_vocab = vocab_metadata_from_gguf(vocab_from)
    else:
        tok = tokenizer or tiny_tokenizer()
        tok_kv, n_vocab = tok.gguf_metadata(), len(tok.tokens)

    specs = tensor_specs(shape, n_vocab)
    arch_kv = architecture_metadata(shape, n_vocab)
    if weights is not None:
        _check_weights(weights, specs)

    # written as `partial_path` and renamed when complete (replacing a file at `path`, a link included): a failure
    # leaves no partial model behind, and one killed is written over by the next write
    tmp = partial_path(path)
    try:
        _write(gguf.GGUFWriter(tmp, shape.arch), shape, dtype, specs, arch_kv, tok_kv, description, weights, seed,
               device, progress, path.name)
        os.replace(tmp, path)
    except OSError as e:
        raise SpecterError(f"writing {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return WriteResult(path=path, shape=shape, dtype=dtype, n_vocab=n_vocab,
                       n_params=sum(s.n_elements for s in specs), n_bytes=path.stat().st_size,
                       seconds=time.perf_counter() - t0, tensors=[s.name for s in specs])


def _write(w: Any, shape: ModelShape, dtype: str, specs: list[TensorSpec], arch_kv: dict[str, Any],
           tok_kv: dict[str, tuple[Any, Any, Any]], description: str, weights: Mapping[str, np.ndarray] | None,
           seed: int, device: str, progress: bool, label: str) -> None:
    """The file of `write_synthetic` through the GGUF writer `w`, closed at the end."""
    import gguf

    w.add_name(shape.name or shape.arch)
    w.add_description(description)
    w.add_file_type(_FILE_TYPE[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    T = gguf.GGUFValueType
    for k, v in arch_kv.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_key_value(k, v, T.STRING)
    for k, (v, vtype, sub) in tok_kv.items():
        w.add_key_value(k, v, vtype, sub)

    total = 0
    for spec in specs:
        qtype = _storage(spec, dtype)
        nbytes = _nbytes(spec, qtype)
        total += nbytes
        # for BF16/Q8_0 the numpy dtype only says "not uint8": the shape is given in elements
        np_dtype = {"F32": np.float32, "F16": np.float16}.get(qtype.name, np.uint16)
        w.add_tensor_info(spec.name, spec.numpy_shape, np.dtype(np_dtype), nbytes,
                          raw_dtype=None if qtype.name in ("F32", "F16") else qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label)
    try:
        for spec in specs:
            fout.write(b"\0" * ((-fout.tell()) % align))
            given = weights[spec.name] if weights is not None else None
            for a in _slabs(spec, shape, dtype, seed, device, given):
                a.tofile(fout)
                if bar is not None:
                    bar.update(a.nbytes)
        fout.write(b"\0" * ((-fout.tell()) % align))
    finally:
        if bar is not None:
            bar.close()
        w.close()
