"""Hybrid expert execution (specter_gguf.runtime.hybrid): missed experts computed by the host's CPU worker.

The worker's sum over the pairs a layer hands it must be `moe_ffn`'s over the same pairs (bitwise on the CPU, where
it is that function; to float32 rounding from a CUDA forward, eager and replayed in a CUDA graph), pairs it is not
handed contribute nothing, and a layer split between the device's kernel and the worker must agree with the whole
layer to float32 rounding. Through the whole engine on the CPU (the same algorithm as on a GPU: the mailbox, the
worker thread, the marking from the residency table): greedy output with hybrid on equals the target's alone,
plain decoding and speculative decoding over 20 prompts × 64 tokens, and the counters say which experts the CPU
computed; the split of a layer's misses between the CPU and the link is checked against its definition (CPU and
CUDA). `plan --hybrid` says what a load would choose. User mistakes get errors that name the fix.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specter_gguf.cli import cli
from specter_gguf.config import ModelConfig
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.kernels import MAX_SPARES, ExpertTable, SpareSlots, moe_ffn
from specter_gguf.runtime import offload
from specter_gguf.runtime.budget import moe_layers, plan_memory, record_layout
from specter_gguf.runtime.hybrid import EVERY_MISS, CpuExperts, HybridChoice, worth_it
from specter_gguf.runtime.offload import residency_max_tokens
from specter_gguf.runtime.store import ExpertStore
from specter_gguf.sampling import SamplingParams
from tests.test_kernels import DEVICES
from tests.test_speculative import PROMPTS

GREEDY = SamplingParams(temperature=0)
CTX = 256


def _store(path, device: torch.device) -> tuple[ExpertStore, dict, ModelConfig]:
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    layouts = {i: record_layout(f, cfg, i) for i in moe_layers(f, cfg)}
    return ExpertStore(f, layouts, cfg.n_expert, device, pin="lazy", progress=False), layouts, cfg


def _host_table(store: ExpertStore, layouts: dict, cfg: ModelConfig, layer: int) -> ExpertTable:
    """The layer's experts in host memory as the CPU kernel's pointer table."""
    ptrs = torch.tensor(store.addresses(layer), dtype=torch.int64)
    return ExpertTable(ptrs, tuple(int(p.type) for p in layouts[layer].parts), cfg.n_embd, cfg.n_ff_exp, ())


def _hand_off(cpu: CpuExperts, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              missed: torch.Tensor, routed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One post and collect on `cpu`'s device, the experts `missed` marks without a slot, every miss the CPU's;
    returns the experts the post gave the CPU (a host tensor)."""
    dev = out.device
    slot_of = torch.where(missed, -1, 0).to(dev)
    on_cpu = torch.zeros(missed.shape, dtype=torch.bool, device=dev)
    cpu_routed = torch.full(missed.shape, 7, dtype=torch.int32, device=dev)
    cpu.post(layer, x.to(dev), ids.to(dev), weights.to(dev), slot_of, routed.to(dev), EVERY_MISS, on_cpu, cpu_routed)
    cpu.collect(out, ids.to(dev), on_cpu)
    assert torch.equal(cpu_routed.cpu(), routed * on_cpu.cpu())
    return on_cpu.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["f16", "q4_k_m"])
