"""Reading a GGUF file: validated, memory-mapped, one copy of the weights.

`GGUFFile` wraps `gguf.GGUFReader`, which memory-maps the file: tensor data are views of the mapping, so
weights are read from the page cache when used and never duplicated in process memory. Every way a file can
be unusable becomes a one-line `SpecterError` naming the file and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from specter_gguf.errors import SpecterError

GGUF_MAGIC = b"GGUF"

# Tensor types the engine can run, and how each is held (see `GGUFTensor.data`).
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                   T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


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
    """An open GGUF file: metadata by key, tensors by name."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise SpecterError(f"{self.path}: no such file")
        if not self.path.is_file():
            raise SpecterError(f"{self.path}: not a file; give the path of a .gguf model file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise SpecterError(f"{self.path}: not a GGUF file (it does not start with 'GGUF'); "
                               f"convert the model with llama.cpp's convert_hf_to_gguf.py first")
        try:
            reader = GGUFReader(self.path, "r")
        except ValueError as e:
            if "GGMLQuantizationType" in str(e):
                raise SpecterError(f"{self.path}: uses a tensor type unknown to this version of gguf ({e}); "
                                   f"re-quantize it to one of {type_names(SUPPORTED_TYPES)}") from None
            raise self._corrupt(e) from None
        except (IndexError, OSError, UnicodeDecodeError, KeyError) as e:
            raise self._corrupt(e) from None
        self._fields = reader.fields
        self.tensors: dict[str, GGUFTensor] = {
            t.name: GGUFTensor(t.name, T(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), t.data)
            for t in reader.tensors
        }

    def _corrupt(self, cause: Exception) -> SpecterError:
        return SpecterError(f"{self.path}: truncated or corrupt GGUF file ({self.path.stat().st_size} bytes; "
                            f"reading it failed: {cause}); download or convert it again")

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

    def metadata_keys(self) -> list[str]:
        return list(self._fields)

    # -- tensors -------------------------------------------------------------------------------------
    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> GGUFTensor:
        """The tensor `name`, checked for presence, a supported type and (when given) its numpy-order shape."""
        t = self.tensors.get(name)
        if t is None:
            raise SpecterError(f"{self.path}: tensor '{name}' is missing; the file is incomplete or not a "
                               f"{self.get('general.architecture')} model as llama.cpp lays it out")
        if t.type not in SUPPORTED_TYPES:
            raise SpecterError(f"{self.path}: tensor '{name}' has type {t.type.name}, which is not supported; "
                               f"supported types: {type_names(SUPPORTED_TYPES)} (re-quantize with "
                               f"`specter-gguf quantize`)")
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
