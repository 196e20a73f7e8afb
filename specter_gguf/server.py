"""An OpenAI-compatible HTTP server (Starlette on uvicorn) over one loaded model.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or Server-Sent Events with
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Requests are served one at a time, first come first served: generation runs on a single worker thread
(the device is used by one request at a time), so the event loop stays free to accept requests, answer
``/health`` and ``/metrics``, and notice clients that leave. A client that disconnects, whether queued or
being served, stops its generation before the next token.

Sampling fields default to llama.cpp's values (temperature 0.8, top_p 0.95, and the extensions top_k 40,
min_p 0.05, repeat_penalty 1.0), as llama.cpp's server does. ``max_tokens`` defaults to 16 for completions
(OpenAI's default) and to "until the reply ends or the context is full" for chat completions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from . import api
from .errors import SpecterError
from .sampling import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from starlette.applications import Starlette
    from starlette.requests import Request

    from .engine import Generation, Model

__all__ = ["create_app", "serve", "Metrics"]

log = logging.getLogger(__name__)

SCHEDULING = "requests are served one at a time on the device, first come first served; the others wait in a queue"

# GenerationStats fields that add up over requests (exported as *_total counters when a generation has them);
# every numeric field is also exported as the last generation's value.
ADDITIVE_STATS = ("prefill_s", "decode_s", "cache_lookups", "cache_hits", "cache_misses", "cache_evictions",
                  "prefetches", "bytes_copied", "copy_s", "copy_exposed_s", "copy_hidden_s",
                  "draft_tokens", "draft_accepted", "draft_rounds")


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-style error object with this HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


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
            for k, v in stats.items():
                if isinstance(v, bool) or v is None:
                    continue
                if isinstance(v, (int, float)):
                    self.last[k] = float(v)
                    if k in ADDITIVE_STATS:
                        self.totals[k] = self.totals.get(k, 0.0) + float(v)
                elif isinstance(v, str):
                    self.last_labels[k] = v

    def render(self, info: dict[str, str]) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        with self._lock:
            metric("specter_info", "gauge", "The model being served (value 1).", [(_labels(info), 1)])
            metric("specter_requests_total", "counter",
                   "Generation requests by endpoint and outcome (ok, error, cancelled: the client left).",
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
                metric(f"specter_last_{_seconds(k)}", "gauge", f"GenerationStats.{k} of the last completed request.",
                       [("", self.last[k])])
            if self.last_labels:
                metric("specter_last_generation_info", "gauge",
                       "Text fields of the last completed request's GenerationStats (value 1).",
                       [(_labels(self.last_labels), 1)])
        return "\n".join(out) + "\n"


def _seconds(name: str) -> str:
    return name[:-2] + "_seconds" if name.endswith("_s") else name


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) and not float(v).is_integer() else str(int(v))


def _labels(d: dict[str, str]) -> str:
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


def _sampling(body: dict[str, Any]) -> SamplingParams:
    d = SamplingParams()
    num = (int, float)
    try:
        return SamplingParams(
            temperature=float(_get(body, "temperature", num, d.temperature)),
            top_p=float(_get(body, "top_p", num, d.top_p)),
            top_k=_get(body, "top_k", (int,), d.top_k),
            min_p=float(_get(body, "min_p", num, d.min_p)),
            repeat_penalty=float(_get(body, "repeat_penalty", num, d.repeat_penalty)),
            repeat_last_n=_get(body, "repeat_last_n", (int,), d.repeat_last_n),
            presence_penalty=float(_get(body, "presence_penalty", num, 0.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", num, 0.0)),
            seed=_get(body, "seed", (int,), None))
    except SpecterError as e:
        raise RequestError(str(e)) from None


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


def _stop(body: dict[str, Any]) -> list[str]:
    try:
        return api.stop_list(body.get("stop"))
    except SpecterError as e:
        raise RequestError(str(e), param="stop") from None


def _max_tokens(body: dict[str, Any], default: int | None) -> int | None:
    v = body.get("max_completion_tokens", body.get("max_tokens", default))
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"'max_tokens' must be a positive integer or null, got {json.dumps(v)}", param="max_tokens")
    return v


def _error(message: str, status: int = 400, param: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


# -- the app -----------------------------------------------------------------------------------------------

class Worker:
    """Runs jobs one at a time on a single thread, in arrival order, and keeps the queue gauges."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specter-generate")
        self.stops: set[threading.Event] = set()

    async def stream(self, job: Callable[[threading.Event, Callable[[Any], None]], None],
                     stop: threading.Event) -> AsyncIterator[Any]:
        """Run `job(stop, emit)` on the worker; yield what it emits. Leaving early (the consumer stops or is
        cancelled) sets `stop`, which the job checks between tokens."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: the server is gone
                stop.set()

        def run() -> None:
            with self.metrics._lock:
                self.metrics.queued -= 1
                self.metrics.running += 1
            try:
                if not stop.is_set():
                    job(stop, lambda item: put("item", item))
                put("end", None)
            except BaseException as e:  # noqa: BLE001 - handed to the request's task
                put("error", e)
            finally:
                with self.metrics._lock:
                    self.metrics.running -= 1

        with self.metrics._lock:
            self.metrics.queued += 1
        self.stops.add(stop)
        try:
            loop.run_in_executor(self._pool, run)
            while True:
                kind, value = await q.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            stop.set()
            self.stops.discard(stop)

    def shutdown(self) -> None:
        for s in list(self.stops):
            s.set()
        self._pool.shutdown(wait=False, cancel_futures=False)


def create_app(model: Model, model_name: str | None = None) -> Starlette:
    """The ASGI app serving `model` (uvicorn, hypercorn... can run it)."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    from .chat import chat_template

    name = model_name or model.path.stem
    created = int(model.path.stat().st_mtime)
    template = chat_template(model)
    metrics = Metrics()
    worker = Worker(metrics)

    def info() -> dict[str, str]:
        d = {"model": name, "device": str(model.device), "ctx_size": str(model.ctx_size),
             "chat_template": template.source}
        offload = getattr(model, "offload", None)
        if offload is not None:
            d["offload"] = str(getattr(offload, "mode", "on"))
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
                          404, "model")
        return JSONResponse({"id": name, "object": "model", "created": created, "owned_by": "specter-gguf"})

    async def prometheus(request: Request) -> Any:
        return PlainTextResponse(metrics.render(info()), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, endpoint: str) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error("the request body must be a JSON object")
        try:
            _unsupported(body)
            sampling, stop_strings = _sampling(body), _stop(body)
            stream = bool(_get(body, "stream", (bool,), False))
            opts = body.get("stream_options") or {}
            include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
            if endpoint == "chat_completions":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise RequestError("'messages' must be a non-empty list", param="messages")
                max_tokens = _max_tokens(body, None)

                def start() -> Generation:
                    return api.start_chat_completion(model, messages, max_tokens, sampling, stop_strings)
                chunks, result = api.chat_chunks, api.chat_result
            else:
                if "prompt" not in body:
                    raise RequestError("'prompt' is required", param="prompt")
                prompt = body["prompt"]
                max_tokens = _max_tokens(body, 16)

                def start() -> Generation:
                    return api.start_completion(model, prompt, max_tokens, sampling, stop_strings)
                chunks, result = api.completion_chunks, api.completion_result
        except RequestError as e:
            metrics.count_request(endpoint, "error")
            return _error(str(e), e.status, e.param)

        rid = ("chatcmpl-" if endpoint == "chat_completions" else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        outcome = {"value": "cancelled"}

        def job(stop: threading.Event, emit: Callable[[Any], None]) -> None:
            gen = start()  # SpecterError (e.g. a prompt longer than the context) ends the request as a 400
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
        watcher = asyncio.create_task(_watch_disconnect(request, stop))
        items = worker.stream(job, stop)

        async def finish() -> None:
            watcher.cancel()
            await items.aclose()
            metrics.count_request(endpoint, outcome["value"])

        try:
            started = await items.__anext__()
            assert started is None
        except (SpecterError, StopAsyncIteration) as e:
            outcome["value"] = "error"
            await finish()
            return _error(str(e) if isinstance(e, SpecterError) else "the server is shutting down", 400)
        except Exception as e:  # pragma: no cover - a bug: report it as a 500, keep serving
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
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.metrics, app.state.worker, app.state.model_name = metrics, worker, name
    return app


async def _watch_disconnect(request: Request, stop: threading.Event) -> None:
    """Set `stop` when the client goes away (the request body has been read, so the next message the
    server gives is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stop.set()
            return


def serve(model: Model, host: str = "127.0.0.1", port: int = 8080, log_level: str = "warning",
          model_name: str | None = None, on_listening: Callable[[str], None] | None = None) -> None:
    """Serve `model` until interrupted (Ctrl-C). `on_listening(url)` is called once the port is bound."""
    import socket

    import uvicorn

    app = create_app(model, model_name)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise SpecterError(f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host") from None
    bound_port = sock.getsockname()[1]
    if on_listening is not None:
        on_listening(f"http://{host}:{bound_port}")
    config = uvicorn.Config(app, host=host, port=bound_port, log_level=log_level, timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
