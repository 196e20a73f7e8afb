"""Decode steps replayed as CUDA graphs against the eager engine (the reference), on the GPU.

Same model, same prompt, same tokens fed to both: the graph reads a fixed window of the KV cache with a mask
(masked attention kernel) where the eager step reads exactly the used keys, so logits differ by rounding only:
per step max|graph - eager| / max|eager| must stay within 1e-3. The prompts end just below a window boundary
(`StepGraphs.WINDOW`) so decoding captures a second window, over the same storage: the graphs reserve the whole
context up front, so the first window's graph stays usable. Generation without penalties, which lets the graphs
choose and feed each next token themselves one step ahead of the host (the argmax, or a draw from the sampler's
next uniform), must give exactly the tokens of stepping the same graphs with the host's sampler, and leave the
cache as long. Runs only on a CUDA GPU with the native CUDA build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specter_gguf import native
from specter_gguf.cuda_graphs import StepGraphs
from specter_gguf.engine import Model
from specter_gguf.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and native.has_cuda()),
                                reason="needs a CUDA GPU and libspecter built with CUDA")

MODELS = ["qwen2moe", "qwen3moe", "llama", "olmoe", "tiny-deepseek2", "tiny-deepseek2-lite", "tiny-phimoe"]
STEPS = 12


def _prompt(n: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 900, size=n)]


@pytest.mark.parametrize("kind", ["f16", "q4_k_m"])
@pytest.mark.parametrize("arch", MODELS)
@torch.inference_mode()
def test_graph_steps_match_eager_steps(tiny_models, arch: str, kind: str) -> None:
    t = Model.load(tiny_models[(arch, kind)], device="cuda", progress=False, cuda_graphs=False).transformer
    prompt = torch.tensor(_prompt(StepGraphs.WINDOW - 5), device="cuda")
    eager_cache, graph_cache = t.new_cache(1024), t.new_cache(1024)
    token = int(t.forward(prompt, eager_cache, last_only=True)[-1].argmax())
    t.forward(prompt, graph_cache, last_only=True)
    graphs = StepGraphs(t, graph_cache)
    storage = graph_cache.k[0].data_ptr()
    assert graph_cache.capacity == 1024, "the graphs reserve the whole context before they capture"
    worst = 0.0
    for _ in range(STEPS):
        eager = t.forward(torch.tensor([token], device="cuda"), eager_cache)[-1]
        graph = graphs.step([token])[0]
        worst = max(worst, float((graph - eager).abs().max() / eager.abs().max()))
        token = int(eager.argmax())
    assert graph_cache.length == eager_cache.length == StepGraphs.WINDOW - 5 + STEPS
    assert graph_cache.k[0].data_ptr() == storage, "the storage moved under the graphs"
    assert sorted(graphs._graphs) == [StepGraphs.WINDOW, 2 * StepGraphs.WINDOW]
    print(f"{arch} {kind}: max rel {worst:.2e}")
    assert worst <= 1e-3, f"max rel {worst:.2e}"


@pytest.mark.parametrize("arch", ["qwen2moe", "tiny-deepseek2"])
def test_generation_with_graphs_equals_without(tiny_models, arch: str) -> None:
    """Greedy tokens with graphs equal the eager engine's, the graphs and the cache are reused by the next
    generation, and a generation started while another runs decodes on its own cache."""
    path = tiny_models[(arch, "f16")]
    greedy = SamplingParams(temperature=0)
    prompt = _prompt(40, seed=5)
    eager = Model.load(path, device="cuda", progress=False, cuda_graphs=False).generate(prompt, 24, greedy).wait()
    m = Model.load(path, device="cuda", progress=False)
    assert m.cuda_graphs
    first = m.generate(prompt, 24, greedy).wait()
    captured = dict(m.decoder._steps[None]._graphs)
    second = m.generate(prompt, 24, greedy).wait()
    assert first.tokens == second.tokens == eager.tokens
    assert m.decoder._steps[None]._graphs == captured, "the second generation must replay the graphs of the first"
    outer = iter(m.generate(prompt, 24, greedy))
    next(outer)
    inner = m.generate(prompt, 24, greedy).wait()
    assert inner.tokens == eager.tokens
    for _ in outer:
        pass


@torch.inference_mode()
def _stepped(model: Model, prompt: list[int], n_predict: int, params: SamplingParams) -> tuple[list[int], int]:
    """Tokens from `StepGraphs.step` fed with the host sampler's choice (what generation does without running
    ahead), up to `n_predict`, an end-of-generation token (included) or a full context; and the cache's length."""
    t, sampler = model.transformer, Sampler(params)
    cache = t.new_cache(model.ctx_size)
    graphs = StepGraphs(t, cache)
    tokens = [sampler.sample(t.forward(torch.tensor(prompt, device="cuda"), cache, last_only=True)[-1])]
    while len(tokens) != n_predict and cache.length < model.ctx_size and not model.tokenizer.is_eog(tokens[-1]):
        tokens.append(sampler.sample(graphs.step(tokens[-1:])[0]))
    return tokens, cache.length


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(seed=4),
                                    SamplingParams(seed=9, top_k=0, temperature=1.3)])
