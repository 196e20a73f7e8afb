"""The offload runtime on a CUDA GPU: every mode gives the plain engine's greedy tokens, the GPU budget is honoured
(torch's peak allocation and the device's free-memory delta), copies run on the copy stream.

Run on the GPU machine (about a minute on an H200; writes a ~2.3 GB 2-layer Qwen1.5-MoE-shaped F16 model):

    python -m pytest -q -s tests/test_offload_gpu.py

Skipped without CUDA (CI): the CPU path of the same runtime is tested by tests/test_runtime.py.
"""

from __future__ import annotations

import pytest
import torch

from cuda_support import free_device, require_native_cuda, warm_up

from specter_gguf.engine import Model
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime import MODES, plan_memory
from specter_gguf.sizes import format_size
from specter_gguf.sampling import SamplingParams
from specter_gguf.tokenizer import ids_only_unless_llama_cpp

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: the offload runtime's CUDA path (copy stream, events, "
                                        "device budget) runs on the GPU machine; tests/test_runtime.py covers the CPU")]

GREEDY = SamplingParams(temperature=0.0)
CTX = 256
N_TOKENS = 32
PROMPT = [11, 23, 5, 42, 7, 19]  # token ids: the test needs no tokenizer


def _plain_tokens(path, graphs: bool = True) -> list[int]:
    """Greedy tokens of the model all on the GPU, decoded on the execution path of the offloaded run compared with
    (CUDA graphs, or eager for gate-prefetch): graphs attend with another kernel (a masked window), whose f16
    rounding can flip a near-tie of random weights (seen on the H200: two logits 0.004 apart); graphs against
    eager steps is `test_cuda_graphs`' business."""
    m = Model.load(path, device="cuda", ctx_size=CTX, progress=False, cuda_graphs=graphs,
                   tokenizer=ids_only_unless_llama_cpp())
    tokens = m.generate(PROMPT, n_predict=N_TOKENS, sampling=GREEDY).wait().tokens
    del m
    free_device()
    return tokens


def _run_within_budget(path, budget: int, **load) -> tuple[list[int], object, int, int]:
    """Load with offloading and generate; returns tokens, stats, torch's peak allocation and the device
    free-memory drop (both above the level before loading)."""
    warm_up()
    base_alloc = torch.cuda.memory_allocated()
    free_before, _ = torch.cuda.mem_get_info()
    torch.cuda.reset_peak_memory_stats()
    m = Model.load(path, device="cuda", ctx_size=CTX, progress=False, gpu_budget=budget,
                   tokenizer=ids_only_unless_llama_cpp(), **load)
    m.offload.store.wait()
    g = m.generate(PROMPT, n_predict=N_TOKENS, sampling=GREEDY).wait()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base_alloc
    free_after, _ = torch.cuda.mem_get_info()  # the caching allocator keeps what it reserved: a peak too
    m.offload.close()
    del m
    free_device()
    return g.tokens, g.stats, peak, free_before - free_after


@pytest.fixture(scope="module")
def qwen_shaped(tmp_path_factory) -> str:
    """Two layers of Qwen1.5-MoE-A2.7B (60 experts of 2048x1408, top-4, shared expert), F16, random weights."""
    from specter_gguf.synthetic.shapes import get_preset
    from specter_gguf.synthetic.writer import write_synthetic

    path = tmp_path_factory.mktemp("gpu-models") / "qwen1.5-moe-2layers-f16.gguf"
    write_synthetic(path, get_preset("qwen1.5-moe-a2.7b").with_layers(2), "f16", seed=0, device="cuda")
    return str(path)


@pytest.mark.parametrize("arch,kind", [("qwen2moe", "f16"), ("llama", "f16"), ("qwen2moe", "q4_k_m"),
                                       ("tiny-deepseek2", "f16"), ("tiny-phimoe", "q4_k_m")])
def test_tiny_models_every_mode_matches(tiny_models, arch: str, kind: str) -> None:
    require_native_cuda()
    path = tiny_models[(arch, kind)]
    expected = {graphs: _plain_tokens(path, graphs) for graphs in (True, False)}
    p = plan_memory(GGUFFile(path), 1 << 40, CTX, "cuda")
    budget = p.minimum + p.n_moe_layers * p.slot_bytes  # top_k + 1 slots per layer
    for mode in MODES:
        # room for one spare a layer, asked for: the default keeps at most half the room beyond the top-k
        spares = {"spare_slots": 1} if mode == "lru" else {}
        tokens, s, peak, _ = _run_within_budget(path, budget, offload=mode, **spares)
        print(f"\n{arch}-{kind} {mode}: {s.summary()}")
        assert tokens == expected[mode != "gate-prefetch"], mode
        assert s.cache_misses > 0 and (mode == "on-demand" or s.cache_evictions > 0)
        assert (s.spare_fetches > 0) == (mode == "lru")
        assert peak <= budget, f"{mode}: torch peak {peak} above the budget {budget}"


