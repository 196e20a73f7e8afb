"""Drafts made on demand: `--draft q4_k_m` (or `Model.load(draft="q4_k_m")`) quantizes the target with llama.cpp's
quantizer (`quantize.quantize_with_progress`, a progress bar over tensors) the first time and reuses the file after.

The file goes into `.specter-drafts/` beside the target, named `<target's name>-<type>.gguf`
(`gguf_file.model_name`: a split model's without the split suffix); when the target's folder is not writable, into
the user cache (`$SPECTER_CACHE`, else `$XDG_CACHE_HOME/specter-gguf`, else `~/.cache/specter-gguf`) under
`drafts/<a hash of the target's path>/`. A JSON file beside each draft records the target's size and modification
time (of a split model, of all its files) and the draft's size: a draft of a target that changed since, or a draft
file that changed (e.g. cut short), is made again. A draft is written under a temporary name and renamed when
complete, so an interrupted quantization leaves no draft behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import model_name, named_files
from specter_gguf.quantize import FTYPES, NEEDS_IMATRIX, needs_imatrix_message, quantize_with_progress

DRAFT_TYPES = ("q2_k", "iq3_s", "q4_k_m", "q8_0")
"""The draft types the help names (any llama.cpp type of `quantize.FTYPES` is accepted)."""

FOLDER = ".specter-drafts"

log = logging.getLogger(__name__)


def user_cache_dir() -> Path:
    if os.environ.get("SPECTER_CACHE"):
        return Path(os.environ["SPECTER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specter-gguf"


def _writable(folder: Path) -> bool:
    """`folder` exists and can take a new file, or can be created in a writable parent."""
    if folder.exists():
        return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
    return os.access(folder.parent, os.W_OK | os.X_OK)


def draft_path(target: Path, qtype: str) -> Path:
    """Where the `qtype` draft of `target` is kept (see the module docstring)."""
    target = Path(target).absolute()
    name = f"{model_name(target)}-{qtype}.gguf"
    beside = target.parent / FOLDER
    if _writable(beside):
        return beside / name
    key = hashlib.sha256(str(target).encode()).hexdigest()[:16]
    return user_cache_dir() / "drafts" / key / name


def _stamp(target: Path) -> dict[str, object]:
    """The target's path, size and modification time; of a split model, the total size and the latest time of its
    files."""
    stats = [p.stat() for p in named_files(target) if p.exists()]
    return {"target": str(target.absolute()), "size": sum(st.st_size for st in stats),
            "mtime_ns": max(st.st_mtime_ns for st in stats)}


def draft_file_or_type(draft: str | os.PathLike[str]) -> Path | str:
    """`draft` as `--draft` takes it: a type name (lower case) or an existing file (a file named like a type
    wins)."""
    path = Path(draft)
    key = str(draft).strip().lower()
    if not path.is_file() and key in FTYPES:
        return key
    if not path.is_file() and key in NEEDS_IMATRIX:
        raise SpecterError(f"draft {draft}: {needs_imatrix_message(key)}")
    if path.is_dir():
        raise SpecterError(f"draft {draft}: a folder, not a file; give the path of a draft .gguf file or a llama.cpp "
                           f"type such as {', '.join(DRAFT_TYPES[:-1])} or {DRAFT_TYPES[-1]}")
    if not path.is_file():
        raise SpecterError(f"draft {draft}: no such file, and not a draft type; give a draft GGUF or a llama.cpp "
                           f"type such as {', '.join(DRAFT_TYPES[:-1])} or {DRAFT_TYPES[-1]} (any type of "
                           f"`specter-gguf quantize --type`; made from the model with llama.cpp's quantizer)")
    return path


def resolve_draft(target: str | os.PathLike[str], draft: str | os.PathLike[str] | None,
                  progress: bool = True) -> Path | None:
    """The draft file for `draft`: None, a path as it is, or a type name (q4_k_m, ...) whose draft of `target` is
    made now unless a current one is kept (`draft_path`)."""
    if draft is None:
        return None
    qtype = draft_file_or_type(draft)
    if isinstance(qtype, Path):
        return qtype
    target = Path(target)
    if not target.is_file():
        raise SpecterError(f"cannot make a {qtype} draft: the model {target} is not a file")
    out = draft_path(target, qtype)
    stamp_file = out.with_suffix(".json")
    if out.is_file() and stamp_file.is_file():
        try:
            record = json.loads(stamp_file.read_text(encoding="utf-8"))
            # records written before the draft's size was kept hold only the target's
            if record == {**_stamp(target), **({"draft_size": out.stat().st_size} if "draft_size" in record else {})}:
                log.info("the %s draft of %s: %s, made before", qtype, target, out)
                return out
        except (OSError, ValueError):
            pass  # an unreadable record: the draft is made again
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecterError(f"cannot make a {qtype} draft in {out.parent}: {e.strerror}; set SPECTER_CACHE to a "
                           f"writable folder, or give a draft file") from None
    log.info("making the %s draft of %s in %s", qtype, target, out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        quantize_with_progress(target, tmp, qtype, show=progress, desc=f"making the {qtype} draft",
                               allow_requantize=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    stamp_file.write_text(json.dumps({**_stamp(target), "draft_size": out.stat().st_size}) + "\n", encoding="utf-8")
    return out
