"""Reading a GGUF file: validated, memory-mapped, one copy of the weights.

`GGUFFile` wraps `gguf.GGUFReader`, which memory-maps the file: tensor data are views of the mapping, so
weights are read from the page cache when used and never duplicated in process memory. Every way a file can
be unusable becomes a one-line `SpecterError` naming the file and the fix.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType

from specter_gguf.errors import SpecterError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
# GGUF value types: fixed size in bytes (STRING = 8 and ARRAY = 9 have a length)
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4

# Tensor types the engine can run, and how each is held (see `GGUFTensor.data`).
VOCAB_KEY = "tokenizer.ggml.tokens"
# vocabulary arrays llama.cpp reads as raw C arrays of one item type (llama-vocab.cpp)
VOCAB_ARRAYS = {VOCAB_KEY: GGUFValueType.STRING, "tokenizer.ggml.merges": GGUFValueType.STRING,
                "tokenizer.ggml.token_type": GGUFValueType.INT32, "tokenizer.ggml.scores": GGUFValueType.FLOAT32}
_CHECKED: set[tuple[str, int, int]] = set()  # (path, size, mtime) of files GGUFFile has opened and checked

SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                   T.Q6_K, T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)

# A model split into several files (llama.cpp's `llama-gguf-split`, or its converter's --split-max-*): each file
# says its index and the count, the first also the tensors of all of them.
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"

# A MoE layer's routed experts in llama.cpp's layout: one tensor per part, all the layer's experts stacked.
EXPERT_PARTS = ("gate", "up", "down")


def block_expert_tensor_name(part: str) -> str:
    """The routed experts' `part` (one of EXPERT_PARTS) within a block: `ffn_{part}_exps.weight`."""
    return f"ffn_{part}_exps.weight"


def expert_tensor_name(layer: int, part: str) -> str:
    """Layer `layer`'s routed experts' `part`: `blk.{layer}.ffn_{part}_exps.weight`."""
    return f"blk.{layer}.{block_expert_tensor_name(part)}"


