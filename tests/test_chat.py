"""Chat templates (the GGUF's own, the ChatML fallback, HF template helpers, the sandbox, hostile templates
and the rendering process that bounds them), chat sessions, and `specter-gguf chat` driven through piped
standard input."""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specter_gguf.chat import (
    CHATML_TEMPLATE,
    MAX_OUTPUT_CHARS,
    RENDER_TIMEOUT_S,
    WORKER_MEMORY_BYTES,
    ChatSession,
    ChatTemplate,
    chat_template,
    normalize_messages,
)
from specter_gguf.cli import cli
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError, TemplateError
from specter_gguf.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
CHATML_TEXT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>"
    " XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud."
    " You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first)"
    " or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}\n"
    "{%- set ns = namespace(system='', count=0) %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set ns.system = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- ns.system + '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message['role'] == 'user') != (ns.count % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- set ns.count = ns.count + 1 %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
EXPECTED = {  # (template, messages, add_generation_prompt, tools): as rendered before the worker existed
    ("chatml", "M1", True, False): (
        "<|im_start|>system\n" "Be brief.<|im_end|>\n" "<|im_start|>user\n" "Hi!<|im_end|>\n"
        "<|im_start|>assistant\n"),
    ("chatml", "M2", True, False): (
        "<|im_start|>user\n" " héllo \n" "<|im_end|>\n" "<|im_start|>assistant\n" "yo<|im_end|>\n"
        "<|im_start|>user\n" "again<|im_end|>\n" "<|im_start|>assistant\n"),
    ("chatml", "M3", False, False): (
        "<|im_start|>user\n" "weather?<|im_end|>\n" "<|im_start|>assistant\n" "<|im_end|>\n"
        "<|im_start|>tool\n" "21 C<|im_end|>\n" "<|im_start|>tool\n" "sunny<|im_end|>\n"),
    ("qwen", "M1", True, False): (
        "<|im_start|>system\n" "Be brief.<|im_end|>\n" "<|im_start|>user\n" "Hi!<|im_end|>\n"
        "<|im_start|>assistant\n"),
    ("qwen", "M1", False, True): (
        "<|im_start|>system\n" "Be brief.\n" "\n" "# Tools\n" "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n" "<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n"
        "</tools><|im_end|>\n" "<|im_start|>user\n" "Hi!<|im_end|>\n"),
    ("qwen", "M2", True, True): (
        "<|im_start|>system\n" "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n" "\n"
        "# Tools\n" "\n" "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n"
        "</tools><|im_end|>\n" "<|im_start|>user\n" " héllo \n" "<|im_end|>\n" "<|im_start|>assistant\n"
        "yo<|im_end|>\n" "<|im_start|>user\n" "again<|im_end|>\n" "<|im_start|>assistant\n"),
    ("qwen", "M3", True, False): (
        "<|im_start|>system\n"
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n" "<|im_start|>user\n"
        "weather?<|im_end|>\n" "<|im_start|>assistant\n" "<tool_call>\n"
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n" "</tool_call><|im_end|>\n"
        "<|im_start|>user\n" "<tool_response>\n" "21 C\n" "</tool_response>\n" "<tool_response>\n" "sunny\n"
        "</tool_response><|im_end|>\n" "<|im_start|>assistant\n"),
    ("qwen", "M3", True, True): (
        "<|im_start|>system\n" "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n" "\n"
        "# Tools\n" "\n" "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n"
        "</tools><|im_end|>\n" "<|im_start|>user\n" "weather?<|im_end|>\n" "<|im_start|>assistant\n"
        "<tool_call>\n" "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n"
        "</tool_call><|im_end|>\n" "<|im_start|>user\n" "<tool_response>\n" "21 C\n" "</tool_response>\n"
        "<tool_response>\n" "sunny\n" "</tool_response><|im_end|>\n" "<|im_start|>assistant\n"),
    ("llama", "M1", True, False): (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n" "\n" "Today Date: 26 Jul 2024\n" "\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n" "\n"
        "Hi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n" "\n"),
    ("llama", "M2", False, False): (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n" "\n" "Today Date: 26 Jul 2024\n" "\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n" "\n"
        "héllo<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n" "\n"
        "yo<|eot_id|><|start_header_id|>user<|end_header_id|>\n" "\n" "again<|eot_id|>"),
}


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
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}", "gguf")


