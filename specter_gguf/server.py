"""An OpenAI-compatible HTTP server (Starlette on uvicorn) over one loaded model.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or Server-Sent Events with
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Requests are served one at a time, first come first served: generation runs on a single worker thread
(the device is used by one request at a time), so the event loop stays free to accept requests, answer
``/health`` and ``/metrics``, and notice clients that leave. A client that disconnects while it waits leaves
the queue at once; one being served stops its generation before the next token.

Every request is bounded before work starts (:class:`ServerLimits`): the body's size (413), the prompt's
length in characters before it is tokenized and in tokens after (400), ``max_tokens`` and the stop strings
(400), the queue (429 with ``Retry-After``). With an API key every endpoint but ``/health`` needs
``Authorization: Bearer KEY`` (401). Every error is an OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``), 404, 405 and 500 included.

Sampling fields default to llama.cpp's values (temperature 0.8, top_p 0.95, and the extensions top_k 40,
min_p 0.05, repeat_penalty 1.0), as llama.cpp's server does; a field that is null takes its default, as one left
out. OpenAI's fields keep OpenAI's ranges (temperature 0 to 2, the penalties -2 to 2); top_k <= 0 disables it and
seed -1 draws a random seed, as in llama.cpp. ``max_tokens`` defaults to 16 for completions (OpenAI's default) and
to "until the reply ends or the context is full" for chat completions (at most ``--max-completion-tokens``);
-1 asks for that bound, as llama.cpp's server reads it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

from . import api
from .engine import stop_list
from .errors import ContextFullError, SpecterError, TemplateError
from .gguf_file import model_name as file_model_name
from .sampling import SamplingOptionError, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from starlette.applications import Starlette
    from starlette.requests import Request

    from .engine import Generation, Model

__all__ = ["create_app", "serve", "Metrics", "ServerLimits", "check_exposure", "check_listen"]

log = logging.getLogger(__name__)

SCHEDULING = "requests are served one at a time on the device, first come first served; the others wait in a queue"

# GenerationStats fields that add up over requests (exported as *_total counters when a generation has them);
# every numeric field is also exported as the last generation's value.
ADDITIVE_STATS = ("prefill_s", "decode_s", "cache_lookups", "cache_hits", "cache_misses", "cache_evictions",
                  "prefetches", "bytes_copied", "copy_s", "copy_exposed_s", "copy_hidden_s",
                  "draft_tokens", "draft_accepted", "draft_rounds")


LOOPBACK_NAMES = ("localhost",)
RETRY_AFTER_S = 1          # what a 429 asks the client to wait: one request of a small model, or a token of a big one
PROMPT_CHARS_PER_TOKEN = 16  # a text longer than this many characters per allowed token is refused untokenized
# OpenAI's ranges for its fields; the sampler alone would take any temperature (<= 0: greedy) and penalty
RANGES = {"temperature": (0.0, 2.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may cost, checked before it is queued (None: the model's context size)."""

    max_body_bytes: int = 2 * 1024 * 1024  # 413 above
    max_prompt_tokens: int | None = None   # 400 above; None: the context size less one (room for a token)
    max_completion_tokens: int | None = None  # the largest max_tokens (a chat's default); None: the context size
    max_stop: int = 16                     # stop strings per request
    max_stop_chars: int = 512              # characters per stop string
    max_queue: int = 32                    # requests waiting for the device (the running one not counted); 429 above

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SpecterError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")

    def prompt_tokens(self, model: Model) -> int:
        return min(self.max_prompt_tokens or model.ctx_size - 1, model.ctx_size - 1)

    def completion_tokens(self, model: Model) -> int:
        return min(self.max_completion_tokens or model.ctx_size, model.ctx_size)


