"""Model files that tests build on first use and share: the one cache behind `conftest.TinyModels`,
`converted_models.ConvertedModels` and the Q8_0 tests' files."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


class BuiltFiles(Mapping):
    """``[(arch, kind)] -> Path``: each file is built by `build` the first time it is asked for (a build may ask for
    another key, e.g. a quantized file for its F16 source) and reused afterwards. Iteration covers `archs` × `kinds`;
    `accepts` says which keys exist (by default those)."""

    archs: Sequence[str] = ()
    kinds: Sequence[str] = ()

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[tuple[str, str], Path] = {}
        self._lock = threading.RLock()

    def accepts(self, arch: str, kind: str) -> bool:
        return arch in self.archs and kind in self.kinds

    def build(self, arch: str, kind: str) -> Path:
        raise NotImplementedError

    def __getitem__(self, key: tuple[str, str]) -> Path:
        arch, kind = key
        if not self.accepts(arch, kind):
            raise KeyError(key)
        with self._lock:
            if key not in self._paths:
                self._paths[key] = self.build(arch, kind)
            return self._paths[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return ((a, k) for a in self.archs for k in self.kinds)

    def __len__(self) -> int:
        return len(self.archs) * len(self.kinds)