def test_normalize_messages() -> None:
    out = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": None, "name": "bot"}])
    assert out == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "", "name": "bot"}]
    assert normalize_messages([{"role": "assistant", "tool_calls": []}])[0]["content"] == ""  # only it may leave it out
    for bad, match in [([], "empty"), ("hi", "list"), ([{"content": "x"}], "role"),
                       ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content': give its text"),
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
    # a reply not read when the next message is sent is finished first: the next reply follows it, as read
    unread = chat.send("Hi!")
    gen = chat.send("And again?")
    gen.wait()
    assert unread.text == first and chat.history[2] == {"role": "assistant", "content": first}
    assert gen.prompt_tokens == chat_template(model).tokens(model, want)


def test_chat_session_seeds_each_reply(model: Model) -> None:
    """With a seed the n-th reply draws with seed + n (llama-cli seeds a session once; a new seed per reply made
    every turn repeat the first one's random stream): a session repeats, its turns differ."""
    sampled = SamplingParams(temperature=1.0, seed=3)
    chat = ChatSession(model, n_predict=6, sampling=sampled)
    first, second = chat.send("Hi!").wait().text, chat.send("Hi!").wait().text
    history = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "Hi!"}]
    assert model.chat(history, n_predict=6, sampling=SamplingParams(temperature=1.0, seed=4)).wait().text == second
    again = ChatSession(model, n_predict=6, sampling=sampled)
    assert [again.send("Hi!").wait().text, again.send("Hi!").wait().text] == [first, second]


def test_model_chat_equals_generate_on_template_tokens(model: Model) -> None:
    a = model.chat(MESSAGES, n_predict=5, sampling=GREEDY).wait()
    b = model.generate(chat_template(model).tokens(model, MESSAGES), n_predict=5, sampling=GREEDY).wait()
    assert a.text == b.text and a.tokens == b.tokens


def test_model_chat_takes_stop_as_generate_does(model: Model) -> None:
    """One text is one stop string (not a string of one-character ones), None is none."""
    full = model.chat(MESSAGES, n_predict=12, sampling=GREEDY).wait()
    assert len(full.text) > 4
    word = full.text[2:5]
    one = model.chat(MESSAGES, n_predict=12, sampling=GREEDY, stop=word).wait()
    listed = model.chat(MESSAGES, n_predict=12, sampling=GREEDY, stop=[word]).wait()
    assert one.text == listed.text == full.text[:full.text.index(word)] and one.finish_reason == "stop"
    assert model.chat(MESSAGES, n_predict=12, sampling=GREEDY, stop=None).wait().text == full.text


def test_cli_chat_piped(shipped_model: Path, model: Model) -> None:
    stdin = "Hi!\n\n/reset\n/rest\nHi!\n/exit\nnever read\n"  # /rest: a mistyped command, not a message
    result = CliRunner().invoke(cli, ["chat", str(shipped_model), "--device", "cpu", "-n", "3", "--temp", "0",
                                      "-s", "Be brief."], input=stdin)
    assert result.exit_code == 0, result.output
    reply = model.chat(MESSAGES, n_predict=3, sampling=GREEDY).wait().text
    assert result.stdout == f"{reply}\n{reply}\n"  # /reset: the second "Hi!" starts afresh
    assert "(history cleared)" in result.stderr and "chat template: gguf" in result.stderr
    assert "unknown command /rest: /reset clears the history, /exit or Ctrl-D quits" in result.stderr


def test_cli_chat_end_of_input_and_history(shipped_model: Path, model: Model) -> None:
    result = CliRunner().invoke(cli, ["chat", str(shipped_model), "--device", "cpu", "-n", "2", "--temp", "0"],
                                input="one\ntwo\n")  # ends with Ctrl-D (end of input)
    assert result.exit_code == 0, result.output
    chat = ChatSession(model, n_predict=2, sampling=GREEDY)
    want = [chat.send("one").wait().text, chat.send("two").wait().text]
    assert result.stdout == "".join(w + "\n" for w in want)