@torch.inference_mode()
def test_the_worker_sums_the_pairs_it_is_handed(tiny_models, device: str, kind: str) -> None:
    dev = torch.device(device)
    store, layouts, cfg = _store(tiny_models[("qwen2moe", kind)], dev)
    cpu = CpuExperts(store, layouts, cfg, dev, residency_max_tokens(cfg))
    try:
        layer = min(layouts)
        table = _host_table(store, layouts, cfg, layer)
        gen = torch.Generator().manual_seed(7)
        for T in (1, 9, cpu.max_tokens):
            x = torch.randn(T, cfg.n_embd, generator=gen) * 0.5
            ids = torch.stack([torch.randperm(cfg.n_expert, generator=gen)[:cfg.n_expert_used] for _ in range(T)])
            weights = torch.rand(ids.shape, generator=gen)
            missed = torch.zeros(cfg.n_expert, dtype=torch.bool)
            missed[torch.randperm(cfg.n_expert, generator=gen)[:cfg.n_expert // 2]] = True
            routed = torch.bincount(ids.flatten(), minlength=cfg.n_expert).to(torch.int32)
            on_cpu = missed & (routed > 0)  # every routed miss is the CPU's (EVERY_MISS)
            # the reference: the CPU kernel over the CPU's pairs only
            want = moe_ffn(x, ids.masked_fill(~on_cpu[ids], -1), weights, table)
            whole = moe_ffn(x, ids, weights, table)
            rest = moe_ffn(x, ids.masked_fill(on_cpu[ids], -1), weights, table)
            base = torch.randn(T, cfg.n_embd, generator=gen)
            out = base.to(dev, copy=True)
            got_on_cpu = _hand_off(cpu, layer, x, ids, weights, missed, routed, out)
            assert torch.equal(got_on_cpu, on_cpu), f"T={T}: not every routed miss went to the CPU"
            got = (out.cpu() - base)
            scale = float(want.abs().max())
            if device == "cpu":
                assert torch.equal(out, base + want), f"T={T}: not the CPU kernel's sum"
            else:  # the worker's sum added on the device: float32 rounding of base + want
                assert float((got - want).abs().max()) <= 1e-5 * max(scale, float(base.abs().max())), f"T={T}"
            # the split (what the device's kernel skips, the worker computes) is the whole layer to fp32 rounding
            split = rest + want
            assert float((split - whole).abs().max()) <= 1e-5 * float(whole.abs().max()), f"T={T}"
            # no miss: nothing handed over, nothing added
            out = base.to(dev, copy=True)
            got_on_cpu = _hand_off(cpu, layer, x, ids, weights, torch.zeros_like(missed), routed, out)
            assert not got_on_cpu.any() and torch.equal(out.cpu(), base)
        cpu.check()
    finally:
        cpu.close()
        store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_the_hand_off_replays_in_a_cuda_graph(tiny_models) -> None:
    dev = torch.device("cuda")
    store, layouts, cfg = _store(tiny_models[("qwen2moe", "f16")], dev)
    cpu = CpuExperts(store, layouts, cfg, dev, residency_max_tokens(cfg))
    try:
        layer = min(layouts)
        table = _host_table(store, layouts, cfg, layer)
        T = 9
        x = torch.zeros(T, cfg.n_embd, device=dev)
        ids = torch.zeros(T, cfg.n_expert_used, dtype=torch.int32, device=dev)
        weights = torch.zeros(ids.shape, device=dev)
        no_slot = torch.full((cfg.n_expert,), -1, dtype=torch.int64, device=dev)
        routed = torch.zeros(cfg.n_expert, dtype=torch.int32, device=dev)
        on_cpu = torch.zeros(cfg.n_expert, dtype=torch.bool, device=dev)
        cpu_routed = torch.zeros_like(routed)
        out = torch.zeros(T, cfg.n_embd, device=dev)

        def body() -> None:  # every expert the replay's routing uses is a miss, and the CPU's
            out.zero_()
            routed.zero_()
            routed.index_add_(0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.int32, device=dev))
            cpu.post(layer, x, ids, weights, no_slot, routed, EVERY_MISS, on_cpu, cpu_routed)
            cpu.collect(out, ids, on_cpu)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):  # each replay hands over the inputs of its own time
            hx = torch.randn(T, cfg.n_embd, generator=gen)
            hids = torch.stack([torch.randperm(cfg.n_expert, generator=gen)[:cfg.n_expert_used] for _ in range(T)])
            hw = torch.rand(hids.shape, generator=gen)
            x.copy_(hx), ids.copy_(hids), weights.copy_(hw)
            cpu.arm()
            graph.replay()
            want = moe_ffn(hx, hids, hw, table)
            assert float((out.cpu() - want).abs().max()) <= 1e-5 * float(want.abs().max())
        cpu.check()
    finally:
        cpu.close()
        store.close()


def test_an_idle_worker_sleeps(tiny_models) -> None:
    """A worker with nothing to do stops looking at its mailbox every 100 µs a second after it was last busy: an idle
    process (a server between requests) wakes up about a hundred times a second, not thousands."""
    dev = torch.device("cpu")
    store, layouts, cfg = _store(tiny_models[("qwen2moe", "f16")], dev)
    cpu = CpuExperts(store, layouts, cfg, dev, 1)
    try:
        cpu.arm()
        time.sleep(1.5)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        time.sleep(1.0)
        wakeups = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
        assert wakeups < 1000, f"{wakeups} voluntary context switches in an idle second"
    finally:
        cpu.close()
        store.close()


