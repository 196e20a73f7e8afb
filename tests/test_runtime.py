"""The offload runtime on the CPU: memory plan, expert store, cache policies, routing hooks, and that every
offload mode generates exactly the no-offload engine's greedy tokens with a cache small enough to evict."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from small_cache import small_cache

from specter_gguf.cli import cli
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime import MODES, DeviceRoutingCounts, OffloadCounters, RoutingProfile, plan_memory
from specter_gguf.runtime.budget import SPECULATION, moe_layers, record_layout, speculation_bytes
from specter_gguf.config import ModelConfig
from specter_gguf.sampling import SamplingParams
from specter_gguf.sizes import parse_size
from specter_gguf.synthetic.shapes import TINY_ARCH_PRESETS

GREEDY = SamplingParams(temperature=0.0)
CTX = 128
N_TOKENS = 32
PROMPT = "The expert cache"


# ---------------------------------------------------------------------------------------------- sizes, plan
@pytest.mark.parametrize("text,expected", [("16GiB", 16 << 30), ("12000MiB", 12000 << 20), ("1.5GB", 1_500_000_000),
                                           ("16G", 16 << 30), ("1024", 1024), ("512 MiB", 512 << 20),
                                           ("16 GiB", 16 << 30), ("16GB", 16 * 10**9), ("1.5GiB", int(1.5 * 2**30)),
                                           ("2TiB", 2 << 40), ("16gib", 16 << 30)])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "16 parsecs", "GiB", "-1GiB", "16XB"])
def test_parse_size_rejects(bad: str) -> None:
    with pytest.raises(SpecterError, match="cannot read the size"):
        parse_size(bad)


def test_a_plan_of_the_whole_model_counts_each_expert_in_its_own_type(tiny_models) -> None:
    """Q4_K_M files mix expert types between layers, and a cache slot is sized for the largest record: where the
    whole model fits, the split counts the experts' own bytes, so a budget of exactly the whole model leaves 0 B."""
    pytest.importorskip("llama_cpp")
    f = GGUFFile(tiny_models[("qwen2moe", "q4_k_m")])
    full = plan_memory(f, "64GiB", CTX, "cuda")
    assert full.slot_bytes * full.n_slots > full.resident_expert_bytes  # mixed types: slots would overcount
    exact = plan_memory(f, full.whole_model, CTX, "cuda")
    assert exact.fits_all
    text = exact.describe()
    assert re.search(r"^  routed experts, all resident +\S+ \S+ ", text, re.M), text
    assert re.search(r"^  unassigned +0 B ", text, re.M) and "short of" not in text, text


def test_plan_splits_the_budget(shipped_model) -> None:
    f = GGUFFile(shipped_model)
    cfg = ModelConfig.from_gguf(f)
    huge = plan_memory(f, "64GiB", CTX, "cuda")
    assert huge.fits_all and huge.n_slots == huge.n_experts_total == cfg.n_layer * cfg.n_expert
    slot = max(record_layout(f, cfg, i).nbytes for i in moe_layers(f, cfg))
    assert huge.slot_bytes == slot and slot % 256 == 0
    # the tensors in the allocator's 512-byte blocks, and on CUDA one block per MoE layer for its router's counter
    counters = 512 * len(moe_layers(f, cfg))
    tensors = sum((t.n_bytes + 511) // 512 * 512 for n, t in f.tensors.items() if "_exps." not in n)
    # on CUDA the token embedding stays in host memory when the experts are offloaded (an LM head of its own here);
    # a plain load, which the budget's `fits_all` is about, takes it onto the device
    embedding = (f.tensor("token_embd.weight").n_bytes + 511) // 512 * 512
    assert f.has_tensor("output.weight") and huge.host_embedding == embedding
    # plus, on CUDA, the caching allocator's worst case: 1 MiB for each tensor above 1 MiB (of its large pool)
    tails = sum(1 << 20 for n, t in f.tensors.items()
                if "_exps." not in n and n != "token_embd.weight" and t.n_bytes > 1 << 20)
    assert huge.non_expert == tensors - embedding + counters + tails
    assert huge.whole_model == huge.fixed + huge.resident_expert_bytes + embedding
    on_cpu = plan_memory(f, "64GiB", CTX, "cpu")
    assert on_cpu.non_expert == tensors and on_cpu.host_embedding == 0
    assert huge.kv_cache == 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * CTX * 2
    assert huge.minimum == huge.fixed + cfg.n_layer * cfg.n_expert_used * slot
    tight = plan_memory(f, huge.minimum + 3 * slot, CTX, "cuda")
    assert tight.n_slots == cfg.n_layer * cfg.n_expert_used + 3 and not tight.fits_all
    assert tight.fixed + tight.slots_bytes <= tight.budget
    text = tight.describe()
    assert f"{tight.n_slots} of {tight.n_experts_total}" in text and "minimum budget" in text
    assert "token embedding in host memory" in text and "token embedding in host memory" not in huge.describe()
    # the whole model on the device: the embedding is a row of its own, and what is left is the budget less all of it
    exact = plan_memory(f, huge.whole_model, CTX, "cuda").describe()
    assert re.search(r"^  token embedding +\S+ \S+ ", exact, re.M), exact
    assert re.search(r"^  unassigned +0 B ", exact, re.M), exact
    assert not plan_memory(f, huge.whole_model - 1, CTX, "cuda").fits_all
    assert plan_memory(f, huge.whole_model, CTX, "cuda").fits_all
    # a draft's routed experts are counted (here the model itself stands in for a draft), and on CUDA what the
    # speculative decoder holds beside them
    with_draft = plan_memory(f, "64GiB", CTX, "cuda", draft=f)
    reserve = speculation_bytes(cfg.n_layer)  # 3/8 GiB, and the graphs of every further depth per layer
    assert with_draft.draft_experts == huge.resident_expert_bytes and with_draft.speculation == reserve
    assert SPECULATION < reserve < speculation_bytes(2 * cfg.n_layer)
    assert with_draft.minimum == huge.minimum + huge.resident_expert_bytes + reserve
    assert "speculation" in with_draft.describe() and huge.speculation == 0
    # what the draft costs the expert cache: the same budget without it
    tight_draft = plan_memory(f, tight.budget + huge.resident_expert_bytes + reserve - slot, CTX, "cuda", draft=f)
    assert tight_draft.n_slots == tight.n_slots - 1
    assert tight_draft.n_slots_without_draft == plan_memory(f, tight_draft.budget, CTX, "cuda").n_slots
    assert f"without the draft: {tight_draft.n_slots_without_draft} of" in tight_draft.describe()
    assert "without the draft" not in tight.describe() and "without the draft" not in with_draft.describe()
    assert plan_memory(f, "64GiB", CTX, "cpu", draft=f).speculation == 0


def test_budget_below_minimum_is_refused_before_loading(shipped_model, monkeypatch) -> None:
    import specter_gguf.models as models

    f = GGUFFile(shipped_model)
    p = plan_memory(f, "64GiB", CTX, "cpu")
    monkeypatch.setattr(models, "load_transformer", lambda *a, **k: pytest.fail("loaded despite the refusal"))
    with pytest.raises(SpecterError, match=f"minimum .* is .*{p.minimum} bytes"):
        Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=p.minimum - 1)


