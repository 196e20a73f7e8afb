"""`specter-gguf serve` on the shipped model, driven by the official `openai` client over real HTTP.

One server process for the module (started like a user would: `python -m specter_gguf serve MODEL --device cpu
--port P`). Outputs are compared with the same engine run in-process, so the server is shown to pass every
option through; cancellation is observed through `/metrics`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from specter_gguf.engine import Model  # noqa: E402
from specter_gguf.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _post(server: str, path: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    """POST raw bytes or JSON; (status, decoded answer). The connection is closed on the way out, so a
    timeout here is a client that leaves."""
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@contextlib.contextmanager
def _serving(*args: str) -> Iterator[str]:
    """`serve ARGS --port 0`: the OS picks a free port, which the server's first line announces; yields the
    base URL, stops the server with SIGTERM afterwards and checks it printed no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "specter_gguf", "serve", *args, "--device", "cpu", "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen = []
    for line in proc.stdout:  # the load progress bar, then "serving tiny-qwen2moe on http://127.0.0.1:PORT/v1 ..."
        seen.append(line)
        m = re.search(r"serving tiny-qwen2moe on (http://127\.0\.0\.1:\d+)/v1 .*one at a time", line)
        if m:
            base = m.group(1)
            break
    else:
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(seen))
    deadline = time.time() + 60
    while True:
        try:
            _get(base + "/health")
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the server did not answer /health:\n{proc.stdout.read()}")
            time.sleep(0.1)
    yield base
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the server did not stop on SIGTERM:\n{out}")
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def server(shipped_model: Path):
    with _serving(str(shipped_model)) as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(shipped_model: Path) -> Model:
    return Model.load(shipped_model, device="cpu", progress=False)


def metrics(server: str) -> dict[str, float]:
    """`/metrics` as {"name{labels}": value}, checking every line is valid Prometheus text."""
    out = {}
    for line in _get(server + "/metrics").splitlines():
        if line.startswith("#"):
            assert re.match(r"# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* \S", line), line
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})?) (\S+)', line)
        assert m, line
        out[m.group(1)] = float(m.group(2))
    return out


def wait_for(server: str, predicate, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        if predicate(m) or time.time() > deadline:
            return m
        time.sleep(0.1)


def test_models_health_metrics(server: str, client) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-qwen2moe"]
    assert client.models.retrieve("tiny-qwen2moe").id == "tiny-qwen2moe"
    health = json.loads(_get(server + "/health"))
    assert health["status"] == "ok" and health["device"] == "cpu" and health["chat_template"] == "gguf"
    assert "one at a time" in health["scheduling"] and health["queue_depth"] == 0
    m = metrics(server)
    assert m['specter_info{model="tiny-qwen2moe",device="cpu",ctx_size="2048",chat_template="gguf"}'] == 1
    assert "specter_generated_tokens_total" in m and "specter_requests_queued" in m


def test_completion_length(client, model: Model) -> None:
    want = model.generate("Once upon a time", n_predict=6, sampling=GREEDY).wait()
    r = client.completions.create(model="tiny-qwen2moe", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(model.tokenize("Once upon a time"))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_stop_string(client, model: Model) -> None:
    full = model.generate("Hello", n_predict=8, sampling=GREEDY).wait().text
    stop = full[4:7]
    cut = full.find(stop)
    r = client.completions.create(model="m", prompt="Hello", max_tokens=8, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:cut]
    assert r.usage.completion_tokens < 8


def test_completion_stream(client) -> None:
    r = client.completions.create(model="m", prompt="Hello", max_tokens=5, temperature=0)
    chunks = list(client.completions.create(model="m", prompt="Hello", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_completion_token_prompt(client, model: Model) -> None:
    ids = model.tokenize("Hello")
    a = client.completions.create(model="m", prompt=ids, max_tokens=3, temperature=0)
    b = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)


def test_sampling_options_pass_through(client, model: Model) -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=1.0)
    want = model.generate("Hello", n_predict=6, sampling=sp).wait().text
    r = client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=1.0, top_p=0.9, seed=7,
                                  presence_penalty=0.5, frequency_penalty=1.0)
    assert r.choices[0].text == want
    # penalties change the (greedy, looping) output of the random model
    plain = client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0)
    penalized = client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0, frequency_penalty=5)
    assert penalized.choices[0].text == model.generate(
        "Hello", n_predict=6, sampling=SamplingParams(temperature=0, frequency_penalty=5)).wait().text
    assert penalized.choices[0].text != plain.choices[0].text


def test_chat(client, model: Model) -> None:
    want = model.chat(MESSAGES, n_predict=5, sampling=GREEDY).wait()
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_tokens) and r.usage.completion_tokens == 5

    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts_and_max_completion_tokens(client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}]
    a = client.chat.completions.create(model="m", messages=parts, max_completion_tokens=3, temperature=0)
    b = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=3, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens == 3


