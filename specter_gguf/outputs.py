"""Checks, before any work, that an output path can be written: each failure is one error line naming the path
and the fix. `label` starts every message (the CLI: the option and the path; the library: what the path is for)."""

from __future__ import annotations

import os
from pathlib import Path

from specter_gguf.errors import SpecterError


def existing_ancestor(path: Path) -> Path:
    """`path` (absolute) or the nearest of its parents that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_file(path: Path, label: str, create_folder: bool = False) -> None:
    """Fails unless a file can be written at `path`: its folder exists (or, with `create_folder`, can be
    created) and is writable."""
    if path.is_dir():
        raise SpecterError(f"{label} is a folder: give a file path, e.g. {path / 'out'}")
    folder = path.absolute().parent
    above = existing_ancestor(folder)
    if not above.is_dir():
        raise SpecterError(f"{label}: {above} is a file, not a folder; choose another path")
    if above != folder and not create_folder:
        raise SpecterError(f"{label}: the folder {folder} does not exist; create it (mkdir -p {folder}) "
                           "or choose another path")
    if not os.access(above, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SpecterError(f"{label}: no permission to write there; choose another path")


def check_output_folder(path: Path, label: str) -> None:
    """Fails unless `path` is a writable folder or one that can be created."""
    above = existing_ancestor(path)
    if not above.is_dir():
        raise SpecterError(f"{label}: {above} is a file, not a folder; choose another path")
    if not os.access(above, os.W_OK | os.X_OK):
        what = "the folder" if above == path.absolute() else f"{path} cannot be created: the folder"
        raise SpecterError(f"{label}: {what} {above} is not writable; choose another path")
