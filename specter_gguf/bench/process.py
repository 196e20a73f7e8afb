"""Subprocesses of the benchmark (llama-server, our worker, tool builds, model makers): each runs in a session of
its own, so that killing its process group ends everything it started."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from specter_gguf.bench import REPO_ROOT
from specter_gguf.errors import SpecterError


def tail(path: str | Path, n: int = 15) -> str:
    """The last `n` lines of a log ("" when it cannot be read)."""
    with contextlib.suppress(OSError):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    return ""


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to `proc`'s process group (started with ``start_new_session=True``), if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def check_call(cmd: Sequence[str], timeout: float) -> None:
    """Run `cmd` in the checkout; a failure or a timeout raises a SpecterError with the end of its output."""
    with tempfile.TemporaryFile(mode="w+") as out:
        p = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
            p.wait()
            raise SpecterError(f"timed out after {timeout:.0f} s: {shlex.join(cmd)}") from None
        if rc != 0:
            out.seek(0)
            last = "\n".join(out.read().splitlines()[-20:])
            raise SpecterError(f"failed (code {rc}): {shlex.join(cmd)}\n{last}")