def test_bad_requests(server: str, client) -> None:
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.completions.create(model="m", prompt="Hi", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="m", prompt="Hi", max_tokens=2, top_p=3)
    with pytest.raises(openai.BadRequestError, match="context holds 2048"):
        client.completions.create(model="m", prompt="hello " * 3000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context holds"):
        client.completions.create(model="m", prompt="hello " * 3000, max_tokens=2, stream=True)
    status, body = _post(server, "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = _post(server, "/v1/chat/completions", {"max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages"
    m = metrics(server)
    assert m['specter_requests_total{endpoint="completions",outcome="error"}'] >= 4


def test_requests_are_queued(server: str, client) -> None:
    results: dict[int, str] = {}

    def go(k: int) -> None:
        results[k] = client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0).choices[0].text

    threads = [threading.Thread(target=go, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    depth = running = 0
    while any(t.is_alive() for t in threads):
        h = json.loads(_get(server + "/health"))  # answered while the worker generates
        depth, running = max(depth, h["queue_depth"]), max(running, h["running"])
        assert h["running"] <= 1
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(set(results.values())) == 1 and len(results) == 3
    assert depth >= 1 and running == 1


def _cancelled(m: dict[str, float], endpoint: str) -> float:
    return m.get(f'specter_requests_total{{endpoint="{endpoint}",outcome="cancelled"}}', 0.0)


def test_disconnect_mid_stream_stops_generation(server: str, client) -> None:
    before = metrics(server)
    stream = client.completions.create(model="m", prompt="Hello", max_tokens=1000, temperature=0, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    after = wait_for(server, lambda m: _cancelled(m, "completions") > _cancelled(before, "completions")
                     and m["specter_requests_running"] == 0)
    assert _cancelled(after, "completions") == _cancelled(before, "completions") + 1
    assert after["specter_requests_running"] == 0
    generated = after["specter_generated_tokens_total"] - before["specter_generated_tokens_total"]
    assert 3 <= generated < 50  # stopped long before max_tokens (greedy never ends this prompt early)


def test_disconnect_non_streaming_stops_generation(server: str) -> None:
    before = metrics(server)
    with pytest.raises(TimeoutError):
        _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1900, "temperature": 0}, 1.5)
    after = wait_for(server, lambda m: _cancelled(m, "chat_completions") > _cancelled(before, "chat_completions")
                     and m["specter_requests_running"] == 0)
    assert _cancelled(after, "chat_completions") == _cancelled(before, "chat_completions") + 1
    generated = after["specter_generated_tokens_total"] - before["specter_generated_tokens_total"]
    assert generated < 1800  # stopped well before max_tokens; how far it got depends on the machine's speed
    # the server goes on serving
    status, body = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


def test_metrics_totals(server: str, client, model: Model) -> None:
    before = metrics(server)
    client.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0)
    after = metrics(server)
    assert after["specter_generated_tokens_total"] - before["specter_generated_tokens_total"] == 4
    assert after["specter_prompt_tokens_total"] - before["specter_prompt_tokens_total"] == len(model.tokenize("Hello"))
    assert after["specter_time_per_output_token_seconds_count"] - before["specter_time_per_output_token_seconds_count"] == 3
    assert after["specter_time_per_output_token_seconds_sum"] > before["specter_time_per_output_token_seconds_sum"]
    assert after["specter_last_generated_tokens"] == 4 and after["specter_last_tpot_ms"] > 0
    assert after['specter_requests_total{endpoint="completions",outcome="ok"}'] >= 1


def test_offload_metrics(shipped_model: Path) -> None:
    """With expert offloading (which also runs on the CPU), /metrics and /health carry its statistics."""
    uvicorn = pytest.importorskip("uvicorn")
    from specter_gguf.server import create_app

    m = Model.load(shipped_model, device="cpu", progress=False, gpu_budget="320MiB", offload="lru")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(m), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert thread.is_alive() and time.time() < deadline
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        status, body = _post(base, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert json.loads(_get(base + "/health"))["offload"] == "lru"
        got = metrics(base)
        assert got["specter_cache_lookups_total"] > 0 and got["specter_bytes_copied_total"] > 0
        assert got["specter_cache_hits_total"] + got["specter_cache_misses_total"] == got["specter_cache_lookups_total"]
        assert 0 <= got["specter_expert_cache_hit_rate"] <= 1
        assert got["specter_last_cache_hit_rate"] == pytest.approx(got["specter_expert_cache_hit_rate"])
        assert "specter_copy_seconds_total" in got and "specter_last_bytes_copied_per_token" in got
        assert any(k.startswith("specter_last_generation_info{") and 'offload="lru"' in k for k in got)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_serve_with_a_draft_decodes_speculatively(shipped_model: Path, model: Model, tmp_path: Path) -> None:
    """`serve --draft`: the completion is the model's own greedy text, and /metrics reports the drafts."""
    pytest.importorskip("llama_cpp")
    from specter_gguf.quantize import quantize_gguf

    draft = tmp_path / "draft-q4_k_m.gguf"
    quantize_gguf(shipped_model, draft, "q4_k_m")
    expected = model.generate("Once upon a time", 12, GREEDY).wait().text
    with _serving(str(shipped_model), "--draft", str(draft)) as base:
        status, body = _post(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12,
                                                       "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == expected
        m = metrics(base)
        assert m["specter_draft_tokens_total"] > 0
        assert m["specter_draft_acceptance_rate"] == m["specter_draft_accepted_total"] / m["specter_draft_tokens_total"]