def test_budget_is_honoured_and_every_mode_matches(qwen_shaped) -> None:
    require_native_cuda()
    f = GGUFFile(qwen_shaped)
    full = plan_memory(f, 1 << 40, CTX, "cuda")
    # about half of the experts cached
    budget = full.fixed + (full.n_experts_total // 2) * full.slot_bytes
    plan = plan_memory(f, budget, CTX, "cuda")
    print("\n" + plan.describe())
    assert not plan.fits_all and plan.n_slots >= plan.n_moe_layers * plan.top_k
    expected = {graphs: _plain_tokens(qwen_shaped, graphs) for graphs in (True, False)}
    runs = [dict(offload=mode) for mode in MODES] + [dict(offload="lru", cache_policy="lfu"),
                                                     dict(offload="lru", spare_slots=0)]
    for load in runs:
        tokens, s, peak, used = _run_within_budget(qwen_shaped, budget, **load)
        print(f"{load}: {s.summary()}\n  torch peak {format_size(peak)}, device free-memory drop {format_size(used)}, "
              f"budget {format_size(budget)}")
        assert tokens == expected[load["offload"] != "gate-prefetch"], load
        assert peak <= budget, f"{load}: torch peak {peak} above the budget {budget}"
        assert used <= budget, f"{load}: the device lost {used} bytes of free memory, above the budget {budget}"
        assert s.peak_gpu_bytes is not None and s.bytes_moved_per_token > 0
        # lru's kernels copy misses into the spare slots (by default 8 a layer here: twice the top-k)
        assert (s.spare_fetches > 0) == (load["offload"] == "lru" and load.get("spare_slots") != 0)
        assert 0 <= s.copy_exposed_s <= s.copy_s and s.copy_hidden_s == pytest.approx(s.copy_s - s.copy_exposed_s)


def test_minimum_budget_global_partition_never_reads_an_overwritten_slot(qwen_shaped) -> None:
    """The smallest legal cache shared by all layers (lfu: one global partition): every layer evicts the slots
    the previous layer's kernels just read, so the last-use events are what keeps the output right."""
    require_native_cuda()
    plan = plan_memory(GGUFFile(qwen_shaped), 1 << 40, CTX, "cuda")
    expected = _plain_tokens(qwen_shaped)
    tokens, s, peak, _ = _run_within_budget(qwen_shaped, plan.minimum, offload="lru", cache_policy="lfu")
    print(f"\nminimum budget {format_size(plan.minimum)}: {s.summary()}")
    assert tokens == expected
    assert peak <= plan.minimum


def test_budget_below_minimum_refused(qwen_shaped) -> None:
    from specter_gguf.errors import SpecterError

    plan = plan_memory(GGUFFile(qwen_shaped), 1 << 40, CTX, "cuda")
    before = torch.cuda.memory_allocated()
    with pytest.raises(SpecterError, match=str(plan.minimum)):
        Model.load(qwen_shaped, device="cuda", ctx_size=CTX, progress=False, gpu_budget=plan.minimum - 1)
    assert torch.cuda.memory_allocated() == before  # refused before loading anything


def test_close_gives_the_device_memory_back(qwen_shaped) -> None:
    """close() on an offloaded CUDA model whose decode steps captured CUDA graphs leaves torch's allocation where
    it was before the load (within a MiB) and its allocator's reserve within 64 MiB of it, while the Model object
    lives on: a next model (another draft, say) gets that memory. A failure lists the segments left."""
    require_native_cuda()
    full = plan_memory(GGUFFile(qwen_shaped), 1 << 40, CTX, "cuda")
    budget = full.fixed + (full.n_experts_total // 2) * full.slot_bytes
    warm_up()
    free_device()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    before = {seg["address"] for seg in torch.cuda.memory_snapshot()}
    m = Model.load(qwen_shaped, device="cuda", ctx_size=CTX, progress=False, gpu_budget=budget,
                   tokenizer=ids_only_unless_llama_cpp())
    m.generate(PROMPT, n_predict=8, sampling=GREEDY).wait()
    held = torch.cuda.memory_allocated() - base
    assert m.cuda_graphs and m.offload is not None and held > budget // 2, held
    m.close()
    left, cached = torch.cuda.memory_allocated() - base, torch.cuda.memory_reserved() - base_reserved
    kept = [(seg["total_size"], seg["allocated_size"], seg["segment_pool_id"], seg["stream"])
            for seg in torch.cuda.memory_snapshot() if seg["address"] not in before]
    print(f"\nheld {format_size(held)} before close; after it {format_size(left)} allocated, {format_size(cached)} "
          f"more reserved than before the load, in segments (bytes, allocated, pool, stream) {kept}")
    assert left < (1 << 20) and cached < (64 << 20), kept
