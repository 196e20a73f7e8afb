"""The README's Python examples, executed as they stand: the ```python blocks of its "Python API" section
(engine, chat, llama-cpp-python–shaped results) and of its "OpenAI-compatible server" section (the official
client against a running server), so a README example that stops working fails here.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest

from specter_gguf.engine import Model

REPO = Path(__file__).resolve().parent.parent

def readme_blocks(heading: str) -> list[str]:
    """The ```python blocks of the README section `## heading` (none when there is no such section)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    return re.findall(r"```python\n(.*?)```", m.group(1), re.S) if m else []


def run_blocks(blocks: list[str], namespace: dict) -> None:
    for code in blocks:
        exec(compile(code, "<README example>", "exec"), namespace)  # noqa: S102


def test_api_examples(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)  # examples name models/... relative to the repository
    blocks = readme_blocks("Python API")
    assert len(blocks) >= 3, "the README's Python API section lost its examples"
    run_blocks(blocks, {})
    out = capsys.readouterr().out
    assert "length 8" in out and "['system', 'user', 'assistant', 'user', 'assistant']" in out
    assert "'prompt_tokens'" in out  # the usage dict of create_completion


@pytest.fixture(scope="module")
def server_url(shipped_model: Path):
    uvicorn = pytest.importorskip("uvicorn")
    from specter_gguf.server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(Model.load(shipped_model, device="cpu", progress=False))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_server_example(server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("openai")
    blocks = readme_blocks("OpenAI-compatible server")
    assert blocks, "the README's server section lost its example"
    run_blocks([b.replace("127.0.0.1:8080", server_url) for b in blocks], {})
    out = capsys.readouterr().out
    # the example samples (the server's default temperature, 0.8, and a random seed): the reply ends at max_tokens or
    # at an end token
    m = re.search(r" (length|stop) CompletionUsage\(completion_tokens=(\d+)", out)
    assert m, out
    assert int(m.group(2)) == 8 if m.group(1) == "length" else int(m.group(2)) <= 8, out