def test_spare_slots_are_for_lru_only(shipped_model) -> None:
    budget = _budget_for(shipped_model)
    for mode in ("on-demand", "gate-prefetch"):
        with pytest.raises(SpecterError, match="--spare-slots: only with --offload lru"):
            Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=budget, offload=mode,
                       spare_slots=1)
    with pytest.raises(SpecterError, match="--spare-slots takes 0 to 8"):
        Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=budget, spare_slots=9)
    m = Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=budget, offload="on-demand",
                   spare_slots=0)  # none asked for: nothing to refuse
    assert m.offload.cache.n_spare == 0


def test_default_spares_hold_two_decode_steps_of_misses() -> None:
    """A spare comes back two forwards after the one that filled it (CUDA), so lru keeps 2 × top-k by default, at
    most MAX_SPARES and half of a layer's slots beyond its top-k; a request is taken as given within those slots."""
    from specter_gguf.runtime.offload import MAX_SPARES, spares_per_layer

    assert [spares_per_layer(100 * 24, 24, top_k) for top_k in (1, 2, 4, 8)] == [2, 4, 8, MAX_SPARES]
    assert spares_per_layer(14 * 24, 24, 4) == 5 and spares_per_layer(14 * 24, 24, 4, 8) == 8
    assert spares_per_layer(10 * 24, 24, 4, 8) == 6 and spares_per_layer(10 * 24, 24, 4, 1) == 1
    assert spares_per_layer(5 * 24, 24, 4) == 0


def test_speculative_decoding_keeps_fewer_spares(shipped_model) -> None:
    """Under speculative decoding the lookahead prefetches into the same slots: the default stays
    SPARES_WITH_LOOKAHEAD where plain decoding takes more (twice the top-k, at most half its room: 3 here)."""
    from specter_gguf.runtime.offload import SPARES_WITH_LOOKAHEAD

    f = GGUFFile(shipped_model)
    p = plan_memory(f, 1 << 40, CTX, "cpu")
    budget = plan_memory(f, 1 << 40, CTX, "cpu", draft=f).minimum + 6 * p.n_moe_layers * p.slot_bytes  # top_k + 6
    plain = Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=budget, offload="lru")
    spec = Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=budget, offload="lru",
                      draft=shipped_model)
    assert plain.offload.cache.n_spare == 3 and spec.offload.cache.n_spare == SPARES_WITH_LOOKAHEAD == 2


def test_offload_needs_a_budget_and_none_needs_room(shipped_model) -> None:
    with pytest.raises(SpecterError, match="needs a GPU memory budget"):
        Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, offload="lru")
    p = plan_memory(GGUFFile(shipped_model), "64GiB", CTX, "cpu")
    with pytest.raises(SpecterError, match="offload its experts"):
        Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=p.minimum, offload="none")
    m = Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget="64GiB")
    assert m.offload is None and m.memory_plan.fits_all  # fits: the plain engine, default mode none