def test_a_worker_error_is_reported(tiny_models) -> None:
    dev = torch.device("cpu")
    store, layouts, cfg = _store(tiny_models[("qwen2moe", "f16")], dev)
    cpu = CpuExperts(store, {}, cfg, dev, 1)  # no layer's experts given to it
    try:
        x, ids = torch.ones(1, cfg.n_embd), torch.zeros(1, cfg.n_expert_used, dtype=torch.int32)
        no_slot = torch.full((cfg.n_expert,), -1, dtype=torch.int64)
        routed = torch.bincount(ids.flatten(), minlength=cfg.n_expert).to(torch.int32)
        on_cpu, cpu_routed = torch.zeros(cfg.n_expert, dtype=torch.bool), torch.zeros_like(routed)
        cpu.post(min(layouts), x, ids, torch.ones(ids.shape), no_slot, routed, EVERY_MISS, on_cpu, cpu_routed)
        with pytest.raises(SpecterError, match="CPU experts' answer failed: invalid argument"):
            cpu.collect(torch.zeros(1, cfg.n_embd), ids, on_cpu)
        with pytest.raises(SpecterError, match="the CPU experts' worker failed"):
            cpu.check()
        with pytest.raises(SpecterError, match="handing layer"):  # a layer out of range
            cpu.post(cfg.n_layer, x, ids, torch.ones(ids.shape), no_slot, routed, EVERY_MISS, on_cpu, cpu_routed)
        with pytest.raises(SpecterError, match="handing layer"):  # a link that costs nothing
            cpu.post(min(layouts), x, ids, torch.ones(ids.shape), no_slot, routed, (0, 0, 0), on_cpu, cpu_routed)
    finally:
        cpu.close()
        store.close()