def check_exposure(host: str, api_key: str | None, insecure: bool = False) -> None:
    """Refuse to serve beyond this machine without an API key: anyone who reaches the port could use the model."""
    if api_key or insecure or is_loopback(host):
        return
    raise SpecterError(f"--host {host} is reachable from other machines and no API key is set: give --api-key KEY "
                       f"(or set SPECTER_API_KEY), listen on 127.0.0.1, or pass --insecure to serve anyone")


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-style error object with this HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers


class ClientLeft(Exception):
    """The client disconnected while its request waited in the queue."""


# -- metrics ---------------------------------------------------------------------------------------------

@dataclass
class Metrics:
    """Counters behind ``/metrics``; updated from the worker thread and read from the event loop."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, outcome) -> count
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0  # generated tokens after the first of each request: the TPOT denominator
    totals: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    last_labels: dict[str, str] = field(default_factory=dict)
    queued: int = 0
    running: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def record(self, gen: Generation, complete: bool) -> None:
        """Add a generation's tokens and, when it ran to its end, its stats."""
        with self._lock:
            self.prompt_tokens += len(gen.prompt_tokens)
            self.generated_tokens += len(gen.tokens)
            if not complete:  # stopped early: its stats were never filled in
                return
            stats = gen.stats.to_dict()
            self.decode_steps += max(gen.stats.generated_tokens - 1, 0)
            self.last.clear()  # the last request's stats only: one it did not have is not an earlier one's
            self.last_labels.clear()
            for k, v in stats.items():
                if isinstance(v, bool) or v is None:
                    continue
                if isinstance(v, (int, float)):
                    self.last[k] = float(v)
                    if k in ADDITIVE_STATS:
                        self.totals[k] = self.totals.get(k, 0.0) + float(v)
                elif isinstance(v, str):
                    self.last_labels[k] = v

    def render(self, info: dict[str, Any]) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        with self._lock:
            metric("specter_info", "gauge", "The model being served (value 1).", [(_labels(info), 1)])
            metric("specter_requests_total", "counter",
                   "Generation requests by endpoint and outcome (ok; error; cancelled: the client left; "
                   "rejected: the queue was full).",
                   [(_labels({"endpoint": e, "outcome": o}), n) for (e, o), n in sorted(self.requests.items())])
            metric("specter_requests_queued", "gauge", "Requests waiting for the device.", [("", self.queued)])
            metric("specter_requests_running", "gauge", "Requests being generated (at most 1).",
                   [("", self.running)])
            metric("specter_prompt_tokens_total", "counter", "Prompt tokens evaluated.", [("", self.prompt_tokens)])
            metric("specter_generated_tokens_total", "counter", "Tokens generated (cancelled requests included).",
                   [("", self.generated_tokens)])
            out += ["# HELP specter_time_per_output_token_seconds Decode time per generated token after the first "
                    "(TPOT), over completed requests.",
                    "# TYPE specter_time_per_output_token_seconds summary",
                    f"specter_time_per_output_token_seconds_sum {_num(self.totals.get('decode_s', 0.0))}",
                    f"specter_time_per_output_token_seconds_count {self.decode_steps}"]
            for k in sorted(self.totals):
                name = f"specter_{_seconds(k)}_total"
                metric(name, "counter", f"Sum of GenerationStats.{k} over completed requests.", [("", self.totals[k])])
            lookups, hits = self.totals.get("cache_lookups"), self.totals.get("cache_hits")
            if lookups:
                metric("specter_expert_cache_hit_rate", "gauge", "Expert cache hits / lookups since the start.",
                       [("", (hits or 0.0) / lookups)])
            drafted = self.totals.get("draft_tokens")
            if drafted:
                metric("specter_draft_acceptance_rate", "gauge", "Accepted / drafted tokens since the start.",
                       [("", self.totals.get("draft_accepted", 0.0) / drafted)])
            for k in sorted(self.last):
                unit_name, value = _base_units(k, self.last[k])
                metric(f"specter_last_{unit_name}", "gauge", f"GenerationStats.{k} of the last completed request"
                       f"{' (in seconds)' if k.endswith('_ms') else ''}.", [("", value)])
            if self.last_labels:
                metric("specter_last_generation_info", "gauge",
                       "Text fields of the last completed request's GenerationStats (value 1).",
                       [(_labels(self.last_labels), 1)])
        return "\n".join(out) + "\n"