def test_plan_command(shipped_model) -> None:
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", "16GiB", "-c", "512"])
    assert r.exit_code == 0, r.output
    assert "routed experts, all resident" in r.output and "KV cache" in r.output and "minimum budget" in r.output
    assert "spare slots: none (the whole model fits the budget)" in r.output
    # top_k (2) + 5 slots a layer, one short of its 8 experts: the default spares take half of the 5
    budget = str(_budget_for(shipped_model, 5))
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", budget, "-c", str(CTX), "--device", "cpu"])
    assert r.exit_code == 0 and "spare slots: 2 of each MoE layer's 7" in r.output, r.output
    assert "lends them to the cache" not in r.output  # hybrid auto is off on the CPU device
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", budget, "-c", str(CTX), "--device", "cpu",
                                 "--hybrid", "on"])
    assert r.exit_code == 0 and "hybrid lends them to the cache while routing does not repeat" in r.output, r.output
    for hybrid, lent in ("on", True), ("off", False), ("auto", False):  # auto: off on the CPU device
        r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", budget, "-c", str(CTX), "--device",
                                     "cpu", "--hybrid", hybrid, "--json"])
        assert r.exit_code == 0 and json.loads(r.output)["lends_spares"] is lent, r.output
    if not torch.cuda.is_available():  # auto on a CUDA device: measured when a model loads, so not known here
        on_cuda = str(int(budget) + plan_memory(GGUFFile(shipped_model), 1 << 40, CTX, "cuda").cuda_runtime)
        r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", on_cuda, "-c", str(CTX), "--json"])
        assert r.exit_code == 0 and json.loads(r.output)["lends_spares"] is None, r.output
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", budget, "-c", str(CTX), "--device", "cpu",
                                 "--json", "--spare-slots", "9"])
    assert r.exit_code == 2, r.output  # above MAX_SPARES
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", budget, "-c", str(CTX), "--device", "cpu",
                                 "--json", "--spare-slots", "7"])
    assert r.exit_code == 0 and json.loads(r.output)["spare_slots"] == 5, r.output  # what the layers have room for
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", "1MiB", "--json"])
    assert r.exit_code == 1, r.output  # the plan is printed, then the refusal names the minimum
    d = json.loads(r.output.splitlines()[0])
    assert d["budget"] == 1 << 20 and d["minimum"] > d["budget"] and d["n_slots"] == 0
    assert "Error: GPU budget 1.00 MiB is too small" in r.output and "Traceback" not in r.output


def test_default_context_is_the_models_own_up_to_4096(tiny_models) -> None:
    """As llama.cpp's -c: min(training context, 4096) by default, 0 for the model's own; negative is refused."""
    long_trained = tiny_models[("tiny-deepseek2", "f16")]  # trained context 163840
    short_trained = tiny_models[("qwen2moe", "f16")]       # 2048
    assert Model.load(long_trained, device="cpu", progress=False).ctx_size == 4096
    assert Model.load(long_trained, device="cpu", progress=False, ctx_size=0).ctx_size == 163840
    assert Model.load(short_trained, device="cpu", progress=False).ctx_size == 2048
    with pytest.raises(SpecterError, match="context size must be 0 .* or positive"):
        Model.load(short_trained, device="cpu", progress=False, ctx_size=-5)
    assert plan_memory(GGUFFile(long_trained), "16GiB").ctx_size == 4096
    r = CliRunner().invoke(cli, ["plan", str(long_trained), "--gpu-budget", "16GiB"])
    assert r.exit_code == 0 and "context 4096 tokens (the model's own is 163840: -c 0)" in r.output, r.output
    r = CliRunner().invoke(cli, ["plan", str(long_trained), "--gpu-budget", "16GiB", "-c", "0"])
    assert "context 163840 tokens (the model's own)" in r.output, r.output
    r = CliRunner().invoke(cli, ["run", str(long_trained), "-p", "Hi", "-n", "2", "--device", "cpu", "--temp", "0"])
    assert r.exit_code == 0 and "context 4096," in r.stderr, r.output
    r = CliRunner().invoke(cli, ["run", str(long_trained), "-p", "Hi", "-n", "2", "--device", "cpu", "-c", "-1"])
    assert r.exit_code == 1 and "Error: context size must be 0" in r.output and "Traceback" not in r.output


def test_workspace_hardly_grows_with_the_context(shipped_model) -> None:
    """Attention reads the KV cache in place: from 4096 to 32768 tokens of context the planned workspace of the
    hidden-256 model grows by the [chunk, context] mask and the RoPE tables only (well under 64 MiB)."""
    f = GGUFFile(shipped_model)
    small, large = (plan_memory(f, "16GiB", ctx, "cuda") for ctx in (4096, 32768))
    assert ModelConfig.from_gguf(f).n_embd == 256
    assert 0 < large.workspace - small.workspace < 64 << 20, (small.workspace, large.workspace)


