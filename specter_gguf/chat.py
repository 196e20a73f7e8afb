"""Chat templates and chat sessions.

A GGUF file's chat template (metadata ``tokenizer.chat_template``, a Hugging Face Jinja template) is
rendered in Jinja2's ``ImmutableSandboxedEnvironment`` with what HF's ``apply_chat_template`` provides:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``, ``raise_exception``,
``strftime_now`` and a ``tojson`` filter that keeps non-ASCII text as it is. A file without a template gets
the built-in ChatML template (``<|im_start|>role\\n...<|im_end|>``); ``ChatTemplate.source`` says which
one is in use.

A template comes from an untrusted file, and the sandbox stops attribute escapes but not unbounded work
(nested ``range`` loops, ``'%020000000d' % 1``, recursive macros). So templates are compiled and rendered in
a child process (``_Worker``): one plain Python interpreter with only jinja2 imported, started once and
reused, with an address-space limit (``WORKER_MEMORY_BYTES``). Each compile or render must answer within
``RENDER_TIMEOUT_S`` and write at most ``MAX_OUTPUT_CHARS`` (plus twice the size of its input); past that,
or on Ctrl-C, the child is killed and a fresh one started. Every failure is one ``TemplateError``. Why a
process and not caps inside the sandbox: a single C-level operation (string formatting, ``*``, filters such
as ``center`` or ``replace``) cannot be interrupted or reliably sized in advance, while a process can always
be killed. Cost, measured on the shipped model's template (2 messages, a loaded 2-core machine): ~0.1 ms a
render through the worker against ~0.01 ms for jinja2 in-process (two pipe round trips and a pickle; less
than one decoding step), ~2 ms to compile a template, and ~0.1 s once to start the worker.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .errors import SpecterError, TemplateError

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Generation, Model
    from .sampling import SamplingParams

__all__ = ["CHATML_TEMPLATE", "MAX_OUTPUT_CHARS", "RENDER_TIMEOUT_S", "WORKER_MEMORY_BYTES", "ChatSession",
           "ChatTemplate", "normalize_messages"]

log = logging.getLogger(__name__)

# ChatML, the fallback for files without a template and the template `synthetic` writes into its files; the
# newlines are Jinja escapes (as in Qwen's own templates), so the text written into a GGUF file stays one line.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_STOP = ("<|im_end|>", "<|im_start|>")

ROLES = ("system", "user", "assistant", "tool", "developer", "function")

RENDER_TIMEOUT_S = 2.0  # wall time one compile or render may take (real ones take well under 10 ms)
MAX_OUTPUT_CHARS = 1_000_000  # characters a render may write, plus twice the size of its input
WORKER_MEMORY_BYTES = 512 << 20  # address space of the rendering process (it idles at ~25 MB)
WORKER_START_TIMEOUT_S = 30.0  # for the child interpreter to start (~0.1 s)
_MESSAGE_CHARS = 300  # longest error text quoted from a template (its raise_exception text is untrusted)
_REMOVE_HINT = ("fix it in a copy of the file: python -m gguf.scripts.gguf_new_metadata IN.gguf OUT.gguf "
                "--chat-template-file FIXED.jinja (or --remove-metadata tokenizer.chat_template to use ChatML)")


class _Refused(Exception):
    """Raised by a template's ``raise_exception(...)``: it rejects the messages (not a broken template)."""


def _raise_exception(message: str) -> None:
    raise _Refused(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's variant: keeps non-ASCII characters and does not HTML-escape (jinja's built-in one does).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and make each ``content`` a string (text parts of a list are joined;
    ``None`` becomes ""; as OpenAI's API, only an assistant message may leave it out). Other keys (``name``,
    ``tool_calls``...) are kept for templates that use them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise SpecterError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise SpecterError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise SpecterError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if "content" not in m and role != "assistant":
            raise SpecterError(f"messages[{i}] ({role}) has no 'content': give its text")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif isinstance(p, str):
                    parts.append(p)
                else:
                    kind = p.get("type") if isinstance(p, Mapping) else type(p).__name__
                    raise SpecterError(f"messages[{i}].content has a part of type {kind!r}; only text is supported")
            content = "".join(parts)
        elif not isinstance(content, str):
            raise SpecterError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "role": role, "content": content})
    if not out:
        raise SpecterError("messages is empty: give at least one message")
    return out