@pytest.mark.parametrize("n_predict, ctx_extra", [(12, None), (-1, 6)])  # stops at the limit; at a full context
@pytest.mark.parametrize("arch", ["qwen2moe", "tiny-deepseek2"])
def test_running_ahead_equals_stepping_the_graphs(tiny_models, arch: str, n_predict: int, ctx_extra: int | None,
                                                  params: SamplingParams) -> None:
    """The prompt ends just below a window boundary: a chained step captures the next window. The step computed
    ahead of the last token is left out of the cache's length, and the next generation gives the same tokens."""
    prompt = _prompt(StepGraphs.WINDOW - 5, seed=11)
    ctx = None if ctx_extra is None else len(prompt) + ctx_extra
    m = Model.load(tiny_models[(arch, "f16")], device="cuda", progress=False, ctx_size=ctx)
    expected, length = _stepped(m, prompt, n_predict, params)
    eog = m.tokenizer.is_eog(expected[-1])
    assert eog or length == (ctx or len(prompt) + n_predict - 1)
    for _ in range(2):
        gen = m.generate(prompt, n_predict, params).wait()
        assert gen.tokens == (expected[:-1] if eog else expected)
        assert gen.finish_reason == ("stop" if eog else "length")
        assert m._cache.length == length
        # the GPU's time in the steps of the tokens handed out (the capture and the step ahead left out); the host
        # runs ahead, so the second token's step may start on the GPU before the first token is handed out (H100,
        # 2026-12-06: 3-10% of decode_s past it): at most one step's time lies before decode_s begins
        steps = len(gen.tokens) - 1
        assert 0 < gen.stats.gpu_s <= gen.stats.decode_s + gen.stats.gpu_s / steps


@torch.inference_mode()
def test_the_graphs_of_one_cache_share_their_memory(tiny_models) -> None:
    """Speculative decoding captures a verification graph per depth: once the draft step's and the first
    verifications' graphs are there, the graphs of five more depths reserve less memory than two graphs of their own
    pools would (a private pool takes at least a 2 MiB segment of small blocks). A first generation at depth 8
    sizes the routing agreement's buffers for it, so that lower depths keep the graphs already captured (a deeper
    agreement buffer would drop them all)."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    m = Model.load(target, draft=draft, device="cuda", progress=False, ctx_size=256, n_draft=8)
    greedy = SamplingParams(temperature=0.0)

    def reserved_after(depth: int) -> int:
        m.decoder.set_depth(depth)
        m.generate(_prompt(20), 12, greedy, ignore_eos=True).wait()
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved()

    reserved_after(8)
    at_one = reserved_after(1)
    one = reserved_after(2) - at_one  # the verification graph of depth 2
    before = torch.cuda.memory_reserved()
    for depth in range(3, 8):
        reserved_after(depth)
    added = torch.cuda.memory_reserved() - before
    assert m.decoder._captures() >= 9, "the draft step's and every depth's verification graphs"
    assert added <= 2 * max(one, 2 << 20), f"five more depths' graphs reserved {added} bytes (one: {one})"