def test_cli_chat_past_the_context_suggests_a_reset(shipped_model: Path) -> None:
    """A conversation that outgrows the context is one error line that says /reset starts over, and the session
    goes on: after /reset a short message is answered."""
    result = CliRunner().invoke(cli, ["chat", str(shipped_model), "--device", "cpu", "-n", "2", "--temp", "0",
                                      "-c", "64"], input="word " * 80 + "\n/reset\nHi!\n")
    assert result.exit_code == 0, result.output
    (line,) = _error_lines(result.stderr)
    assert "the context holds 64" in line and line.endswith("(/reset starts over)")
    assert result.stdout.strip() != ""


# -- real templates render as before; hostile ones end in one TemplateError, in bounded time and memory --------

MARGIN_S = 1.5  # for a loaded machine: the limit is RENDER_TIMEOUT_S, this is slack for killing and restarting
RENDERS = {
    "M1": MESSAGES,
    "M2": [{"role": "user", "content": " héllo \n"}, {"role": "assistant", "content": "yo"},
           {"role": "user", "content": "again"}],
    "M3": [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
           {"role": "tool", "content": "21 C"}, {"role": "tool", "content": "sunny"}],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TEMPLATES = {"chatml": (CHATML_TEMPLATE, ""), "qwen": (QWEN25_TEMPLATE, ""),
             "llama": (LLAMA3_TEMPLATE, "<|begin_of_text|>")}
HOSTILE = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "took more than 2 s to render"),
    "huge format": ("{{ '%020000000d' % 1 }}", "wrote more than"),
    "huge range": ("{% for i in range(10**9) %}{% endfor %}", r"OverflowError: Range too big"),
    "recursive macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "division by zero": ("{{ 1/0 }}", "ZeroDivisionError"),
    "type error": ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    "too much memory": ("{{ ('x' * 10**9) | length }}", f"more than {WORKER_MEMORY_BYTES >> 20} MB of memory"),
    "too much output": ("{% set s = messages[0]['content'] * 100 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
                        "wrote more than"),
    # folded into a constant while compiling: slow (time-out) or big (memory), depending on the machine
    "huge constant": ("{% set s = 'x' * 10**8 %}{{ (s ~ s ~ s ~ s ~ s ~ s) | length }}",
                      f"took more than 2 s to|more than {WORKER_MEMORY_BYTES >> 20} MB of memory"),
    "syntax error": ("{% for x in %}", "does not compile"),
}
NORMAL = ChatTemplate(CHATML_TEMPLATE, "builtin-chatml")


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: "-".join(map(str, k)))
def test_real_templates_render_as_before(key: tuple[str, str, bool, bool]) -> None:
    name, messages, add_generation_prompt, tools = key
    text, bos = TEMPLATES[name]
    t = ChatTemplate(text, "gguf", bos_token=bos, eos_token="<|eot_id|>")
    kwargs = {"tools": TOOLS} if tools else {}
    assert t.render(RENDERS[messages], add_generation_prompt=add_generation_prompt, **kwargs) == EXPECTED[key]


def test_shipped_template_renders_as_before(model: Model) -> None:
    t = ChatTemplate.for_model(model)
    for m in ("M1", "M2"):
        assert t.render(RENDERS[m]) == EXPECTED[("chatml", m, True, False)]
    assert t.render(RENDERS["M3"], add_generation_prompt=False) == EXPECTED[("chatml", "M3", False, False)]
    llama = ChatTemplate(LLAMA3_TEMPLATE, "gguf")
    with pytest.raises(TemplateError, match="refused these messages: Conversation roles must alternate"):
        llama.render(RENDERS["M3"])