def _seconds(name: str) -> str:
    return name[:-2] + "_seconds" if name.endswith("_s") else name


def _base_units(name: str, value: float) -> tuple[str, float]:
    """A GenerationStats field as Prometheus wants it: seconds, and whole words for rates (`tpot_ms` ->
    `tpot_seconds`, `tokens_per_s` -> `tokens_per_second`)."""
    if name.endswith("_ms"):
        return name[:-3] + "_seconds", value / 1000.0
    if name.endswith("_per_s"):
        return name[:-6] + "_per_second", value
    return _seconds(name), value


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) and not float(v).is_integer() else str(int(v))


def _labels(d: dict[str, Any]) -> str:
    def esc(s: str) -> str:
        return str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}" if d else ""


# -- request parsing ---------------------------------------------------------------------------------------

def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        want = " or ".join(k.__name__ for k in kinds).replace("float", "number").replace("int", "integer")
        raise RequestError(f"'{name}' must be {want}, got {json.dumps(v)}", param=name)
    return v


def _number(body: dict[str, Any], name: str, default: float) -> float:
    """A numeric field as a float, within OpenAI's range where it is one of OpenAI's fields (400 outside)."""
    v = _get(body, name, (int, float), default)
    try:
        x = float(v)
    except OverflowError:  # an integer beyond a float's range: infinite, which the sampler refuses
        x = math.inf if v > 0 else -math.inf
    if name in RANGES:  # the sampler checks the others (NaN and infinities included)
        lo, hi = RANGES[name]
        if not lo <= x <= hi:  # NaN, which Python's JSON reads, too
            raise RequestError(f"'{name}' must be from {lo:g} to {hi:g}, got {json.dumps(v)}", param=name)
    return x


def _sampling(body: dict[str, Any]) -> SamplingParams:
    d = SamplingParams()
    seed = _get(body, "seed", (int,), None)
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", d.temperature),
            top_p=_number(body, "top_p", d.top_p),
            top_k=_get(body, "top_k", (int,), d.top_k),
            min_p=_number(body, "min_p", d.min_p),
            repeat_penalty=_number(body, "repeat_penalty", d.repeat_penalty),
            repeat_last_n=_get(body, "repeat_last_n", (int,), d.repeat_last_n),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            seed=None if seed == -1 else seed)  # -1: random, as the CLI's --seed and llama.cpp's server
    except SamplingOptionError as e:
        raise RequestError(str(e), param=e.option) from None


def _unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n not in (None, 1):
        raise RequestError("only n=1 is supported (one choice per request)", param="n")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise RequestError("only best_of=1 is supported", param="best_of")
    if body.get("echo"):
        raise RequestError("echo is not supported", param="echo")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("logprobs are not supported", param="logprobs")
    if body.get("suffix"):
        raise RequestError("suffix is not supported", param="suffix")
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported", param="logit_bias")
    if body.get("tools") or body.get("functions"):
        raise RequestError("tools and function calling are not supported", param="tools")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise RequestError("only response_format {'type': 'text'} is supported", param="response_format")


def _stop(body: dict[str, Any], limits: ServerLimits) -> list[str]:
    try:
        stop = stop_list(body.get("stop"))
    except SpecterError as e:
        raise RequestError(str(e), param="stop") from None
    if len(stop) > limits.max_stop:
        raise RequestError(f"'stop' has {len(stop)} strings; this server allows at most {limits.max_stop}",
                           param="stop")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_chars:
        raise RequestError(f"a stop string has {longest} characters; this server allows at most "
                           f"{limits.max_stop_chars}", param="stop")
    return stop


