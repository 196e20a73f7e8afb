"""Speculative decoding (specter_gguf.speculation) on the CPU, against target-only decoding.

Greedy: the tokens must equal the target's alone, token by token, for every architecture (DeepSeek-V2 with
MLA and Phi-3.5-MoE included), with drafts made by llama.cpp's quantizer (Q4_K_M, Q2_K) from the F16 target,
with penalties, with an offloaded target, up to a full context; and 20 prompts × 64 tokens for every
architecture (offloaded, evicting) and every draft type (Q8_0, Q4_K_M, Q2_K). The F16 file as its own draft
must be accepted every time (the acceptance path), a Q4_K_M draft at least sometimes (mixed rounds). Sampled:
the rule that accepts or replaces a drafted token must output the target's distribution exactly; checked by drawing many
rounds through `accept_drafts`, and through the whole decoder (drafting, the verdict on the device, CUDA graphs on
the GPU): chi-square of the first tokens' joint counts against the target's probabilities.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from small_cache import small_cache

from specter_gguf.cli import cli
from specter_gguf.config import ModelConfig
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime.budget import plan_memory
from specter_gguf.sampling import Sampler, SamplingParams, chain_sample
from specter_gguf.speculation import accept_drafts, synthetic_acceptance
from specter_gguf.speculation.accept import SampledVerdict, synthetic_count, synthetic_rate
from specter_gguf.speculation.decoder import GENERATION_KINDS
from specter_gguf.speculation.depth import DepthChooser
from tests.test_kernels import DEVICES

MODELS = ["qwen2moe", "qwen3moe", "llama", "olmoe", "tiny-deepseek2", "tiny-deepseek2-lite", "tiny-phimoe"]
GREEDY = SamplingParams(temperature=0)
PROMPT = [5, 17, 300, 42, 7, 99, 128, 3]
N = 32


def _target_tokens(path: Path, n: int = N, sampling: SamplingParams = GREEDY, **load) -> list[int]:
    return Model.load(path, device="cpu", progress=False, **load).generate(PROMPT, n, sampling).wait().tokens


@pytest.mark.parametrize("draft_kind", ["q4_k_m", "q2_k"])
@pytest.mark.parametrize("arch", MODELS)
def test_greedy_speculative_equals_target_only(tiny_models, arch: str, draft_kind: str) -> None:
    target = tiny_models[(arch, "f16")]
    sm = Model.load(target, draft=tiny_models[(arch, draft_kind)], device="cpu", progress=False,
                    n_draft=4)  # a fixed depth: auto may choose plain steps on the CPU, where drafting does not pay
    gen = sm.generate(PROMPT, N, GREEDY).wait()
    assert gen.tokens == _target_tokens(target)
    s = gen.stats
    assert s.draft_rounds > 0 and s.draft_tokens >= s.draft_accepted
    if draft_kind == "q4_k_m":
        assert s.draft_accepted > 0, "a Q4_K_M draft of the same model should agree with it at times"


@pytest.mark.parametrize("arch", ["qwen2moe", "tiny-deepseek2"])
def test_the_target_as_its_own_draft_is_always_accepted(tiny_models, arch: str) -> None:
    target = tiny_models[(arch, "f16")]
    sm = Model.load(target, draft=target, device="cpu", progress=False, n_draft=3)
    n = 1 + 4 * 8  # the first token, then 8 iterations of 3 drafts and one token more
    gen = sm.generate(PROMPT, n, GREEDY).wait()
    assert gen.tokens == _target_tokens(target, n)
    assert gen.stats.draft_accepted == gen.stats.draft_tokens and gen.stats.mean_accepted_len == 4.0


@pytest.mark.parametrize("n_draft, n, rounds, drafted", [
    (8, 5, 1, 3),    # the first token, then one iteration of 3 drafts (not 8) and one token more
    (3, 10, 3, 6),   # 1 + 4 + 4, then a verification of nothing drafted for the last token
])
def test_nothing_is_drafted_past_the_tokens_asked_for(tiny_models, n_draft: int, n: int, rounds: int,
                                                     drafted: int) -> None:
    """An iteration yields its accepted drafts and one token more; the target is its own draft, so every drafted
    token is kept, and every one is generated."""
    target = tiny_models[("qwen2moe", "f16")]
    sm = Model.load(target, draft=target, device="cpu", progress=False, n_draft=n_draft)
    gen = sm.generate(PROMPT, n, GREEDY, ignore_eos=True).wait()
    s = gen.stats
    assert gen.tokens == _target_tokens(target, n) and len(gen.tokens) == n
    assert (s.draft_rounds, s.draft_tokens, s.draft_accepted) == (rounds, drafted, drafted)


def test_greedy_with_penalties_and_offloaded_target_with_lookahead(tiny_models) -> None:
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q4_k_m")]
    penalized = SamplingParams(temperature=0, repeat_penalty=1.3, presence_penalty=0.2)
    sm = Model.load(target, draft=draft, device="cpu", progress=False)
    assert sm.generate(PROMPT, N, penalized).wait().tokens == _target_tokens(target, sampling=penalized)
    plan = plan_memory(GGUFFile(target), 1 << 40, 256, "cpu", draft=GGUFFile(draft))
    budget = plan.minimum + plan.n_moe_layers * plan.slot_bytes  # top_k + 1 slots per layer: it evicts
    stats = {}
    for lookahead in (False, True):
        sm = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256, gpu_budget=budget,
                        offload="lru", n_draft=4)  # a fixed depth: auto's choices follow measured times
        assert sm.offload is not None and sm.memory_plan.draft_experts > 0
        if not lookahead:  # the cache filled by lru alone: what each forward used is brought in after it
            sm.decoder.lookahead, sm.offload.options.lookahead = None, False
        gen = sm.generate(PROMPT, N, GREEDY).wait()
        assert gen.tokens == _target_tokens(target) and gen.stats.cache_evictions > 0
        stats[lookahead] = gen.stats
    # the lookahead buffer prefetches what the draft routes to: verification finds more of its experts than
    # lru's bringing in of what was used
    assert stats[False].prefetches == 0 < stats[True].prefetches
    assert stats[True].cache_hit_rate > stats[False].cache_hit_rate
    s = stats[True]  # recall: of what verification would have missed without the lookahead, the share prefetched
    assert 0 < s.prefetched_used <= min(s.prefetched, s.verify_missing) and 0 < s.prefetch_recall <= 1


def test_full_context_ends_the_generation(tiny_models) -> None:
    target = tiny_models[("olmoe", "f16")]
    ctx = len(PROMPT) + 13  # rounds near the end have less room than n_draft
    sm = Model.load(target, draft=tiny_models[("olmoe", "q4_k_m")], device="cpu", progress=False,
                               ctx_size=ctx, n_draft=5)
    gen = sm.generate(PROMPT, -1, GREEDY).wait()
    assert gen.finish_reason == "length" and len(gen.tokens) == ctx - len(PROMPT) + 1
    assert gen.tokens == _target_tokens(target, n=-1, ctx_size=ctx)


def test_stats_count_the_drafts_a_stop_string_hands_out(shipped_model) -> None:
    """The model as its own draft keeps all 8 drafts of an iteration; a stop string that ends the text among them
    leaves the statistics with the tokens handed out (the prefill's first one, then accepted drafts and the target's
    own), not the drafts the verification accepted past it."""
    draft = Model.load(shipped_model, draft=shipped_model, device="cpu", progress=False, n_draft=8)
    gen = draft.generate("def main():", 24, GREEDY, stop=['"""']).wait()
    want = Model.load(shipped_model, device="cpu", progress=False).generate("def main():", 24, GREEDY).wait()
    assert gen.text == want.text[:want.text.index('"""')] and gen.finish_reason == "stop"
    s = gen.stats
    assert s.draft_tokens == 8 * s.draft_rounds and s.draft_rounds == 2  # the stop comes in the second iteration
    # handed out: the prefill's token, the first iteration's 8 drafts and its target token, then 3 drafts
    assert s.draft_accepted == s.generated_tokens - 2 == 11
    assert s.mean_accepted_len <= s.generated_tokens / s.draft_rounds