def test_render_cost(model: Model) -> None:
    """The worker process costs well under a millisecond a render (about 0.02 ms on an idle machine)."""
    t = ChatTemplate.for_model(model)
    for _ in range(20):
        t.render(MESSAGES)
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        t.render(MESSAGES)
    assert (time.perf_counter() - start) / n < 0.002


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template(name: str) -> None:
    text, match = HOSTILE[name]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.monotonic()
    with pytest.raises(TemplateError, match=match) as e:
        ChatTemplate(text, "gguf").render(MESSAGES)
    assert time.monotonic() - start < RENDER_TIMEOUT_S + MARGIN_S
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 << 10  # the work was not done here
    message = str(e.value)
    assert message.startswith("the model's chat template ") and "--chat-template-file" in message
    assert "\n" not in message and len(message) < 600
    assert NORMAL.render(MESSAGES) == CHATML_TEXT  # the next render works, in a fresh worker where needed


def test_output_cap() -> None:
    t = ChatTemplate("{% for i in range(n) %}{{ 'x' * 100 }}{% endfor %}", "gguf")
    assert t.render(MESSAGES, n=9_000) == "x" * 900_000  # big is fine
    with pytest.raises(TemplateError, match=r"wrote more than 1,0\d\d,\d\d\d characters") as e:
        t.render(MESSAGES, n=11_000)
    assert int(str(e.value).split("more than ")[1].split()[0].replace(",", "")) < MAX_OUTPUT_CHARS + 2_000
    # a long conversation is not cut: the cap grows with the input
    long = [{"role": "user", "content": "y" * 1_500_000}]
    assert NORMAL.render(long) == f"<|im_start|>user\n{'y' * 1_500_000}<|im_end|>\n<|im_start|>assistant\n"


def test_error_text_from_the_template_is_one_safe_line() -> None:
    t = ChatTemplate("{{ raise_exception('bad\\n\\x1b[31mred' * 1000) }}", "gguf")
    with pytest.raises(TemplateError, match=r"refused these messages: bad \\x1b\[31mred") as e:
        t.render(MESSAGES)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value) and len(str(e.value)) < 400


def test_ctrl_c_stops_a_render() -> None:
    t = ChatTemplate(HOSTILE["nested loops"][0], "gguf")
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        t.render(MESSAGES)
    assert time.monotonic() - start < 0.3 + MARGIN_S
    assert NORMAL.render(MESSAGES) == CHATML_TEXT


def test_threads_share_the_worker() -> None:
    t = ChatTemplate(QWEN25_TEMPLATE, "gguf")
    want = EXPECTED[("qwen", "M3", True, True)]
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.extend(t.render(RENDERS["M3"], tools=TOOLS)
                                                              for _ in range(50))) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [want] * 200


@pytest.fixture(scope="module")
def hostile_model_path(shipped_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile-template") / "tiny-hostile-template.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(shipped_model), str(path),
                    "--chat-template", HOSTILE["nested loops"][0], "--force"], check=True, capture_output=True)
    return path


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def test_cli_chat_hostile_file(hostile_model_path: Path) -> None:
    start = time.monotonic()
    result = CliRunner().invoke(cli, ["chat", str(hostile_model_path), "--device", "cpu", "-n", "2"], input="Hi!\n")
    assert result.exit_code == 0, result.output
    assert time.monotonic() - start < RENDER_TIMEOUT_S + 30  # the model load included
    (line,) = _error_lines(result.stderr)
    assert line.startswith("Error: the model's chat template took more than 2 s to render and was stopped; ")
    assert result.stdout == ""


@pytest.mark.parametrize("name", ["huge format", "recursive macro", "type error", "too much memory", "syntax error"])
def test_cli_chat_hostile_template(name: str, shipped_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text, match = HOSTILE[name]
    monkeypatch.setattr(ChatTemplate, "for_model", classmethod(lambda cls, model: cls(text, "gguf")))
    result = CliRunner().invoke(cli, ["chat", str(shipped_model), "--device", "cpu", "-n", "2"], input="Hi!\nHo!\n")
    compiles = name != "syntax error"
    assert result.exit_code == (0 if compiles else 1), result.output
    lines = _error_lines(result.stderr)
    assert len(lines) == (2 if compiles else 1)  # one line a turn, or one line in all when it does not compile
    assert all(line.startswith("Error: the model's chat template ") and re.search(match, line) for line in lines)
    assert not any("/reset" in line for line in lines)  # starting over renders the same template