def _budget(path, draft=None, slots: int = 1) -> int:
    """The minimum budget plus `slots` slots per MoE layer (one: top_k + 1 slots a layer, so it evicts, and
    misses)."""
    plan = plan_memory(GGUFFile(path), 1 << 40, CTX, "cpu", draft=None if draft is None else GGUFFile(draft))
    return plan.minimum + slots * plan.n_moe_layers * plan.slot_bytes


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "tiny-deepseek2"])
def test_hybrid_decoding_equals_the_target_alone(tiny_models, arch: str) -> None:
    """Plain offloaded decoding and speculative decoding with hybrid on give the target's tokens, 20 prompts × 64
    tokens, and so does a longer prefill that the residency path serves; unmeasured (the CPU device) every miss is
    the CPU's, and with a CPU as slow as the link the misses are split between the two."""
    target, draft = tiny_models[(arch, "f16")], tiny_models[(arch, "q4_k_m")]
    plain = Model.load(target, device="cpu", progress=False, ctx_size=CTX)
    lru = Model.load(target, device="cpu", progress=False, ctx_size=CTX, gpu_budget=_budget(target), offload="lru",
                     hybrid="on")
    spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=CTX,
                      gpu_budget=_budget(target, draft), offload="lru", n_draft=4, hybrid="on")
    assert lru.offload.hybrid.on and lru.offload.hybrid.cpu_us_per_token is None
    pairs = {"lru": 0, "spec": 0}
    for prompt in PROMPTS:
        want = plain.generate(prompt, 64, GREEDY).wait().tokens
        for name, m in (("lru", lru), ("spec", spec)):
            got = m.generate(prompt, 64, GREEDY).wait()
            assert got.tokens == want, (name, prompt)
            s = got.stats
            assert s.hybrid and s.cache_misses > 0 and s.gpu_s is None  # no GPU to time
            assert (s.cpu_wait_s > 0) == (s.cpu_expert_pairs > 0) and s.cpu_wait_s <= s.prefill_s + s.decode_s
            pairs[name] += s.cpu_expert_pairs
    assert pairs["lru"] > 0 and pairs["spec"] > 0
    # a prefill the residency path serves hands its misses over too: one generated token, the prefill's pairs only
    prompt = (PROMPTS[1] * 8)[:min(lru.offload.cpu_experts.max_tokens, CTX // 2)]
    assert len(prompt) > 17  # longer than a verification
    got = lru.generate(prompt, 1, GREEDY).wait()
    assert got.tokens == plain.generate(prompt, 1, GREEDY).wait().tokens and got.stats.cpu_expert_pairs > 0
    # a token's expert costs the CPU what reading it costs the link: a layer's misses are split between the two
    spec.offload.hybrid = HybridChoice(True, cpu_us_per_expert=50.0, cpu_us_per_token=50.0, copy_us=100.0,
                                       link_us=100.0)
    got = spec.generate(PROMPTS[0], 64, GREEDY).wait()
    assert got.tokens == plain.generate(PROMPTS[0], 64, GREEDY).wait().tokens
    assert got.stats.zero_copy_bytes > 0 and got.stats.cpu_expert_pairs > 0 and got.stats.cpu_expert_s > 0
    assert "pairs computed on the CPU" in got.stats.summary()


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_where_routing_repeats_the_cache_is_as_transfers_only_leave_it(tiny_models, arch: str,
                                                                       monkeypatch) -> None:
    """Where routing repeats from token to token (REUSED_SHARE 0 here: always) the split weighs no future hits: a
    miss the CPU computes is cached afterwards as one read over the link would be (the spare slots take their
    misses before the split; lru brings in every expert a forward used), so with hybrid on the expert cache holds
    what it holds with hybrid off, slot for slot, after each generation; plain offloaded decoding and speculative
    decoding, where every miss goes to the CPU (the CPU device)."""
    monkeypatch.setattr(offload, "REUSED_SHARE", 0.0)
    target, draft = tiny_models[(arch, "f16")], tiny_models[(arch, "q4_k_m")]
    for extra, slots in (({}, 1), ({}, 5), ({"draft": draft, "n_draft": 4}, 1)):  # five slots a layer: spares too
        budget = _budget(target, extra.get("draft"), slots)
        models = {mode: Model.load(target, device="cpu", progress=False, ctx_size=CTX, gpu_budget=budget,
                                   offload="lru", hybrid=mode, **extra) for mode in ("off", "on")}
        assert (models["on"].offload.cache.n_spare > 0) == (slots > 1)
        pairs = 0
        for prompt in PROMPTS[:6]:
            gens = {mode: m.generate(prompt, 32, GREEDY).wait() for mode, m in models.items()}
            assert gens["on"].tokens == gens["off"].tokens
            pairs += gens["on"].stats.cpu_expert_pairs
            assert models["on"].offload.routing_repeats
            assert models["on"].offload.cache.key == models["off"].offload.cache.key, (extra, prompt)
        assert pairs > 0 and gens["off"].stats.cpu_expert_pairs == 0


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_where_routing_does_not_repeat_misses_are_split_and_brought_in_by_uses(tiny_models, arch: str,
                                                                                monkeypatch) -> None:
    """Where routing does not repeat (REUSED_SHARE above 1 here: never, once decode steps have been read back) the
    spare slots are lent to their layers' cache: the split weighs every miss, the link's share is read in place, and
    an expert the CPU computes crosses no link then; after the forward lru brings in only experts used more often
    lately than the one they would evict, under half the misses once the free slots are filled (counts halve over
    the six prompts, so new experts come in sooner than on lifetime counts), fewer bytes than hybrid off copies.
    Unmeasured (the CPU device) every miss is the CPU's; with a CPU as slow as the link (each layer's misses split)
    plain decoding moves fewer bytes over the link than with a CPU too slow to take any. No spare takes a miss.
    Plain offloaded decoding and speculative decoding, tokens unchanged (and those of hybrid off)."""
    target, draft = tiny_models[(arch, "f16")], tiny_models[(arch, "q4_k_m")]
    costs = {"split": HybridChoice(True, cpu_us_per_expert=50.0, cpu_us_per_token=50.0, copy_us=100.0,
                                   link_us=100.0),
             "link": HybridChoice(True, cpu_us_per_expert=1e6, cpu_us_per_token=0.0, copy_us=100.0, link_us=100.0)}
    monkeypatch.setattr(offload, "REUSED_SHARE", 1.01)
    for extra in ({}, {"draft": draft, "n_draft": 4}):
        budget = _budget(target, extra.get("draft"), 2)  # two slots more a layer: a spare, and misses once it is lent
        models = {mode: Model.load(target, device="cpu", progress=False, ctx_size=CTX, gpu_budget=budget,
                                   offload="lru", hybrid="off" if mode == "off" else "on", **extra)
                  for mode in ("off", "on", "split", "link")}
        for mode, choice in costs.items():
            models[mode].offload.hybrid = choice
        for m in models.values():
            m.offload.routing_repeats = False  # as decode steps would soon have shown
        assert all(m.offload.cache.n_spare > 0 for m in models.values())
        total = {mode: m.offload.counters.snapshot() for mode, m in models.items()}
        for prompt in PROMPTS[:6]:
            gens = {mode: m.generate(prompt, 32, GREEDY).wait() for mode, m in models.items()}
            assert all(g.tokens == gens["off"].tokens for g in gens.values()), (extra, prompt)
            s = gens["on"].stats
            assert s.cpu_expert_pairs > 0 and s.spare_fetches == 0, (extra, prompt)
        for mode in ("on", "split", "link"):  # every slot in a layer's cache
            lent = models[mode].offload.cache
            assert not lent.spares_kept and (lent.spares < 0).all(), mode
            assert sum(lent.capacity(layer) for layer in lent.position) == lent.n_slots, mode
        got = {mode: m.offload.counters.since(total[mode]) for mode, m in models.items()}
        assert got["split"].cpu_expert_pairs > 0 and got["link"].cpu_expert_pairs == 0, extra
        assert got["split"].spare_fetches == got["link"].spare_fetches == 0 < got["off"].spare_fetches, extra
        assert got["split"].zero_copy_bytes > 0, extra
        if not extra:  # (a lookahead prefetches what the draft routes to, whoever computed it last time)
            link = {mode: c.bytes_copied + c.zero_copy_bytes for mode, c in got.items()}
            assert 0 < link["split"] < link["link"], link
            record = next(iter(models["on"].offload.layouts.values())).nbytes  # (every layer's is the same size)
            on = got["on"]  # brought in by uses: under half the misses once the free slots are filled
            assert 0 < on.bytes_copied < on.cache_misses * record // 2 and on.bytes_copied < got["off"].bytes_copied


def test_the_spares_are_kept_and_lent_as_routing_changes(shipped_model, monkeypatch) -> None:
    """Routing judged to repeat for one prompt and not for the next, six times over: the spare slots are lent to
    the cache and kept again between generations (after forwards that copied into them), and the tokens are the
    target's alone."""
    plain = Model.load(shipped_model, device="cpu", progress=False, ctx_size=CTX)
    model = Model.load(shipped_model, device="cpu", progress=False, ctx_size=CTX,
                       gpu_budget=_budget(shipped_model, slots=3), offload="lru", hybrid="on")
    cache = model.offload.cache
    assert cache.n_spare > 0
    kept, fetches = [], 0
    for i, prompt in enumerate(PROMPTS[:6]):
        monkeypatch.setattr(offload, "REUSED_SHARE", 0.0 if i % 2 else 1.01)
        got = model.generate(prompt, 32, GREEDY).wait()
        assert got.tokens == plain.generate(prompt, 32, GREEDY).wait().tokens, prompt
        kept.append(cache.spares_kept)
        assert got.stats.spares_lent is not cache.spares_kept and (" lent to the cache" in got.stats.summary()) is (
            not cache.spares_kept)
        fetches += got.stats.spare_fetches
    assert kept == [False, True] * 3 and fetches > 0


def test_a_warm_up_forwards_spare_copies_are_adopted(shipped_model) -> None:
    """A CUDA graph's warm-up forward has no `end`: `adopt_spares` hands the cache what its table kernels copied into
    spare slots, so that lending the spares later leaves no table entry naming a slot that holds another expert."""
    model = Model.load(shipped_model, device="cpu", progress=False, ctx_size=CTX,
                       gpu_budget=_budget(shipped_model, slots=3), offload="lru", hybrid="on")
    rt, cache, cfg = model.offload, model.offload.cache, model.offload.cfg
    g = torch.Generator().manual_seed(0)
    rt.begin()
    for layer in rt.layers:  # a decode step's MoE layers, as the warm-up runs them
        ids = torch.randperm(cfg.n_expert, generator=g)[:cfg.n_expert_used].reshape(1, -1).to(torch.int32)
        rt.from_residency(layer, torch.randn(1, cfg.n_embd, generator=g), ids,
                          torch.full(ids.shape, 1.0 / cfg.n_expert_used))
    assert rt.fetched.any()  # misses copied into spares
    rt.adopt_spares()
    rt.routing_repeats = False
    rt.begin()  # lends the spares
    for layer in rt.layers:  # the cache fills every slot, the lent ones too
        cache.request([(layer, e) for e in range(cfg.n_expert)], prefetch=False)
    cache.publish()
    for layer in rt.layers:
        for e, slot in enumerate(cache.table[layer].tolist()):
            assert slot < 0 or cache.key[slot] == (layer, e), (layer, e, slot, cache.key[slot])


def test_routing_repeats_is_judged_from_decode_steps(shipped_model) -> None:
    """`routing_repeats` starts true (the order measured at the usual scale) and follows a running average of the
    share of a decode step's experts that the step before used, against REUSED_SHARE; forwards of more than one
    token (a verification, a prefill) neither count nor serve as the step before."""
    model = Model.load(shipped_model, device="cpu", progress=False, ctx_size=CTX, gpu_budget=_budget(shipped_model),
                       offload="lru", hybrid="on")
    rt, cfg = model.offload, model.offload.cfg
    assert rt.routing_repeats

    def step(*experts: int, tokens: int = 1) -> None:
        counts = np.zeros((cfg.n_layer, cfg.n_expert), dtype=np.int32)
        for layer in rt.layers:
            counts[layer, list(experts)] = tokens
        rt._track_repeats(counts)

    k = cfg.n_expert_used
    for _ in range(3 * offload.REUSE_FORWARDS):  # steps that share none of their experts: not repeating
        step(*range(k))
        step(*range(k, 2 * k))
    assert not rt.routing_repeats
    for _ in range(3 * offload.REUSE_FORWARDS):  # a verification between the steps hides their repetition
        step(*range(k))
        step(*range(2 * k), tokens=2)
    assert not rt.routing_repeats
    for _ in range(3 * offload.REUSE_FORWARDS):  # steps that repeat
        step(*range(k))
    assert rt.routing_repeats


def _split_reference(slot_of: list[int], routed: list[int], per_expert: int, per_token: int,
                     link: int, free_spares: int = 0) -> list[int]:
    """The split's definition: misses ranked by (tokens, expert), but for the first `free_spares` of those with no
    slot (-1) in ascending order (the spares', when they are on); the CPU takes the longest prefix along which each
    one taken (per_expert + tokens * per_token, in ns) makes max(CPU time, link time) smaller."""
    spared = [e for e, (s, t) in enumerate(zip(slot_of, routed)) if t > 0 and s == -1][:free_spares]
    misses = sorted((t, e) for e, (s, t) in enumerate(zip(slot_of, routed)) if t > 0 and s < 0 and e not in spared)
    taken, cpu = [], 0
    for r, (t, e) in enumerate(misses):
        cost = per_expert + t * per_token
        if max(cpu + cost, (len(misses) - r - 1) * link) >= max(cpu, (len(misses) - r) * link):
            break
        taken.append(e)
        cpu += cost
    return [int(e in taken) for e in range(len(routed))]


@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_the_split_weighs_the_cpu_against_the_link(tiny_models, device: str) -> None:
    """The post's split (native, on the device) against its definition, random layers of 1 to 160 experts. (The
    pairs route no token, so nothing is handed over: the split reads only the routing counts.)"""
    dev = torch.device(device)
    store, _, cfg = _store(tiny_models[("qwen2moe", "f16")], dev)
    g = torch.Generator().manual_seed(0)
    checked = 0
    try:
        for n_expert in (1, 2, 8, 60, 128, 160):
            cpu = CpuExperts(store, {}, dataclasses.replace(cfg, n_expert=n_expert, n_expert_used=1), dev, 1)
            x, ids, weights = torch.zeros(1, cfg.n_embd), torch.full((1, 1), -1, dtype=torch.int32), torch.ones(1, 1)
            try:
                for _ in range(20):
                    # no slot, a slot, or a copy into slot 5 on its way (a miss that no spare takes)
                    pick = torch.rand(n_expert, generator=g)
                    slot_of = torch.where(pick < 0.4, -1, torch.where(pick < 0.8, 3, -2 - 5)).to(torch.int64)
                    used = torch.rand(n_expert, generator=g) < 0.4
                    routed = torch.randint(1, 6, (n_expert,), generator=g, dtype=torch.int32) * used
                    per_expert, per_token, link_us = [float(v) for v in torch.randint(0, 800, (3,), generator=g)]
                    choice = HybridChoice(True, per_expert, per_token, copy_us=link_us, link_us=link_us)
                    on_cpu = torch.ones(n_expert, dtype=torch.bool, device=dev)
                    cpu_routed = torch.full((n_expert,), 7, dtype=torch.int32, device=dev)
                    out = torch.zeros(1, cfg.n_embd, device=dev)
                    # spare slots (some used: -1; every one, as when they are lent to the cache, one time in
                    # five), which take their misses first, or none
                    usable = 0.0 if int(torch.randint(0, 5, (1,), generator=g)) == 0 else 0.7
                    slots = torch.where(torch.rand(MAX_SPARES, generator=g) < usable, 5, -1)
                    given = int(torch.randint(0, 2, (1,), generator=g))
                    spares = SpareSlots(slots.to(dev), torch.zeros(n_expert, dtype=torch.int32, device=dev),
                                        torch.zeros(1, dtype=torch.int32, device=dev)) if given else None
                    cpu.post(0, x.to(dev), ids.to(dev), weights.to(dev), slot_of.to(dev), routed.to(dev),
                             choice.costs_ns(), on_cpu, cpu_routed, spares)
                    cpu.collect(out, ids.to(dev), on_cpu)
                    want = _split_reference(slot_of.tolist(), routed.tolist(), round(per_expert * 1000),
                                            round(per_token * 1000), max(1, round(link_us * 1000)),
                                            int((slots >= 0).sum()) * given)
                    assert on_cpu.int().tolist() == want, (n_expert, per_expert, per_token, link_us)
                    assert cpu_routed.tolist() == [t * w for t, w in zip(routed.tolist(), want)]
                    assert not out.any()
                    checked += sum(want)
                cpu.check()
            finally:
                cpu.close()
        # auto's rule (`worth_it`) is the split's own for a layer of two one-token misses
        cpu = CpuExperts(store, {}, dataclasses.replace(cfg, n_expert=2, n_expert_used=1), dev, 1)
        try:
            x, ids, weights = x.to(dev), ids.to(dev), weights.to(dev)
            for one_us, link_us in ((30.0, 60.0), (100.0, 60.0), (119.0, 60.0), (120.0, 60.0), (121.0, 60.0)):
                on_cpu = torch.zeros(2, dtype=torch.bool, device=dev)
                cpu.post(0, x, ids, weights, torch.full((2,), -1, device=dev), torch.ones(2, dtype=torch.int32,
                                                                                           device=dev),
                         (round(one_us * 1000), 0, round(link_us * 1000)), on_cpu,
                         torch.zeros(2, dtype=torch.int32, device=dev))
                cpu.collect(torch.zeros(1, cfg.n_embd, device=dev), ids, on_cpu)
                assert bool(on_cpu.any()) == worth_it(one_us, link_us) == (one_us < 2 * link_us), (one_us, link_us)
        finally:
            cpu.close()
    finally:
        store.close()
    assert checked > 0
    # unmeasured (the CPU device's choice): every miss is the CPU's
    assert HybridChoice(True).costs_ns() == EVERY_MISS


def test_hybrid_off_and_auto_on_the_cpu_start_no_worker(shipped_model) -> None:
    for mode in ("off", "auto", None):  # None: the default
        m = Model.load(shipped_model, device="cpu", progress=False, ctx_size=CTX, gpu_budget=_budget(shipped_model),
                       offload="lru", hybrid=mode)
        assert m.offload.cpu_experts is None and not m.offload.hybrid.on
        s = m.generate([5, 17, 300], 8, GREEDY).wait().stats
        assert s.hybrid is False and s.cpu_expert_pairs == 0


def test_hybrid_mistakes_are_named(shipped_model) -> None:
    with pytest.raises(SpecterError, match="unknown --hybrid mode 'maybe'"):
        Model.load(shipped_model, device="cpu", progress=False, hybrid="maybe")
    with pytest.raises(SpecterError, match="--hybrid on: only for offloaded experts"):
        Model.load(shipped_model, device="cpu", progress=False, gpu_budget="64GiB", hybrid="on")
    with pytest.raises(SpecterError, match="--hybrid on: not with --offload gate-prefetch"):
        Model.load(shipped_model, device="cpu", progress=False, ctx_size=CTX, gpu_budget=_budget(shipped_model),
                   offload="gate-prefetch", hybrid="on")
    result = CliRunner().invoke(cli, ["run", str(shipped_model), "-p", "hi", "-n", "2", "--device", "cpu",
                                      "--hybrid", "on", "--draft", "none"])
    assert result.exit_code != 0 and "--hybrid on: only for offloaded experts" in result.output
    assert "Traceback" not in result.output


def test_plan_says_what_hybrid_would_choose(shipped_model) -> None:
    """`plan --hybrid` names the choice and its reason (on CUDA the load's measurement: the GPU test below)."""
    def plan(*args: str) -> str:
        r = CliRunner().invoke(cli, ["plan", str(shipped_model), "-c", str(CTX), *args])
        assert r.exit_code == 0 and "Traceback" not in r.output, r.output
        return r.output.splitlines()[-1]

    budget = ["--gpu-budget", str(_budget(shipped_model)), "--device", "cpu"]
    assert plan(*budget, "--hybrid", "off") == "hybrid off: the experts a forward misses are read over PCIe"
    auto = "hybrid off (auto: on the CPU device every expert runs on the CPU either way)"
    assert plan(*budget) == plan(*budget, "--hybrid", "auto") == auto  # auto is the default
    most = residency_max_tokens(ModelConfig.from_gguf(GGUFFile(shipped_model)))
    assert plan(*budget, "--hybrid", "on").startswith(f"hybrid on (--hybrid on: every missed expert of a batch of "
                                                      f"up to {most} tokens")
    assert "no expert is offloaded" in plan("--gpu-budget", "64GiB", "--device", "cpu", "--hybrid", "on")
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), *budget, "--hybrid", "on", "--json"])
    assert json.loads(r.output)["hybrid"].startswith("hybrid on"), r.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_hybrid_on_the_gpu_agrees_with_the_target_alone(tiny_models) -> None:
    """CUDA graphs, an evicting expert cache, hybrid on: eager decode steps agree with the whole model's eager
    decode steps over the same tokens (max relative difference of the logits <= 5e-3: the CPU's sums round
    differently from the GPU's, and the activations' float16 roundings can then fall apart; the tiny models on
    the GPU against the CPU are held to 1e-2), and greedy output, plain and speculative, is the target's, except
    where the target's own top two logits lie within 1e-3 of the largest logit. The link is paced to 0.1 GB/s or
    slower: the tiny model's experts cross PCIe in microseconds, faster than a hand-off to the CPU, so that the
    split would otherwise hand the CPU nothing."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q4_k_m")]
    plan = plan_memory(GGUFFile(target), 1 << 40, CTX, "cuda", draft=GGUFFile(draft))
    budget = plan.minimum + plan.n_moe_layers * plan.slot_bytes
    whole = Model.load(target, device="cuda", progress=False, ctx_size=CTX)
    lru = Model.load(target, device="cuda", progress=False, ctx_size=CTX, gpu_budget=budget, offload="lru",
                     hybrid="on")
    spec = Model.load(target, draft=draft, device="cuda", progress=False, ctx_size=CTX, gpu_budget=budget,
                      offload="lru", n_draft=4, hybrid="on")
    h = lru.offload.hybrid
    assert h.on and h.cpu_us_per_expert + h.cpu_us_per_token > 0 and h.copy_us > 0
    # at most 0.1 GB/s, and slow enough that an expert crosses the link in four times the CPU's measured time for
    # it (a host busy with other work measures a slow CPU: 8 ms an expert while llama.cpp built beside this test)
    nbytes = lru.offload.layouts[lru.offload.layers[0]].nbytes
    gbps = min(0.1, nbytes / (4000 * (h.cpu_us_per_expert + h.cpu_us_per_token)))
    for m in (lru, spec):
        m.offload.pace_transfers(gbps)
    assert h.link_us > 2 * (h.cpu_us_per_expert + h.cpu_us_per_token), h.describe()

    def steps(m: Model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits of eager decode steps over `tokens` after the prompt."""
        cache = m.transformer.new_cache(CTX)
        m.forward(torch.tensor(prompt, device="cuda"), cache)
        return torch.stack([m.forward(torch.tensor([t], device="cuda"), cache)[-1] for t in tokens])

    pairs, busy = 0, 0.0
    for prompt in PROMPTS[:6]:
        want = whole.generate(prompt, 32, GREEDY).wait().tokens
        a, b = steps(whole, prompt, want), steps(lru, prompt, want)
        worst = float((a - b).abs().max() / a.abs().max())
        assert worst <= 5e-3, f"max rel {worst:.2e}"
        for m in (lru, spec):
            got = m.generate(prompt, 32, GREEDY).wait()
            pairs, busy = pairs + got.stats.cpu_expert_pairs, busy + got.stats.cpu_expert_s
            s = got.stats  # the GPU's time in the decode forwards, and its waits for the CPU, within the wall time
            assert 0 < s.gpu_s <= s.decode_s * 1.05 and 0 <= s.cpu_wait_s <= s.prefill_s + s.decode_s
            if got.tokens != want:
                i = next(i for i, (x, y) in enumerate(zip(got.tokens, want)) if x != y)
                cache = whole.transformer.new_cache(CTX)
                logits = whole.forward(torch.tensor(prompt + want[:i], device="cuda"), cache, last_only=True)[-1]
                top = torch.topk(logits.float(), 2).values
                assert float(top[0] - top[1]) <= 1e-3 * float(logits.abs().max()), (prompt, i)
    assert pairs > 0 and busy > 0
    lru.offload.cpu_experts.check()
    # `plan` measures as the load did
    r = CliRunner().invoke(cli, ["plan", str(target), "--draft", str(draft), "-c", str(CTX),
                                 "--gpu-budget", str(budget), "--hybrid", "on"])
    line = r.output.splitlines()[-1]
    assert r.exit_code == 0 and "on the CPU" in line and "its copy to the device" in line, r.output


