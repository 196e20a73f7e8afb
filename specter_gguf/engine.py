"""The public engine: load a GGUF MoE model once, then compute logits or generate text many times."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.layers import Transformer
from specter_gguf.models import load_transformer
from specter_gguf.sampling import Sampler, SamplingParams
from specter_gguf.tokenizer import Tokenizer

SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen2moe.gguf"


def resolve_device(device: str | None) -> torch.device:
    """`None` picks CUDA when present, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise SpecterError(f"unknown device '{device}'; use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecterError("--device cuda was asked for but PyTorch sees no CUDA GPU; use --device cpu")
    return torch.device(device)


@dataclass
class GenerationStats:
    """Timings of one generation. `prefill_s` runs from the start to the first generated token, `decode_s`
    from there to the last; TPOT and tokens/s describe the decode phase."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tpot_ms(self) -> float:
        steps = self.generated_tokens - 1
        return 1000.0 * self.decode_s / steps if steps > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_ms": self.tpot_ms, "tokens_per_s": self.tokens_per_s}

    def summary(self) -> str:
        return (f"prompt {self.prompt_tokens} tokens, generated {self.generated_tokens} tokens, "
                f"prefill {self.prefill_s * 1000:.1f} ms, TPOT {self.tpot_ms:.2f} ms, "
                f"{self.tokens_per_s:.1f} tokens/s")


@dataclass
class Generation:
    """A generation in progress: iterate to stream text pieces; afterwards `text`, `tokens`,
    `finish_reason` ("stop" at an end-of-generation token or a stop string, "length" at the token limit
    or a full context) and `stats` hold the result."""

    prompt_tokens: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    _pieces: Iterator[str] | None = None

    def __iter__(self) -> Iterator[str]:
        assert self._pieces is not None, "a Generation is made by Model.generate"
        return self._pieces

    def wait(self) -> Generation:
        """Run to the end without streaming; returns self."""
        for _ in self:
            pass
        return self


class Model:
    """A GGUF Mixture-of-Experts model on one device. `Model.load(path)` then `generate` / `logits`."""

    def __init__(self, path: Path, transformer: Transformer, tokenizer: Tokenizer, ctx_size: int) -> None:
        self.path, self.transformer, self.tokenizer, self.ctx_size = path, transformer, tokenizer, ctx_size
        self.config = transformer.config
        self.device = transformer.token_embd.device

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, device: str | None = None,
             ctx_size: int | None = None, progress: bool = True) -> Model:
        """Load `path` (default: the small model shipped in `models/`) onto `device` ("cpu", "cuda";
        default CUDA when present). `ctx_size` defaults to the context length the model was trained for."""
        path = Path(path) if path is not None else SHIPPED_MODEL
        dev = resolve_device(device)
        f = GGUFFile(path)
        transformer = load_transformer(f, dev, progress)
        if ctx_size is not None and ctx_size <= 0:
            raise SpecterError(f"context size must be positive, got {ctx_size}")
        return cls(path, transformer, Tokenizer.from_gguf(path), ctx_size or transformer.config.n_ctx_train)

    # -- tokens ----------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _check_tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        if len(tokens) == 0:
            raise SpecterError("no tokens to evaluate: the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < self.config.n_vocab]
        if bad:
            raise SpecterError(f"token id {bad[0]} is out of range: the vocabulary has {self.config.n_vocab} tokens")
        return torch.tensor(list(tokens), dtype=torch.long, device=self.device)

    # -- evaluation ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 logits [len(tokens), n_vocab] of one forward pass over `tokens` from an empty context."""
        ids = self._check_tokens(tokens)
        cache = self.transformer.new_cache(len(tokens))
        return self.transformer.forward(ids, cache).cpu().numpy()

    def generate(self, prompt: str | Sequence[int], n_predict: int = 128,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = ()) -> Generation:
        """Generate up to `n_predict` tokens (-1: until the end of generation or a full context) after
        `prompt` (text, or token ids used as they are). Iterate the result to stream text."""
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_tokens(prompt_ids)
        if len(prompt_ids) >= self.ctx_size:
            raise SpecterError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.ctx_size}; "
                               f"shorten it or raise -c/--ctx-size")
        gen = Generation(prompt_tokens=prompt_ids)
        gen._pieces = self._run(gen, n_predict, Sampler(sampling or SamplingParams()), list(stop))
        return gen

    @torch.inference_mode()
    def _run(self, gen: Generation, n_predict: int, sampler: Sampler, stop: list[str]) -> Iterator[str]:
        limit = n_predict if n_predict >= 0 else self.ctx_size
        stats = gen.stats
        stats.prompt_tokens = len(gen.prompt_tokens)
        cache = self.transformer.new_cache(self.ctx_size)
        decoder = self.tokenizer.stream(continuation=True)  # generated text continues the prompt
        history = list(gen.prompt_tokens)
        emitted = 0  # characters of gen.text already yielded
        start = time.perf_counter()
        logits = self.transformer.forward(self._check_tokens(gen.prompt_tokens), cache)[-1]
        first_token_at = None
        cut = None
        while gen.finish_reason is None:
            if len(gen.tokens) >= limit:
                gen.finish_reason = "length"
                break
            token = sampler.sample(logits, history)  # reads the logits back: the step's host sync
            if first_token_at is None:
                first_token_at = time.perf_counter()
                stats.prefill_s = first_token_at - start
            if self.tokenizer.is_eog(token):
                gen.finish_reason = "stop"
                break
            gen.tokens.append(token)
            history.append(token)
            gen.text += decoder.push(token)
            cut = _find_stop(gen.text, stop, emitted)
            if cut is not None:
                gen.text, gen.finish_reason = gen.text[:cut], "stop"
            elif len(gen.tokens) < limit:
                if cache.length + 1 > self.ctx_size:
                    gen.finish_reason = "length"
                else:
                    logits = self.transformer.forward(torch.tensor([token], device=self.device), cache)[-1]
            safe = len(gen.text) if gen.finish_reason else len(gen.text) - _stop_prefix_len(gen.text, stop)
            if safe > emitted:
                yield gen.text[emitted:safe]
                emitted = safe
        if cut is None:  # a stop string ends the text; otherwise complete a dangling UTF-8 sequence
            tail = decoder.flush()
            gen.text += tail
            if len(gen.text) > emitted:
                yield gen.text[emitted:]
        stats.generated_tokens = len(gen.tokens)
        if first_token_at is not None:
            stats.decode_s = time.perf_counter() - first_token_at


def _find_stop(text: str, stop: list[str], emitted: int) -> int | None:
    """Index in `text` where the earliest stop string begins, looking only where it could be new."""
    hits = [i for s in stop if s and (i := text.find(s, max(0, emitted - len(s)))) >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string (held back)."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