def test_synthetic_acceptance_is_llama_cpps() -> None:
    """llama.cpp's --spec-synth-len L at --spec-draft-n-max n: each drafted token kept with probability p once the
    one before it was, p + ... + p^n = L - 1, so a depth of n keeps a mean of L - 1 drafts."""
    for L, n in ((4, 8), (2.5, 4), (6, 8)):
        p = synthetic_rate(L, n)
        assert abs(sum(p ** j for j in range(1, n + 1)) - (L - 1)) < 1e-9
    assert synthetic_rate(1, 8) == 0.0 and synthetic_rate(9, 8) == 1.0
    for bad in (0.5, 9.5):
        with pytest.raises(SpecterError, match=r"within \[1, 9\]"):
            synthetic_rate(bad, 8)
    sampler, p = Sampler(SamplingParams(temperature=0, seed=5)), synthetic_rate(4, 8)
    counts = [synthetic_count(sampler, 8, p) for _ in range(20000)]
    assert abs(sum(counts) / len(counts) - 3) < 0.05
    # at a shallower depth, as many as a real draft of per-token acceptance p keeps: p + p^2 + p^3 at depth 3
    counts = [synthetic_count(sampler, 3, p) for _ in range(20000)]
    assert abs(sum(counts) / len(counts) - (p + p * p + p ** 3)) < 0.05 and max(counts) == 3


