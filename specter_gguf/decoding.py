"""How a model produces tokens after the prompt: the decoders the engine delegates to.

A decoder turns the logits after the prompt into generated tokens, one at a time, over the generation's KV cache
(`Decoder.tokens`). The caller appends each token to `history` before asking for the next, and stops asking when
it has enough (at most `n_wanted`); a decoder ends when the context is full.

- `PlainDecoder`: one eager forward per token.
- `StepDecoder`: each step replays a CUDA graph (`cuda_graphs.StepGraphs`), offloaded models included (their
  experts come from the residency table inside the graph); decoding without penalties chooses each token on the
  device (the argmax, or a draw from the sampling chain) and runs one step ahead of the host.
- `speculation.SpeculativeDecoder`: drafts with the quantized experts and verifies in one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol, TypeVar

import torch

from specter_gguf.layers import KVCache
from specter_gguf.sampling import Sampler, SamplingParams, chain_candidates
from specter_gguf.steps import PhaseClock, Steps, make_steps

if TYPE_CHECKING:
    from specter_gguf.engine import GenerationStats, Model

T = TypeVar("T")


class Decoder(Protocol):
    def tokens(self, model: Model, logits: torch.Tensor, cache: KVCache, sampler: Sampler, history: list[int],
               stats: GenerationStats, n_wanted: int) -> Iterator[int]:
        """The generated tokens one by one, from `logits` after the prompt; the caller takes at most `n_wanted`
        of them. The forward pass of a token runs only when the next is asked for, so a generation that ends
        computes nothing more (except where a decoder says it looks ahead)."""
        ...


class PlainDecoder:
    """One eager forward per token."""

    def tokens(self, model: Model, logits: torch.Tensor, cache: KVCache, sampler: Sampler, history: list[int],
               stats: GenerationStats, n_wanted: int) -> Iterator[int]:
        token = sampler.sample(logits, history)  # reads the logits back: the step's host sync
        while True:
            yield token
            if cache.length + 1 > model.ctx_size:
                return
            logits = model.forward(torch.tensor(history[-1:], device=model.device), cache,
                                   observe=model.routing_observer)[-1]
            token = sampler.sample(logits, history)


class StepDecoder:
    """Decode steps judged on the device (`steps.Steps`) over the model's reusable KV cache: CUDA graphs where the
    model replays them, eager steps otherwise (the CPU, which tests the same algorithm). A generation on a cache
    of its own, or with a routing observer attached, decodes as `PlainDecoder`. Without penalties each step also
    chooses the next token itself (greedy: the argmax; sampled: a draw from the sampling chain) and runs one step
    ahead of the host; with penalties, which depend on the tokens so far, the host chooses."""

    def __init__(self) -> None:
        self._steps: dict[int | None, Steps] = {}  # sampled candidates (None: greedy) -> the steps over `_cache`
        self._cache: KVCache | None = None

    def steps(self, model: Model, cache: KVCache, sampled: SamplingParams | None) -> Steps | None:
        """The one-token steps of `cache` judged greedily or, with `sampled`, by a draw from its chain; None when
        `cache` is not the model's reusable cache or a routing observer is attached."""
        if cache is not model.reusable_cache or model.routing_observer is not None:
            return None
        if self._cache is not cache:
            self._steps, self._cache = {}, cache
        n_vocab = model.config.n_vocab
        key = None if sampled is None else chain_candidates(sampled, n_vocab)
        steps = self._steps.get(key)
        if steps is None:
            from specter_gguf.speculation.accept import SampledVerdict  # a one-token verdict is a plain draw

            verdict = None if sampled is None else SampledVerdict(sampled, 1, n_vocab, model.device)
            steps = self._steps[key] = make_steps(model, cache, 1, graphs=model.cuda_graphs, verdict=verdict)
        elif sampled is not None:
            steps.verdict.set(sampled)
        return steps

    def tokens(self, model: Model, logits: torch.Tensor, cache: KVCache, sampler: Sampler, history: list[int],
               stats: GenerationStats, n_wanted: int) -> Iterator[int]:
        p = sampler.params
        on_device = not p.penalties_active
        steps = self.steps(model, cache, None if p.greedy or not on_device else p)
        if steps is None:
            yield from PlainDecoder().tokens(model, logits, cache, sampler, history, stats, n_wanted)
            return
        token = sampler.sample(logits, history)
        clock = PhaseClock(model.device)
        try:
            if on_device:
                yield from self._ahead(model, token, cache, steps, clock, None if p.greedy else sampler)
                return
            while True:
                yield token
                if cache.length + 1 > model.ctx_size:
                    return
                logits = _timed(clock, steps, lambda: steps.step(history[-1:]))[0]
                token = sampler.sample(logits, history)
        finally:
            stats.gpu_s = clock.total("step") if clock.cuda else None

    @staticmethod
    def _ahead(model: Model, token: int, cache: KVCache, steps: Steps, clock: PhaseClock,
               sampler: Sampler | None) -> Iterator[int]:
        """Decoding from its first `token` where each step chooses the next token (its verdict: the argmax, or
        with `sampler` a draw from the uniform the sampler's generator gives it, as the host's draw would take it)
        and feeds it to the next step, and the step of a token is enqueued before the token is read back, so the
        device computes while the host handles a token. The step of the last token yielded is thus computed even
        when the caller stops there; `cache.length` then leaves it out, as without running ahead (its keys, past
        the length, are overwritten before any query may see them). `clock` times each step, the one ahead that no
        token was asked of left out."""
        chosen: Callable[[], int] = lambda: token  # the first token is on the host already
        feed: int | None = token  # the token the next step appends; None: the previous step's choice
        asked = cache.length  # the cache's length without the step ahead
        try:
            while cache.length + 1 <= model.ctx_size:
                if sampler is not None:
                    steps.verdict.take_uniforms(sampler)
                ahead = _timed(clock, steps, lambda: steps.step_ahead(feed))
                yield chosen()
                asked, chosen, feed = cache.length, ahead, None  # the caller asked past the step of that token
            yield chosen()
        finally:
            if cache.length > asked:
                clock.drop_last()
            cache.truncate(asked)


def _timed(clock: PhaseClock, steps: Steps, step: Callable[[], T]) -> T:
    """`step()` between two marks of `clock`: phase "step", or "capture" where it captured a CUDA graph (the capture
    is not decode time)."""
    captures = steps.captures
    clock.mark()
    out = step()
    clock.mark("step" if steps.captures == captures else "capture")
    return out