@dataclass
class ChatTemplate:
    """A compiled chat template. ``source`` is ``"gguf"`` (the file's ``tokenizer.chat_template``) or
    ``"builtin-chatml"`` (the fallback). ``stop`` lists texts that end an assistant turn when the model
    writes them as plain text rather than as an end-of-generation token."""

    text: str
    source: str
    bos_token: str = ""
    eos_token: str = ""
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # compiled in the worker too (a hostile file can make compiling slow or deep); it keeps the result
        _WORKER.call(self, "compile", {})

    @classmethod
    def chatml(cls, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        return cls(CHATML_TEMPLATE, "builtin-chatml", bos_token, eos_token, CHATML_STOP)

    @classmethod
    def for_model(cls, model: Model) -> ChatTemplate:
        """The template of `model`'s GGUF file, or the ChatML fallback when it has none."""
        from .gguf_file import GGUFFile

        tok = model.tokenizer
        bos = tok.token_bytes(tok.bos_id).decode("utf-8", "replace") if tok.bos_id is not None else ""
        eos = tok.token_bytes(tok.eos_id).decode("utf-8", "replace") if tok.eos_id is not None else ""
        text = GGUFFile(model.path).get("tokenizer.chat_template")
        if isinstance(text, str) and text.strip():
            log.info("chat template: the one in %s", model.path.name)
            return cls(text, "gguf", bos, eos)
        log.info("chat template: %s has none; using the built-in ChatML template", model.path.name)
        return cls.chatml(bos, eos)

    def render(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for `messages` (extra keyword arguments, e.g. ``tools``, reach the template),
        rendered in the worker process; any failure, time-out or oversized output is a `TemplateError`."""
        msgs = normalize_messages(messages)
        context = dict(kwargs, messages=msgs, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        return _WORKER.call(self, "render", context)

    @property
    def description(self) -> str:
        """How error messages name this template."""
        return "the built-in ChatML template" if self.source == "builtin-chatml" else "the model's chat template"

    def tokens(self, model: Model, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt: special-token text becomes its token; a BOS is put in front
        when the file asks for one and the template did not already write it."""
        text = self.render(messages, add_generation_prompt, **kwargs)
        tok = model.tokenizer
        add_bos = tok.add_bos and not (self.bos_token and text.startswith(self.bos_token))
        return tok.encode(text, add_bos=add_bos, special=True)


# -- the rendering process ------------------------------------------------------------------------------------
# Protocol on the child's stdin/stdout: a request is _REQUEST (payload length, output cap, time limit) and a
# pickle of (op, template text, context); the parent is trusted, the child is not, so a reply is plain bytes:
# _REPLY (status, length) and UTF-8 text (the rendered prompt or an error message). The child first sends
# _READY once jinja2 is imported.

_REQUEST = struct.Struct(">IQd")
_REPLY = struct.Struct(">cI")
_READY, _OK, _FAILED, _REFUSED, _SYNTAX, _TOO_LONG, _NO_MEMORY = b"R", b"O", b"F", b"X", b"S", b"L", b"M"
_WORKER_CODE = "import sys; sys.path.insert(0, sys.argv[2]); from specter_gguf.chat import _worker_main; _worker_main()"


def _one_line(text: str, limit: int = _MESSAGE_CHARS) -> str:
    """`text` fit for one line of a terminal or a JSON error: whitespace collapsed, control characters
    escaped, at most `limit` characters (a template's error text is the file author's to choose)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return text if len(text) <= limit else text[:limit] + "..."


class _Stopped(Exception):
    """The child did not answer in time (``timed_out``) or stopped answering (died, broken pipe)."""

    def __init__(self, timed_out: bool, how: str) -> None:
        super().__init__(how)
        self.timed_out = timed_out


class _Worker:
    """The parent's end of the rendering process: one request at a time (a lock), each under a deadline.

    Between calls the pipes hold no unread bytes: a call that does not end with a whole reply (time-out,
    Ctrl-C, a dead child, a reply too long) kills the child and starts the next one, which later calls use.
    A process forked from this one (pid changed) starts its own child instead of sharing these pipes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._pid = 0

    def call(self, template: ChatTemplate, op: str, context: dict[str, Any],
             timeout: float | None = None) -> str:
        """Compile (``op="compile"``) or render `template` in the child; every failure is a TemplateError."""
        timeout = RENDER_TIMEOUT_S if timeout is None else timeout
        name = template.description
        hint = f"; {_REMOVE_HINT}" if template.source == "gguf" else ""
        try:
            payload = pickle.dumps((op, template.text, context), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - whatever pickle refuses (a lambda, a lock...)
            raise TemplateError(f"{name} cannot be given these arguments: {_one_line(str(e))}") from None
        max_chars = MAX_OUTPUT_CHARS + 2 * len(payload)
        with self._lock:
            self._start()
            try:
                self._wait_ready()
                deadline = time.monotonic() + timeout
                self._send(_REQUEST.pack(len(payload), max_chars, timeout) + payload, deadline)
                status, data = self._receive(deadline, 4 * max_chars + 4 * _MESSAGE_CHARS + 64)
            except _Stopped as e:
                self._restart()
                if e.timed_out:
                    verb = "compile" if op == "compile" else "render"
                    raise TemplateError(f"{name} took more than {timeout:g} s to {verb} and was stopped{hint}") \
                        from None
                raise TemplateError(f"{name} stopped the process rendering it ({e}){hint}") from None
            except BaseException:  # Ctrl-C, or anything else mid-exchange: the child's state is unknown
                self._restart()
                raise
            if status == _NO_MEMORY:
                self._restart()
        if status == _OK:
            return data.decode("utf-8", "surrogatepass")
        text = _one_line(data.decode("utf-8", "replace"))
        where = "while compiling" if op == "compile" else "on these messages"
        raise TemplateError({
            _REFUSED: f"{name} refused these messages: {text}",
            _SYNTAX: f"{name} does not compile ({text}){hint}",
            _TOO_LONG: f"{name} wrote more than {max_chars:,} characters and was stopped{hint}",
            _NO_MEMORY: f"{name} needed more than {WORKER_MEMORY_BYTES >> 20} MB of memory to {op} and was "
                        f"stopped{hint}",
        }.get(status, f"{name} failed {where} ({text}){hint}"))

    def _start(self) -> None:
        if self._proc is not None and self._pid == os.getpid() and self._proc.poll() is None:
            return
        if self._proc is not None and self._pid == os.getpid():
            self._kill()
        root = str(Path(__file__).resolve().parent.parent)
        self._proc = subprocess.Popen([sys.executable, "-P", "-c", _WORKER_CODE, str(WORKER_MEMORY_BYTES), root],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      start_new_session=True)  # a Ctrl-C in the terminal reaches the parent only
        os.set_blocking(self._proc.stdin.fileno(), False)  # type: ignore[union-attr]
        self._pid, self._ready = os.getpid(), False

    def _wait_ready(self) -> None:
        if self._ready:
            return
        try:
            status, _ = self._receive(time.monotonic() + WORKER_START_TIMEOUT_S, 0)
        except _Stopped as e:
            self._kill()
            raise TemplateError(f"the chat template renderer (a child Python process) did not start ({e}); "
                                f"check that `{sys.executable} -c 'import jinja2'` works") from None
        if status != _READY:
            raise _Stopped(False, "it sent no greeting")
        self._ready = True

    def _send(self, data: bytes, deadline: float) -> None:
        fd = self._proc.stdin.fileno()  # type: ignore[union-attr]
        view = memoryview(data)
        while view:
            if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
                raise _Stopped(True, "timed out")
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError as e:  # BrokenPipeError: the child is gone
                raise _Stopped(False, self._exit_status(e)) from None

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self._proc.stdout.fileno()  # type: ignore[union-attr]
        chunks, left = [], n
        while left:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise _Stopped(True, "timed out")
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise _Stopped(time.monotonic() >= deadline, self._exit_status(None))
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _receive(self, deadline: float, max_bytes: int) -> tuple[bytes, bytes]:
        status, n = _REPLY.unpack(self._read(_REPLY.size, deadline))
        if n > max_bytes:
            raise _Stopped(False, f"it sent a reply of {n} bytes")
        return status, self._read(n, deadline)

    def _exit_status(self, error: OSError | None) -> str:
        try:
            rc = self._proc.wait(1.0)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            return str(error or "it closed its output")
        if rc < 0:
            return f"it was killed by signal {signal.Signals(-rc).name}"
        return f"it exited with status {rc}"

    def _kill(self) -> None:
        proc, self._proc, self._ready = self._proc, None, False
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()  # type: ignore[union-attr]
            except OSError:
                pass

    def _restart(self) -> None:
        """Kill the child and start its successor now, so that the next call finds it ready."""
        self._kill()
        self._start()

    def close(self) -> None:
        """Let the child end (its input closes); kill it if it does not within a second."""
        proc, self._proc = self._proc, None
        if proc is None or self._pid != os.getpid():
            return
        try:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(1.0)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


_WORKER = _Worker()
atexit.register(_WORKER.close)


def _worker_main() -> None:
    """The rendering process (started by _Worker): answers requests on stdin until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and then kills this process
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not Linux: the time limit still holds
        pass
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing printed here can corrupt the replies
    requests = sys.stdin.buffer

    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    compiled: dict[str, Any] = {}

    def reply(status: bytes, text: str) -> None:
        data = text.encode("utf-8", "surrogatepass")
        out.write(_REPLY.pack(status, len(data)) + data)
        out.flush()

    def serve(op: str, text: str, context: dict[str, Any], max_chars: int) -> tuple[bytes, str]:
        template = compiled.get(text)
        if template is None:
            try:
                template = env.from_string(text)
            except TemplateSyntaxError as e:
                return _SYNTAX, _one_line(str(e))
            if len(compiled) >= 16:
                compiled.pop(next(iter(compiled)))
            compiled[text] = template
        if op == "compile":
            return _OK, ""
        parts, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                return _TOO_LONG, ""
            parts.append(piece)
        return _OK, "".join(parts)

    reply(_READY, "")
    while True:
        head = requests.read(_REQUEST.size)
        if len(head) < _REQUEST.size:
            return  # the parent closed the pipe (or exited)
        n, max_chars, timeout = _REQUEST.unpack(head)
        op, text, context = pickle.loads(requests.read(n))
        # the parent kills this process at `timeout`; should the parent be gone, the alarm's default action does
        signal.setitimer(signal.ITIMER_REAL, timeout + 5.0)
        try:
            status, result = serve(op, text, context, max_chars)
        except MemoryError:
            status, result = _NO_MEMORY, ""
        except _Refused as e:
            status, result = _REFUSED, _one_line(str(e))
        except Exception as e:  # noqa: BLE001 - jinja2's errors, RecursionError, ZeroDivisionError, TypeError...
            status, result = _FAILED, _one_line(f"{type(e).__name__}: {e}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        del context
        reply(status, result)


def chat_template(model: Model) -> ChatTemplate:
    """`model`'s chat template, made once per model."""
    t = getattr(model, "_specter_chat_template", None)
    if t is None:
        t = ChatTemplate.for_model(model)
        model._specter_chat_template = t  # type: ignore[attr-defined]
    return t


def start_chat(model: Model, messages: Sequence[Mapping[str, Any]], n_predict: int = -1,
               sampling: SamplingParams | None = None, stop: str | Sequence[str] | None = (),
               ignore_eos: bool = False) -> Generation:
    """Generate the assistant's reply to `messages` (a Generation: iterate it to stream); `stop`: a text or texts
    that end it, besides the template's own end of turn (`ignore_eos`: as for `Model.generate`)."""
    from .engine import stop_list

    t = chat_template(model)
    ids = t.tokens(model, messages)
    return model.generate(ids, n_predict=n_predict, sampling=sampling, stop=[*stop_list(stop), *t.stop],
                          ignore_eos=ignore_eos)


class ChatSession:
    """A conversation that keeps its history::

        chat = ChatSession(model, system="You are terse.")
        for piece in chat.send("Hi!"):
            print(piece, end="")
        chat.history  # [{'role': 'system', ...}, {'role': 'user', ...}, {'role': 'assistant', ...}]

    The reply joins the history once it is complete (or stopped); a reply not read to its end when the next
    message is sent is finished first, so that the next reply follows it. ``reset()`` forgets all but the system
    message. With a seed, the n-th reply of the session draws with seed + n: a session repeats, its replies do not
    share one random stream.
    """

    def __init__(self, model: Model, system: str | None = None, n_predict: int = -1,
                 sampling: SamplingParams | None = None) -> None:
        from .sampling import SamplingParams

        SamplingParams.check(sampling)
        self.model, self.system, self.n_predict, self.sampling = model, system, n_predict, sampling
        self.history: list[dict[str, str]] = []
        self._pending: Generation | None = None  # the latest reply
        self._replies = 0  # replies started in this session (reset keeps counting: seeds are not reused)
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []
        self._pending = None

    def send(self, text: str) -> Generation:
        """Add a user message and start the reply; iterate the result to stream it."""
        if not isinstance(text, str):
            raise SpecterError(f"send takes the user's message as text, not {type(text).__name__}")
        if self._pending is not None:
            self._pending.wait()
        messages = [*self.history, {"role": "user", "content": text}]
        sampling = self.sampling
        if sampling is not None and sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + self._replies) % 2**64)
        self._replies += 1
        gen = start_chat(self.model, messages, n_predict=self.n_predict, sampling=sampling)
        self.history.append({"role": "user", "content": text})
        reply = {"role": "assistant", "content": ""}
        self.history.append(reply)
        pieces = iter(gen)

        def stream():
            for piece in pieces:
                reply["content"] += piece
                yield piece
            reply["content"] = gen.text

        gen._pieces = stream()
        self._pending = gen
        return gen