def test_synthetic_acceptance_has_the_asked_mean_length(tiny_models) -> None:
    target = tiny_models[("qwen2moe", "f16")]
    sm = Model.load(target, draft=tiny_models[("qwen2moe", "q2_k")], device="cpu", progress=False, n_draft=4)
    synthetic_acceptance(sm, 2.5, 4)
    s = sm.generate(PROMPT, 96, SamplingParams(temperature=0, seed=3)).wait().stats
    assert 2.0 <= s.mean_accepted_len <= 3.0, s.mean_accepted_len
    sm = Model.load(target, draft=target, device="cpu", progress=False)
    synthetic_acceptance(sm, 1, 8)
    assert sm.generate(PROMPT, 16, GREEDY).wait().stats.draft_accepted == 0
    synthetic_acceptance(sm, 9, 8)  # every drafted token kept
    s = sm.generate(PROMPT, 16, GREEDY).wait().stats
    assert s.draft_accepted == s.draft_tokens > 0


def test_speculative_sampling_outputs_the_target_distribution() -> None:
    """One drafted token per round, drawn from q; the output token (the accepted draft, or the replacement)
    must be distributed as the target's p, whatever q is."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    sampler = Sampler(params)
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(1, 6, generator=g) * 1.5
    verified = torch.cat([target_logits, torch.zeros(1, 6)])  # the second row is read only after an acceptance
    p = sampler.probabilities(target_logits[0])
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 1.5, 0)
    rounds, counts, accepted = 20000, torch.zeros(6), 0
    for _ in range(rounds):
        d = sampler.draw(q)
        kept, token = accept_drafts(verified, [d], [q], sampler, [])
        out = kept[0] if kept else token
        accepted += len(kept)
        counts[out] += 1
    expected = p.float() * rounds
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, f"chi2 {chi2:.1f} (5 degrees of freedom, p = 0.001 at 20.5)"
    assert abs(accepted / rounds - float(torch.minimum(p, q).sum())) < 0.02  # P(accept) = sum min(p, q)


CHAINS = {"top-k": SamplingParams(temperature=2.0, top_k=2, top_p=1.0, min_p=0.0),
          "top-p, min-p": SamplingParams(temperature=2.0, top_k=4, top_p=0.6, min_p=0.4)}  # they keep 2 of 4
CHAIN_PROMPT = [11, 200, 31, 400]  # where the Q2_K draft's distributions differ from the target's (~80% kept)


def _chi2_bound(dof: int) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty: 1.4% above the exact one at dof = 4,
    closer for more)."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _joint_probabilities(model: Model, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(t_1 .. t_n) of target-only sampling, exactly: the reference chain (`Sampler.probabilities`) after every
    prefix."""
    sampler = Sampler(params)
    joint: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        grown = {}
        for prefix, p in joint.items():
            probs = sampler.probabilities(torch.from_numpy(model.logits([*prompt, *prefix])[-1]))
            for t in torch.nonzero(probs).reshape(-1).tolist():
                grown[(*prefix, t)] = p * float(probs[t])
        joint = grown
    return joint


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("chain", CHAINS)
def test_sampled_speculative_decoding_outputs_the_target_distribution(tiny_models, chain: str, device: str) -> None:
    """Three tokens sampled with a Q2_K draft drafting two (the first token is the prefill's, the next two come
    from one iteration: accepted drafts or the verdict's draw), 600 times with different seeds: the counts of
    the 8 triples against the target-only joint probabilities. On the GPU the iterations replay
    CUDA graphs, the verdict included."""
    params = CHAINS[chain]
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    joint = _joint_probabilities(Model.load(target, device="cpu", progress=False), CHAIN_PROMPT, params, 3)
    spec = Model.load(target, draft=draft, device=device, progress=False, ctx_size=64, n_draft=2)
    rounds, counts, drafted, accepted = 600, {t: 0 for t in joint}, 0, 0
    for seed in range(rounds):
        gen = spec.generate(CHAIN_PROMPT, 3, dataclasses.replace(params, seed=seed)).wait()
        counts[tuple(gen.tokens)] += 1  # a triple outside the support fails here
        drafted, accepted = drafted + gen.stats.draft_tokens, accepted + gen.stats.draft_accepted
    assert 0 < accepted < drafted, "both verdicts (kept, replaced) must occur"
    expected = {t: p * rounds for t, p in joint.items()}
    assert min(expected.values()) >= 5, "the chain's support has cells too rare for a chi-square test"
    chi2 = sum((counts[t] - e) ** 2 / e for t, e in expected.items())
    dof = len(joint) - 1
    bound = _chi2_bound(dof)
    assert chi2 < bound, f"chi2 {chi2:.1f} ({dof} degrees of freedom, p = 0.001 at {bound:.1f})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k", [40, 0])
