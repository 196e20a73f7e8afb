"""Chat templates and chat sessions.

A GGUF file's chat template (metadata ``tokenizer.chat_template``, a Hugging Face Jinja template) is
rendered in Jinja2's ``ImmutableSandboxedEnvironment`` with what HF's ``apply_chat_template`` provides:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``, ``raise_exception``,
``strftime_now`` and a ``tojson`` filter that keeps non-ASCII text as it is. A file without a template gets
the built-in ChatML template (``<|im_start|>role\\n...<|im_end|>``); ``ChatTemplate.source`` says which
one is in use.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .errors import SpecterError

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Generation, Model
    from .sampling import SamplingParams

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "ChatSession", "normalize_messages"]

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_STOP = ("<|im_end|>", "<|im_start|>")

ROLES = ("system", "user", "assistant", "tool", "developer", "function")


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's variant: keeps non-ASCII characters and does not HTML-escape (jinja's built-in one does).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and make each ``content`` a string (text parts of a list are joined;
    ``None`` becomes ""). Other keys (``name``, ``tool_calls``...) are kept for templates that use them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise SpecterError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise SpecterError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise SpecterError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
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
    _template: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.text)
        except TemplateError as e:
            raise SpecterError(f"the {self.source} chat template does not compile ({e})") from None

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
        """The prompt text for `messages` (extra keyword arguments, e.g. ``tools``, reach the template)."""
        from jinja2 import TemplateError

        msgs = normalize_messages(messages)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except TemplateError as e:
            raise SpecterError(f"the {self.source} chat template failed on these messages: {e}") from None

    def tokens(self, model: Model, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt: special-token text becomes its token; a BOS is put in front
        when the file asks for one and the template did not already write it."""
        text = self.render(messages, add_generation_prompt, **kwargs)
        tok = model.tokenizer
        add_bos = tok.add_bos and not (self.bos_token and text.startswith(self.bos_token))
        return tok.encode(text, add_bos=add_bos, special=True)


def chat_template(model: Model) -> ChatTemplate:
    """`model`'s chat template, made once per model."""
    t = getattr(model, "_specter_chat_template", None)
    if t is None:
        t = ChatTemplate.for_model(model)
        model._specter_chat_template = t  # type: ignore[attr-defined]
    return t


def start_chat(model: Model, messages: Sequence[Mapping[str, Any]], n_predict: int = -1,
               sampling: SamplingParams | None = None, stop: Sequence[str] = ()) -> Generation:
    """Generate the assistant's reply to `messages` (a Generation: iterate it to stream)."""
    t = chat_template(model)
    ids = t.tokens(model, messages)
    return model.generate(ids, n_predict=n_predict, sampling=sampling, stop=[*stop, *t.stop])


class ChatSession:
    """A conversation that keeps its history::

        chat = ChatSession(model, system="You are terse.")
        for piece in chat.send("Hi!"):
            print(piece, end="")
        chat.history  # [{'role': 'system', ...}, {'role': 'user', ...}, {'role': 'assistant', ...}]

    The reply joins the history once it is complete (or stopped); ``reset()`` forgets all but the system
    message.
    """

    def __init__(self, model: Model, system: str | None = None, n_predict: int = -1,
                 sampling: SamplingParams | None = None) -> None:
        self.model, self.system, self.n_predict, self.sampling = model, system, n_predict, sampling
        self.history: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str) -> Generation:
        """Add a user message and start the reply; iterate the result to stream it."""
        messages = [*self.history, {"role": "user", "content": text}]
        gen = start_chat(self.model, messages, n_predict=self.n_predict, sampling=self.sampling)
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
        return gen
