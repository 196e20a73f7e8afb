"""The trained tiny model's text: the Python standard library's sources on this machine (its docs included: the
reference's topics in `pydoc_data/topics.py`, every module's docstrings), found with `sysconfig`, read at run time
(nothing is downloaded).

Every `*.py` file under `sysconfig.get_paths()["stdlib"]` except `site-packages/` and `dist-packages/`, sorted by
relative path, read as UTF-8 (a file that is not valid UTF-8 is skipped). A file is held out when the first byte
of the SHA-256 of its relative path is below `HELD_OUT_BYTE` (about 1 in 32 files): the split depends on the
names only, so it is the same on every machine with the same Python version.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from specter_gguf.errors import SpecterError

HELD_OUT_BYTE = 8  # of 256
_SKIP = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: list[tuple[str, str]]     # (relative path, text)
    held_out: list[tuple[str, str]]

    def digest(self) -> str:
        """SHA-256 over both splits' paths and texts (identifies the corpus in the recipe)."""
        h = hashlib.sha256()
        for split in (self.train, self.held_out):
            for rel, text in split:
                h.update(rel.encode() + b"\0" + text.encode() + b"\0")
        return h.hexdigest()

    def describe(self) -> dict[str, object]:
        return {"root": str(self.root), "train_files": len(self.train), "held_out_files": len(self.held_out),
                "train_bytes": sum(len(t.encode()) for _, t in self.train),
                "held_out_bytes": sum(len(t.encode()) for _, t in self.held_out), "sha256": self.digest()}


def held_out(rel: str) -> bool:
    return hashlib.sha256(rel.encode()).digest()[0] < HELD_OUT_BYTE


def stdlib_corpus(root: str | Path | None = None, max_bytes: int | None = None) -> Corpus:
    """The corpus under `root` (default: this Python's standard library). `max_bytes` keeps the files of every
    k-th path (k as small as fits) for short runs: the split stays the same rule."""
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise SpecterError(f"the standard library folder {root} does not exist; give the corpus folder with --corpus")
    paths = sorted(p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts))
    texts: list[tuple[str, str]] = []
    for p in paths:
        try:
            texts.append((p.relative_to(root).as_posix(), p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if not texts:
        raise SpecterError(f"no readable .py files under {root}; give a folder of Python sources with --corpus")
    if max_bytes is not None:
        total = sum(len(t.encode()) for _, t in texts)
        stride = max(1, -(-total // max_bytes))
        texts = texts[::stride]
    train = [(r, t) for r, t in texts if not held_out(r)]
    held = [(r, t) for r, t in texts if held_out(r)]
    if not train or not held:
        raise SpecterError(f"the corpus under {root} is too small to split ({len(train)} train, {len(held)} "
                           f"held-out files); use a larger one")
    return Corpus(root, train, held)
