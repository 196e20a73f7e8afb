"""Progress of llama.cpp's quantizer as a tqdm bar.

llama.cpp logs one line per tensor while it quantizes (``[  12/  37] blk.0.ffn_down_exps.weight - ...``).
:func:`llama_quantize_progress` routes llama.cpp's log through a callback for the duration: the per-tensor
lines advance a bar, the closing size lines are kept (``Progress.summary``), and so are errors (``Progress.errors``, for the
caller's message); warnings go to ``logging`` (shown), everything else to ``logging`` at DEBUG level
(shown with ``-vv``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Iterator

log = logging.getLogger("specter_gguf.llama_cpp")

_TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
_SIZE_LINE = re.compile(r"(model|quant) size\s*=\s*(.*)$")
_callbacks: list = []  # ctypes callbacks must outlive every call into llama.cpp that may log


@dataclass
class Progress:
    summary: list[str] = field(default_factory=list)  # "model size = ...", "quant size = ..."
    errors: list[str] = field(default_factory=list)
    tensors_done: int = 0
    tensors_total: int = 0


@contextlib.contextmanager
def llama_quantize_progress(show: bool = True, desc: str = "quantizing") -> Iterator[Progress]:
    """While active, llama.cpp's log feeds a tensor progress bar (on stderr when `show`)."""
    import llama_cpp as lc
    from tqdm import tqdm

    state = Progress()
    bar: list[tqdm] = []
    buf = [""]
    level_of_line = [1]

    def line(text: str, level: int) -> None:
        m = _TENSOR_LINE.match(text)
        if m:
            i, n, name = int(m.group(1)), int(m.group(2)), m.group(3)
            state.tensors_done, state.tensors_total = i, n
            if show:
                if not bar:
                    bar.append(tqdm(total=n, desc=desc, unit="tensor", file=sys.stderr, leave=True))
                bar[0].set_postfix_str(name, refresh=False)
                bar[0].update(i - bar[0].n)
            log.debug("%s", text)
            return
        s = _SIZE_LINE.search(text)
        if s:
            state.summary.append(f"{s.group(1)} size {s.group(2).strip()}")
        if level == 4:  # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation
            state.errors.append(text)  # the caller reports them (see cli quantize)
            log.debug("%s", text)
        elif level == 3:
            log.warning("llama.cpp: %s", text)
        else:
            log.debug("%s", text)

    def forward(level, text, user_data):  # noqa: ARG001
        try:
            if level != 5 and level != level_of_line[0]:  # 5 = continuation of the previous message
                if buf[0].strip():  # a message of another level (an error) ends the line in progress
                    line(buf[0].rstrip(), level_of_line[0])
                buf[0] = ""
                level_of_line[0] = level
            buf[0] += text.decode("utf-8", errors="replace")
            while "\n" in buf[0]:
                one, buf[0] = buf[0].split("\n", 1)
                if one.strip():
                    line(one.rstrip(), level_of_line[0])
        except Exception:  # never raise into C
            pass

    cb = lc.llama_log_callback(forward)
    _callbacks.append(cb)
    prev_cb, prev_ud = lc.llama_log_callback(), ctypes.c_void_p()
    try:
        lc.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
    except Exception:  # pragma: no cover - older llama-cpp-python without llama_log_get
        prev_cb = None
    lc.llama_log_set(cb, ctypes.c_void_p(0))
    try:
        yield state
    finally:
        if buf[0].strip():
            line(buf[0].rstrip(), level_of_line[0])
        if prev_cb is not None:
            lc.llama_log_set(prev_cb, prev_ud)
        if bar:
            bar[0].close()
