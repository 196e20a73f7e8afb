"""The engine's KV cache reuse on the CPU: generation after generation on one cache, and a generation started
while another is running (it gets a cache of its own), give the tokens of a fresh model."""

from __future__ import annotations

from pathlib import Path

from specter_gguf.engine import Model
from specter_gguf.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def test_generations_reuse_one_cache(shipped_model: Path) -> None:
    m = Model.load(shipped_model, device="cpu", progress=False)
    long_first = m.generate("A long prompt that fills the cache further than the next one does", 12, GREEDY).wait()
    cache = m._cache
    short = m.generate("Hello", 12, GREEDY).wait()
    assert m._cache is cache and not m._cache_in_use
    fresh = Model.load(shipped_model, device="cpu", progress=False)
    assert short.tokens == fresh.generate("Hello", 12, GREEDY).wait().tokens
    assert long_first.tokens == fresh.generate(long_first.prompt_tokens, 12, GREEDY).wait().tokens


def test_interleaved_generations_do_not_share_the_cache(shipped_model: Path) -> None:
    m = Model.load(shipped_model, device="cpu", progress=False)
    alone = m.generate("Once upon a time", 16, GREEDY).wait().tokens
    outer = m.generate("Once upon a time", 16, GREEDY)
    pieces = iter(outer)
    next(pieces)
    inner = m.generate("Once upon a time", 16, GREEDY).wait()
    for _ in pieces:
        pass
    assert inner.tokens == outer.tokens == alone
    assert not m._cache_in_use