def _max_tokens(body: dict[str, Any], default: int, most: int) -> int:
    """`max_completion_tokens` (OpenAI's newer name) or else `max_tokens`; null is the same as left out, -1 is `most`
    (llama.cpp's "no limit" within the context)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = body.get(name)
    if v is None:
        return default
    if type(v) is int and v == -1:
        return most
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"'{name}' must be a positive integer, -1 (as many as this server allows) or null, got "
                           f"{json.dumps(v)}", param=name)
    if v > most:
        raise RequestError(f"'{name}' is {v} but this server generates at most {most} tokens per request "
                           f"(the context size or --max-completion-tokens); ask for fewer", param=name)
    return v


def _strings(value: Any) -> Iterator[str]:
    """Every string in a decoded JSON value, keys included (iteratively: the depth is the client's choice)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, read no further than `limit` bytes (413 beyond): a huge body costs the server nothing."""
    length = request.headers.get("content-length")
    too_big = RequestError(f"the request body is larger than this server's limit of {limit} bytes "
                           f"(--max-body-bytes)", 413)
    if length is not None:
        if not length.isdigit():
            raise RequestError("the Content-Length header is not a number")
        if int(length) > limit:
            raise too_big
    data, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        data.append(chunk)
    try:
        body = json.loads(b"".join(data))
    except RecursionError:
        raise RequestError("the request body nests JSON too deeply") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise RequestError("the request body is not valid JSON") from None
    for s in _strings(body):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"the request holds a lone UTF-16 surrogate ({s[e.start]!r}), which is not text; "
                               f"send valid Unicode") from None
    return body


def _too_long(tokens: int, limits: ServerLimits, model: Model, param: str) -> RequestError:
    """The error for a prompt of more tokens than the server takes, addressed to the client: the context is the
    server's choice, the prompt is the client's."""
    most = limits.prompt_tokens(model)
    why = (f"its context of {model.ctx_size} tokens, the server's -c/--ctx-size, less one for the reply"
           if most == model.ctx_size - 1 else "the server's --max-prompt-tokens")
    what = "the prompt has" if param == "prompt" else "the messages make a prompt of"
    return RequestError(f"{what} {tokens} tokens; this server takes at most {most} ({why}); shorten the {param}",
                        param=param)


def _check_prompt_size(prompt: Any, limits: ServerLimits, model: Model, param: str) -> None:
    """Refuse a prompt that cannot fit before tokenizing it: tokenizing costs time and memory in its length."""
    most = limits.prompt_tokens(model)
    if param == "prompt" and isinstance(prompt, list) and not (len(prompt) == 1 and isinstance(prompt[0], str)):
        if len(prompt) > most:
            raise _too_long(len(prompt), limits, model, param)
        return
    chars = sum(len(s) for s in _strings(prompt))
    if chars > most * PROMPT_CHARS_PER_TOKEN:
        raise RequestError(f"'{param}' has {chars} characters, more than the {most * PROMPT_CHARS_PER_TOKEN} "
                           f"this server reads ({PROMPT_CHARS_PER_TOKEN} per token of its {most}-token prompt "
                           f"limit); shorten the {param}", param=param)