def is_routed_expert(name: str) -> bool:
    """Whether the tensor `name` holds routed experts (any part, any layer)."""
    return name.endswith("_exps.weight")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: `shape` is numpy order (rows last-but-one, row length last), `data` the raw
    memory-mapped bytes (uint8 rows for quantized and BF16 types, typed arrays for F32/F16)."""

    name: str
    type: T
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """An open GGUF model: metadata by key, tensors by name. A model that llama.cpp's tools split into several
    files (`<name>-00001-of-00003.gguf`, ...) is opened from its first file, as llama.cpp opens it: the metadata
    are the first file's, the tensors those of every file (`paths`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        reader = _read(self.path)
        self._fields = reader.fields
        self._check_vocabulary()
        self.paths = [self.path]
        readers = [reader]
        n_split = self._count(SPLIT_COUNT, 1)
        if n_split > 1:
            index = self._count(SPLIT_NO, 0)
            if index >= n_split:
                raise SpecterError(f"{self.path}: {SPLIT_NO} is {index}, not below {SPLIT_COUNT} ({n_split}); the "
                                   f"file's metadata is corrupt — download or split the model again")
            if index != 0:
                first = split_paths(self.path, index, n_split)[0]
                raise SpecterError(f"{self.path}: file {index + 1} of a model split into {n_split} files; give the "
                                   f"first one, {first.name}")
            self.paths = split_paths(self.path, 0, n_split)
            readers += [_read_split(p, i, n_split, self.path) for i, p in enumerate(self.paths[1:], 1)]
        self.tensors: dict[str, GGUFTensor] = {}
        for p, r in zip(self.paths, readers):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise SpecterError(f"{p}: tensor '{t.name}' is in an earlier file of the split model too; the "
                                       f"files are not one model's — download or split the model again")
                shape = tuple(int(d) for d in reversed(t.shape))
                self.tensors[t.name] = GGUFTensor(t.name, T(t.tensor_type), shape, t.data)
        expected = self.get(SPLIT_TENSORS, len(self.tensors)) if n_split > 1 else len(self.tensors)
        if expected != len(self.tensors):
            raise SpecterError(f"{self.path}: the {n_split} split files hold {len(self.tensors)} tensors where the "
                               f"first says {expected}; a file is incomplete — download or split the model again")
        _CHECKED.add(_identity(self.path))

    def _count(self, key: str, default: int) -> int:
        """The whole number >= 0 at metadata `key` (`default` when absent)."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecterError(f"{self.path}: {key} is {value!r}, expected a whole number; the file's metadata is "
                               f"corrupt — download or split the model again")
        return value

    @property
    def file_bytes(self) -> int:
        """The size of the model's file, or of all its files when it is split."""
        return sum(p.stat().st_size for p in self.paths)

    # -- metadata ------------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key` (arrays as lists), or `default` when absent."""
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise SpecterError(f"{self.path}: metadata key '{key}' is missing; the file is incomplete "
                               f"or was written by a converter this tool does not know")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    # -- tensors -------------------------------------------------------------------------------------
    @property
    def routed_expert_bytes(self) -> int:
        """The bytes of the routed experts' tensors (what a draft keeps on the device, what offloading moves)."""
        return sum(t.n_bytes for t in self.tensors.values() if is_routed_expert(t.name))

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> GGUFTensor:
        """The tensor `name`, checked for presence, a supported type and (when given) its numpy-order shape."""
        t = self.tensors.get(name)
        if t is None and is_routed_expert(name) and name.replace("_exps.weight", ".0.weight") in self.tensors:
            raise SpecterError(f"{self.path}: the routed experts are stored one tensor each ('"
                               f"{name.replace('_exps.weight', '.0.weight')}', ...), as llama.cpp's converter wrote "
                               f"them until early 2024, where llama.cpp now reads '{name}' (a layer's experts in one "
                               f"tensor) and refuses such files too; convert the model again with a current llama.cpp")
        if t is None:
            raise SpecterError(f"{self.path}: tensor '{name}' is missing; the file is incomplete or not a "
                               f"{self.get('general.architecture')} model as llama.cpp lays it out")
        if t.type not in SUPPORTED_TYPES:
            raise SpecterError(f"{self.path}: tensor '{name}' has type {t.type.name}, which is not supported; "
                               f"supported types: {type_names(SUPPORTED_TYPES)} (re-quantize with "
                               f"`specter-gguf quantize`)")
        if shape is not None and len(shape) == 1 and t.type not in FLOAT_TYPES:
            raise SpecterError(f"{self.path}: tensor '{name}' is a vector (a norm or a bias) stored as {t.type.name}; "
                               f"vectors must be {type_names(FLOAT_TYPES)} as llama.cpp writes them — convert the "
                               f"model again")
        if shape is None or t.shape == tuple(shape):
            return t
        if not same_shape(t.shape, shape):
            raise SpecterError(f"{self.path}: tensor '{name}' has shape {list(t.shape)}, expected "
                               f"{list(shape)} from the file's metadata; the file is inconsistent")
        # a dimension of 1 more or less, as llama.cpp's converter writes some vectors ([1, n] for [n]): the same
        # bytes, viewed in the expected shape (the last axis of quantized and BF16 data counts bytes)
        return GGUFTensor(t.name, t.type, tuple(shape), t.data.reshape(*shape[:-1], t.data.shape[-1]))

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    # -- vocabulary ----------------------------------------------------------------------------------
    def _check_vocabulary(self) -> None:
        """Refuse a vocabulary llama.cpp's loader would abort the process on (a repeated token string trips a
        GGML_ASSERT; arrays of the wrong type or length are read past their end) before it ever sees it."""
        tokens = self.get(VOCAB_KEY)
        if tokens is None:
            return
        if not tokens:
            raise SpecterError(f"{self.path}: the vocabulary is empty ({VOCAB_KEY} has no tokens); the file is "
                               f"corrupt — convert the model again")
        for key, item in VOCAB_ARRAYS.items():
            field = self._fields.get(key)
            if field is not None and [int(t) for t in field.types] not in ([GGUFValueType.ARRAY, item],
                                                                          [GGUFValueType.ARRAY]):  # [] when empty
                raise SpecterError(f"{self.path}: metadata '{key}' is not an array of {item.name}; the vocabulary is "
                                   f"corrupt — convert the model again")
        first: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            # the text llama.cpp keys its token map by: read as a C string (up to a NUL), an empty one renamed
            text = tok.split("\0", 1)[0] or f"[EMPTY_{i}]"
            j = first.setdefault(text, i)
            if j != i:
                seen = f"{tok!r}, up to its NUL" if "\0" in tok else repr(tok)
                raise SpecterError(f"{self.path}: token id {i} ({seen}) repeats the text of token id {j} "
                                   f"({tokens[j]!r}); llama.cpp needs every token distinct — the file is corrupt, "
                                   f"convert the model again")
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            values = self.get(key)
            if values is not None and len(values) != len(tokens):
                raise SpecterError(f"{self.path}: '{key}' has {len(values)} entries for {len(tokens)} tokens; "
                                   f"the vocabulary is corrupt — convert the model again")
        bad = next((i for i, t in enumerate(self.get("tokenizer.ggml.token_type", ())) if not 0 <= t <= 6), None)
        if bad is not None:
            raise SpecterError(f"{self.path}: token id {bad} has token type "
                               f"{self.get('tokenizer.ggml.token_type')[bad]} (llama.cpp's are 0 to 6); the "
                               f"vocabulary is corrupt — convert the model again")


