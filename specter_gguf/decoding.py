"""How a model produces tokens after the prompt: the decoders the engine delegates to.

A decoder turns the logits after the prompt into generated tokens, one at a time, over the generation's KV cache
(`Decoder.tokens`). The caller appends each token to `history` before asking for the next, and stops asking when
it has enough (at most `n_wanted`); a decoder ends when the context is full.

- `PlainDecoder`: one eager forward per token.
- `GraphDecoder`: each step replays a CUDA graph (`cuda_graphs.StepGraphs`), offloaded models included (their
  experts come from the residency table inside the graph); greedy decoding chooses on the device and runs one
  step ahead of the host.
- `speculation.SpeculativeDecoder`: drafts with the quantized experts and verifies in one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import torch

from specter_gguf.layers import KVCache
from specter_gguf.sampling import Sampler

if TYPE_CHECKING:
    from specter_gguf.cuda_graphs import StepGraphs
    from specter_gguf.engine import GenerationStats, Model


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


class GraphDecoder:
    """Decode steps as CUDA graphs over the model's reusable KV cache (a generation on a cache of its own, or
    with a routing observer attached, decodes eagerly)."""

    def __init__(self) -> None:
        self._graphs: StepGraphs | None = None
        self._cache: KVCache | None = None

    def graphs(self, model: Model, cache: KVCache) -> StepGraphs | None:
        """The one-token step graphs of `cache` when it is the model's reusable cache, else None."""
        if cache is not model.reusable_cache or model.routing_observer is not None:
            return None
        if self._cache is not cache:
            from specter_gguf.cuda_graphs import StepGraphs

            self._graphs, self._cache = StepGraphs(model.transformer, cache, offload=model.offload), cache
        return self._graphs

    def tokens(self, model: Model, logits: torch.Tensor, cache: KVCache, sampler: Sampler, history: list[int],
               stats: GenerationStats, n_wanted: int) -> Iterator[int]:
        graphs = self.graphs(model, cache)
        if graphs is None:
            yield from PlainDecoder().tokens(model, logits, cache, sampler, history, stats, n_wanted)
            return
        token = sampler.sample(logits, history)
        p = sampler.params
        if p.greedy and not p.penalties_active:
            yield from self._lookahead(model, token, cache, graphs)
            return
        while True:
            yield token
            if cache.length + 1 > model.ctx_size:
                return
            token = sampler.sample(graphs.step(history[-1:])[0], history)

    @staticmethod
    def _lookahead(model: Model, token: int, cache: KVCache, graphs: StepGraphs) -> Iterator[int]:
        """Greedy decoding from its first `token`: each graph also chooses the next token (the argmax, on the
        device) and feeds it to the next step, and the step of a token is enqueued before the token is read back,
        so the GPU computes while the host handles a token. The step of the last token yielded is thus computed
        even when the caller stops there; `cache.length` then leaves it out, as without the lookahead (its keys,
        past the length, are overwritten before any query may see them)."""
        chosen: Callable[[], int] = lambda: token  # the first token is on the host already
        feed: int | None = token  # the token the next step appends; None: the previous step's choice
        asked = cache.length  # the cache's length without the lookahead
        try:
            while cache.length + 1 <= model.ctx_size:
                ahead = graphs.greedy_step(feed)
                yield chosen()
                asked, chosen, feed = cache.length, ahead, None  # the caller asked past the step of that token
            yield chosen()
        finally:
            cache.truncate(asked)
