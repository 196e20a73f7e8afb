"""Chat templates (the GGUF's own, the ChatML fallback, HF template helpers, the sandbox), chat sessions,
and `specter-gguf chat` driven through piped standard input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specter_gguf.chat import CHATML_TEMPLATE, ChatSession, ChatTemplate, chat_template, normalize_messages
from specter_gguf.cli import cli
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError
from specter_gguf.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
CHATML_TEXT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model(shipped_model: Path) -> Model:
    return Model.load(shipped_model, device="cpu", progress=False)


@pytest.fixture(scope="module")
def no_template_model(shipped_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("no-template") / "tiny-no-template.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(shipped_model), str(path),
                    "--remove-metadata", "tokenizer.chat_template", "--force"], check=True, capture_output=True)
    return Model.load(path, device="cpu", progress=False)


def test_template_from_gguf(model: Model) -> None:
    t = chat_template(model)
    assert t.source == "gguf" and chat_template(model) is t
    assert t.render(MESSAGES) == CHATML_TEXT
    assert t.render(MESSAGES, add_generation_prompt=False) == CHATML_TEXT.removesuffix("<|im_start|>assistant\n")
    ids = t.tokens(model, MESSAGES)
    assert ids == model.tokenizer.encode(CHATML_TEXT, add_bos=False, special=True)
    im_start = model.tokenizer.encode("<|im_start|>", add_bos=False, special=True)
    assert len(im_start) == 1 and ids.count(im_start[0]) == 3  # special-token text became one token


def test_fallback_chatml(no_template_model: Model, model: Model) -> None:
    t = chat_template(no_template_model)
    assert t.source == "builtin-chatml" and t.text == CHATML_TEMPLATE
    assert t.render(MESSAGES) == CHATML_TEXT
    assert "<|im_end|>" in t.stop
    # same weights, same prompt: the same reply as through the file's (identical) template
    a = no_template_model.chat(MESSAGES, n_predict=4, sampling=GREEDY).wait()
    b = model.chat(MESSAGES, n_predict=4, sampling=GREEDY).wait()
    assert a.tokens == b.tokens


def test_hf_template_helpers() -> None:
    text = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]{% else %} {{ m['content'] }}"
        "{{ eos_token }}{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"
    )
    t = ChatTemplate(text, "gguf", bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": " héllo "}, {"role": "assistant", "content": "yo"}])
    assert out == '<s>[INST] héllo [/INST] yo</s>{"role": "user", "content": " héllo "}|4'
    with pytest.raises(SpecterError, match="roles must alternate"):
        t.render([{"role": "assistant", "content": "x"}])


def test_sandbox() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(SpecterError, match="chat template failed"):
        ChatTemplate("{{ messages.append({'role': 'user', 'content': 'y'}) }}", "gguf").render(messages)
    with pytest.raises(SpecterError, match="chat template failed"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "gguf").render(messages)
    assert messages == [{"role": "user", "content": "x"}]
    with pytest.raises(SpecterError, match="does not compile"):
        ChatTemplate("{% for %}", "gguf")


def test_normalize_messages() -> None:
    out = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": None, "name": "bot"}])
    assert out == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "", "name": "bot"}]
    for bad, match in [([], "empty"), ("hi", "list"), ([{"content": "x"}], "role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "image_url"),
                       ([{"role": "user", "content": 3}], "string")]:
        with pytest.raises(SpecterError, match=match):
            normalize_messages(bad)


def test_chat_session_keeps_history(model: Model) -> None:
    chat = ChatSession(model, system="Be brief.", n_predict=3, sampling=GREEDY)
    first = "".join(chat.send("Hi!"))
    assert [m["role"] for m in chat.history] == ["system", "user", "assistant"]
    assert chat.history[-1]["content"] == first
    gen = chat.send("And again?")
    second = gen.wait().text
    assert chat.history[-1]["content"] == second and len(chat.history) == 5
    want = [*MESSAGES, {"role": "assistant", "content": first}, {"role": "user", "content": "And again?"}]
    assert gen.prompt_tokens == chat_template(model).tokens(model, want)
    chat.reset()
    assert chat.history == [{"role": "system", "content": "Be brief."}]


def test_model_chat_equals_generate_on_template_tokens(model: Model) -> None:
    a = model.chat(MESSAGES, n_predict=5, sampling=GREEDY).wait()
    b = model.generate(chat_template(model).tokens(model, MESSAGES), n_predict=5, sampling=GREEDY).wait()
    assert a.text == b.text and a.tokens == b.tokens


def test_cli_chat_piped(shipped_model: Path, model: Model) -> None:
    stdin = "Hi!\n\n/reset\nHi!\n/exit\nnever read\n"
    result = CliRunner().invoke(cli, ["chat", str(shipped_model), "--device", "cpu", "-n", "3", "--temp", "0",
                                      "-s", "Be brief."], input=stdin)
    assert result.exit_code == 0, result.output
    reply = model.chat(MESSAGES, n_predict=3, sampling=GREEDY).wait().text
    assert result.stdout == f"{reply}\n{reply}\n"  # /reset: the second "Hi!" starts afresh
    assert "(history cleared)" in result.stderr and "chat template: gguf" in result.stderr


def test_cli_chat_end_of_input_and_history(shipped_model: Path, model: Model) -> None:
    result = CliRunner().invoke(cli, ["chat", str(shipped_model), "--device", "cpu", "-n", "2", "--temp", "0"],
                                input="one\ntwo\n")  # ends with Ctrl-D (end of input)
    assert result.exit_code == 0, result.output
    chat = ChatSession(model, n_predict=2, sampling=GREEDY)
    want = [chat.send("one").wait().text, chat.send("two").wait().text]
    assert result.stdout == "".join(w + "\n" for w in want)