def test_workspace_holds_a_verifications_decode_attention(shipped_model) -> None:
    """On CUDA the planned workspace holds the native decode attention's scratch for the most queries it takes over
    the whole context (a verification late in a long sequence)."""
    from specter_gguf.kernels import DECODE_ATTN_MAX_TOKENS, decode_attention_workspace_size

    f = GGUFFile(shipped_model)
    cfg = ModelConfig.from_gguf(f)
    for ctx in (512, 32768):
        need = decode_attention_workspace_size(DECODE_ATTN_MAX_TOKENS, cfg.n_head, cfg.head_dim, ctx)
        assert plan_memory(f, "16GiB", ctx, "cuda").workspace > need


def test_fitted_budget_is_the_free_memory_less_the_margin(shipped_model, monkeypatch) -> None:
    """Without --gpu-budget on CUDA, a model that does not fit the free memory is planned within it, less
    FIT_MARGIN; one that fits needs no plan (the load is plain)."""
    from specter_gguf.runtime import budget

    f = GGUFFile(shipped_model)
    need = plan_memory(f, "64GiB", CTX, "cuda").whole_model
    monkeypatch.setattr(budget, "free_device_memory", lambda device: need + budget.FIT_MARGIN)
    assert budget.fitted_budget(f, "cuda", CTX) is None
    monkeypatch.setattr(budget, "free_device_memory", lambda device: need + budget.FIT_MARGIN - 1)
    fit = budget.fitted_budget(f, "cuda", CTX)
    assert fit is not None and fit.budget == need - 1 and not fit.fits_all
    # offloaded, the token embedding stays in host memory: here that frees more than all the experts take
    assert fit.n_slots == fit.n_experts_total and fit.host_embedding > fit.slot_bytes


# ---------------------------------------------------------------------------------------------- store, cache
def test_store_records_are_the_file_bytes(shipped_model) -> None:
    cache = small_cache(shipped_model, 2)
    f = cache.store.f
    (slot,) = cache.acquire(1, [5])
    raw = cache.view(slot).numpy()
    for part in cache.store.layouts[1].parts:
        t = f.tensor(f"blk.1.ffn_{part.name}_exps.weight")
        assert np.array_equal(raw[part.offset:part.offset + part.nbytes], np.asarray(t.data[5]).reshape(-1).view(np.uint8))
    cache.release([slot])


def test_lru_evicts_least_recently_used(shipped_model) -> None:
    cache = small_cache(shipped_model, 3)  # 3 slots per layer
    for e in (0, 1, 2):
        cache.release(cache.acquire(0, [e]))
    cache.release(cache.acquire(0, [0]))      # 0 is now the most recent; 1 the least
    cache.release(cache.acquire(0, [3]))      # evicts 1
    assert cache.resident([(0, 0), (0, 1), (0, 2), (0, 3)]) == [True, False, True, True]
    c = cache.counters
    assert (c.cache_lookups, c.cache_hits, c.cache_misses, c.cache_evictions) == (5, 1, 4, 1)
    assert c.bytes_copied == 4 * sum(p.nbytes for p in cache.store.layouts[0].parts)
    # the other layer's partition is untouched
    assert cache.resident([(1, 0)]) == [False]


def test_pinned_slots_are_never_evicted(shipped_model) -> None:
    cache = small_cache(shipped_model, 2)  # 2 per layer
    slots = cache.acquire(0, [0, 1])
    assert cache.request([(0, 2)]) == 0     # nothing evictable: skipped
    with pytest.raises(SpecterError, match="needs more than"):
        cache.acquire(0, [2])
    cache.release(slots)
    assert cache.request([(0, 2)]) == 1


def test_lfu_keeps_the_frequent(shipped_model) -> None:
    cache = small_cache(shipped_model, 6, policy="lfu")  # global partition of 6
    for e, uses in ((0, 3), (1, 1), (2, 2), (3, 2), (4, 2), (5, 2)):
        for _ in range(uses):
            cache.release(cache.acquire(0, [e]))
    cache.release(cache.acquire(0, [6]))      # evicts expert 1 (one use), though 0 is older
    assert cache.resident([(0, 0), (0, 1), (0, 6)]) == [True, False, True]


def test_static_hot_keeps_the_profiled_hot_set(shipped_model) -> None:
    profile = RoutingProfile({(0, 7): 100, (0, 6): 90, (1, 3): 80, (0, 1): 5})
    cache = small_cache(shipped_model, 3, policy="static-hot", profile=profile)
    assert cache.warm() == 3
    assert cache.resident([(0, 7), (0, 6), (1, 3)]) == [True, True, True]
    for e in (0, 2, 4):                       # cold experts only take the coldest slot, one after the other
        cache.release(cache.acquire(0, [e]))
    assert cache.resident([(0, 7), (0, 6), (0, 4), (1, 3)]) == [True, True, True, False]
    with pytest.raises(SpecterError, match="routing profile"):
        small_cache(shipped_model, 3, policy="static-hot")