def test_a_one_token_sampled_verdict_is_a_draw_from_the_chain(device: str, top_k: int) -> None:
    """A one-token step's sampled verdict (a draft step): `ids`, `probs` are the chain's distribution, the token is
    `chain_sample`'s draw with the step's uniform, choice = [0, token], next = [token, position + 1]; native with
    top-k on, torch ops with it off."""
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=0.95, min_p=0.05)
    n_vocab = 5000
    logits = (torch.randn(1, n_vocab, generator=torch.Generator().manual_seed(top_k)) * 3).to(device)
    verdict = SampledVerdict(params, 1, n_vocab, torch.device(device))
    verdict.uniforms.fill_(0.37)
    choice, next, finite = (torch.full((n,), -1, dtype=torch.long, device=device) for n in (2, 2, 1))
    verdict(logits, torch.tensor([7, 50], device=device), choice, next, finite)
    ids, probs, tokens = chain_sample(logits, verdict.n_candidates, verdict.knobs, verdict.uniforms)
    assert torch.equal(verdict.ids, ids) and torch.equal(verdict.probs, probs)
    token = int(tokens[0])
    assert choice.tolist() == [0, token] and next.tolist() == [token, 51] and finite.tolist() == [1]
    full = torch.zeros(n_vocab, dtype=torch.float64).scatter_(0, ids[0].cpu(), probs[0].cpu())
    assert torch.allclose(full, Sampler(params).probabilities(logits[0]), atol=1e-12, rtol=1e-9)


