"""The engine on the CPU: KV cache reuse (generation after generation on one cache, and a generation started while
another is running, which gets a cache of its own, give the tokens of a fresh model); steps judged on the device
(`StepDecoder`, eager on the CPU) give the plain decoder's tokens; a model loaded with an ids-only tokenizer, and
generations that ignore end-of-generation tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specter_gguf.decoding import StepDecoder
from specter_gguf.engine import Model, plan_budget
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime.budget import plan_memory
from specter_gguf.sampling import SamplingParams
from specter_gguf.tokenizer import IdsOnlyTokenizer

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


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(seed=3), SamplingParams(seed=8, top_k=0, top_p=0.9),
                                    SamplingParams(seed=5, temperature=1.5, min_p=0.0),
                                    SamplingParams(seed=2, repeat_penalty=1.3)])
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_steps_judged_on_the_device_give_the_plain_tokens(shipped_model: Path, params: SamplingParams,
                                                          offloaded: bool) -> None:
    """Each step chooses the next token (the argmax, or a draw from the sampler's next uniform) and runs one step
    ahead; with penalties the host chooses. Either way the tokens are the plain decoder's, up to the limit and up
    to a full context, and the step computed ahead is left out of the next generation's cache; offloaded too (a
    cache of top-k slots a layer, which evicts: the runtime's bookkeeping runs a step behind the device)."""
    load = {}
    if offloaded:
        plan = plan_memory(GGUFFile(shipped_model), 1 << 40, 48, "cpu")
        load = {"offload": "lru", "gpu_budget": plan.minimum + plan.n_moe_layers * plan.slot_bytes}
    plain = Model.load(shipped_model, device="cpu", progress=False, ctx_size=48, **load)
    stepped = Model.load(shipped_model, device="cpu", progress=False, ctx_size=48, **load)
    stepped.decoder = StepDecoder()
    prompt = "Once upon a time, in a land far away,"
    for n_predict in (20, -1, 7):
        expected = plain.generate(prompt, n_predict, params).wait()
        got = stepped.generate(prompt, n_predict, params).wait()
        assert got.tokens == expected.tokens, n_predict
        assert got.finish_reason == expected.finish_reason
    assert len(expected.tokens) == 7 and len(got.tokens) == 7
    assert stepped.decoder._steps, "the steps were expected to run, not the plain decoder"
    if offloaded:
        assert stepped.offload_mode == "lru" and got.stats.cache_evictions > 0


class _EndsAt(IdsOnlyTokenizer):
    """Ids only, and `token` ends generation."""

    def __init__(self, token: int) -> None:
        self.token = token

    def is_eog(self, token_id: int) -> bool:
        return token_id == self.token


def test_ids_only_tokenizer_and_ignore_eos(shipped_model: Path) -> None:
    m = Model.load(shipped_model, device="cpu", progress=False)
    ids = m.tokenize("Once upon a time")
    real = m.generate(ids, 8, GREEDY).wait()
    ids_only = Model.load(shipped_model, device="cpu", progress=False, tokenizer=IdsOnlyTokenizer())
    g = ids_only.generate(ids, 8, GREEDY).wait()
    assert g.tokens == real.tokens and g.text == "" and g.finish_reason == "length"
    with pytest.raises(SpecterError, match="token ids only"):
        ids_only.generate("Once upon a time", 8, GREEDY)
    ends = Model.load(shipped_model, device="cpu", progress=False, tokenizer=_EndsAt(real.tokens[0]))
    stopped = ends.generate(ids, 8, GREEDY).wait()
    assert stopped.tokens == [] and stopped.finish_reason == "stop"
    assert ends.generate(ids, 8, GREEDY, ignore_eos=True).wait().tokens == real.tokens


def test_a_context_past_the_training_one_is_warned_about(shipped_model: Path, caplog) -> None:
    """As llama.cpp does: a context above the model's training context loads, with a warning naming both."""
    import logging

    with caplog.at_level(logging.WARNING, logger="specter_gguf"):
        m = Model.load(shipped_model, device="cpu", progress=False, ctx_size=1024)
    assert m.ctx_size == 1024
    assert any("1024 tokens exceeds the 512" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specter_gguf"):
        Model.load(shipped_model, device="cpu", progress=False, ctx_size=512)
    assert not [r for r in caplog.records if "exceeds" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="specter_gguf"):  # the plan of such a run warns the same
        plan_budget(shipped_model, "1GiB", ctx_size=2048, device="cpu")
    assert any("2048 tokens exceeds the 512" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_a_closed_generation_reports_what_it_made(shipped_model: Path, draft: bool) -> None:
    """Ctrl-C in `run` or `chat` closes the generation: its stats then describe the tokens it made, not zeros."""
    m = Model.load(shipped_model, device="cpu", progress=False, **({"draft": "q8_0", "n_draft": 3} if draft else {}))
    gen = m.generate("Once upon a time", 64, SamplingParams(temperature=0))
    pieces = iter(gen)
    for _ in range(5):
        next(pieces)
    gen.close()
    s = gen.stats
    assert 5 <= s.generated_tokens == len(gen.tokens) < 64 and s.decode_s > 0 and gen.finish_reason is None
    unread = m.generate("Once upon a time", 8)
    unread.close()  # before its first piece: the prompt and the context are known all the same
    assert unread.stats.prompt_tokens == len(unread.prompt_tokens) > 0 and unread.stats.ctx_size == m.ctx_size
    if draft:  # the decoder's figures are final too
        assert s.draft_rounds > 0 and s.draft_s > 0 and s.verify_s > 0
        assert s.draft_accepted + s.draft_rounds >= s.generated_tokens - 1


def test_zero_tokens_still_evaluates_the_prompt(shipped_model: Path) -> None:
    """-n 0 as llama.cpp reads it: the prompt is evaluated (its time reported), nothing is generated."""
    gen = Model.load(shipped_model, device="cpu", progress=False).generate("Once upon a time", 0).wait()
    assert gen.tokens == [] and gen.text == "" and gen.finish_reason == "length" and gen.stats.prefill_s > 0


def test_a_drawn_seed_is_logged_and_repeats_the_generation(shipped_model: Path, caplog) -> None:
    """As llama.cpp prints its sampler's seed: a sampled generation without a seed logs the one drawn (-v), and
    that seed repeats it; greedy and seeded generations log none."""
    import logging
    import re

    m = Model.load(shipped_model, device="cpu", progress=False)
    with caplog.at_level(logging.INFO, logger="specter_gguf"):
        drawn = m.generate("Once", 12, SamplingParams(temperature=1.0)).wait()
        m.generate("Once", 2, SamplingParams(temperature=0)).wait()
        m.generate("Once", 2, SamplingParams(temperature=1.0, seed=5)).wait()
    (seed,) = [int(x) for x in re.findall(r"sampling seed (\d+) \(drawn at random", caplog.text)]
    assert m.generate("Once", 12, SamplingParams(temperature=1.0, seed=seed)).wait().tokens == drawn.tokens


def test_api_arguments_of_the_wrong_type_are_one_error_line(shipped_model: Path) -> None:
    """A wrong type at the Python API is a SpecterError naming the argument, not a TypeError from deep inside."""
    from specter_gguf.chat import ChatSession

    m = Model.load(shipped_model, device="cpu", progress=False)
    for call, match in [(lambda: Model.load(shipped_model, device="cpu", ctx_size="512"), "context size"),
                        (lambda: m.generate("hi", n_predict="4"), "n_predict"),
                        (lambda: m.generate("hi", n_predict=None), "n_predict"),
                        (lambda: m.generate(None), "token ids must be a list"),
                        (lambda: m.generate(["a", "b"]), "token ids must be integers"),
                        (lambda: m.generate([1.5, 2]), "token ids must be integers"),
                        (lambda: m.generate("hi", stop=[1]), "stop"),
                        (lambda: m.generate("hi", stop=5), "stop"),
                        (lambda: m.generate("hi", sampling={"temperature": 0}), "SamplingParams"),
                        (lambda: m.tokenize(None), "tokenize takes text"),
                        (lambda: m.detokenize([10**6]), "out of range"),
                        (lambda: m.detokenize("abc"), "token ids must be a list"),
                        (lambda: ChatSession(m).send(None), "send takes"),
                        (lambda: ChatSession(m, sampling={"temperature": 0}), "SamplingParams"),
                        (lambda: m.generate("hi", ignore_eos="no"), "ignore_eos"),
                        (lambda: m.create_completion("hi", stream="no"), "stream must be True or False"),
                        (lambda: m.create_completion("hi", model=3), "model must be a name"),
                        (lambda: m.create_completion("hi", echo=True), "echo not supported"),
                        (lambda: m.create_chat_completion([{"role": "user", "content": "hi"}], tools=[]),
                         "tools not supported")]:
        with pytest.raises(SpecterError, match=match):
            call()
    # llama-cpp-python's readings: no stop list, max_tokens <= 0 (no limit), seed -1 (random); logits of text
    greedy = SamplingParams(temperature=0)
    assert m.generate("hi", 3, greedy, stop=None).wait().tokens == m.generate("hi", 3, greedy).wait().tokens
    out = m.create_completion("Once", max_tokens=0, seed=-1)
    assert out["usage"]["completion_tokens"] >= 1
    # llama-cpp-python's `model` names the results
    assert m.create_completion("Once", max_tokens=1, model="mine")["model"] == "mine"
    chunks = list(m.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=1, model="mine",
                                           stream=True))
    assert {c["model"] for c in chunks} == {"mine"}
    assert (m.logits("import os") == m.logits(m.tokenize("import os"))).all()


def test_close_frees_the_model_and_a_closed_model_says_so(shipped_model: Path) -> None:
    """close() (or the end of a `with` block) lets the weights, the expert cache and the draft go while the Model
    object lives on, ends the generations not yet iterated to their end where they are, and a later call says the
    model was closed."""
    import gc
    import weakref

    greedy = SamplingParams(temperature=0)
    with Model.load(shipped_model, device="cpu", progress=False, gpu_budget="20MiB", draft="q2_k") as m:
        assert m.offload_mode == "lru" and m.draft is not None
        want = m.generate("import os", 4, greedy).wait().tokens
        held = weakref.ref(m.transformer), weakref.ref(m.offload), weakref.ref(m.decoder)
        started, unstarted = m.generate("import os", 8, greedy), m.generate("import os", 8, greedy)
        first = next(iter(started))
    assert "".join([first, *started]) == started.text and started.finish_reason is None  # ended where it was
    assert list(unstarted) == [] and unstarted.tokens == []
    gc.collect()
    assert [ref() for ref in held] == [None, None, None]
    for call in (lambda: m.generate("import os", 4), lambda: m.logits([1, 2])):
        with pytest.raises(SpecterError, match="tiny-qwen2moe.gguf was closed: load it again"):
            call()
    m.close()  # twice is harmless
    again = Model.load(shipped_model, device="cpu", progress=False, gpu_budget="20MiB", draft="q2_k")
    assert again.generate("import os", 4, greedy).wait().tokens == want


def test_a_draft_no_smaller_than_the_model_is_warned_of(shipped_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The model as its own draft (what `--draft f16` makes of an F16 model) keeps as many expert bytes on the
    device as the model: a warning says so, and it runs; a quantized draft gets none."""
    import logging

    with caplog.at_level(logging.WARNING, logger="specter_gguf"):
        Model.load(shipped_model, device="cpu", progress=False, draft=shipped_model)
    assert "no fewer bytes than the model's own (12.00 MiB)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specter_gguf"):
        Model.load(shipped_model, device="cpu", progress=False, draft="q2_k")
    assert "no fewer bytes" not in caplog.text


def test_phase_clock_totals_a_phase_and_forgets_the_last() -> None:
    import time

    from specter_gguf.steps import PhaseClock

    clock = PhaseClock(torch.device("cpu"))  # wall time on the CPU
    for phase, seconds in (("step", 0.02), ("capture", 0.05), ("step", 0.01), ("step", 0.2)):
        clock.mark()
        time.sleep(seconds)
        clock.mark(phase)
    clock.drop_last()
    assert 0.03 <= clock.total("step") < 0.06 and clock.total("capture") >= 0.05