def test_request_priority_and_resident(shipped_model) -> None:
    cache = small_cache(shipped_model, 2)  # 2 per layer
    assert cache.request([(0, 1), (0, 2), (0, 3)], priority=[1.0, 3.0, 2.0]) == 2
    assert cache.resident([(0, 1), (0, 2), (0, 3)]) == [False, True, True]  # the lowest priority did not fit
    assert cache.counters.prefetches == 2 and cache.counters.cache_lookups == 0
    assert cache.publish() == 2  # on the CPU a copy is done at once: published at the next `publish`
    assert cache.table[0].tolist() == [-1, -1, cache.where[(0, 2)], cache.where[(0, 3)], -1, -1, -1, -1]
    assert cache.published[0].tolist() == [s >= 0 for s in cache.table[0].tolist()]
    cache.request([(0, 5)])  # evicts the least recently used, (0, 2): its entry is cleared at once
    assert cache.table[0, 2] == -1 and not cache.published[0, 2] and cache.table[0, 5] == -1
    assert cache.publish() == 1 and cache.table[0, 5] == cache.where[(0, 5)]


def test_request_by_uses_brings_in_only_the_more_used(shipped_model) -> None:
    """`by_uses`: a missing key takes a free slot, or evicts the least recently used expert only where it has been
    used more often (`count_uses`); resident keys are refreshed either way."""
    cache = small_cache(shipped_model, 2)  # 2 per layer
    cache.count_uses([(0, 1), (0, 1), (0, 2), (0, 3), (0, 4), (0, 4), (0, 4)])
    assert cache.request([(0, 3), (0, 1)], prefetch=False, by_uses=True) == 2  # free slots
    assert cache.request([(0, 2)], prefetch=False, by_uses=True) == 0  # 1 use, (0, 3) the victim with 1
    assert cache.request([(0, 4)], prefetch=False, by_uses=True) == 1  # 3 uses evict (0, 3)
    assert cache.resident([(0, 1), (0, 3), (0, 4)]) == [True, False, True]
    cache.request([(0, 1)], prefetch=False, by_uses=True)  # refreshed: (0, 4) is the least recently used now
    cache.count_uses([(0, 5)] * 3)
    assert cache.request([(0, 5)], prefetch=False, by_uses=True) == 0  # 3 uses do not beat (0, 4)'s 3
    assert cache.request([(0, 5)], prefetch=False) == 1  # without by_uses: lru
    assert cache.resident([(0, 1), (0, 4), (0, 5)]) == [True, False, True]


def test_use_counts_halve_so_that_the_experts_used_now_overtake(shipped_model) -> None:
    """Every use count halves once `USES_HALVED_AFTER` × the slots of uses are counted since the last halving (by
    `count_uses` or `acquire`): an expert used now overtakes an old favourite after about half the favourite's uses,
    where on lifetime counts it would need all of them."""
    from specter_gguf.runtime.cache import USES_HALVED_AFTER

    cache = small_cache(shipped_model, 2)  # 2 per layer
    window = USES_HALVED_AFTER * cache.n_slots
    cache.count_uses([(0, 1)] * (window - 1))  # an old favourite, one use short of a halving
    cache.request([(0, 1), (0, 2)], prefetch=False)  # (0, 1) the least recently used
    uses = 0
    while not cache.request([(0, 5)], prefetch=False, by_uses=True):
        cache.count_uses([(0, 5)])
        uses += 1
    # the first use halves (0, 1)'s count (and its own 1 to 0), the next ones pass what is left
    assert uses == 1 + (window - 1) // 2 + 1 < window
    assert cache.resident([(0, 1), (0, 2), (0, 5)]) == [False, True, True]
    # lookups count too: uses - 1 counted since the halving, then up to one short of the next and one more
    cache.release(cache.acquire(1, [3] * (window - uses)))
    assert cache._uses[(1, 3)] == window - uses
    cache.release(cache.acquire(1, [3]))
    assert cache._uses[(1, 3)] == (window - uses + 1) // 2


def check_slots(cache) -> None:
    """Every slot is in exactly one place: a partition (its expert, if any, in `where` and the table once published)
    or the spares (empty, in the device's spare row, named by no table entry)."""
    in_parts = [s for part in cache._parts for s in part]
    spares = sorted(cache._spare_of)
    assert sorted(in_parts + spares) == list(range(cache.n_slots))
    for slot, (layer, j) in cache._spare_of.items():
        assert cache.key[slot] is None and cache.spares[layer, j] == slot
    assert not (torch.isin(cache.table, torch.tensor(spares)).any() if spares else False)
    for key, slot in cache.where.items():
        assert cache.key[slot] == key and (not cache.published[key] or cache.table[key] == slot)