def test_verifications_of_every_depth_share_their_verdict_buffers(tiny_models) -> None:
    """Sampled with top-k off (verdict buffers over the whole vocabulary), the verification steps of each depth take
    views of one set of buffers, sized for the deepest; a draft step's are its own (each step's distribution is
    copied into the coming verification's)."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    m = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=64, n_draft="auto")
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    m.generate(CHAIN_PROMPT, 4, params).wait()
    dec, cache, n_vocab = m.decoder, m.transformer.new_cache(64), m.config.n_vocab
    shallow, deepest = (dec.steps(m, cache, n, draft=False, sampled=params).verdict for n in (3, dec.n_draft + 1))
    drafting = dec.steps(m, cache, 1, draft=True, sampled=params).verdict
    assert shallow.ids.shape == (3, n_vocab) and deepest.probs.shape == (dec.n_draft + 1, n_vocab)
    for name in ("uniforms", "draft_ids", "draft_probs", "ids", "probs"):
        assert getattr(shallow, name).data_ptr() == getattr(deepest, name).data_ptr(), name
    assert drafting.ids.data_ptr() != shallow.ids.data_ptr()
    assert drafting.uniforms.data_ptr() != shallow.uniforms.data_ptr()


def test_a_draft_of_another_model_is_refused(tiny_models) -> None:
    with pytest.raises(SpecterError, match="not a draft of"):
        Model.load(tiny_models[("qwen2moe", "f16")], draft=tiny_models[("olmoe", "f16")], device="cpu",
                              progress=False)
    with pytest.raises(SpecterError, match="needs a draft"):
        Model.load(tiny_models[("qwen2moe", "f16")], device="cpu", progress=False, n_draft=3)


def test_a_draft_with_another_vocabulary_is_refused(shipped_model, tmp_path) -> None:
    """Same layers and experts as the shipped model, another vocabulary: not a quantized copy of it."""
    import dataclasses

    from specter_gguf.synthetic.shapes import get_preset
    from specter_gguf.synthetic.writer import write_synthetic

    shape = dataclasses.replace(get_preset("tiny-qwen2moe").with_layers(4), n_expert_used=2)
    other = write_synthetic(tmp_path / "other.gguf", shape, "f16").path
    with pytest.raises(SpecterError, match=r"is not a draft of .* \(vocabulary 949 against 3072\); make one from "
                                           r"the model with `specter-gguf quantize"):
        Model.load(shipped_model, draft=other, device="cpu", progress=False)


def test_a_draft_is_checked_before_the_target_loads_and_by_plan(shipped_model, tmp_path, monkeypatch) -> None:
    """A draft of another model is refused from the headers: before the target's weights load (minutes for a big
    file), and by `plan` with the same check (it once compared layers, experts and hidden size only)."""
    from specter_gguf import engine
    from specter_gguf.synthetic.shapes import get_preset
    from specter_gguf.synthetic.writer import write_synthetic

    cfg = ModelConfig.from_gguf(GGUFFile(shipped_model))
    shape = dataclasses.replace(get_preset("tiny-qwen2moe").with_layers(cfg.n_layer),
                                n_expert_used=cfg.n_expert_used + 1)
    other = write_synthetic(tmp_path / "other.gguf", shape, "f16").path  # same layers, experts and hidden size
    monkeypatch.setattr(engine, "load_offloaded", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(SpecterError, match=f"experts per token {cfg.n_expert_used + 1} against {cfg.n_expert_used}"):
        Model.load(shipped_model, draft=other, device="cpu", progress=False)
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", "2GiB", "--draft", str(other)])
    assert r.exit_code == 1 and "is not a draft of" in r.output and "Traceback" not in r.output
    plain = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", "2GiB"])
    r = CliRunner().invoke(cli, ["plan", str(shipped_model), "--gpu-budget", "2GiB", "--draft", "none"])
    assert r.exit_code == plain.exit_code == 0 and r.output == plain.output  # as run's --draft none


def test_cli_run_with_draft(tiny_models) -> None:
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q4_k_m")]
    base = ["run", str(target), "-p", "Once upon a time", "-n", "12", "--temp", "0", "--device", "cpu", "--json"]
    plain = CliRunner().invoke(cli, base)
    spec = CliRunner().invoke(cli, [*base, "--draft", str(draft), "--n-draft", "3"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["tokens"] == b["tokens"] and b["stats"]["draft_tokens"] > 0 and a["stats"]["draft_tokens"] is None
    wrong = CliRunner().invoke(cli, [*base, "--draft", str(tiny_models[("olmoe", "f16")])])
    assert wrong.exit_code == 1 and "Error:" in wrong.output and "Traceback" not in wrong.output


def _lookahead(shipped_model: Path, slots: int):
    """The lookahead buffer of the shipped model over a CPU cache of `slots` slots per MoE layer."""
    from specter_gguf.speculation.lookahead import ExpertLookahead

    cache = small_cache(shipped_model, slots)
    cfg = ModelConfig.from_gguf(cache.store.f)
    return ExpertLookahead(cache, cfg.n_layer, cfg.n_expert, [0, 1], torch.device("cpu"))


def _drafted(*steps: list[list[int]]) -> torch.Tensor:
    """Recorded draft routing [steps, 4 layers, top-2] of layers 0 and 1 (the lookahead's MoE layers in these
    tests; the shipped model's layers 2 and 3 hold experts that must not be counted)."""
    return torch.tensor([[*step, [6, 7], [6, 7]] for step in steps], dtype=torch.int32)


def test_lookahead_prefetches_what_the_draft_counted_most_used_first(shipped_model) -> None:
    """The ELB counts the draft's recorded routing on the device (the MoE layers it was given); each snapshot it
    reads asks the cache for the counted experts not resident yet, most used first, then earlier layers; slots it
    requested in this iteration are not evicted by its later requests or by any other request, and an expert is
    requested once per iteration."""
    from specter_gguf.speculation.lookahead import chunk_ends

    elb = _lookahead(shipped_model, 3)
    cache = elb.cache
    elb.start()
    steps = [[[5, 2], [7, 2]], [[5, 3], [2, 7]]]
    elb.snapshot(_drafted(*steps))
    assert elb.plan() == 5
    assert list(cache.where) == [(0, 5), (0, 2), (0, 3), (1, 2), (1, 7)]  # (0, 5) twice, then layer by layer
    assert elb.prefetched == set(cache.where) and cache.counters.prefetches == 5
    steps.append([[6, 1], [7, 2]])  # layer 0's three slots are all this iteration's
    elb.snapshot(_drafted(*steps))
    assert elb.plan() == 0 and (0, 6) not in cache.where and (0, 5) in cache.where
    assert elb.refused == 2  # counted, but no slot of layer 0 could be taken
    assert cache.request([(0, 9)], prefetch=False) == 0  # nor can any other request (lru's) take them
    elb.start()  # a new iteration may evict them
    assert elb.refused == 0
    elb.snapshot(_drafted([[6, 1], [7, 2]]))
    assert elb.plan() == 2 and (0, 6) in cache.where and (0, 1) in cache.where
    assert chunk_ends(8, 0.003, 0.0065) == [2, 4, 6, 8] and chunk_ends(4, 0.003, 0.0) == [1, 2, 3, 4]
    assert chunk_ends(1, 0.003, 0.01) == [1]


def test_lookahead_queues_the_last_snapshot_layer_by_layer(shipped_model) -> None:
    """Snapshots before the last are requested most used first across layers; the last one layer by layer (the
    verification's order), the cache's copy progress raised to p before MoE layer p's copies are queued and to
    the layer count after all, so the verification's layer p waits for the copies of layers 0..p only. On the
    CPU a wait whose layer was not announced in this round is an error (the GPU would wait for it)."""
    elb = _lookahead(shipped_model, 6)
    cache = elb.cache
    progress, events = cache.progress, []
    request, landed = cache.request, progress.landed
    cache.request = lambda keys, **kw: (events.append(("copy", list(keys))), request(keys, **kw))[1]
    progress.landed = lambda p: (events.append(("landed", p)), landed(p))[1]
    n = len(cache.position)
    elb.start()
    with pytest.raises(SpecterError, match="has not reached"):
        progress.wait(0)  # nothing announced in this round
    steps = [[[1, 2], [3, 4]], [[0, 3], [3, 4]]]
    elb.snapshot(_drafted(*steps))
    steps.append([[5, 1], [6, 7]])
    elb.snapshot(_drafted(*steps))
    assert elb.plan() == 9
    assert events == [("copy", [(1, 3), (1, 4), (0, 0), (0, 1), (0, 2), (0, 3)]),  # most used first
                      ("landed", 0), ("copy", [(0, 5)]), ("landed", 1), ("copy", [(1, 6), (1, 7)]),  # by layer
                      ("landed", n)]
    for p in range(n):
        progress.wait(p)
    elb.start()  # the next round: its waits wait for its own announcements
    progress.landed(1)
    progress.wait(0)
    with pytest.raises(SpecterError, match="has not reached"):
        progress.wait(1)


def test_each_verification_layer_waits_for_its_copies(tiny_models) -> None:
    """An offloaded target's verification, eager on the CPU as in a CUDA graph on the GPU, waits once per MoE
    layer for that layer's copies (`CopyProgress.wait`), and the output is the target's own."""
    from specter_gguf.runtime.cache import CopyProgress

    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q4_k_m")]
    plan = plan_memory(GGUFFile(target), 1 << 40, 256, "cpu", draft=GGUFFile(draft))
    m = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256,
                   gpu_budget=plan.minimum + plan.n_moe_layers * plan.slot_bytes, offload="lru", n_draft=4)
    waits: list[int] = []
    progress = m.offload.cache.progress
    wait = progress.wait
    progress.wait = lambda p: (waits.append(p), wait(p))[1]
    gen = m.generate(PROMPT, N, GREEDY).wait()
    assert gen.tokens == _target_tokens(target)
    assert isinstance(progress, CopyProgress) and gen.stats.draft_rounds > 0
    assert waits == list(range(plan.n_moe_layers)) * gen.stats.draft_rounds


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_drafting_never_waits_for_the_host(tiny_models, monkeypatch, sampling: SamplingParams) -> None:
    """Drafting chains on the device, greedy or sampled: while an iteration's k draft steps are launched (the
    lookahead buffer counting and snapshotting their routing, sampled drafts drawn from uniforms sent ahead),
    nothing reads a tensor back or waits for the device; the one host read of an iteration is the verdict."""
    from specter_gguf.speculation import decoder as spec

    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q4_k_m")]
    plan = plan_memory(GGUFFile(target), 1 << 40, 256, "cpu", draft=GGUFFile(draft))
    m = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256,
                   gpu_budget=plan.minimum + plan.n_moe_layers * plan.slot_bytes, offload="lru", n_draft=4)
    assert m.decoder.lookahead is not None
    reads: list[str] = []
    drafting = [0]

    def counted(name: str, fn):
        def wrapper(*args, **kwargs):
            if drafting[0]:
                reads.append(name)
            return fn(*args, **kwargs)
        return wrapper

    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counted("synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted("Event.synchronize", torch.cuda.Event.synchronize))
    draft_steps = spec.SpeculativeDecoder._draft_on_device

    def watched(self, *args, **kwargs):
        drafting[0] += 1
        try:
            return draft_steps(self, *args, **kwargs)
        finally:
            drafting[0] -= 1

    monkeypatch.setattr(spec.SpeculativeDecoder, "_draft_on_device", watched)
    gen = m.generate(PROMPT, N, sampling).wait()
    assert gen.stats.draft_rounds > 3 and gen.stats.prefetched > 0
    if sampling.greedy:
        assert gen.tokens == _target_tokens(target)
    assert reads == [], f"host reads while drafting: {sorted(set(reads))}"


class _ScriptedDepths(DepthChooser):
    """Depths from a script, then 0; measurements recorded as by the real chooser."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(first=4)
        self.script = list(script)

    def choose(self, opening: bool = False) -> int:  # the script decides, the opening included
        return self.script.pop(0) if self.script else 0


def _script(m: Model, depths: list[int]) -> _ScriptedDepths:
    """`m`'s generations of every kind take their depths from one script."""
    chooser = _ScriptedDepths(depths)
    m.decoder.depth = {kind: chooser for kind in GENERATION_KINDS}
    return chooser


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=5)], ids=["greedy", "sampled"])
def test_plain_runs_step_ahead_between_drafting_iterations(tiny_models, sampling: SamplingParams, device: str) -> None:
    """Where auto depth chooses 0 the target's steps run one ahead of the host (`_plain_run`), between iterations
    that draft, offloaded with the lookahead: greedy tokens are the target's alone; a sampled generation of plain
    steps only is the plain decoder's, token for token (one uniform a token); every token after the prefill's
    is one iteration at depth 0; a generation closed within a run leaves the step ahead out of the cache. On the
    GPU (CUDA graphs) against the target alone there."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q4_k_m")]
    plan = plan_memory(GGUFFile(target), 1 << 40, 256, device, draft=GGUFFile(draft))
    m = Model.load(target, draft=draft, device=device, progress=False, ctx_size=256,
                   gpu_budget=plan.minimum + plan.n_moe_layers * plan.slot_bytes, offload="lru")
    assert m.decoder.lookahead is not None and m.decoder.depth is not None
    want = Model.load(target, device=device, progress=False, ctx_size=256).generate(PROMPT, N, sampling).wait().tokens
    _script(m, [])
    gen = m.generate(PROMPT, N, sampling).wait()
    assert gen.tokens == want
    assert gen.stats.depth_rounds == {0: N - 1} and gen.stats.draft_tokens == 0
    # plain steps bring what they missed into the cache, as plain decoding does: the last one's experts are in it
    used = {(int(layer), int(e)) for layer, e in zip(*np.nonzero(m.offload.last_used))}
    assert used and gen.stats.cache_misses > 0 and used <= m.offload.cache.where.keys()
    if not sampling.greedy:
        return
    _script(m, [0, 0, 0, 3, 0, 0, 2, 1, 0, 0, 0, 4, 0, 2, 2, 0])
    gen = m.generate(PROMPT, N, sampling).wait()
    assert gen.tokens == want
    assert gen.stats.depth_rounds[0] > 5 and gen.stats.draft_tokens > 0
    _script(m, [])
    gen = m.generate(PROMPT, N, sampling)
    pieces = iter(gen)
    for _ in range(5):
        next(pieces)
    gen.close()  # within a run: a step ahead of the last token handed out
    assert 5 <= len(gen.tokens) < N and gen.tokens == want[:len(gen.tokens)]
    assert m._cache.length == len(PROMPT) + len(gen.tokens) - 1, "the step ahead must be left out of the cache"
    _script(m, [0, 0, 2])
    assert m.generate(PROMPT, N, sampling).wait().tokens == want


def test_a_drafting_iterations_other_time_holds_the_callers(tiny_models) -> None:
    """The chooser's price of a drafting iteration runs from the last verdict's read to this one's: the caller's
    time between the tokens handed out (nothing is queued on the device meanwhile) is part of it."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q4_k_m")]
    m = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256)
    depths = _script(m, [2] * 6)
    caller_s = 0.02
    for _ in m.generate(PROMPT, 24, GREEDY):
        time.sleep(caller_s)
    assert depths.other_s is not None and depths.other_s >= caller_s  # at least one token handed out each
    assert depths.plain_other_s is not None  # the plain steps after the script, measured apart


