"""The memory plan against what a run really allocates on a CUDA GPU (skipped elsewhere).

Each model is loaded with its experts offloaded (a budget of the plan's minimum plus one slot per MoE layer), at a
context of 4096 and of 32768 tokens; it prefills a prompt that fills the context but for the tokens it then
decodes. Torch's peak allocation (above the level before loading) must stay within the planned non-expert weights
+ KV cache + workspace + expert slots, and the transient part of it (the peak less the weights, slots and KV
storage present at the end) must be at least two thirds of the planned workspace: the plan hides no waste.
cuBLAS's workspace is made before measuring (the plan counts it apart from the workspace). What speculation holds
beyond a plain decoder, by the driver's count of free memory, must stay within the plan's speculation reserve.

    python -m pytest -q -s tests/test_memory_gpu.py   # on the GPU machine, about a minute
"""

from __future__ import annotations

import pytest
import torch

from cuda_support import free_device, require_native_cuda, warm_up

from specter_gguf.engine import Model
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime import plan_memory
from specter_gguf.sizes import format_size
from specter_gguf.sampling import SamplingParams
from specter_gguf.tokenizer import ids_only_unless_llama_cpp

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's allocator)")]

CONTEXTS = (4096, 32768)
DECODED = 16
TINY = [("qwen2moe", "f16"), ("qwen3moe", "f16"), ("llama", "f16"), ("olmoe", "f16"), ("tiny-deepseek2", "f16"),
        ("tiny-phimoe", "f16")]


@pytest.fixture(scope="module")
def qwen3_shaped(tmp_path_factory) -> str:
    """Two layers of Qwen3-30B-A3B (128 experts of 2048x768, top-8, grouped-query attention 32/4), F16."""
    from specter_gguf.synthetic.shapes import get_preset
    from specter_gguf.synthetic.writer import write_synthetic

    path = tmp_path_factory.mktemp("gpu-models") / "qwen3-30b-a3b-2layers-f16.gguf"
    write_synthetic(path, get_preset("qwen3-30b-a3b").with_layers(2), "f16", seed=0, device="cuda")
    return str(path)


def _measure(path, ctx: int) -> None:
    require_native_cuda()
    f = GGUFFile(path)
    full = plan_memory(f, 1 << 40, ctx, "cuda")
    budget = full.minimum + full.n_moe_layers * full.slot_bytes
    plan = plan_memory(f, budget, ctx, "cuda")
    warm_up()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    m = Model.load(path, device="cuda", ctx_size=ctx, progress=False, gpu_budget=budget, offload="lru",
                   tokenizer=ids_only_unless_llama_cpp())
    try:
        m.offload.store.wait()
        loaded = torch.cuda.memory_allocated() - base
        rng = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, m.config.n_vocab, (ctx - DECODED - 1,), generator=rng).tolist()
        g = m.generate(prompt, n_predict=DECODED, sampling=SamplingParams(temperature=0)).wait()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        cache = m._cache
        kv = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        transient = peak - loaded - kv
        # the slots the load sized from what the weights really took (`slots_after_load`): the plan's count, or more
        # where the allocator's rounding stayed under the plan's worst case
        assert m.memory_plan.n_slots >= plan.n_slots
        planned = plan.non_expert + plan.kv_cache + plan.workspace + m.memory_plan.slots_bytes
        print(f"\n{f.path.name} ctx {ctx}: peak {format_size(peak)} (planned {format_size(planned)}); loaded "
              f"{format_size(loaded)} (planned weights {format_size(plan.non_expert)} + slots "
              f"{format_size(m.memory_plan.slots_bytes)}), KV {format_size(kv)} (planned {format_size(plan.kv_cache)}), "
              f"transient {format_size(transient)} (planned workspace {format_size(plan.workspace)}, "
              f"{plan.workspace / max(transient, 1):.2f}x); generated {len(g.tokens)}")
        assert len(g.tokens) == DECODED
        assert peak <= planned, f"peak {peak} above the plan {planned}"
        assert plan.workspace <= 1.5 * transient, f"planned workspace {plan.workspace} > 1.5 x measured {transient}"
    finally:
        m.offload.close()
        del m
        free_device()


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("arch,kind", TINY)
def test_tiny_models_stay_within_the_plan(tiny_models, arch: str, kind: str, ctx: int) -> None:
    _measure(tiny_models[(arch, kind)], ctx)


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_qwen3_shapes_stay_within_the_plan(qwen3_shaped, ctx: int) -> None:
    _measure(qwen3_shaped, ctx)


