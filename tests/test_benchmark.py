"""The benchmark harness (specter_gguf/bench/, scripts/bench.py), tested on the CPU.

These tests check the harness's logic and formatting — budget parsing, the -ncmoe estimate from real GGUF
files, medians, the systems matrix, llama-server process handling (against a stand-in server script), the
report and plots from fake result records — and run bench.py end to end with our real engine on a tiny
model. None of the numbers they produce or read says anything about speed.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specter_gguf.bench import prompts
from specter_gguf.bench.cache_replay import RoutingRecorder, replay, replay_served
from specter_gguf.bench.llamacpp import EXPERT_RE, ModelSizes, llama_server_args, smallest_ncmoe
from specter_gguf.bench.matrix import (LLAMA_FAMILIES, Budget, MatrixConfig, SystemSpec, build_matrix, parse_budgets,
                                       select_families, split_part)
from specter_gguf.bench.metrics import median, summarize_runs
from specter_gguf.bench.model_files import find_vocab, llama_sources
from specter_gguf.bench.ours import OURS_MODES
from specter_gguf.bench.plots import synth_figure, tpot_figure, write_plots
from specter_gguf.bench.prompts import (PROMPTS_FILE, load_prompts, server_tokenizer, stored_token_ids,
                                        tokenize_prompts, vocab_fingerprint)
from specter_gguf.bench.report import SPEC_COLUMNS, SPEC_KEYS, append_report, format_size, merge_docs, render_markdown
from specter_gguf.bench.runner import BenchContext, RunSettings, _slug, run_system
from specter_gguf.engine import tpot_ms
from specter_gguf.errors import SpecterError
from specter_gguf.sizes import parse_size
from specter_gguf.synthetic.architectures import tensor_specs
from specter_gguf.synthetic.shapes import PRESETS
from specter_gguf.synthetic.writer import write_synthetic

REPO = Path(__file__).resolve().parent.parent
QWEN2_VOCAB = sorted(Path("/tmp").glob("*/llama_cpp_python-*/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"))


# ----------------------------------------------------------------------------------------- budgets
def test_parse_budgets():
    bs = parse_budgets("16GiB, 20GiB")
    assert [(b.label, b.bytes) for b in bs] == [("16GiB", 16 * 2**30), ("20GiB", 20 * 2**30)]
    assert bs[0].gib == 16
    rel = parse_budgets("50%,75%", model_bytes=1000)
    assert [(b.label, b.bytes) for b in rel] == [("50%", 500), ("75%", 750)]
    with pytest.raises(SpecterError):
        parse_budgets("50%")  # relative without a model size
    with pytest.raises(SpecterError):
        parse_budgets("0GiB")
    assert parse_budgets("") == []


def test_format_size():
    assert format_size(None) == "—"
    assert format_size(3 * 2**30) == "3.0 GiB"
    assert format_size(300 * 2**20) == "300.0 MiB"


# ----------------------------------------------------------------------------------------- metrics
def test_median_and_tpot():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert median([None, 5.0, float("nan")]) == 5.0
    assert median([]) is None
    # 128 generated tokens: 127 decode steps after the first token (llama-server's and our definition)
    assert tpot_ms(1.27, 128) == pytest.approx(10.0)
    assert tpot_ms(0.5, 1) is None


def _run(dec, tpot, n=128, warmup=False, **extra):
    return {"decoding": dec, "tpot_ms": tpot, "generated_tokens": n, "prompt_tokens": 32, "prefill_ms": 5.0,
            "warmup": warmup, "extra": extra}


def test_summarize_runs_medians_counts_and_rates():
    runs = [
        _run("greedy", 999.0, warmup=True),  # warm-up: ignored
        _run("greedy", 10.0, draft_tokens=80, draft_accepted=8, bytes_copied=1280),
        _run("greedy", 30.0, draft_tokens=20, draft_accepted=12, bytes_copied=0),
        _run("greedy", 20.0, draft_tokens=100, draft_accepted=0, bytes_copied=1280),
        _run("sampled", 40.0, cache_hit_rate=0.5, hidden_copy_share=0.9),
        _run("sampled", 50.0, cache_hit_rate=0.7, hidden_copy_share=0.7),
    ]
    s = summarize_runs(runs)
    g, m = s["greedy"], s["sampled"]
    assert g["n_prompts"] == 3 and m["n_prompts"] == 2
    assert g["tpot_ms"] == 20.0 and g["tokens_per_s"] == pytest.approx(50.0)
    assert g["tpot_ms_min"] == 10.0 and g["tpot_ms_max"] == 30.0
    assert g["acceptance"] == pytest.approx(20 / 200)  # summed counts, not a mean of ratios
    assert g["bytes_per_token"] == pytest.approx(2560 / (3 * (32 + 128)))  # per processed token
    assert "cache_hit_rate" not in g
    assert m["tpot_ms"] == 45.0
    assert m["cache_hit_rate"] == pytest.approx(0.6) and m["hidden_copy_share"] == pytest.approx(0.8)
    assert "acceptance" not in m


def test_summarize_runs_speculation_and_data_movement():
    """Prefetch precision / recall, bytes moved, draft step and the per-iteration breakdown: counts summed over
    prompts, then divided; ready-made rates (medians) only where counts are missing."""
    spec = [  # two prompts of a speculative system: 32 prompt + 128 generated tokens each
        _run("greedy", 10.0, draft_tokens=100, draft_rounds=25, draft_s=0.5, verify_s=1.0, other_s=0.25,
             copy_exposed_s=0.1, prefetched=40, prefetched_used=30, verify_missing=60, bytes_copied=1000,
             zero_copy_bytes=600, prefetch_precision=0.75, draft_step_ms=5.0, cpu_expert_s=0.064, copy_s=0.128,
             cpu_wait_s=0.032, gpu_s=1.27),
        _run("greedy", 20.0, draft_tokens=60, draft_rounds=15, draft_s=0.3, verify_s=0.6, other_s=0.15,
             copy_exposed_s=0.3, prefetched=10, prefetched_used=2, verify_missing=40, bytes_copied=2000,
             prefetch_precision=0.2, draft_step_ms=5.0, cpu_expert_s=0.0, copy_s=0.128, cpu_wait_s=0.0, gpu_s=0.635),
    ]
    g = summarize_runs(spec)["greedy"]
    assert g["prefetch_precision"] == pytest.approx(32 / 50)  # not the median 0.475 of the per-prompt ratios
    assert g["prefetch_recall"] == pytest.approx(32 / 100)
    assert g["bytes_moved_per_token"] == pytest.approx((3000 + 600) / 320)  # zero-copy missing on one prompt: 0
    assert g["bytes_per_token"] == pytest.approx(3000 / 320)
    assert g["draft_step_ms"] == pytest.approx(1000 * 0.8 / 160)
    assert g["iter_draft_ms"] == pytest.approx(20.0) and g["iter_verify_ms"] == pytest.approx(40.0)
    assert g["iter_other_ms"] == pytest.approx(10.0) and g["iter_copy_exposed_ms"] == pytest.approx(10.0)
    # utilisation per generated token: 64 ms of CPU experts and 256 ms of copies over 256 tokens
    assert g["cpu_experts_ms_per_token"] == pytest.approx(0.25) and g["copy_ms_per_token"] == pytest.approx(1.0)
    assert g["cpu_wait_ms_per_token"] == pytest.approx(0.125)
    # the GPU's time per decode step, as TPOT: 1.905 s over 2 × 127 steps
    assert g["gpu_ms_per_token"] == pytest.approx(7.5)
    # rates only (no counts): medians; other_s derived from the decode time when the stats lack it
    rates = [dict(_run("sampled", 10.0, prefetch_precision=p, prefetch_recall=0.5, draft_step_ms=d,
                       bytes_moved_per_token=b, draft_rounds=10, draft_s=0.2, verify_s=0.5), decode_ms=900.0)
             for p, d, b in ((0.6, 4.0, 100.0), (0.8, 6.0, 300.0), (0.9, 8.0, 200.0))]
    m = summarize_runs(rates)["sampled"]
    assert m["prefetch_precision"] == pytest.approx(0.8) and m["prefetch_recall"] == pytest.approx(0.5)
    assert m["draft_step_ms"] == pytest.approx(6.0) and m["bytes_moved_per_token"] == pytest.approx(200.0)
    assert m["iter_other_ms"] == pytest.approx(1000 * 3 * 0.2 / 30)  # (0.9 - 0.2 - 0.5) s per prompt, 10 rounds
    assert "iter_copy_exposed_ms" not in m and "bytes_per_token" not in m and "copy_ms_per_token" not in m
    assert "gpu_ms_per_token" not in m and "cpu_wait_ms_per_token" not in m
    # a system without any of it (llama.cpp): no such keys at all
    assert not set(SPEC_KEYS) & set(summarize_runs([_run("greedy", 5.0)])["greedy"])


# ----------------------------------------------------------------------------------------- cache replay
def test_replay_policies_and_delays():
    """lru on a cycle longer than the cache misses every time, the best policy does not; a missed expert found from
    the next forward on with delay 0, `delay` forwards later otherwise."""
    cycle = [{0: frozenset({e})} for e in [0, 1, 2] * 20]
    assert replay(cycle, 2, "lru") == 0.0
    assert replay(cycle, 2, "optimal") >= 0.45 and replay(cycle, 3, "lru") > 0.9
    same = [{0: frozenset({5}), 3: frozenset({1, 2})}] * 11  # 10 forwards after the prompt's
    for delay in (0, 1, 3):
        assert replay(same, 2, "lru", delay) == pytest.approx((10 - delay) / 10)
    with pytest.raises(ValueError, match="policy"):
        replay(same, 2, "fifo")


def test_replay_by_uses():
    """by-uses brings in after a decode forward only an expert used more often than the least recently used one it
    would evict; the prompt's forward brings in every expert. Two experts alternating with a third used once: lru
    lets the one-off in, evicting one of the pair, by-uses keeps the pair."""
    trace = [{0: frozenset({0, 1})}, {0: frozenset({0})}, {0: frozenset({1})}, {0: frozenset({2})},
             {0: frozenset({0})}, {0: frozenset({1})}]
    # lru: 2 evicts 0 (least recent), forward 4 misses 0, which evicts 1, and forward 5 misses 1; by-uses: 2 (one
    # use) does not beat 0 (two), so only forward 3 misses
    assert replay(trace, 2, "lru") == pytest.approx(2 / 5)
    assert replay(trace, 2, "by-uses") == pytest.approx(4 / 5)
    assert replay([{0: frozenset({0, 1})}, {0: frozenset({0, 1})}], 2, "by-uses") == 1.0  # the prompt's: all in


def test_replay_served_halves_use_counts():
    """One cache through two generations in turn: on lifetime counts by-uses never brings in the second's two experts
    (the first's were used more often), with counts halved after each 5 × the slots of uses it does within a few
    forwards; a single generation served is `replay`'s."""
    first = [{0: frozenset({0, 1})}] * 41  # a prompt's forward and 40 decode forwards
    second = [{0: frozenset({2, 3})}] * 41
    runs = [(first, False), (second, False)]
    assert replay_served(runs, 2, "by-uses", halve_after=0) == 0.5  # the first's 80 lookups hit, the second's miss
    assert replay_served(runs, 2, "lru", halve_after=0) == 1.0  # the second's prompt brings its experts in
    halved = replay_served(runs, 2, "by-uses", halve_after=5)
    assert 0.9 < halved < 1.0
    assert replay_served([(first, False)], 2, "by-uses") == replay(first, 2, "by-uses") == 1.0
    trace = [{layer: frozenset(np.random.default_rng(n).choice(16, 4, replace=False).tolist()) for layer in range(3)}
             for n in range(30)]
    assert replay_served([(trace, True)], 6, "by-uses", 3) == replay(trace, 6, "by-uses", 3, prompt_in_waves=True)
    # a later prompt of six experts on two slots: in waves each evicts the one before and 6, 7 are left, so the
    # decode forward's 2 and 3 miss; as a forward's, 2 and 3 come in and the others find no slot the forward did
    # not use
    many = [{0: frozenset(range(2, 8))}, {0: frozenset({2, 3})}]
    assert replay_served([(first[:2], False), (many, True)], 2, "lru") == 0.5
    assert replay_served([(first[:2], False), (many, False)], 2, "lru") == 1.0
    with pytest.raises(ValueError, match="halve_after"):
        replay(first, 2, "lru", halve_after=-1)


def test_replay_with_spares():
    """A miss copied into a spare is found from the next forward on, whatever the delay; on CUDA's timing a spare
    comes back to the layer two forwards after it was used. With delay 0 a spare is a slot fewer for the cache, but
    for where its expert stands in the recency order (taken in before the forward's hits are refreshed)."""
    same = [{0: frozenset({5}), 3: frozenset({1, 2})}] * 11  # 10 forwards after the prompt's
    # layer 0: only the first forward misses 5. Layer 3: 1 is copied in the first forward, 2 in the third (the spare
    # is out in the second), and from the fourth the prompt's copies are in: 0 + 1 + 1 + 7 * 2 of 20
    assert replay(same, 3, "lru", 3, spares=1) == pytest.approx((9 + 16) / 30)
    rng = np.random.default_rng(3)
    trace = [{layer: frozenset(rng.choice(16, 4, replace=False).tolist()) for layer in range(3)} for _ in range(60)]
    for policy in ("lru", "lfu"):  # lifetime counts (lfu): counts halve after a number of uses the slots set
        assert replay(trace, 8, policy, 0, spares=2, halve_after=0) == pytest.approx(
            replay(trace, 6, policy, 0, halve_after=0), abs=0.01)
        assert replay(trace, 8, policy, 3, spares=2, halve_after=0) > replay(trace, 6, policy, 3, halve_after=0)
    with pytest.raises(ValueError, match="spares"):
        replay(same, 2, "lru", 0, spares=2)


def test_routing_recorder_keeps_each_forward(tiny_models):
    from specter_gguf.engine import Model
    from specter_gguf.sampling import SamplingParams

    m = Model.load(tiny_models[("qwen2moe", "f16")], device="cpu", progress=False, ctx_size=128)
    recorder = RoutingRecorder()
    m.routing_observer = recorder
    m.generate([1, 2, 3, 4, 5], 6, SamplingParams(temperature=0), ignore_eos=True).wait()
    trace = recorder.take()
    assert len(trace) == 6 and recorder.take() == []  # the prompt's forward and five decode steps
    moe = sorted(trace[0])
    assert moe and all(sorted(f) == moe for f in trace)
    k = m.config.n_expert_used
    assert all(len(f[layer]) == k for f in trace[1:] for layer in moe)  # one token: its k experts
    assert all(k <= len(trace[0][layer]) <= min(5 * k, m.config.n_expert) for layer in moe)


def test_replay_at_delay_0_is_the_engines_lru_on_the_cpu(tiny_models):
    """On the CPU a copy into a slot is done before the next forward: the engine's lru decode hit rate is the replay's
    with delay 0 over the same routing (recorded on the whole model), lookup for lookup, at the slots of a layer's
    partition — a spare slot (one a layer, set aside for a forward to copy its misses into) is not among them."""
    from specter_gguf.engine import Model
    from specter_gguf.gguf_file import GGUFFile
    from specter_gguf.runtime.budget import plan_memory
    from specter_gguf.runtime.offload import residency_max_tokens
    from specter_gguf.sampling import SamplingParams

    path, greedy, prompt = tiny_models[("qwen2moe", "f16")], SamplingParams(temperature=0), list(range(3, 40))
    plan = plan_memory(GGUFFile(path), 1 << 40, 256, "cpu")
    budget = plan.minimum + 4 * plan.n_moe_layers * plan.slot_bytes  # top_k + 3 slots a layer and a spare: it evicts

    def offloaded(n: int):
        m = Model.load(path, device="cpu", progress=False, ctx_size=256, gpu_budget=budget, offload="lru",
                       hybrid="off", spare_slots=1)
        return m, m.generate(prompt, n, greedy, ignore_eos=True).wait().stats

    _, prefill = offloaded(1)
    m, whole = offloaded(48)
    lookups, hits = whole.cache_lookups - prefill.cache_lookups, whole.cache_hits - prefill.cache_hits
    assert whole.cache_evictions > 0 and 0 < hits < lookups and whole.spare_fetches > 0
    plain = Model.load(path, device="cpu", progress=False, ctx_size=256)
    plain.routing_observer = recorder = RoutingRecorder()
    plain.generate(prompt, 48, greedy, ignore_eos=True).wait()
    trace = recorder.take()
    assert sum(len(e) for f in trace[1:] for e in f.values()) == lookups
    slots = m.offload.cache.capacity(min(m.offload.layers))
    waves = len(prompt) > residency_max_tokens(m.config)  # (it is)
    assert replay(trace, slots, "lru", 0, prompt_in_waves=waves) == pytest.approx(hits / lookups)
    assert replay(trace, slots, "lru", 3, prompt_in_waves=waves) < hits / lookups


@pytest.mark.parametrize("prompt_len", [37, 20])
def test_replay_at_delay_0_is_the_engines_by_uses_on_the_cpu(tiny_models, monkeypatch, prompt_len: int):
    """Hybrid where routing does not repeat (REUSED_SHARE above 1: never) brings in by uses: on the CPU its decode hit
    rate is the by-uses replay's with delay 0, lookup for lookup, at the slots of a layer's partition (no spare slots:
    one lent only once the prompt's experts are in would start the two apart), use counts halved as the engine's; a
    prompt's experts come in waves above `residency_max_tokens` (31 here), by uses below."""
    from specter_gguf.engine import Model
    from specter_gguf.gguf_file import GGUFFile
    from specter_gguf.runtime import offload
    from specter_gguf.runtime.budget import plan_memory
    from specter_gguf.sampling import SamplingParams

    monkeypatch.setattr(offload, "REUSED_SHARE", 1.01)
    path, greedy = tiny_models[("qwen2moe", "f16")], SamplingParams(temperature=0)
    prompt = list(range(3, 3 + prompt_len))
    plan = plan_memory(GGUFFile(path), 1 << 40, 256, "cpu")
    budget = plan.minimum + 2 * plan.n_moe_layers * plan.slot_bytes

    def offloaded(n: int):
        m = Model.load(path, device="cpu", progress=False, ctx_size=256, gpu_budget=budget, offload="lru",
                       hybrid="on", spare_slots=0)
        m.offload.routing_repeats = False  # as decode steps would soon show
        return m, m.generate(prompt, n, greedy, ignore_eos=True).wait().stats

    _, prefill = offloaded(1)
    m, whole = offloaded(48)
    lookups, hits = whole.cache_lookups - prefill.cache_lookups, whole.cache_hits - prefill.cache_hits
    assert whole.cache_evictions > 0 and 0 < hits < lookups
    plain = Model.load(path, device="cpu", progress=False, ctx_size=256)
    plain.routing_observer = recorder = RoutingRecorder()
    plain.generate(prompt, 48, greedy, ignore_eos=True).wait()
    trace = recorder.take()
    slots = m.offload.cache.capacity(min(m.offload.layers))
    waves = prompt_len > offload.residency_max_tokens(m.config)
    assert waves == (prompt_len == 37)
    assert replay(trace, slots, "by-uses", 0, prompt_in_waves=waves) == pytest.approx(hits / lookups)
    assert replay(trace, slots, "lru", 0, prompt_in_waves=waves) != pytest.approx(hits / lookups)
    if not waves:  # the use counts halved on the way (USES_HALVED_AFTER), in the engine as in the replay
        assert replay(trace, slots, "by-uses", 0, halve_after=0) != pytest.approx(hits / lookups)


# ----------------------------------------------------------------------------------------- prompts
def test_prompts_file_is_varied_and_round_robin():
    data = json.loads(PROMPTS_FILE.read_text())
    kinds = [p["kind"] for p in data["prompts"]]
    assert len(kinds) >= 20 and {"code", "math", "prose", "chat"} <= set(kinds)
    assert len({p["id"] for p in data["prompts"]}) == len(kinds)
    first = load_prompts(n=4)
    assert sorted(p.kind for p in first) == ["chat", "code", "math", "prose"]
    assert len(load_prompts()) == len(kinds)
    with pytest.raises(SpecterError):
        load_prompts(n=0)


@pytest.mark.skipif(not QWEN2_VOCAB, reason="llama.cpp's ggml-vocab-qwen2.gguf (llama-cpp-python sdist) not found")
def test_prompt_lengths_and_stored_ids_match_llama_cpp_tokenizer():
    pytest.importorskip("llama_cpp")
    from specter_gguf.tokenizer import Tokenizer

    vocab = QWEN2_VOCAB[0]
    tok = Tokenizer.from_gguf(vocab)
    stored = stored_token_ids(PROMPTS_FILE, vocab_fingerprint(vocab))
    for p in load_prompts():
        ids = tok.encode(p.text)
        assert 16 <= len(ids) <= 128, (p.id, len(ids))
        assert stored[p.id] == ids, p.id  # the ids used where llama-cpp-python is missing


# ------------------------------------------------------------------------------- -ncmoe estimate
@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """A real GGUF in qwen2moe layout (tiny widths, 4 layers) written by the synthetic writer."""
    path = tmp_path_factory.mktemp("bench") / "tiny-qwen2moe-l4-f16.gguf"
    shape = PRESETS["tiny-qwen2moe"].with_layers(4)
    write_synthetic(path, shape, "f16", seed=0)
    return path, shape


def test_model_sizes_from_real_gguf(qwen_like):
    path, s = qwen_like
    sizes = ModelSizes.from_gguf(path)
    assert sizes.arch == "qwen2moe" and sizes.n_layer == 4
    per_layer = 3 * s.n_expert * s.n_embd * s.n_ff_exp * 2  # gate, up, down in F16
    assert sizes.expert_bytes == [per_layer] * 4
    import gguf

    r = gguf.GGUFReader(str(path))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    total = sum(sp.n_elements * (4 if sp.f32 else 2) for sp in tensor_specs(s, n_vocab))
    assert sizes.cpu_only_bytes == n_vocab * s.n_embd * 2  # token_embd stays on the CPU in llama.cpp
    assert sizes.nonexpert_bytes + sizes.cpu_only_bytes + sum(sizes.expert_bytes) == total
    assert sizes.kv_bytes_per_token == 4 * 2 * s.n_head_kv * s.head_dim * 2
    assert sizes.gpu_bytes(0, 100) == sizes.nonexpert_bytes + 4 * per_layer + 100 * sizes.kv_bytes_per_token
    assert sizes.gpu_bytes(3, 0) == sizes.nonexpert_bytes + per_layer
    assert sizes.gpu_bytes(99, 0) == sizes.nonexpert_bytes


def test_smallest_ncmoe_boundaries(qwen_like):
    sizes = ModelSizes.from_gguf(qwen_like[0])
    ctx, margin = 256, 1000
    for n in range(sizes.n_layer + 1):
        exact = sizes.gpu_bytes(n, ctx) + margin
        assert smallest_ncmoe(exact, sizes, ctx, margin) == n
        if n < sizes.n_layer:
            assert smallest_ncmoe(exact - 1, sizes, ctx, margin) == n + 1
    assert smallest_ncmoe(10**15, sizes, ctx, margin) == 0
    assert smallest_ncmoe(sizes.gpu_bytes(sizes.n_layer, ctx) + margin - 1, sizes, ctx, margin) is None
    # with a draft fully on the GPU, the target must give up more layers
    draft = ModelSizes.from_gguf(qwen_like[0])
    budget = sizes.gpu_bytes(2, ctx) + margin + draft.gpu_bytes(0, ctx) + 500
    assert smallest_ncmoe(budget, sizes, ctx, margin, draft, 500) == 2
    assert smallest_ncmoe(budget - 1, sizes, ctx, margin, draft, 500) == 3
    assert smallest_ncmoe(budget, sizes, ctx, margin) == 0


def test_expert_regex_on_real_qwen_shape():
    """Qwen1.5-MoE-A2.7B's tensor list: llama.cpp's -ncmoe regex finds 60 x 3 x 2048 x 1408 F16 = 1.04 GB of
    experts per layer (23.2 GiB in all, DESIGN.md's 26.7 GiB file minus embeddings, attention, shared experts)."""
    shape = PRESETS["qwen1.5-moe-a2.7b"]
    per_layer = [0] * shape.n_layer
    for sp in tensor_specs(shape, 151936):
        m = EXPERT_RE.match(sp.name)
        if m:
            per_layer[int(m.group(1))] += sp.n_elements * 2
    assert per_layer == [60 * 3 * 2048 * 1408 * 2] * 24
    assert sum(per_layer) / 2**30 == pytest.approx(23.2, abs=0.1)


@pytest.mark.skipif(not QWEN2_VOCAB, reason="ggml-vocab-qwen2.gguf not found")
def test_synthetic_model_has_the_vocab_fingerprint_of_its_vocab(tmp_path):
    """A model written with --vocab-from tokenizes like the vocab GGUF, so the stored prompt ids apply."""
    path = tmp_path / "q.gguf"
    write_synthetic(path, PRESETS["tiny-qwen2moe"].with_layers(1), "f16", vocab_from=QWEN2_VOCAB[0])
    assert vocab_fingerprint(path) == vocab_fingerprint(QWEN2_VOCAB[0])
    assert ModelSizes.from_gguf(path).cpu_only_bytes == 151936 * 256 * 2
    assert stored_token_ids(PROMPTS_FILE, vocab_fingerprint(path))  # ids for this vocab are stored


# ------------------------------------------------------------------------------------------- matrix
def _fake_sizes(n_layer=24, expert=2**30, nonexpert=3 * 2**30, path="t.gguf"):
    return ModelSizes(path, "qwen2moe", n_layer, nonexpert + n_layer * expert, 2**29, nonexpert,
                        [expert] * n_layer, 2**17)


def test_build_matrix_and_parts():
    t, d = _fake_sizes(), _fake_sizes(expert=2**28, nonexpert=2**30, path="d.gguf")
    cfg = MatrixConfig(t, d, "Q4_K_M", parse_budgets("16GiB,20GiB"), ctx_size=1024, margin_bytes=2**30,
                         draft_margin_bytes=2**29, ncmoe_sweep=(-1, 0, 1), synth_lens=(2, 4))
    specs, notes = build_matrix(select_families("*"), cfg)
    fams = [s.family for s in specs]
    assert fams[0] == "llama-gpu" and "ours" in fams
    nc16 = [s for s in specs if s.family == "llama-ncmoe" and s.budget.label == "16GiB"]
    n0 = smallest_ncmoe(16 * 2**30, t, 1024, 2**30)
    assert [s.params["n_cpu_moe"] for s in nc16] == [n0 - 1, n0, n0 + 1]
    assert [s.est_gpu_bytes <= 16 * 2**30 for s in nc16] == [False, True, True]
    spec = [s for s in specs if s.family == "llama-spec"]
    synth = [s for s in specs if s.family == "llama-spec-synth"]
    assert len(spec) == 2 and len(synth) == 4
    assert all(s.params["n_cpu_moe"] > n0 for s in spec if s.budget.label == "16GiB")
    assert {s.params["synth_len"] for s in synth} == {2.0, 4.0}
    # each of our modes runs (once, or once per budget) or is reported as not available here
    for name, mode in OURS_MODES.items():
        runs = [s for s in specs if s.family == name]
        noted = any(n.startswith(name + ":") for n in notes)
        assert noted != bool(runs), name
        if runs:
            assert len(runs) == (1 if not mode.budget_bound else 2 * (2 if mode.synthetic else 1)), name
            assert all((s.budget is None) == (not mode.budget_bound) for s in runs)
    # every system keeps its own logs and results, long settings included (the hybrid keys are cut before L=)
    assert len({_slug(s) for s in specs}) == len(specs)
    assert len(split_part(specs, "1/2")) + len(split_part(specs, "2/2")) == len(specs)
    assert set(map(id, split_part(specs, "1/2"))).isdisjoint(map(id, split_part(specs, "2/2")))
    for bad in ("0/2", "3/2", "x"):
        with pytest.raises(SpecterError):
            split_part(specs, bad)


def test_matrix_when_nothing_fits():
    t = _fake_sizes()
    cfg = MatrixConfig(t, None, None, parse_budgets("1GiB"), ncmoe_sweep=(0, 1))
    specs, notes = build_matrix(["llama-ncmoe", "llama-spec"], cfg)
    assert [s.params["n_cpu_moe"] for s in specs] == [24]
    assert "does not fit" in specs[0].note and notes == ["llama-spec: no draft model"]


def test_select_families():
    assert select_families("ours") == ["ours"]
    assert select_families("llama-*") == list(LLAMA_FAMILIES)
    with pytest.raises(SpecterError):
        select_families("vllm")


def test_llama_server_args_use_flags_of_this_llama_cpp():
    spec = SystemSpec("llama-spec-synth", "llama", "x", Budget("16GiB", 16 * 2**30),
                        {"n_cpu_moe": 13, "draft": "/m/d.gguf", "draft_n_max": 8, "synth_len": 4.0})
    a = llama_server_args(spec, "/m/t.gguf", 1024, None)
    s = " ".join(a)
    for frag in ("-m /m/t.gguf", "-ngl 999", "--fit off", "-c 1024", "-np 1", "-ncmoe 13", "--model-draft /m/d.gguf",
                 "--spec-type draft-simple", "--spec-draft-n-max 8", "-ngld 999", "--spec-synth-len 4"):
        assert frag in s, frag
    src = sorted(Path("/tmp").glob("*/llama_cpp_python-*/vendor/llama.cpp/common/arg.cpp"))
    if src:  # every flag we pass exists in the llama.cpp source we build
        text = src[0].read_text()
        for flag in [x for x in a if x.startswith("-")]:
            assert f'"{flag}"' in text, flag


# ------------------------------------------------------------------------------- llama-server handling
FAKE_SERVER = r'''
import json, sys, time, os
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "crash":
    print("error: failed to load model", flush=True); sys.exit(3)
t0 = time.time()
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, obj):
        b = json.dumps(obj).encode(); self.send_response(code)
        self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(b)))
        self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        if time.time() - t0 < 0.7: return self._send(503, {"error": "loading"})
        self._send(200, {"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize": return self._send(200, {"tokens": [ord(c) for c in body["content"][:20]]})
        n = body["n_predict"]
        assert body["ignore_eos"] is True and body["cache_prompt"] is False
        t = {"prompt_n": len(body["prompt"]), "prompt_ms": 1.5, "predicted_n": n, "predicted_ms": 2.0 * (n - 1),
             "predicted_per_token_ms": 2.0 if body["temperature"] == 0 else 3.0}
        if "--model-draft" in args: t.update(draft_n=10, draft_n_accepted=4)
        if mode == "hang": time.sleep(60)
        self._send(200, {"tokens": list(range(n)), "timings": t})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture()
def fake_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return d


def _ctx(tmp_path, llama_bin, prompts=3, **kw):
    ps = load_prompts(n=prompts + 1)  # the last one warms up
    for i, p in enumerate(ps):
        p.ids = list(range(1, 10 + i))
    settings = RunSettings(n_predict=8, decodings=("greedy", "sampled"), seed=7, seconds_per_system=60)
    return BenchContext("/m/t.gguf", "fake", ps[:-1], settings, tmp_path / "out", llama_bin=llama_bin,
                          log=lambda s: None, warmup=ps[-1], **kw)


def test_llama_system_against_stand_in_server(tmp_path, fake_bin):
    spec = SystemSpec("llama-spec", "llama", "draft", Budget("16GiB", 16 * 2**30),
                        {"n_cpu_moe": 3, "draft": "/m/d.gguf", "draft_n_max": 8})
    r = run_system(spec, _ctx(tmp_path, fake_bin))
    assert r["status"] == "ok", r["error"]
    measured = [x for x in r["runs"] if not x.get("warmup")]
    assert len(measured) == 6 and r["runs"][0]["generated_tokens"] == 8
    # decoding by decoding, each after a warm-up on a prompt not measured: no run follows one of its own prompt
    assert [(x["decoding"], x["warmup"]) for x in r["runs"]] == [("greedy", True)] + [("greedy", False)] * 3 + \
        [("sampled", True)] + [("sampled", False)] * 3
    ids = [x["prompt_id"] for x in r["runs"]]
    assert ids[0] == ids[4] not in ids[1:4] and all(a != b for a, b in zip(ids, ids[1:]))
    assert r["summary"]["greedy"]["tpot_ms"] == 2.0 and r["summary"]["sampled"]["tpot_ms"] == 3.0
    assert r["summary"]["greedy"]["acceptance"] == pytest.approx(0.4)
    assert all(x["tokens"] == [] for x in measured if x["decoding"] == "sampled")
    assert "--model-draft /m/d.gguf" in r["command"] and r["load_s"] > 0.5  # waited for /health


def test_llama_system_failures_are_recorded(tmp_path, fake_bin, monkeypatch):
    spec = SystemSpec("llama-gpu", "llama", "all on GPU", None, {"n_cpu_moe": 0})
    monkeypatch.setenv("FAKE_MODE", "crash")
    r = run_system(spec, _ctx(tmp_path, fake_bin))
    assert r["status"] == "error" and "exited with code 3" in r["error"] and "failed to load" in r["error"]
    monkeypatch.setenv("FAKE_MODE", "hang")
    r = run_system(spec, _ctx(tmp_path, fake_bin, job_timeout=8))
    assert r["status"] == "error" and r["wall_s"] < 30
    r = run_system(spec, _ctx(tmp_path, tmp_path / "nowhere"))
    assert r["status"] == "error" and "not found" in r["error"]
    import time

    r = run_system(spec, _ctx(tmp_path, fake_bin, deadline=time.monotonic() + 20))  # not past it, but too near
    assert r["status"] == "skipped" and "fewer than 30 s were left before the run's --deadline" in r["error"]


def test_server_tokenizer_and_stored_ids(tmp_path, fake_bin, monkeypatch):
    with server_tokenizer(fake_bin, "/m/t.gguf", tmp_path / "tok.log") as tok:
        assert tok("abc") == [97, 98, 99]
    # without llama-cpp-python, stored ids of the same vocabulary are used, else the server
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    ps = load_prompts(n=2)
    monkeypatch.setattr(prompts, "vocab_fingerprint", lambda p: "none")
    assert tokenize_prompts(ps, "/m/t.gguf", server_tokenize=lambda s: [1, 2]) == "llama-server /tokenize"
    assert ps[0].ids == [1, 2]
    with pytest.raises(SpecterError):
        tokenize_prompts(ps, "/m/t.gguf")


# --------------------------------------------------------------------------- report (formatting only)
def _fake_doc():
    """Fake results: they test the report's formatting, not anybody's speed."""
    def res(family, setting, budget, tpot, peak, status="ok", error=None, **extra):
        runs = [{"decoding": d, "tpot_ms": tpot * (1.1 if d == "sampled" else 1), "generated_tokens": 64,
                 "prefill_ms": 1.0, "extra": extra} for d in ("greedy", "sampled") for _ in range(3)]
        return {"family": family, "kind": "llama" if family.startswith("llama") else "ours", "setting": setting,
                "budget": budget, "budget_bytes": parse_size(budget) if budget else None,
                "params": {"synth_len": float(setting[-1])} if "L=" in setting else {}, "note": "",
                "status": status, "error": error, "runs": runs if status == "ok" else [],
                "summary": summarize_runs(runs) if status == "ok" else {}, "peak_gpu_bytes": peak,
                "torch_peak_bytes": None}
    G = 2**30
    results = [
        res("llama-gpu", "all on GPU", None, 3.3, 28 * G),
        res("llama-ncmoe", "-ncmoe 12", "16GiB", 13.8, 15 * G),
        res("llama-ncmoe", "-ncmoe 11", "16GiB", 12.0, 17 * G),
        res("llama-spec", "draft Q4_K_M, -ncmoe 16", "16GiB", 100.0, 15.5 * G, draft_tokens=650, draft_accepted=9),
        res("llama-spec-synth", "draft Q4_K_M, -ncmoe 16, L=2", "16GiB", 70.0, 15.5 * G),
        res("llama-spec-synth", "draft Q4_K_M, -ncmoe 16, L=4", "16GiB", 30.0, 15.5 * G),
        res("ours", "whole model", None, 0, None, status="error", error="SpecterError: CUDA out of memory | oops"),
        res("ours-spec", "speculative decoding with the draft's experts", "16GiB", 20.0, 15 * G, draft_tokens=64,
            draft_accepted=32, draft_rounds=16, draft_s=0.08, verify_s=0.24, other_s=0.04, copy_exposed_s=0.016,
            prefetched=50, prefetched_used=40, verify_missing=80, bytes_copied=3 * 2**20, zero_copy_bytes=2**20,
            mean_accepted_len=3.0, cache_slots=226),
        res("ours-lru", "experts in host memory, LRU expert cache", "16GiB", 40.0, 14 * G, cache_hits=1,
            cache_lookups=4, bytes_copied=2**20, cache_slots=735),
    ]
    meta = {"date": "2026-01-01 00:00 UTC", "stamp": "test", "gpu": {"gpu": "FAKE GPU", "cpu": "fake"},
            "model": "/w/m-f16.gguf", "model_label": "fake model", "model_bytes": 28 * G, "draft": "/w/m-q4_k_m.gguf",
            "draft_bytes": 8 * G, "budgets": {"16GiB": 16 * G}, "n_prompts": 3, "n_predict": 64,
            "decodings": ["greedy", "sampled"], "seed": 1, "ctx_size": 1024, "tokenized_by": "test",
            "llama_version": "fake", "command": "python3 scripts/bench.py --fake"}
    return {"meta": meta, "notes": ["ours-lru: not implemented"], "results": results}


def test_report_formatting_from_fake_results():
    doc = _fake_doc()
    md = render_markdown(doc, ["img/x.png"])
    lines = md.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| System"))
    rows = list(itertools.takewhile(lambda ln: ln.startswith("| "), lines[header + 2:]))  # the main table
    assert len(rows) == len(doc["results"])
    ncols = lines[header].count("|")
    assert all(r.count("|") - r.count("\\|") == ncols for r in rows)  # pipes inside cells are escaped
    assert "FAKE GPU" in md and "python3 scripts/bench.py --fake" in md and "16GiB" in md
    assert "| 13.80 / 15.18 |" in md  # greedy / sampled TPOT
    assert "1.4% / 1.4%" in md  # 9 of 650 drafted
    assert "**error**: SpecterError: CUDA out of memory" in md
    assert "**no**" in md  # -ncmoe 11 measured above its budget
    assert "synthetic acceptance" in md and "![x](img/x.png)" in md
    assert "Best llama.cpp setting within 16GiB (greedy): llama-ncmoe -ncmoe 12" in md
    assert "Not run: ours-lru" in md
    assert "PCIe paced" not in md
    doc["meta"]["pcie_gbps"] = 25.0  # --pcie-gbps 25: the report says our transfers were paced
    assert "**PCIe paced to 25 GB/s** for ours" in render_markdown(doc, [])
    assert "spare slots a layer" not in md
    doc["meta"]["spare_slots"] = 0  # --spare-slots 0: said, though 0
    want = "**0 spare slots a layer** for ours-lru, ours-lru-hybrid and the speculative rows"
    assert want in render_markdown(doc, [])


def test_report_holds_each_row_against_llama_cpps_best_at_its_budget_and_length():
    """The main table's "/ llama.cpp" column: a row's TPOT over llama.cpp's fastest setting that fits its budget,
    per decoding (-ncmoe 11, 12.0 ms but measured above the budget, does not count), and at a synthetic L over
    llama.cpp's own speculation at that L where that is faster (L = 8 here, not L = 4)."""
    doc = _fake_doc()

    def at(row: dict, setting: str, tpot: float, synth_len: float) -> dict:
        runs = [dict(run, tpot_ms=tpot * (1.1 if run["decoding"] == "sampled" else 1)) for run in row["runs"]]
        return dict(row, setting=setting, params={"synth_len": synth_len}, runs=runs, summary=summarize_runs(runs))

    spec = next(r for r in doc["results"] if r["family"] == "ours-spec")
    llama_l4 = next(r for r in doc["results"] if r["setting"].endswith("L=4"))
    doc["results"] += [at(dict(spec, family="ours-spec-synth"), "synthetic, L=4", 10.0, 4.0),
                       at(dict(spec, family="ours-spec-synth"), "synthetic, L=8", 4.5, 8.0),
                       at(llama_l4, "draft Q4_K_M, -ncmoe 16, L=8", 9.0, 8.0)]
    lines = render_markdown(doc).splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| System | Setting | Budget | TPOT"))
    cols = [c.strip() for c in lines[header].strip("|").split("|")]
    cells = {}
    for ln in itertools.takewhile(lambda ln: ln.startswith("| "), lines[header + 2:]):
        row = dict(zip(cols, (c.strip() for c in ln.strip("|").split("|"))))
        cells[(row["System"], row["Setting"])] = row["/ llama.cpp"]
    assert cells[("llama-ncmoe", "-ncmoe 12")] == "1.00 / 1.00"
    assert cells[("ours-spec", "speculative decoding with the draft's experts")] == "1.45 / 1.45"  # 20 / 13.8
    assert cells[("ours-spec-synth", "synthetic, L=4")] == "0.72 / 0.72"  # against -ncmoe 12: L = 4's is 30 ms
    assert cells[("ours-spec-synth", "synthetic, L=8")] == "0.50 / 0.50"  # against llama.cpp's L = 8: 9 ms
    assert cells[("llama-gpu", "all on GPU")] == "—" and cells[("ours", "whole model")] == "—"  # no budget


def test_lru_rows_take_the_jobs_spare_slots(tiny_models):
    """--spare-slots reaches ours-lru, ours-lru-hybrid and the speculative rows (None: the engine's default, here
    half the room a layer has beyond its top-k); the -inplace rows keep 0."""
    from specter_gguf.bench.ours import OURS_MODES
    from specter_gguf.gguf_file import GGUFFile
    from specter_gguf.runtime import plan_memory

    path = tiny_models[("qwen2moe", "f16")]

    def job(extra_slots: int, draft: bool) -> dict:
        plan = plan_memory(GGUFFile(path), 1 << 40, 256, "cpu", draft=GGUFFile(path) if draft else None)
        return {"model": str(path), "draft": str(path) if draft else None, "device": "cpu", "ctx_size": 256,
                "rows": [], "settings": {"decodings": ["greedy"]},
                "budget_bytes": plan.minimum + extra_slots * plan.n_moe_layers * plan.slot_bytes}

    plain, speculative = job(4, False), job(3, True)  # the model as its own draft; its layers have 8 experts
    for spares, mode, want in [(None, "ours-lru", 2), (3, "ours-lru", 3), (1, "ours-lru-hybrid", 1),
                               (3, "ours-lru-inplace", 0), (3, "ours-lru-hybrid-inplace", 0)]:
        model = OURS_MODES[mode].load(dict(plain, spare_slots=spares), None)
        assert model.offload.cache.n_spare == want, (mode, spares)
    for spares, mode, want in [(None, "ours-spec", 1), (3, "ours-spec", 3), (1, "ours-spec-synth-fixed-hybrid", 1)]:
        model = OURS_MODES[mode].load(dict(speculative, spare_slots=spares), None)
        assert model.offload.cache.n_spare == want, (mode, spares)


def test_report_speculation_table_from_fake_results():
    """The second table: speculative systems (llama.cpp's with empty cells) and offload rows, with the figures of
    the fake counts (3 prompts per decoding, 64 generated tokens each, no prompt tokens recorded)."""
    doc = _fake_doc()
    lines = render_markdown(doc).splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| System | Setting | Budget | Tokens/iter"))
    assert header > next(i for i, ln in enumerate(lines) if ln.startswith("| System | Setting | Budget | TPOT"))
    cols = [c.strip() for c in lines[header].strip("|").split("|")]
    assert cols[3:] == [h for h, _, _ in SPEC_COLUMNS]
    assert "Prefetch precision" in cols and "Verify ms/iter" in cols and "Other ms/iter" in cols
    rows = {}
    for ln in lines[header + 2:]:
        if not ln.startswith("| "):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == len(cols)
        rows[(cells[0], cells[1])] = dict(zip(cols, cells))
    assert [k[0] for k in rows] == ["llama-spec", "llama-spec-synth", "llama-spec-synth", "ours-spec", "ours-lru"]
    ours = rows[("ours-spec", "speculative decoding with the draft's experts")]
    assert ours["Budget"] == "16GiB" and ours["Tokens/iter"] == "3.00 / 3.00"
    assert ours["Draft step ms"] == "1.25 / 1.25"  # 3 × 0.08 s over 3 × 64 drafted tokens
    assert ours["Prefetch precision"] == "80.0% / 80.0%" and ours["Prefetch recall"] == "50.0% / 50.0%"
    assert ours["Moved/token"] == "64 KiB / 64 KiB"  # 3 × (3 + 1) MiB over 3 × 64 tokens
    assert ours["Cache slots"] == "226 / 226"  # the draft's experts took the rest of the LRU mode's slots
    assert ours["Draft ms/iter"] == "5.00 / 5.00" and ours["Verify ms/iter"] == "15.00 / 15.00"
    assert ours["Copy wait ms/iter"] == "1.00 / 1.00" and ours["Other ms/iter"] == "2.50 / 2.50"
    llama = rows[("llama-spec", "draft Q4_K_M, -ncmoe 16")]
    assert all(llama[h] == "—" for h, _, _ in SPEC_COLUMNS)  # llama.cpp reports none of it
    lru = rows[("ours-lru", "experts in host memory, LRU expert cache")]
    assert lru["Moved/token"] == "16 KiB / 16 KiB"  # 3 × 1 MiB over 3 × 64 tokens
    assert lru["Cache slots"] == "735 / 735"
    assert lru["Prefetch precision"] == "—" and lru["Draft ms/iter"] == "—"
    assert "llama-gpu" not in {k[0] for k in rows} and "llama-ncmoe" not in {k[0] for k in rows}
    # the JSON document carries the same figures
    again = json.loads(json.dumps(doc))
    (spec,) = [r for r in again["results"] if r["family"] == "ours-spec"]
    assert spec["summary"]["greedy"]["prefetch_recall"] == pytest.approx(0.5)
    assert spec["summary"]["sampled"]["iter_verify_ms"] == pytest.approx(15.0)


def test_plots_from_fake_results(tmp_path):
    pytest.importorskip("matplotlib")
    files = write_plots(_fake_doc(), tmp_path, "t")
    assert [f.name for f in files] == ["t-tpot.png", "t-synth.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)


def test_tpot_figure_keeps_its_panels_wide_beside_long_settings():
    """Settings of 80+ characters: each panel keeps at least 4 inches, the legend sits below them (it names every
    system, even one with no bar in the first panel), and the groups are the budgets that have rows."""
    plt = pytest.importorskip("matplotlib.pyplot")
    doc = _fake_doc()
    rows = [r for r in doc["results"] if r["status"] == "ok" and "spec-synth" not in r["family"]]
    for r in rows:
        r["setting"] += ", a setting long enough to have squeezed the panels beside a legend to their right"
    sampled_only = dict(rows[1], family="llama-other", summary={"sampled": rows[1]["summary"]["sampled"]})
    fig = tpot_figure(plt, rows + [sampled_only], ["greedy", "sampled"], ["12GiB", "16GiB"])
    try:
        axes = fig.get_axes()
        assert len(axes) == 2
        for ax in axes:
            assert ax.get_position().width * fig.get_figwidth() >= 4.0
            assert [t.get_text() for t in ax.get_xticklabels()] == ["no limit", "16GiB"]
            assert ax.get_ylim()[0] == 0
        (legend,) = fig.legends
        assert len(legend.get_texts()) == len(rows) + 1
        assert legend.get_window_extent().y1 < min(ax.get_window_extent().y0 for ax in axes)
    finally:
        plt.close(fig)


def test_synth_figure_draws_the_decodings_and_budgets_its_rows_have():
    """Synthetic rows measured greedy only, at 16 GiB, beside llama.cpp rows at 16 and 24 GiB: one panel (no empty
    sampled one), one line per system, and llama.cpp's best as a reference at 16 GiB only."""
    plt = pytest.importorskip("matplotlib.pyplot")
    doc = _fake_doc()
    res = [r for r in doc["results"] if r["status"] == "ok"]
    res.append(dict(res[1], budget="24GiB", budget_bytes=24 * 2**30))  # a llama.cpp row of another budget
    synth = [dict(r, summary={"greedy": r["summary"]["greedy"]}) for r in res if "spec-synth" in r["family"]]
    fig = synth_figure(plt, res, synth, ["greedy", "sampled"])
    try:
        (ax,) = fig.get_axes()
        assert ax.get_title() == "greedy decoding"
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["llama-spec-synth @ 16GiB", "best llama.cpp, no synthetic acceptance @ 16GiB"]
    finally:
        plt.close(fig)
    assert synth_figure(plt, res, [], ["greedy"]) is None


def test_merging_greedy_and_sampled_parts_gives_one_row_with_both():
    """One part ran a system greedy, another the same system sampled: the merge has one row with both decodings
    (and the meta both, greedy first); a decoding both parts measured keeps the first part's runs; a row that failed
    in one part gives way to the other part's measured row."""
    a, b = _fake_doc(), _fake_doc()
    for doc, dec in ((a, "sampled"), (b, "greedy")):
        doc["meta"]["decodings"] = [dec]
        for r in doc["results"]:
            r["runs"] = [dict(run, tpot_ms=run["tpot_ms"] * (2 if doc is b else 1)) for run in r["runs"]
                         if run["decoding"] == dec or doc is b]
            r["summary"] = summarize_runs(r["runs"]) if r["runs"] else {}
    m = merge_docs([a, b])
    assert m["meta"]["decodings"] == ["greedy", "sampled"]
    (lru,) = [r for r in m["results"] if r["family"] == "ours-lru"]
    assert lru["summary"]["greedy"]["tpot_ms"] == pytest.approx(80.0)   # from b
    assert lru["summary"]["sampled"]["tpot_ms"] == pytest.approx(44.0)  # a's, not b's 88
    assert len(lru["runs"]) == 6
    # a row that failed in the first part and was measured in the second: the measured one
    failed = dict(lru, status="error", error="SpecterError: out of memory", runs=[], summary={})
    (again,) = [r for r in merge_docs([dict(a, results=[failed]), b])["results"] if r["family"] == "ours-lru"]
    assert again["status"] == "ok" and again["summary"]["greedy"]["tpot_ms"] == pytest.approx(80.0)


def test_append_report_and_merge(tmp_path):
    rep = tmp_path / "docs" / "B.md"
    append_report(rep, "### one\n")
    append_report(rep, "### two\n")
    text = rep.read_text()
    assert text.startswith("# Benchmarks") and text.index("### one") < text.index("### two")
    a, b = _fake_doc(), _fake_doc()
    b["meta"]["command"] = "python3 scripts/bench.py --part 2/2"
    a["meta"]["budgets"], b["meta"]["budgets"] = {"16GiB": 16 * 2**30}, {"20GiB": 20 * 2**30}  # one run per budget
    first, second = a["results"][0], dict(a["results"][0], budget="20GiB")  # one measured, one left for part 2
    a["results"] = [first, dict(second, status="skipped", summary={})]
    b["results"] = [second, dict(first, family="ours-lru")]
    m = merge_docs([a, b])
    assert "--part 2/2" in m["meta"]["command"] and list(m["meta"]["budgets"]) == ["16GiB", "20GiB"]
    assert [(r["family"], r["budget"], r["status"]) for r in m["results"]] == [
        (first["family"], first["budget"], "ok"), (first["family"], "20GiB", "ok"), ("ours-lru", first["budget"], "ok")]


def test_merging_a_spare_slot_sweep_keeps_each_row():
    """Runs of --spare-slots 1 and 8 (and the default) merged: the same system and budget three times, each row's
    setting naming the spare slots its runs report; without a sweep, settings are left as they are."""
    docs = []
    for asked, ran in [(1, 1), (None, 2), (8, 8)]:
        doc = _fake_doc()
        doc["meta"]["spare_slots"] = asked
        lru = dict(doc["results"][0], family="ours-lru", runs=[{"decoding": "greedy", "extra": {"spare_slots": ran}}])
        doc["results"] = [lru, dict(lru, family="llama-ncmoe", runs=[{"decoding": "greedy", "extra": {}}])]
        docs.append(doc)
    m = merge_docs(docs)
    setting = docs[0]["results"][0]["setting"]
    assert [r["setting"] for r in m["results"] if r["family"] == "ours-lru"] == [
        f"{setting}, 1 spare slot a layer", f"{setting}, 2 spare slots a layer", f"{setting}, 8 spare slots a layer"]
    assert [r["setting"] for r in m["results"] if r["family"] == "llama-ncmoe"] == [setting]
    assert m["meta"]["spare_slots"] is None and "spare slots a layer**" not in render_markdown(m, [])
    assert [r["setting"] for r in merge_docs(docs[:1] * 2)["results"]] == [setting, setting]


def test_a_merge_summarizes_results_from_their_runs():
    """Results written before a column existed get it when rendered again: the merge summarizes every measured
    result from its runs (here a stored summary without the cache's slots), and leaves the others as they are."""
    doc = _fake_doc()
    for r in doc["results"]:
        for summary in r["summary"].values():
            summary.pop("cache_slots", None)
    m = merge_docs([doc])
    (spec,) = [r for r in m["results"] if r["family"] == "ours-spec"]
    assert spec["summary"]["greedy"]["cache_slots"] == 226
    assert spec["summary"] == summarize_runs(spec["runs"])
    (failed,) = [r for r in m["results"] if r["status"] == "error"]
    assert failed["summary"] == {} and failed["runs"] == []
    bare = dict(spec, runs=[], summary={"greedy": {"tpot_ms": 5.0}})  # no runs to summarize: its summary stays
    assert merge_docs([dict(doc, results=[bare])])["results"][0]["summary"] == bare["summary"]


# ------------------------------------------------------------------------------------- end to end
def _bench(*args, env=None, timeout=300):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO), env=e)


@pytest.mark.parametrize("preset", ["tiny-qwen2moe", "tiny-deepseek2", "tiny-phimoe"])
def test_bench_end_to_end_ours_on_cpu(tmp_path, preset):
    """bench.py with the real engine on a tiny model (CPU, 2 prompts, 4 tokens): JSON and Markdown come out.
    The timings it prints are not looked at."""
    pytest.importorskip("llama_cpp")
    out, work, report = tmp_path / "out", tmp_path / "work", tmp_path / "docs" / "BENCHMARKS.md"
    p = _bench("--model-preset", preset, "--systems", "ours", "--device", "cpu", "--prompts", "2",
               "--n-predict", "4", "--out", str(out), "--work-dir", str(work), "--report", str(report),
               "--img-dir", str(tmp_path / "docs" / "img"))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "results.json").read_text())
    (r,) = doc["results"]
    assert r["family"] == "ours" and r["status"] == "ok", r["error"]
    measured = [x for x in r["runs"] if not x["warmup"]]
    assert len(measured) == 4 and all(x["generated_tokens"] == 4 for x in measured)
    assert {x["decoding"] for x in measured} == {"greedy", "sampled"}
    assert all(x["tpot_ms"] > 0 for x in measured)
    assert r["summary"]["greedy"]["n_prompts"] == 2
    warm = {x["prompt_id"] for x in r["runs"] if x["warmup"]}  # the file's third prompt warms up
    assert warm == {doc["meta"]["warmup_prompt"]} and not warm & {x["prompt_id"] for x in measured}
    md = (out / "section.md").read_text()
    assert "| ours |" in md and preset in md and "on a prompt not measured" in md
    assert "| ours |" in report.read_text()
    # the model is reused on a second run, which also exercises --from-results
    p2 = _bench("--from-results", str(out / "results.json"), "--out", str(tmp_path / "again"))
    assert p2.returncode == 0, p2.stdout + p2.stderr
    assert (tmp_path / "again" / "section.md").read_text().count("| ours |") == 1


def test_bench_makes_a_target_with_its_attention_output_scaled(tmp_path):
    """--attn-output-scale reaches the model maker: the target is named for it (beside the plain one, not over
    it) and its attention output weights have that multiple of the usual std; 0, and a scale beside --model (whose
    weights are used as they are), are refused in one line."""
    work = tmp_path / "w"
    p = _bench("--model-preset", "tiny-qwen2moe", "--attn-output-scale", "0.25", "--systems", "ours", "--device", "cpu",
               "--prepare-only", "--work-dir", str(work), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stdout + p.stderr
    import gguf

    (target,) = work.glob("*.gguf")
    assert target.name == "tiny-qwen2moe-f16-ao0.25.gguf"
    w = np.asarray(next(t for t in gguf.GGUFReader(target).tensors if t.name == "blk.0.attn_output.weight").data,
                   np.float32)
    assert abs(w.std() / PRESETS["tiny-qwen2moe"].init_std - 0.25) < 0.02
    bad = _bench("--model-preset", "tiny-qwen2moe", "--attn-output-scale", "0", "--systems", "ours", "--device", "cpu",
                 "--prepare-only", "--work-dir", str(work), "--out", str(tmp_path / "out"))
    said = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "--attn-output-scale must be from 0.01 to 10" in said and "Traceback" not in said
    given = _bench("--model", str(target), "--attn-output-scale", "0.25", "--systems", "ours", "--device", "cpu",
                   "--dry-run", "--out", str(tmp_path / "out"))
    said = given.stdout + given.stderr
    assert given.returncode != 0 and "--model's weights are used as they are" in said and "Traceback" not in said


def test_bench_user_mistakes_are_one_error_line(tmp_path):
    """A results file that is missing, not JSON or not a run's, and a budget misspelt, are one line naming the file or
    the value (the budget before any tool is built or model written)."""
    (tmp_path / "notes.json").write_text("x")
    (tmp_path / "other.json").write_text("{}")
    for args, want in [(["--from-results", str(tmp_path / "nosuch.json")], "cannot read"),
                       (["--from-results", str(tmp_path / "notes.json")], "is not JSON"),
                       (["--from-results", str(tmp_path / "other.json")], "is not a benchmark's results"),
                       (["--model-preset", "tiny-qwen2moe", "--budgets", "abc", "--work-dir", str(tmp_path / "w")],
                        "cannot read the size 'abc'")]:
        p = _bench(*args, "--out", str(tmp_path / "out"))
        assert p.returncode == 2 and p.stdout.startswith("error: ") and want in p.stdout, p.stdout + p.stderr
        assert "Traceback" not in p.stdout + p.stderr
    assert not (tmp_path / "w").exists()


def test_bench_end_to_end_ours_speculative_on_cpu(tmp_path):
    """Our speculative modes in the harness: a Q4_K_M draft made from the target, real acceptance (depth auto,
    which may choose plain steps on the CPU) and synthetic acceptance at depth auto and at llama.cpp's depth, with
    the engine's iteration times."""
    pytest.importorskip("llama_cpp")
    out = tmp_path / "out"
    p = _bench("--model-preset", "tiny-qwen2moe", "--systems", "ours-spec,ours-spec-synth,ours-spec-synth-fixed",
               "--budgets", "2GiB", "--synth-lens", "3", "--draft-n-max", "4", "--device", "cpu", "--prompts", "2",
               "--n-predict", "24", "--out", str(out), "--work-dir", str(tmp_path / "work"))
    assert p.returncode == 0, p.stdout + p.stderr
    real, auto, fixed = json.loads((out / "results.json").read_text())["results"]
    assert [r["family"] for r in (real, auto, fixed)] == ["ours-spec", "ours-spec-synth", "ours-spec-synth-fixed"]
    assert all(r["status"] == "ok" for r in (real, auto, fixed)), [r["error"] for r in (real, auto, fixed)]
    # one worker loaded the model once for the three rows, then set each row's depth and acceptance
    assert "one load for 3 rows" in real["command"] and real["load_s"] == auto["load_s"] == fixed["load_s"]
    for r in (real, auto):  # auto may choose plain steps on the CPU
        assert r["summary"]["greedy"]["mean_accepted_len"] >= 1.0
    # at llama.cpp's depth (4 here) synthetic acceptance keeps a mean of L - 1 = 2 drafts (p + .. + p^4 = 2)
    assert 2.0 <= fixed["summary"]["greedy"]["mean_accepted_len"] <= 4.0
    g = fixed["summary"]["greedy"]  # the worker carries the engine's drafting and verification times
    assert g["draft_step_ms"] > 0 and g["iter_draft_ms"] > 0 and g["iter_verify_ms"] > 0
    assert g["iter_other_ms"] >= 0
    # [depth, verifications, mean ms] per depth: 4 but where a prompt's last iterations wanted fewer tokens
    depths = {k: (n, ms) for k, n, ms in g["depths"]}
    assert max(depths) == 4 and depths[4][0] >= sum(n for n, _ in depths.values()) - 2 * 3
    assert all(ms > 0 for _, ms in depths.values()) and 3 < g["drafted_per_iter"] <= 4
    md = (out / "section.md").read_text()
    assert "L=3" in md and "| Verify ms/iter |" in md and "`--spec-draft-n-max` 4" in md
    assert f"4:{depths[4][0]} ({depths[4][1]:.1f})" in md


def test_real_acceptance_mode_meets_every_depth_before_the_prompts(tiny_models, monkeypatch):
    """ours-spec (depth auto) runs one short generation at each depth, deepest first, in each decoding, before the
    measured prompts (each depth's verification graphs are then captured, depth 0 included: the last token of a
    generation at a fixed depth may be verified alone), and decodes with depth auto after."""
    from specter_gguf import speculation
    from specter_gguf.bench.ours import OURS_MODES
    from specter_gguf.speculation.decoder import SpeculativeDecoder

    target = draft = tiny_models[("qwen2moe", "f16")]  # its own draft: every drafted token is kept
    depths: list[int] = []
    verified: set[int] = set()
    set_depth, steps = SpeculativeDecoder.set_depth, SpeculativeDecoder.steps
    monkeypatch.setattr(SpeculativeDecoder, "set_depth", lambda self, k: (depths.append(k), set_depth(self, k))[1])
    monkeypatch.setattr(SpeculativeDecoder, "steps", lambda self, model, cache, n, draft, sampled=None: (
        verified.add(n - 1) if not draft else None, steps(self, model, cache, n, draft, sampled))[1])
    job = {"model": str(target), "draft": str(draft), "device": "cpu", "ctx_size": 256, "budget_bytes": None,
           "settings": {"decodings": ["greedy", "sampled"]}, "rows": [{"mode": "ours-spec", "synth_len": None}]}
    model = OURS_MODES["ours-spec"].load(job, None)
    assert depths == ["auto", *range(speculation.MAX_DEPTH, 0, -1), "auto"]  # loaded with auto, then each depth
    assert verified == set(range(speculation.MAX_DEPTH + 1))  # a verification of every depth k, 0 .. MAX_DEPTH
    assert model.decoder.depth is not None and model.decoder.n_draft == speculation.MAX_DEPTH
    g = model.generate([5, 6, 7], 6, ignore_eos=True).wait()
    assert len(g.tokens) == 6 and g.stats.draft_rounds > 0


def test_ours_worker_without_llama_cpp_tokenizer(tmp_path, shipped_model):
    """On the GPU machine llama-cpp-python is missing: the worker then loads the model with an ids-only
    tokenizer; greedy tokens must equal those of a run with the real tokenizer."""
    pytest.importorskip("llama_cpp")
    prompts = load_prompts(n=1)
    prompts[0].ids = [39, 730, 78, 266, 282, 339]
    settings = RunSettings(n_predict=5, decodings=("greedy",), seed=3, seconds_per_system=60, warmup_tokens=2)
    tokens = []
    for force in ("", "1"):
        job = {"model": str(shipped_model), "device": "cpu", "ctx_size": 256, "budget_bytes": None, "draft": None,
               "rows": [{"key": "ours", "mode": "ours", "synth_len": None, "result": str(tmp_path / f"r{force}.json")}],
               "prompts": [vars(p) for p in prompts], "settings": vars(settings) | {"decodings": ["greedy"]},
               "time_budget_s": 120}
        (tmp_path / "job.json").write_text(json.dumps(job))
        env = dict(os.environ, SPECTER_BENCH_NO_LLAMA_CPP=force, PYTHONPATH=str(REPO))
        p = subprocess.run([sys.executable, "-m", "specter_gguf.bench.worker", str(tmp_path / "job.json")],
                           capture_output=True, text=True, env=env, timeout=120, cwd=str(REPO))
        assert p.returncode == 0, p.stdout + p.stderr
        res = json.loads((tmp_path / f"r{force}.json").read_text())
        (run,) = [r for r in res["runs"] if not r["warmup"]]
        assert run["generated_tokens"] == 5
        tokens.append(run["tokens"])
    assert tokens[0] == tokens[1]


def test_dry_run_prints_matrix(tmp_path, qwen_like):
    p = _bench("--model", str(qwen_like[0]), "--budgets", "60%,80%", "--dry-run", "--out", str(tmp_path),
               "--llama-bin", str(tmp_path), "--systems", "llama-gpu,llama-ncmoe,ours", "--no-build")
    # no llama-server in --llama-bin: refused before anything runs
    assert p.returncode == 2 and "llama-server not found" in p.stdout
    p = _bench("--model", str(qwen_like[0]), "--budgets", "60%,80%", "--dry-run", "--out", str(tmp_path),
               "--systems", "ours")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ours [" in p.stdout


def test_find_vocab_extracts_from_the_carried_tarball(tmp_path):
    import tarfile

    gpu_dir = tmp_path / "repo" / ".gpu"
    gpu_dir.mkdir(parents=True)
    src = tmp_path / "v.gguf"
    src.write_bytes(b"GGUF fake vocab")
    with tarfile.open(gpu_dir / "llama-src.tar.gz", "w:gz") as tf:
        tf.add(src, arcname="llama-src/vendor/llama.cpp/models/ggml-vocab-test.gguf")
    got = find_vocab("ggml-vocab-test.gguf", tmp_path / "work", gpu_dir, [])
    assert got == tmp_path / "work" / "ggml-vocab-test.gguf" and got.read_bytes() == b"GGUF fake vocab"
    with pytest.raises(SpecterError):
        find_vocab("ggml-vocab-none.gguf", tmp_path / "work", gpu_dir, [])


def test_find_vocab_in_llama_cpp_source_trees(tmp_path):
    """Without the carried tarball: the source trees of unpacked llama-cpp-python sdists, then build_llama_tools'."""
    sdists, llama_dir = tmp_path / "llsrc", tmp_path / "llama"
    built = llama_dir / "llama-src" / "vendor" / "llama.cpp" / "models"
    built.mkdir(parents=True)
    (built / "ggml-vocab-test.gguf").write_bytes(b"GGUF")
    sources = llama_sources(sdists, llama_dir)
    assert find_vocab("ggml-vocab-test.gguf", tmp_path / "work", tmp_path / "no-gpu-dir", sources) == (
        built / "ggml-vocab-test.gguf")