def _error(message: str, status: int = 400, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import JSONResponse

    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class ApiKeyMiddleware:
    """401 for a request without ``Authorization: Bearer KEY`` (``/health`` excepted, for probes). The key is
    compared through its SHA-256 in constant time, so neither its content nor its length leaks through timing."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.digest = app, hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"")
            token = header[7:].strip() if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(hashlib.sha256(token).digest(), self.digest):
                why = "no API key was given" if not token else "the API key is not this server's"
                response = _error(f"{why}: send 'Authorization: Bearer KEY' with the server's --api-key", 401,
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the app -----------------------------------------------------------------------------------------------

class Worker:
    """Runs jobs one at a time on one thread, in arrival order, with at most `max_queue` waiting, and keeps the
    queue gauges. A job whose client leaves while it waits is taken out of the queue at once."""

    def __init__(self, metrics: Metrics, max_queue: int = 32) -> None:
        self.metrics, self.max_queue = metrics, max_queue
        self.stops: set[threading.Event] = set()
        self._pending: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()  # guards _pending, _running, _closed and the gauges' values
        self._running = False  # a job is running (or was taken off the queue to run)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="specter-generate", daemon=True)
        self._thread.start()

    def _waiting(self) -> int:
        """Jobs that wait for the device: with none running, the first queued one is about to start."""
        return len(self._pending) - (0 if self._running or not self._pending else 1)

    def _gauges(self) -> None:
        with self.metrics._lock:
            self.metrics.queued = self._waiting()
            self.metrics.running = int(self._running or bool(self._pending))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                run = self._pending.popleft()
                self._running = True
                self._gauges()
            try:
                run()
            finally:
                with self._cond:
                    self._running = False
                    self._gauges()

    def _submit(self, run: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RequestError("the server is shutting down", 503)
            if (waiting := self._waiting()) >= self.max_queue:
                who = "1 request waits" if waiting == 1 else f"{waiting} requests wait"
                raise RequestError(f"the server is busy: {who} for the device "
                                   f"(--max-queue {self.max_queue}); retry in {RETRY_AFTER_S} s", 429,
                                   code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
            self._pending.append(run)
            self._gauges()
            self._cond.notify()

    def _withdraw(self, run: Callable[[], None]) -> bool:
        """Take a job that has not started out of the queue; False when it has started (or ended)."""
        with self._cond:
            try:
                self._pending.remove(run)
            except ValueError:
                return False
            self._gauges()
            return True

    async def stream(self, job: Callable[[threading.Event, Callable[[Any], None]], None], stop: threading.Event,
                     request: Request) -> AsyncIterator[Any]:
        """Queue `job(stop, emit)`; yield what it emits. Raises RequestError (429) when the queue is full and
        ClientLeft when the client disconnects before the job starts; a client that leaves later, or a
        consumer that stops early, sets `stop`, which the job checks between tokens."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: the server is gone
                stop.set()

        def run() -> None:
            try:
                if not stop.is_set():
                    job(stop, lambda item: put("item", item))
                put("end", None)
            except BaseException as e:  # noqa: BLE001 - handed to the request's task
                put("error", e)

        def left() -> None:
            stop.set()
            q.put_nowait(("left", None))

        self._submit(run)
        self.stops.add(stop)
        watcher = asyncio.create_task(_watch_disconnect(request, left))
        try:
            while True:
                kind, value = await q.get()
                if kind == "left":
                    if self._withdraw(run):
                        raise ClientLeft
                    continue  # running: it stops before its next token and ends as usual
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            watcher.cancel()
            stop.set()
            self._withdraw(run)
            self.stops.discard(stop)

    def shutdown(self) -> None:
        """Stop every generation at its next token; the queued ones end without starting."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        for s in list(self.stops):
            s.set()


ENDPOINTS = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model}",
             "GET /health", "GET /metrics")


def create_app(model: Model, model_name: str | None = None, api_key: str | None = None,
               limits: ServerLimits | None = None) -> Starlette:
    """The ASGI app serving `model` (uvicorn, hypercorn... can run it); with `api_key`, every endpoint but
    /health needs it as a bearer token."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    from .chat import chat_template

    limits = limits or ServerLimits()
    name = model_name or file_model_name(model.path)
    created = int(model.path.stat().st_mtime)
    template = chat_template(model)
    metrics = Metrics()
    worker = Worker(metrics, limits.max_queue)
    most_prompt, most_tokens = limits.prompt_tokens(model), limits.completion_tokens(model)

    def info() -> dict[str, Any]:
        d = {"model": name, "device": str(model.device), "ctx_size": model.ctx_size, "chat_template": template.source}
        if model.offload_mode is not None:
            d["offload"] = model.offload_mode
        if model.draft is not None:
            d["draft"] = model.draft
        return d

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok", **info(), "scheduling": SCHEDULING, "queue_depth": metrics.queued,
                             "running": metrics.running})

    async def models(request: Request) -> Any:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "specter-gguf"}]})

    async def model_detail(request: Request) -> Any:
        if request.path_params["model"] != name:
            return _error(f"model '{request.path_params['model']}' is not served here; this server has '{name}'",
                          404, "model", "model_not_found")
        return JSONResponse({"id": name, "object": "model", "created": created, "owned_by": "specter-gguf"})

    async def prometheus(request: Request) -> Any:
        return PlainTextResponse(metrics.render(info()), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, endpoint: str) -> Any:
        try:
            body = await _read_json(request, limits.max_body_bytes)
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            _unsupported(body)
            sampling, stop_strings = _sampling(body), _stop(body, limits)
            stream = bool(_get(body, "stream", (bool,), False))
            ignore_eos = bool(_get(body, "ignore_eos", (bool,), False))  # llama.cpp's field (benchmark clients)
            opts = body.get("stream_options") or {}
            include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
            if endpoint == "chat_completions":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise RequestError("'messages' must be a non-empty list", param="messages")
                param = "messages"
                _check_prompt_size(messages, limits, model, param)
                # "until the reply ends": the context ends it, or the operator's bound on max_tokens
                max_tokens = _max_tokens(body, most_tokens, most_tokens)

                def start() -> Generation:
                    return api.start_chat_completion(model, messages, max_tokens, sampling, stop_strings, ignore_eos)

                def prompt_tokens() -> int:
                    return len(template.tokens(model, messages))
                chunks, result = api.chat_chunks, api.chat_result
            else:
                param, prompt = "prompt", body.get("prompt")
                if prompt is None:
                    raise RequestError("'prompt' is required", param=param)
                _check_prompt_size(prompt, limits, model, param)
                max_tokens = _max_tokens(body, min(16, most_tokens), most_tokens)

                def start() -> Generation:
                    return api.start_completion(model, prompt, max_tokens, sampling, stop_strings, ignore_eos)

                def prompt_tokens() -> int:  # a text, a batch of one text or of one list of ids
                    one = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
                    return len(model.tokenize(one)) if isinstance(one, str) else len(one)
                chunks, result = api.completion_chunks, api.completion_result
        except RequestError as e:
            metrics.count_request(endpoint, "error")
            return _error(str(e), e.status, e.param, e.code, e.headers)

        rid = ("chatcmpl-" if endpoint == "chat_completions" else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        outcome = {"value": "cancelled"}

        def job(stop: threading.Event, emit: Callable[[Any], None]) -> None:
            try:
                gen = start()
            except ContextFullError:  # the engine's message is for the CLI's user; count again to tell the client
                raise _too_long(prompt_tokens(), limits, model, param) from None
            except TemplateError:
                raise
            except SpecterError as e:  # the fields were checked before: what is left is the prompt's or messages'
                raise RequestError(str(e), 400, param) from None
            if len(gen.prompt_tokens) > most_prompt:
                raise _too_long(len(gen.prompt_tokens), limits, model, param)
            emit(None)     # "started": headers may go out now
            complete = False
            try:
                if stream:
                    it = chunks(gen, name, rid, now, include_usage)
                    for item in it:
                        emit(item)
                        if stop.is_set():
                            it.close()
                            return
                else:
                    for _ in gen:
                        if stop.is_set():
                            return
                    emit(result(gen, name, rid, now))
                complete = True
                outcome["value"] = "ok"
            finally:
                metrics.record(gen, complete)
                if not complete and not stop.is_set():
                    outcome["value"] = "error"

        stop = threading.Event()
        items = worker.stream(job, stop, request)

        async def finish() -> None:
            await items.aclose()
            metrics.count_request(endpoint, outcome["value"])

        try:
            started = await items.__anext__()
            assert started is None
        except ClientLeft:  # left while queued: its place is free already
            await finish()
            return _error("the client disconnected", 499)
        except RequestError as e:  # the queue is full, a prompt over the token limit or wrong, shutting down
            outcome["value"] = "rejected" if e.status == 429 else "error"
            await finish()
            return _error(str(e), e.status, e.param, e.code, e.headers)
        except TemplateError as e:
            outcome["value"] = "error"
            await finish()
            return _error(f"the chat template failed: {e}", 400, "messages", "template_error")
        except (SpecterError, StopAsyncIteration) as e:
            outcome["value"] = "error"
            await finish()
            if isinstance(e, SpecterError):
                return _error(str(e), 400)
            return _error("the server is shutting down", 503)
        except Exception as e:  # a bug: report it as a 500, keep serving
            log.exception("generation failed")
            outcome["value"] = "error"
            await finish()
            return _error(f"generation failed: {e}", 500)

        if not stream:
            try:
                results = [value async for value in items]  # to the end: the job has set its outcome
                if not results:
                    return _error("the client disconnected", 499)
                return JSONResponse(results[-1])
            except Exception as e:
                log.exception("generation failed")
                return _error(f"generation failed: {e}", 500)
            finally:
                await finish()

        async def sse() -> AsyncIterator[str]:
            try:
                async for chunk in items:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                yield "data: [DONE]\n\n"
            except Exception as e:
                log.exception("generation failed")
                err = {"error": {"message": f"generation failed: {e}", "type": "server_error", "param": None,
                                 "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
            finally:
                await finish()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def completions(request: Request) -> Any:
        return await generate(request, "completions")

    async def chat_completions(request: Request) -> Any:
        return await generate(request, "chat_completions")

    async def http_error(request: Request, exc: Exception) -> Any:
        assert isinstance(exc, HTTPException)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"there is no endpoint {where}; this server has " + ", ".join(ENDPOINTS)
        elif exc.status_code == 405:
            message = f"{where} is not allowed; {request.url.path} takes {(exc.headers or {}).get('Allow', '')}"
        else:
            message = str(exc.detail)
        return _error(message, exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Any:
        # Starlette logs the traceback after this answer goes out
        return _error(f"internal server error ({type(exc).__name__}); the server's log has the details", 500)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        worker.shutdown()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_detail, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.metrics, app.state.worker, app.state.model_name = metrics, worker, name
    return app


async def _watch_disconnect(request: Request, left: Callable[[], None]) -> None:
    """Call `left` when the client goes away (the request body has been read, so the next message the server
    gives is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            left()
            return


def check_listen(host: str, port: int, api_key: str | None, insecure: bool = False) -> None:
    """Refuse an exposed host without a key and a port out of range, before the model is loaded."""
    check_exposure(host, api_key, insecure)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise SpecterError(f"--port must be from 0 to 65535 (0: any free port), got {port}")


def serve(model: Model, host: str = "127.0.0.1", port: int = 8080, log_level: str = "warning",
          model_name: str | None = None, on_listening: Callable[[str], None] | None = None,
          api_key: str | None = None, limits: ServerLimits | None = None, insecure: bool = False) -> None:
    """Serve `model` until interrupted (Ctrl-C). `on_listening(url)` is called once the port is bound. A host
    other than loopback needs `api_key` (or `insecure`); `limits` bound each request (:class:`ServerLimits`)."""
    import socket

    import uvicorn

    check_listen(host, port, api_key, insecure)
    app = create_app(model, model_name, api_key, limits)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise SpecterError(f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host"
                           ) from None
    bound_port = sock.getsockname()[1]
    if on_listening is not None:
        url_host = f"[{host}]" if ":" in host else host
        on_listening(f"http://{url_host}:{bound_port}")
    config = uvicorn.Config(app, host=host, port=bound_port, log_level=log_level, timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
