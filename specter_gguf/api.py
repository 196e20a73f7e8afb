"""llama-cpp-python / OpenAI–shaped results over the engine: ``create_completion`` and
``create_chat_completion`` return the same dicts as ``llama_cpp.Llama``'s methods of those names (and as
OpenAI's ``/v1/completions`` and ``/v1/chat/completions``), or, with ``stream=True``, an iterator of chunks.
The HTTP server formats its answers with the same functions.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from .errors import SpecterError
from .gguf_file import model_name
from .sampling import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Generation, Model

__all__ = ["create_completion", "create_chat_completion", "start_completion", "start_chat_completion",
           "completion_result", "completion_chunks", "chat_result", "chat_chunks", "usage"]


def _max_tokens(max_tokens: int | None) -> int:
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise SpecterError(f"max_tokens must be a whole number or None, got {max_tokens!r}")
    if max_tokens is None or max_tokens <= 0:
        return -1  # llama-cpp-python's: until the end of generation or a full context
    return max_tokens


def _prompt_ids(model: Model, prompt: str | Sequence[int]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _prompt_ids(model, prompt[0])  # a batch of one
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise SpecterError("prompt must be a string or a list of token ids (batches of several prompts are not supported)")


def start_completion(model: Model, prompt: str | Sequence[int], max_tokens: int | None = 16,
                     sampling: SamplingParams | None = None, stop: str | Sequence[str] | None = None,
                     ignore_eos: bool = False) -> Generation:
    """A Generation for a completion request (nothing is computed until it is iterated)."""
    return model.generate(_prompt_ids(model, prompt), n_predict=_max_tokens(max_tokens), sampling=sampling,
                          stop=stop, ignore_eos=ignore_eos)


def start_chat_completion(model: Model, messages: Sequence[Mapping[str, Any]], max_tokens: int | None = None,
                          sampling: SamplingParams | None = None, stop: str | Sequence[str] | None = None,
                          ignore_eos: bool = False) -> Generation:
    """A Generation for the assistant's reply to `messages`, prompted through the chat template."""
    from .chat import start_chat

    return start_chat(model, messages, n_predict=_max_tokens(max_tokens), sampling=sampling, stop=stop,
                      ignore_eos=ignore_eos)


def usage(gen: Generation) -> dict[str, int]:
    p, c = len(gen.prompt_tokens), len(gen.tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _head(kind: str, model_name: str, id_: str | None, created: int | None) -> dict[str, Any]:
    prefix = "cmpl-" if kind.startswith("text") else "chatcmpl-"
    return {"id": id_ or prefix + uuid.uuid4().hex, "object": kind,
            "created": created if created is not None else int(time.time()), "model": model_name}


def completion_result(gen: Generation, model_name: str, id_: str | None = None,
                      created: int | None = None) -> dict[str, Any]:
    """Run `gen` to the end; the ``text_completion`` object."""
    gen.wait()
    return {**_head("text_completion", model_name, id_, created),
            "choices": [{"text": gen.text, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}],
            "usage": usage(gen)}


def completion_chunks(gen: Generation, model_name: str, id_: str | None = None, created: int | None = None,
                      include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """Stream `gen` as ``text_completion`` chunks: one per text piece, then one with ``finish_reason``
    (and, with `include_usage`, a last one with empty ``choices`` and the ``usage``, as OpenAI sends)."""
    head = _head("text_completion", model_name, id_, created)
    for piece in gen:
        yield {**head, "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}]}
    yield {**head, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(gen)}


def chat_result(gen: Generation, model_name: str, id_: str | None = None,
                created: int | None = None) -> dict[str, Any]:
    """Run `gen` to the end; the ``chat.completion`` object."""
    gen.wait()
    return {**_head("chat.completion", model_name, id_, created),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                         "logprobs": None, "finish_reason": gen.finish_reason}],
            "usage": usage(gen)}


def chat_chunks(gen: Generation, model_name: str, id_: str | None = None, created: int | None = None,
                include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """Stream `gen` as ``chat.completion.chunk`` objects: the role first, then content deltas, then an
    empty delta with ``finish_reason`` (and optionally a usage chunk)."""
    head = _head("chat.completion.chunk", model_name, id_, created)

    def chunk(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for piece in gen:
        yield chunk({"content": piece})
    yield chunk({}, gen.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": usage(gen)}


def sampling_params(temperature: float, top_p: float, top_k: int, min_p: float, repeat_penalty: float,
                    presence_penalty: float, frequency_penalty: float, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, seed=None if seed == -1 else seed)  # -1: random


def _refuse(call: str, unsupported: Mapping[str, Any]) -> None:
    """llama-cpp-python's arguments that this API does not take: one error naming them (not a TypeError)."""
    if unsupported:
        raise SpecterError(f"{call}: {', '.join(sorted(unsupported))} not supported (the arguments taken are "
                           f"llama-cpp-python's prompt or messages, max_tokens, temperature, top_p, top_k, min_p, "
                           f"stop, seed, presence_penalty, frequency_penalty, repeat_penalty, stream and model)")


def _check_stream(stream: bool) -> None:
    if not isinstance(stream, bool):
        raise SpecterError(f"stream must be True or False, not {stream!r}")


def _result_name(llm: Model, model: str | None) -> str:
    """The name a result carries: `model` where given (llama-cpp-python's argument), else the file's."""
    if model is not None and not isinstance(model, str):
        raise SpecterError(f"model must be a name (text) for the results, not {type(model).__name__}")
    return model if model is not None else model_name(llm.path)


def create_completion(llm: Model, prompt: str | Sequence[int], max_tokens: int | None = 16,
                      temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                      stop: str | Sequence[str] | None = None, seed: int | None = None,
                      presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                      stream: bool = False, model: str | None = None,
                      **unsupported: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """Complete `prompt` (text or token ids) on `llm`, with llama-cpp-python's defaults. ``max_tokens=None`` or
    ``<= 0`` generates until the end of the text or a full context; ``seed=-1`` draws one; `model` names the
    results (default: the file's name). Other arguments of llama-cpp-python's (echo, logprobs, suffix, ...) are
    refused with a SpecterError naming them."""
    _refuse("create_completion", unsupported)
    _check_stream(stream)
    name = _result_name(llm, model)
    sp = sampling_params(temperature, top_p, top_k, min_p, repeat_penalty, presence_penalty, frequency_penalty, seed)
    gen = start_completion(llm, prompt, max_tokens, sp, stop)
    return completion_chunks(gen, name) if stream else completion_result(gen, name)


def create_chat_completion(llm: Model, messages: Sequence[Mapping[str, Any]], max_tokens: int | None = None,
                           temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                           stop: str | Sequence[str] | None = None, seed: int | None = None,
                           presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                           repeat_penalty: float = 1.0, stream: bool = False, model: str | None = None,
                           **unsupported: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """Answer OpenAI-style `messages` on `llm` through the model's chat template, with llama-cpp-python's
    defaults (``max_tokens=None`` or ``<= 0``: until the end of the reply or a full context; ``seed=-1`` draws one;
    `model` names the results). Other arguments of llama-cpp-python's (tools, response_format, logprobs, ...) are
    refused with a SpecterError naming them."""
    _refuse("create_chat_completion", unsupported)
    _check_stream(stream)
    name = _result_name(llm, model)
    sp = sampling_params(temperature, top_p, top_k, min_p, repeat_penalty, presence_penalty, frequency_penalty, seed)
    gen = start_chat_completion(llm, messages, max_tokens, sp, stop)
    return chat_chunks(gen, name) if stream else chat_result(gen, name)