def _read(path: Path) -> GGUFReader:
    """`gguf.GGUFReader` of `path`, after `check_structure`; every way the file can be unusable a `SpecterError`."""
    if not path.exists():
        raise SpecterError(f"{path}: no such file")
    if not path.is_file():
        raise SpecterError(f"{path}: not a file; give the path of a .gguf model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise SpecterError(f"{path}: not a GGUF file (it does not start with 'GGUF'); "
                           f"convert the model with llama.cpp's convert_hf_to_gguf.py first")
    check_structure(path)
    try:
        return GGUFReader(path, "r")
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise SpecterError(f"{path}: uses a tensor type unknown to this version of gguf ({e}); "
                               f"re-quantize it to one of {type_names(SUPPORTED_TYPES)}") from None
        raise _corrupt(path, e) from None
    except Exception as e:  # a parser of untrusted bytes: whatever it trips on, the file is corrupt
        raise _corrupt(path, e) from None


def _corrupt(path: Path, cause: Exception) -> SpecterError:
    return SpecterError(f"{path}: truncated or corrupt GGUF file ({path.stat().st_size} bytes; reading it failed: "
                        f"{cause}); download or convert it again")


def split_paths(path: Path, index: int, n_split: int) -> list[Path]:
    """The files of a model split into `n_split`, from the path of its file `index` (0-based), named as llama.cpp
    names them: `<prefix>-00001-of-0000N.gguf` to `<prefix>-0000N-of-0000N.gguf` (`llama_split_path`)."""
    suffix = f"-{index + 1:05d}-of-{n_split:05d}.gguf"
    if not path.name.endswith(suffix) or path.name == suffix:
        raise SpecterError(f"{path}: file {index + 1} of a model split into {n_split} files, but not named "
                           f"'<name>{suffix}' as llama.cpp names split files, so the others cannot be found; give "
                           f"the files their split names again, or merge them with llama.cpp's `llama-gguf-split "
                           f"--merge`")
    prefix = path.name[:-len(suffix)]
    return [path.with_name(f"{prefix}-{i + 1:05d}-of-{n_split:05d}.gguf") for i in range(n_split)]


_SPLIT_SUFFIX = re.compile(r"-(\d{5})-of-(\d{5})$")


def model_name(path: str | os.PathLike[str]) -> str:
    """The model's name from its file name: the stem, less the split suffix of a split model's file
    (`qwen3-q8_0-00001-of-00002.gguf` -> `qwen3-q8_0`)."""
    return _SPLIT_SUFFIX.sub("", Path(path).stem)