def test_spare_slots_are_adopted_and_replaced(shipped_model) -> None:
    """A spare holds no expert; once a forward's table kernel has copied a miss into it, `adopt` makes it the expert's
    slot (most recently used, named by the table) and the next `publish` sets the least recently used slot aside
    instead, evicting its expert. An expert that a copy brought in meanwhile keeps that slot: the spare stays one."""
    cache = small_cache(shipped_model, 4, n_spare=1)  # 4 slots a layer: 3 in the partition and a spare
    assert cache.capacity(0) == 3 and len(cache._spare_of) == len(cache.position)  # one spare a MoE layer
    cache.request([(0, 1), (0, 2), (0, 3)])
    cache.publish()
    check_slots(cache)
    spare = int(cache.spares[0, 0])
    # the table kernel copies expert 5 of layer 0 into the spare (as `kernels.residency_pointers` does)
    cache.table[0, 5] = spare
    cache.spares[0, 0] = -1
    cache.adopt((0, 5), spare)
    assert cache.where[(0, 5)] == spare and cache.published[0, 5] and cache.counters.spare_fetches == 1
    oldest = cache.where[(0, 1)]
    cache.publish()  # the least recently used, (0, 1), makes way for the next spare
    assert cache.resident([(0, 1), (0, 2), (0, 3), (0, 5)]) == [False, True, True, True]
    assert cache.spares[0, 0] == oldest and cache.table[0, 1] == -1
    check_slots(cache)
    # a copy of expert 6 is on its way (the table says so) when a forward copies it into the spare as well
    cache.request([(0, 6)])
    copying = cache.where[(0, 6)]
    assert cache.table[0, 6] == -2 - copying
    spare = int(cache.spares[0, 0])
    cache.spares[0, 0] = -1
    cache.adopt((0, 6), spare)
    assert cache.where[(0, 6)] == copying and cache.spares[0, 0] == spare and cache.key[spare] is None
    cache.publish()
    assert cache.table[0, 6] == copying
    check_slots(cache)


def test_spare_slots_are_lent_to_the_cache_and_kept_again(shipped_model) -> None:
    """Lent (`keep_spares(False)`), each layer's spares join its partition as free slots and the device finds none
    (-1); kept again, the next `publish` sets the least recently used slots aside as spares, evicting their
    experts."""
    cache = small_cache(shipped_model, 4, n_spare=1)
    cache.request([(0, 1), (0, 2), (0, 3)])
    cache.publish()
    cache.keep_spares(False)
    assert not cache.spares_kept and (cache.spares == -1).all() and not cache._spare_of
    assert cache.capacity(0) == 4
    check_slots(cache)
    cache.request([(0, 4)])  # the lent slot takes it: nothing evicted
    cache.publish()
    assert cache.resident([(0, 1), (0, 2), (0, 3), (0, 4)]) == [True] * 4 and cache.counters.cache_evictions == 0
    cache.publish()  # lent: no spare is set aside again
    assert (cache.spares == -1).all()
    cache.keep_spares(True)
    cache.publish()
    assert cache.capacity(0) == 3 and len(cache._spare_of) == len(cache.position)
    assert cache.resident([(0, 1), (0, 2), (0, 3), (0, 4)]) == [False, True, True, True]
    check_slots(cache)


# ---------------------------------------------------------------------------------------------- routing hooks
def test_device_routing_counts_and_profile_roundtrip(tmp_path) -> None:
    counts = DeviceRoutingCounts(3, 8, "cpu")
    counts(0, torch.tensor([[1, 2], [2, 5]]), torch.tensor([[0.5, 0.5], [0.25, 0.75]]))
    counts(2, torch.tensor([[7, 0]]), torch.tensor([[0.9, 0.1]]))
    assert counts.counts[0].tolist() == [0, 1, 2, 0, 0, 1, 0, 0] and counts.counts.sum().item() == 6
    p = counts.profile()
    assert p.count((0, 2)) == 2 and p.count((2, 7)) == 1 and p.hottest()[0] == (0, 2)
    p.save(tmp_path / "p.json")
    q = RoutingProfile.load(tmp_path / "p.json")
    assert q.counts == p.counts
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SpecterError, match="not a routing profile"):
        RoutingProfile.load(tmp_path / "bad.json")


# ---------------------------------------------------------------------------------------------- equality
def _budget_for(path, extra_slots_per_layer: int = 1) -> int:
    """The minimum budget plus one slot per MoE layer: each layer has top_k + 1 slots, so it evicts."""
    p = plan_memory(GGUFFile(path), 1 << 40, CTX, "cpu")
    return p.minimum + extra_slots_per_layer * p.n_moe_layers * p.slot_bytes