def test_a_model_larger_than_the_free_memory_runs_without_flags(tiny_models, monkeypatch, caplog) -> None:
    """With the free device memory capped (what the planner sees) below the model's size, a load without
    --gpu-budget offloads within the free memory less FIT_MARGIN and says so in one line; --offload none
    refuses with the figures; `run` with no memory flag works and gives the plain engine's tokens."""
    from click.testing import CliRunner

    from specter_gguf.cli import cli
    from specter_gguf.errors import SpecterError
    from specter_gguf.runtime import budget

    require_native_cuda()
    path = tiny_models[("qwen2moe", "f16")]
    whole = plan_memory(GGUFFile(path), 1 << 40, 256, "cuda")
    free = budget.FIT_MARGIN + whole.minimum + whole.n_moe_layers * whole.slot_bytes  # fits, offloaded
    assert free - budget.FIT_MARGIN < whole.fixed + whole.resident_expert_bytes
    plain = Model.load(path, device="cuda", ctx_size=256, progress=False, cuda_graphs=False,
                       tokenizer=ids_only_unless_llama_cpp())
    expected = plain.generate([5, 17, 300, 42], n_predict=12, sampling=SamplingParams(temperature=0)).wait().tokens
    del plain
    free_device()
    monkeypatch.setattr(budget, "free_device_memory", lambda device: free)
    with caplog.at_level("WARNING", logger="specter_gguf"):
        m = Model.load(path, device="cuda", ctx_size=256, progress=False, tokenizer=ids_only_unless_llama_cpp())
    assert m.offload is not None and m.memory_plan.budget == free - budget.FIT_MARGIN
    assert any("offloaded within a budget" in r.getMessage() for r in caplog.records)
    assert m.generate([5, 17, 300, 42], n_predict=12, sampling=SamplingParams(temperature=0)).wait().tokens == expected
    m.offload.close()
    del m
    free_device()
    with pytest.raises(SpecterError, match=r"needs .* is free; drop --offload none"):
        Model.load(path, device="cuda", ctx_size=256, progress=False, offload="none")
    r = CliRunner().invoke(cli, ["run", str(path), "-p", "Hi", "-n", "4", "--device", "cuda", "-c", "256"])
    assert r.exit_code == 0 and "offloaded within a budget" in r.output, r.output


def _device_use(path: str, draft: str | None) -> int:
    """Device memory (the driver's count: allocator reserve, graphs, everything) that loading `path` whole and
    decoding greedily, then sampled over the whole vocabulary (top-k 0: the widest verdict buffers), took; with a
    draft, at every depth `--n-draft auto` may verify at (each captures its own graphs), deepest first as the
    benchmark's warm-up does, then at depth auto."""
    from specter_gguf.speculation import MAX_DEPTH

    require_native_cuda()
    free_device()
    before = torch.cuda.mem_get_info()[0]
    m = Model.load(path, draft=draft, device="cuda", ctx_size=512, progress=False, n_draft="auto" if draft else None,
                   tokenizer=ids_only_unless_llama_cpp())
    assert m.cuda_graphs
    every_token = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    for depth in [*range(MAX_DEPTH, 0, -1), "auto"] if draft else [None]:
        if depth is not None:
            m.decoder.set_depth(depth)
        for params in (SamplingParams(temperature=0), every_token):
            m.generate([5, 17, 300, 42, 7], n_predict=48, sampling=params, ignore_eos=True).wait()
    torch.cuda.synchronize()
    used = before - torch.cuda.mem_get_info()[0]
    del m
    free_device()
    return used


def test_speculation_stays_within_its_reserve(qwen3_shaped) -> None:
    """What a speculative decoder holds on the device beyond a plain decoder of the same model and its draft's
    experts (CUDA graphs of draft steps and of a verification per depth, verdict buffers, the allocator's share)
    stays within the plan's `speculation` line. The model stands in as its own draft."""
    warm_up()
    plain = _device_use(qwen3_shaped, None)
    spec = _device_use(qwen3_shaped, qwen3_shaped)
    plan = plan_memory(GGUFFile(qwen3_shaped), 1 << 40, 512, "cuda", draft=GGUFFile(qwen3_shaped))
    extra = spec - plain - plan.draft_experts
    print(f"\nspeculation held {format_size(extra)} beyond the plain decoder and the draft experts "
          f"(reserve {format_size(plan.speculation)}; plain {format_size(plain)}, speculative {format_size(spec)})")
    assert extra <= plan.speculation
