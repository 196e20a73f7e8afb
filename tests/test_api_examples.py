"""The README's Python examples, executed: the Python API (engine, chat, llama-cpp-python–shaped results)
and the OpenAI client against a running server.

`API_EXAMPLES` and `SERVER_EXAMPLE` are the snippets of the README's "Python API" and "OpenAI-compatible
server" sections. The README's own ```python blocks in those sections are run as well (whatever they say
now), so a README example that stops working fails here.
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

API_EXAMPLES = [
r"""from specter_gguf.engine import Model
from specter_gguf.sampling import SamplingParams

model = Model.load(device="cpu")  # no path: models/tiny-qwen2moe.gguf; device=None picks CUDA when present
greedy = SamplingParams(temperature=0)

gen = model.generate("Once upon a time", n_predict=8, sampling=greedy)
for piece in gen:  # streams text as it is generated
    print(piece, end="", flush=True)
print()
print(gen.finish_reason, len(gen.tokens), gen.stats.summary())  # length 8 prompt … tokens, generated 8 …

ids = model.tokenize("Once upon a time")  # token ids in, token ids out
again = model.generate(ids, n_predict=8, sampling=greedy).wait()
assert again.tokens == gen.tokens and again.text == gen.text

stopped = model.generate("Once upon a time", n_predict=8, sampling=greedy, stop=[gen.text[3:6]]).wait()
print(repr(stopped.text), stopped.finish_reason)  # cut before the stop text, "stop"
""",
r"""from specter_gguf.chat import ChatSession, chat_template

messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
print(chat_template(model).source)  # "gguf", or "builtin-chatml" for a file without a template
reply = model.chat(messages, n_predict=8, sampling=greedy).wait()
print(reply.text, reply.finish_reason)

chat = ChatSession(model, system="You are terse.", n_predict=8)  # keeps the history
for piece in chat.send("Hello!"):
    print(piece, end="")
print()
chat.send("Tell me more.").wait()
print([m["role"] for m in chat.history])  # ['system', 'user', 'assistant', 'user', 'assistant']
chat.reset()
""",
"""out = model.create_completion("Once upon a time", max_tokens=8, temperature=0, stop=["\\n"])
print(out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"])

out = model.create_chat_completion(messages, max_tokens=8, seed=1)
print(out["choices"][0]["message"]["content"])

for chunk in model.create_chat_completion(messages, max_tokens=8, seed=1, stream=True):
    print(chunk["choices"][0]["delta"].get("content", ""), end="")
print()
""",
]

SERVER_EXAMPLE = r"""from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")
r = client.chat.completions.create(model="tiny-qwen2moe", max_tokens=8,
                                   messages=[{"role": "user", "content": "Hello!"}])
print(r.choices[0].message.content, r.choices[0].finish_reason, r.usage)
for chunk in client.completions.create(model="tiny-qwen2moe", prompt="Once upon a time", max_tokens=8,
                                       stream=True):
    print(chunk.choices[0].text, end="", flush=True)
print()
"""


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
    readme = readme_blocks("Python API")
    run_blocks(readme + [b for b in API_EXAMPLES if b not in readme], {})
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
    readme = readme_blocks("OpenAI-compatible server")
    blocks = readme + ([SERVER_EXAMPLE] if SERVER_EXAMPLE not in readme else [])
    run_blocks([b.replace("127.0.0.1:8080", server_url) for b in blocks], {})
    assert "completion_tokens=8" in capsys.readouterr().out