def test_residency_counts_hits_against_the_table_the_forward_read(shipped_model) -> None:
    """A forward's hits and misses are those of the residency table when it was enqueued: an expert published
    only after it (its copy landed meanwhile) is still a miss of that forward, and an expert evicted after it a
    hit; lru then brings the forward's experts in."""
    m = Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=_budget_for(shipped_model),
                   offload="lru")
    rt, cache = m.offload, m.offload.cache
    cache.request([(0, 1)])
    rt.begin()  # publishes (0, 1)
    assert cache.published[0, 1] and not cache.published[0, 2]
    rt.routed[0, 1] = rt.routed[0, 2] = 1  # the forward used (0, 1), resident, and (0, 2), read from host memory
    rt.end()
    before = rt.counters.snapshot()
    cache.request([(0, 2)])  # lands and is published before the forward's routing is read
    cache.publish()
    rt.settle(wait=True)
    c = rt.counters.since(before)
    assert (c.cache_lookups, c.cache_hits, c.cache_misses) == (2, 1, 1)
    assert c.zero_copy_bytes == rt.layouts[0].nbytes
    assert rt.last_used[0, 1] and rt.last_used[0, 2] and rt.last_used.sum() == 2


_reference: dict = {}


def _reference_tokens(path) -> list[int]:
    if path not in _reference:
        m = Model.load(path, device="cpu", ctx_size=CTX, progress=False)
        _reference[path] = m.generate(PROMPT, n_predict=N_TOKENS, sampling=GREEDY).wait().tokens
    return _reference[path]


CASES = ([(arch, "f16") for arch in [*TINY_ARCH_PRESETS, "tiny-deepseek2", "tiny-deepseek2-lite", "tiny-phimoe"]]
         + [("qwen2moe", "q4_k_m"), ("llama", "q4_k_m"), ("tiny-deepseek2", "q4_k_m"), ("tiny-phimoe", "q4_k_m")])


@pytest.mark.parametrize("arch,kind", CASES, ids=[f"{a}-{k}" for a, k in CASES])
def test_every_mode_matches_the_plain_engine(tiny_models, arch: str, kind: str) -> None:
    path = tiny_models[(arch, kind)]
    expected = _reference_tokens(path)
    assert len(expected) == N_TOKENS
    for mode, spare_slots in [(mode, None) for mode in MODES] + [("lru", 1)]:
        m = Model.load(path, device="cpu", ctx_size=CTX, progress=False, gpu_budget=_budget_for(path), offload=mode,
                       spare_slots=spare_slots)
        g = m.generate(PROMPT, n_predict=N_TOKENS, sampling=GREEDY).wait()
        s = g.stats
        assert g.tokens == expected, f"{mode}, spare slots {spare_slots}: tokens differ from the no-offload engine"
        check_slots(m.offload.cache)
        # lru copies misses into spares as it goes where it keeps any, no other mode does; with top_k + 1 slots a
        # layer, by request only (the default keeps at most half the one slot beyond the top-k)
        spares = spare_slots or 0
        assert s.spare_slots == spares and (s.spare_fetches > 0) == (spares > 0)
        assert s.offload == mode and s.cache_misses > 0 and s.bytes_moved_per_token > 0
        assert s.cache_hits + s.cache_misses == s.cache_lookups
        if mode == "on-demand":  # no cache: decoding reads every expert in place, nothing is copied for it
            assert s.cache_hits == 0 and s.cache_misses == s.cache_lookups and s.zero_copy_bytes > 0
        else:
            assert s.bytes_copied > 0
            assert s.cache_evictions > 0, f"{mode}: the cache never evicted; the budget is too large for the test"
        if mode == "gate-prefetch" and m.memory_plan.n_moe_layers > 1:  # it prefetches for the next MoE layer
            assert s.prefetches > 0
        d = s.to_dict()
        assert d["cache_hit_rate"] == s.cache_hits / s.cache_lookups and d["bytes_moved_per_token"] > 0
        assert d["copy_exposed_s"] <= d["copy_s"] + 1e-12 and "tpot_ms" in d and "prefill_s" in d


@pytest.mark.parametrize("arch,room,spares", [("qwen3moe", 3, 2), ("qwen2moe", 3, 2), ("qwen3moe", 5, 4)])
@pytest.mark.parametrize("lag", [2, 5])
def test_spares_stay_right_when_the_host_learns_late(tiny_models, arch: str, room: int, spares: int,
                                                     lag: int) -> None:
    """On CUDA the host reads a forward's routing forwards after the device ran it: the device copies misses into
    spares the host does not know of yet, and the host brings in experts a later forward has copied into a spare
    already. Here the CPU runtime settles each forward only `lag` forwards late, with everything else the same:
    greedy output stays the no-offload engine's, every slot stays in one place, and adoptions meet experts brought
    in meanwhile (the case the device's table must not be trusted for). `room`: slots a layer beyond its top-k,
    `spares` of them spares (4 of 5: as many as the default's twice the top-k, with one slot left to evict)."""
    path = tiny_models[(arch, "f16")]
    expected = _reference_tokens(path)
    m = Model.load(path, device="cpu", ctx_size=CTX, progress=False, gpu_budget=_budget_for(path, room),
                   offload="lru", spare_slots=spares)
    rt, cache = m.offload, m.offload.cache
    settle, adopt = rt.settle, cache.adopt
    rt.settle = lambda wait=False, keep=0: settle(wait, keep if wait else max(keep, lag))
    met = []

    def adopt_counting(key, slot):
        met.append(key in cache.where)
        adopt(key, slot)

    cache.adopt = adopt_counting
    g = m.generate(PROMPT, n_predict=N_TOKENS, sampling=GREEDY).wait()
    assert g.tokens == expected
    check_slots(cache)
    assert cache.n_spare == spares and g.stats.spare_fetches == len(met) > 0 and any(met)