PROMPTS = [[int(t) for t in torch.randint(3, 900, (4 + 3 * i,), generator=torch.Generator().manual_seed(i))]
           for i in range(20)]


@pytest.mark.parametrize("arch", MODELS)
def test_many_prompts_lossless(tiny_models, arch: str) -> None:
    """20 prompts × 64 tokens: greedy speculative output equals target-only output token for token, the target
    offloaded to a cache that must evict (the residency path, misses read in place, the lookahead prefetching)."""
    target, draft = tiny_models[(arch, "f16")], tiny_models[(arch, "q4_k_m")]
    plan = plan_memory(GGUFFile(target), 1 << 40, 256, "cpu", draft=GGUFFile(draft))
    budget = plan.minimum + plan.n_moe_layers * plan.slot_bytes
    plain = Model.load(target, device="cpu", progress=False, ctx_size=256)
    spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256, gpu_budget=budget,
                      offload="lru", n_draft=4)  # drafting every iteration (auto may not, on the CPU)
    evictions = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, 64, GREEDY).wait().tokens
        got = spec.generate(prompt, 64, GREEDY).wait()
        assert got.tokens == want, prompt
        evictions += got.stats.cache_evictions
    assert evictions > 0


@pytest.mark.parametrize("draft_kind", ["q8_0", "q4_k_m", "q2_k"])
def test_many_prompts_lossless_every_draft_type(tiny_models, draft_kind: str) -> None:
    target = tiny_models[("qwen3moe", "f16")]
    plain = Model.load(target, device="cpu", progress=False, ctx_size=256)
    spec = Model.load(target, draft=tiny_models[("qwen3moe", draft_kind)], device="cpu", progress=False,
                      ctx_size=256, n_draft=6)
    accepted = 0
    for prompt in PROMPTS:
        got = spec.generate(prompt, 64, GREEDY).wait()
        assert got.tokens == plain.generate(prompt, 64, GREEDY).wait().tokens, prompt
        accepted += got.stats.draft_accepted
    assert accepted > 0