def test_pacing_is_for_cuda_only(shipped_model) -> None:
    m = Model.load(shipped_model, device="cpu", progress=False, ctx_size=CTX, gpu_budget=_budget(shipped_model),
                   offload="lru")
    with pytest.raises(SpecterError, match="pacing stands for a slower PCIe link: it needs a CUDA device"):
        m.offload.pace_transfers(25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paced_transfers_take_the_slower_links_time(tiny_models) -> None:
    """--pcie-gbps: copies into slots take about their bytes' time at the paced rate, and the output is unchanged."""
    path = tiny_models[("qwen2moe", "f16")]
    plan = plan_memory(GGUFFile(path), 1 << 40, CTX, "cuda")
    budget = plan.minimum + plan.n_moe_layers * plan.slot_bytes
    tokens = {}
    for gbps in (None, 1.0):
        m = Model.load(path, device="cuda", progress=False, ctx_size=CTX, gpu_budget=budget, offload="lru")
        if gbps:
            measured = m.offload.pace_transfers(gbps)
            assert measured > gbps
        gen = m.generate(PROMPTS[1], 32, GREEDY).wait()
        tokens[gbps] = gen.tokens
        s = gen.stats
        if gbps:  # 1 GB/s: a byte a nanosecond
            assert s.bytes_copied > 0 and 0.8 <= s.copy_s * 1e9 / s.bytes_copied <= 1.5, s.summary()
    assert tokens[None] == tokens[1.0]