def named_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of the model that `path` names, by name alone (nothing is read): a split model's every file where
    `path` has a split name, else `path`."""
    path = Path(path)
    found = _SPLIT_SUFFIX.search(path.stem)
    if found is None or not 1 <= int(found[1]) <= int(found[2]):
        return [path]
    return split_paths(path, int(found[1]) - 1, int(found[2]))


def _read_split(path: Path, index: int, n_split: int, first: Path) -> GGUFReader:
    """File `index` (0-based) of the split model whose first file is `first`, checked to be that file."""
    if not path.exists():
        raise SpecterError(f"{path}: no such file; {first.name} is the first of {n_split} files of a split model, "
                           f"and all of them must be in its folder")
    reader = _read(path)
    field = reader.fields.get(SPLIT_NO)
    got = None if field is None else field.contents()
    if got != index:
        said = "no split number" if got is None else f"split number {got + 1}"
        raise SpecterError(f"{path}: has {said} where file {index + 1} of {first.name}'s split model belongs; the "
                           f"files are not one model's — download or split the model again")
    return reader


def same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two numpy-order shapes are equal up to leading dimensions of 1 (ggml's trailing ones), as llama.cpp
    compares a tensor's shape with the one it expects."""
    def strip(s: tuple[int, ...]) -> tuple[int, ...]:
        s = tuple(s)
        while len(s) > 1 and s[0] == 1:
            s = s[1:]
        return s
    return strip(a) == strip(b)


def type_names(types: tuple[T, ...]) -> str:
    return ", ".join(t.name for t in types)


