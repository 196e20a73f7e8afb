"""Edited copies of GGUF files, written with gguf's own writer (the one llama.cpp's converter uses): metadata and
tensors changed or dropped, or the file split into several as llama.cpp splits models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

DROP = object()


def rewrite(src: Path, dst: Path, *, arch: str | None = None, kv: dict[str, Any] | None = None,
            tensors: dict[str, Any] | None = None, split_max_tensors: int = 0, metadata_first: bool = False) -> Path:
    """A copy of GGUF `src` at `dst` with edits. `arch`: a new general.architecture. `kv`: key -> DROP, or
    (value, GGUFValueType) to set. `tensors`: name -> DROP, or (array, raw_dtype or None) to store instead, or to
    add after the others where `src` has no such tensor (raw_dtype given: `array` holds the raw bytes of that type,
    rows last). `split_max_tensors` > 0: split into
    files of at most that many tensors, as llama.cpp's converter and `llama-gguf-split` do (gguf's writer names them
    `<dst stem>-00001-of-0000N.gguf`, ...), with `metadata_first` the first file holding no tensor (the converter's
    --no-tensor-first-split); returns the first."""
    kv, tensors = kv or {}, tensors or {}
    reader = GGUFReader(src)
    old_arch = str(reader.fields["general.architecture"].contents())
    w = _Writer(dst, arch or old_arch, split_max_tensors=split_max_tensors, small_first_shard=metadata_first)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in kv:
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    for name, edit in kv.items():
        if edit is not DROP:
            value, vtype, *sub = edit
            w.add_key_value(name, value, vtype, *sub)
    for t in reader.tensors:
        edit = tensors.get(t.name)
        if edit is DROP:
            continue
        if edit is not None:
            data, raw_dtype = edit
            w.add_tensor(t.name, data, raw_dtype=raw_dtype)
            continue
        quantized = t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type if quantized else None)
    present = {t.name for t in reader.tensors}
    for name, edit in tensors.items():
        if edit is not DROP and name not in present:
            data, raw_dtype = edit
            w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(dst)[0]


class _Writer(GGUFWriter):
    """GGUFWriter that also writes empty arrays (of the item type given), as a hostile file may hold."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None):
        if vtype == GGUFValueType.ARRAY and len(val) == 0:
            return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)