@pytest.mark.parametrize("policy", ["lfu", "static-hot"])
def test_policies_match_the_plain_engine(tiny_models, tmp_path, monkeypatch, policy: str) -> None:
    from specter_gguf.runtime import cache as cache_module

    monkeypatch.setattr(cache_module, "USES_HALVED_AFTER", 1 << 30)  # lifetime counts, to count them below
    path = tiny_models[("qwen3moe", "f16")]
    expected = _reference_tokens(path)
    kwargs = {}
    if policy == "static-hot":  # a profiling run with the routing observer, then the profile
        m = Model.load(path, device="cpu", ctx_size=CTX, progress=False)
        m.record_routing()
        m.generate("A different prompt for profiling", n_predict=8, sampling=GREEDY).wait()
        m.routing_profile().save(tmp_path / "profile.json")
        kwargs["routing_profile"] = tmp_path / "profile.json"
    m = Model.load(path, device="cpu", ctx_size=CTX, progress=False, gpu_budget=_budget_for(path), offload="lru",
                   cache_policy=policy, **kwargs)
    g = m.generate(PROMPT, n_predict=N_TOKENS, sampling=GREEDY).wait()
    assert g.tokens == expected
    assert g.stats.cache_policy == policy and g.stats.cache_evictions > 0 and g.stats.cache_misses > 0
    # lfu counts every lookup as a use: the prefill's waves and the decode steps' residency path alike
    assert sum(m.offload.cache._uses.values()) == m.offload.counters.cache_lookups


def test_long_prompt_is_prefilled_in_chunks(shipped_model) -> None:
    """A prompt longer than the prefill chunk (and batches needing more experts than a layer's slots: waves)."""
    m0 = Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False)
    prompt = list(range(5, 5 + 70))
    expected = m0.generate(prompt, n_predict=4, sampling=GREEDY).wait().tokens
    m = Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=_budget_for(shipped_model),
                   offload="lru")
    m.prefill_chunk = 32
    g = m.generate(prompt, n_predict=4, sampling=GREEDY).wait()
    assert g.tokens == expected


def test_run_stats_and_routing_profile_cli(shipped_model, tmp_path) -> None:
    budget = _budget_for(shipped_model)
    r = CliRunner().invoke(cli, ["run", str(shipped_model), "-p", "Hi", "-n", "6", "--temp", "0", "--device", "cpu",
                                 "-c", str(CTX), "--gpu-budget", str(budget), "--offload", "gate-prefetch", "--stats",
                                 "--save-routing-profile", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert "cache hit rate" in r.output and "bytes_copied_per_token" in r.output
    assert RoutingProfile.load(tmp_path / "p.json").counts
    r = CliRunner().invoke(cli, ["run", str(shipped_model), "-p", "Hi", "-n", "4", "--temp", "0", "--device", "cpu",
                                 "-c", str(CTX), "--gpu-budget", str(budget), "--routing-profile",
                                 str(tmp_path / "p.json"), "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output.strip().splitlines()[-1])["stats"]
    assert stats["offload"] == "lru" and stats["cache_policy"] == "static-hot"


def test_a_routing_profile_of_another_model_is_refused(shipped_model, tmp_path, caplog) -> None:
    """A profile counting an expert or layer the model does not have (or a negative count) is one error naming the
    file and the fix; one recorded with another file loads with a warning."""
    import logging

    budget = _budget_for(shipped_model)
    n_layer, n_expert = 4, 8
    for counts in ({(0, n_expert): 5}, {(n_layer, 0): 5}, {(1, 1): -3}):
        RoutingProfile(counts, str(shipped_model)).save(tmp_path / "odd.json")
        with pytest.raises(SpecterError, match=r"odd.json: .* which tiny-qwen2moe.gguf \(4 layers of 8 experts\) "
                                               "cannot have: the profile is of another model"):
            Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=budget,
                       routing_profile=tmp_path / "odd.json")
    RoutingProfile({(1, 2): 4}, "/elsewhere/other-model.gguf").save(tmp_path / "other.json")
    with caplog.at_level(logging.WARNING, logger="specter_gguf"):
        Model.load(shipped_model, device="cpu", ctx_size=CTX, progress=False, gpu_budget=budget,
                   routing_profile=tmp_path / "other.json")
    assert "was recorded with other-model.gguf, not tiny-qwen2moe.gguf" in caplog.text


def test_counters_since() -> None:
    c = OffloadCounters(cache_lookups=5, copy_s=1.0)
    s = c.snapshot()
    c.cache_lookups += 2
    c.copy_s += 0.5
    d = c.since(s)
    assert d.cache_lookups == 2 and d.copy_s == pytest.approx(0.5)