def _identity(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def check_file(path: str | os.PathLike[str]) -> None:
    """Check `path` as `GGUFFile` does (structure, metadata strings, vocabulary) unless it was opened unchanged
    already in this process: what hands a file to llama.cpp calls this first, so that no hostile file reaches
    its loader, whose asserts abort the whole process."""
    p = Path(path)
    if not p.is_file() or _identity(p) not in _CHECKED:
        GGUFFile(p)


class _Scan:
    """A bounds-checked cursor over the bytes of a GGUF file's header: every read that would pass the end of
    the file, or a length that the rest of the file cannot hold, ends in a `SpecterError` naming `what`."""

    def __init__(self, path: Path, data: Any, size: int) -> None:
        self.path, self.data, self.size, self.pos = path, data, size, 0

    def fail(self, what: str) -> SpecterError:
        return SpecterError(f"{self.path}: truncated or corrupt GGUF file ({self.size} bytes): {what}; "
                            f"download or convert it again")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} at byte {self.pos} runs past the end of the file")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack("<Q", self.take(8, what))[0])

    def count(self, what: str, min_item: int) -> int:
        n = self.u64(what)
        if n * min_item > self.size - self.pos:
            raise self.fail(f"{what} is {n}, more than the {self.size - self.pos} bytes left can hold")
        return n

    def text(self, what: str) -> str:
        raw = self.take(self.count(f"length of {what}", 1), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecterError(f"{self.path}: {what} is not valid UTF-8 ({e.reason} at byte {e.start}); the file "
                               f"is corrupt or was written by a faulty converter — convert the model again") from None


def check_structure(path: Path) -> None:
    """Walk the header, metadata and tensor table of GGUF `path` with every length, UTF-8 string and tensor
    data range checked, before `gguf.GGUFReader` or llama.cpp parse it: a hostile file then fails with a
    message naming what is wrong instead of an exception deep in a parser, a long loop, or an abort in C++
    (llama.cpp's gguf loader refuses the same layouts, with a message its quiet loading hides)."""
    import mmap

    size = path.stat().st_size
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        _check_structure(_Scan(path, mm, size))  # slices of an mmap are bytes: nothing pins the mapping


def _check_structure(s: _Scan) -> None:
    s.take(4, "magic")
    version = s.u32("version")
    if version not in GGUF_VERSIONS:
        raise SpecterError(f"{s.path}: GGUF version {version} is not supported (versions 2 and 3, little-endian, "
                           f"are); convert the model again with a current llama.cpp")
    n_tensors = s.count("tensor count", 24)
    n_kv = s.count("metadata count", 13)
    alignment = 32
    for i in range(n_kv):
        key = _shown(s.text(f"metadata key {i}"))
        vtype = s.u32(f"type of '{key}'")
        value = _scan_value(s, key, vtype)
        if key == "general.alignment":
            if vtype != _UINT32 or value == 0 or value & (value - 1):
                raise SpecterError(f"{s.path}: general.alignment is {value!r} (type {vtype}), expected a power of "
                                   f"two stored as UINT32; the file is corrupt — convert the model again")
            alignment = int(value)
    infos, names = [], set()
    for i in range(n_tensors):
        name = _shown(s.text(f"name of tensor {i}"))
        if name in names:
            raise SpecterError(f"{s.path}: tensor '{name}' appears twice in the tensor table; the file is corrupt "
                               f"— convert the model again")
        names.add(name)
        n_dims = s.u32(f"dimension count of tensor '{name}'")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise SpecterError(f"{s.path}: tensor '{name}' has {n_dims} dimensions (1 to {GGML_MAX_DIMS} are "
                               f"possible); the file is corrupt — convert the model again")
        dims = [s.u64(f"shape of tensor '{name}'") for _ in range(n_dims)]
        infos.append((name, dims, s.u32(f"type of tensor '{name}'"), s.u64(f"data offset of tensor '{name}'")))
    data_start = -(-s.pos // alignment) * alignment
    spans = []
    for name, dims, raw_type, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[T(raw_type)]
        except (ValueError, KeyError):
            raise SpecterError(f"{s.path}: tensor '{name}' has type {raw_type}, unknown to this version of gguf; "
                               f"re-quantize it to one of {type_names(SUPPORTED_TYPES)}") from None
        if dims[0] % block:
            raise SpecterError(f"{s.path}: tensor '{name}' has rows of {dims[0]} values, not a multiple of "
                               f"{T(raw_type).name}'s block of {block}; the file is corrupt — convert it again")
        n_bytes = math.prod(dims) // block * type_size
        if offset % alignment:
            raise SpecterError(f"{s.path}: tensor '{name}' data at offset {offset} is not aligned to "
                               f"general.alignment ({alignment}); the file is corrupt — convert the model again")
        start = data_start + offset
        if start + n_bytes > s.size:
            raise SpecterError(f"{s.path}: tensor '{name}' data (bytes {start} to {start + n_bytes}) runs past the "
                               f"end of the file ({s.size} bytes); the file is truncated — download or convert "
                               f"it again")
        spans.append((start, start + n_bytes, name))
    for (_, end, a), (start, _, b) in zip(sorted(spans), sorted(spans)[1:]):
        if start < end:
            raise SpecterError(f"{s.path}: the data of tensors '{a}' and '{b}' overlap (bytes {start} to {end}); "
                               f"the file is corrupt — convert the model again")
    expected = 0  # llama.cpp's gguf loader also wants the data in table order, each tensor padded to the alignment
    for start, end, name in spans:
        if start - data_start != expected:
            raise SpecterError(f"{s.path}: tensor '{name}' data is at offset {start - data_start}, where llama.cpp "
                               f"expects {expected} (tensor data in table order, each padded to general.alignment); "
                               f"the file is corrupt — convert the model again")
        expected += -(-(end - start) // alignment) * alignment


def _shown(text: str) -> str:
    """`text` as a one-line message can show it (control characters escaped)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _scan_value(s: _Scan, key: str, vtype: int, in_array: bool = False) -> Any:
    """Skip over one metadata value, checking it; return it when it is a scalar number (else None)."""
    size = _VALUE_SIZES.get(vtype)
    if size is not None:
        raw = s.take(size, f"value of '{key}'")
        return int.from_bytes(raw, "little") if vtype in (0, 2, 4, 10) else None
    if vtype == _STRING:
        s.text(f"metadata '{key}'")
        return None
    if vtype == _ARRAY and not in_array:
        item = s.u32(f"item type of '{key}'")
        if item == _STRING:
            n = s.count(f"item count of '{key}'", 8)
            what = "token id" if key == "tokenizer.ggml.tokens" else "item"
            for j in range(n):
                s.text(f"metadata '{key}' {what} {j}")
            return None
        item_size = _VALUE_SIZES.get(item)
        if item_size is None:
            raise SpecterError(f"{s.path}: metadata '{key}' is an array of value type {item}, which GGUF does not "
                               f"have (or an array of arrays); the file is corrupt — convert the model again")
        s.take(s.count(f"item count of '{key}'", item_size) * item_size, f"items of '{key}'")
        return None
    raise SpecterError(f"{s.path}: metadata '{key}' has value type {vtype}, which GGUF does not have; the file is "
                       f"corrupt — convert the model again")
