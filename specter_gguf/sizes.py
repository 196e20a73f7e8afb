"""Sizes in bytes as the options take them ("16GiB", "1.5GB") and as reports write them ("1.50 GiB")."""

from __future__ import annotations

import math
import re

from specter_gguf.errors import SpecterError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_SIZE_RE = re.compile(r"^\s*([+-]?)\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|nan|inf(?:inity)?)\s*([A-Za-z]*)\s*$",
                      re.IGNORECASE)
MAX_SIZE = 1 << 60        # bytes (1 EiB): no device or host holds more; larger figures are typos
_UNITS = {"": 1, "b": 1, "k": KiB, "kb": 1000, "kib": KiB, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": GiB, "gb": 10**9, "gib": GiB, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def names_unit(text: str) -> bool:
    """Whether a size as `parse_size` reads it names its unit ("16GiB"), not bytes by default ("16", "1.5")."""
    m = _SIZE_RE.match(str(text))
    return bool(m and m.group(3))


def parse_size(text: str | int) -> int:
    """Bytes of "16GiB", "16G" (= GiB), "1.5GB" (= 1.5e9), "12000MiB", "1024" (bytes): how every size option
    (the CLI's, the benchmark's) is read. Anything else (empty, negative, NaN, infinite, above `MAX_SIZE`, an unknown
    unit) raises a SpecterError that names the problem."""
    if isinstance(text, int):
        return text
    example = "write e.g. 16GiB, 12000MiB, 1.5GB"
    m = _SIZE_RE.match(str(text))
    shown = repr(text) if len(str(text)) <= 40 else repr(f"{str(text)[:16]}...{str(text)[-8:]}")
    if not str(text).strip():
        raise SpecterError(f"cannot read the size {shown}: it is empty; {example}")
    if not m:
        raise SpecterError(f"cannot read the size {shown}: {example}")
    sign, number, unit = m.group(1), m.group(2), m.group(3)
    if unit.lower() not in _UNITS:
        raise SpecterError(f"cannot read the size {shown}: unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB "
                           "(powers of 1024; K, M, G, T mean the same), or KB, MB, GB, TB (powers of 1000)")
    value = float(number)
    if number.lower().startswith(("nan", "inf")):  # digits past float's range: too large, below
        raise SpecterError(f"cannot read the size {shown}: it is not a finite number; {example}")
    if sign == "-" and value != 0:
        raise SpecterError(f"cannot read the size {shown}: a size cannot be negative; {example}")
    n = value * _UNITS[unit.lower()]
    if not math.isfinite(n) or n > MAX_SIZE:
        raise SpecterError(f"cannot read the size {shown}: it is too large (more than {MAX_SIZE >> 60} EiB, "
                           f"more memory than any machine has); {example}")
    return int(n)


_SIZE_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1))


def format_size(n: float | None, spec: str = ".2f", *, smallest: str = "B", none: str = "-") -> str:
    """`n` bytes in the largest binary unit it reaches, down to `smallest`, the number written with `spec`:
    "1.50 GiB", "512 B"; `spec=".3g"` gives three significant digits (the benchmark's per-token sizes) and
    `smallest="MiB"` writes everything under 1 GiB in MiB. Bytes print whole for a fixed-point `spec`; `none`
    stands for None."""
    if n is None:
        return none
    for unit, scale in _SIZE_UNITS:
        if abs(n) >= scale or unit == smallest:
            if scale == 1 and spec.endswith("f"):
                return f"{int(n)} B"
            return f"{n / scale:{spec}} {unit}"
    raise ValueError(f"unknown unit {smallest!r}")
