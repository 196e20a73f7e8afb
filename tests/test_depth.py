"""The draft depth: `--n-draft auto` (speculation.depth) and `specter-gguf profile-depth` (speculation.profile).

The chooser is driven by simulated iterations whose costs and acceptance are known, so the depth it settles on
can be compared with the true optimum; the command runs on the CPU on a tiny model with a Q2_K draft.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest
from click.testing import CliRunner

from specter_gguf.cli import cli
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile
from specter_gguf.runtime.budget import plan_memory
from specter_gguf.sampling import SamplingParams
from specter_gguf.speculation import DepthChooser
from specter_gguf.speculation.decoder import GENERATION_KINDS
from specter_gguf.speculation.depth import (MEAN, PROBE_AFTER, PROBE_AFTER_MAX, PROBE_MARGIN, expected_tokens,
                                           parse_depth)


def _simulate(acceptance: float, step_s: float, verify_s, iterations: int = 400,
              chosen: list[int] | None = None, seed: int = 0) -> DepthChooser:
    """Iterations where each drafted token is kept with probability `acceptance` until the first rejection, a
    draft step costs `step_s` and a verification of depth k `verify_s(k)` (with ±5% noise); `chosen` gets the
    depths."""
    rng = random.Random(seed)
    chooser = DepthChooser(first=4)
    for _ in range(iterations):
        k = chooser.choose()
        if chosen is not None:
            chosen.append(k)
        n = 0
        while n < k and rng.random() < acceptance:
            n += 1
        noise = lambda: 1 + rng.uniform(-0.05, 0.05)  # noqa: E731
        chooser.record(k, n, k * step_s * noise(), verify_s(k) * noise(), 0.0002)
    return chooser


def _best(acceptance: float, step_s: float, verify_s) -> int:
    return min(range(0, 9), key=lambda k: (k * step_s + verify_s(k) + 0.0002) / expected_tokens(k, acceptance))


@pytest.mark.parametrize("acceptance, step_s", [(0.9, 0.0005), (0.8, 0.001), (0.5, 0.001), (0.3, 0.002)])
def test_the_chooser_settles_on_the_fastest_depth(acceptance: float, step_s: float) -> None:
    def verify(k: int) -> float:  # a fixed cost and more experts for more tokens, as an offloaded verification
        return 0.004 + 0.0008 * (k + 1)

    chosen: list[int] = []
    _simulate(acceptance, step_s, verify, chosen=chosen)
    best = _best(acceptance, step_s, verify)
    k = Counter(chosen[-100:]).most_common(1)[0][0]  # where it settled (probes aside)
    true = lambda d: (d * step_s + verify(d) + 0.0002) / expected_tokens(d, acceptance)  # noqa: E731
    assert true(k) <= 1.03 * true(best), (k, best)  # a neighbour within 3% of the optimum is as good
    # the acceptance is decayed counts over the last ~20 tokens tested: at 0.5 one run's estimate is off by ~0.1
    # (more than 0.12 in a third of the seeds), so the median over runs is what is held to it
    errors = [abs(_simulate(acceptance, step_s, verify, seed=seed).acceptance - acceptance) for seed in range(9)]
    assert sorted(errors)[4] < 0.12, errors


def test_high_acceptance_drafts_deep_and_low_acceptance_shallow() -> None:
    def verify(k: int) -> float:
        return 0.004 + 0.0002 * (k + 1)

    def settled(acceptance: float, step_s: float) -> int:  # the depth chosen most of the last 100 (probes aside)
        chosen: list[int] = []
        _simulate(acceptance, step_s, verify, chosen=chosen)
        return Counter(chosen[-100:]).most_common(1)[0][0]

    assert settled(0.95, 0.0003) >= 6
    assert settled(0.4, 0.0004) == 1


def test_a_draft_that_does_not_pay_is_left_aside_and_probed() -> None:
    """Acceptance 0.1 and a dear draft step: plain steps of the target (depth 0) are faster, so the chooser
    takes them, and after PROBE_AFTER of them in a row (or more: `test_probes_that_do_not_pay_come_less_often`)
    drafts once again to measure the acceptance anew."""
    def verify(k: int) -> float:
        return 0.004 + 0.0002 * (k + 1)

    chosen: list[int] = []
    _simulate(0.1, 0.002, verify, iterations=400, chosen=chosen)
    late = chosen[100:]
    assert late.count(0) >= 0.9 * len(late)
    probes = [i for i, k in enumerate(late) if k > 0]
    assert probes and all(late[i - PROBE_AFTER:i] == [0] * PROBE_AFTER for i in probes if i >= PROBE_AFTER)


def test_probes_that_do_not_pay_come_less_often() -> None:
    """Qwen3-30B-A3B shapes at 24 GiB, greedy (H100, 2026-12-06 12:10), simulated: plain steps 6.3 ms, draft steps
    3.95 ms, a verification of depth k 9.4 + 0.8 (k - 1) ms, 45% acceptance. A probe every PROBE_AFTER plain steps
    drafts in one iteration of 17; the gap grows after probes that left drafting priced far above plain steps, so
    fewer iterations draft. When the text turns to one the draft predicts (95% accepted), the next probe comes within
    PROBE_AFTER_MAX plain steps."""
    rng = random.Random(0)
    chooser = DepthChooser(first=4)
    chosen: list[int] = []
    for i in range(700):
        acceptance = 0.45 if i < 400 else 0.95
        k = chooser.choose()
        chosen.append(k)
        kept = 0
        while kept < k and rng.random() < acceptance:
            kept += 1
        noise = lambda: 1 + rng.uniform(-0.05, 0.05)  # noqa: E731
        verify = 0.0063 if k == 0 else 0.0094 + 0.0008 * (k - 1)
        chooser.record(k, kept, 0.00395 * k * noise(), verify * noise(), 0.00035)
    settled = chosen[100:400]
    assert sum(k > 0 for k in settled) < len(settled) / (PROBE_AFTER + 1), Counter(settled)
    assert any(chosen[400:400 + PROBE_AFTER_MAX + 1])


def test_the_probe_gap_doubles_after_a_probe_far_from_paying_and_resets_after_one_that_pays() -> None:
    chooser = DepthChooser(first=1)
    chooser.record(1, 0, 0.004, 0.010, 0.0)  # drafting measured dear and rejected: plain steps win
    gaps = []
    for _ in range(4):
        while chooser.choose() == 0:
            chooser.record(0, 0, 0.0, 0.006, 0.0)
        chooser.record(1, 0, 0.004, 0.010, 0.0)  # the probe: rejected, 14 ms for one token against 6
        chooser.record(0, 0, 0.0, 0.006, 0.0)
        gaps.append(chooser.probe_gap)
    assert gaps == [2 * PROBE_AFTER, PROBE_AFTER_MAX, PROBE_AFTER_MAX, PROBE_AFTER_MAX]
    while chooser.choose() == 0:
        chooser.record(0, 0, 0.0, 0.006, 0.0)
    chooser.record(1, 1, 0.004, 0.004, 0.0)  # a probe kept its draft, verified cheaply: drafting priced near plain
    assert chooser.seconds_per_token(1) < PROBE_MARGIN * chooser.seconds_per_token(0)
    chooser.record(0, 0, 0.0, 0.006, 0.0)  # a plain step all the same, but probes come every PROBE_AFTER again
    assert chooser.probe_gap == PROBE_AFTER


def test_plain_steps_are_probed_and_a_stale_time_is_replaced() -> None:
    """Plain steps measured dear among a generation's first iterations (the expert cache still turning over) and
    drafting since: after PROBE_AFTER drafting iterations in a row one plain step runs, and its time,
    cheap now, replaces the stale one instead of joining its mean, so the chooser turns to plain steps."""
    chooser = DepthChooser(first=1)
    for _ in range(3):
        chooser.record(0, 0, 0.0, 0.025, 0.0002)  # 25 ms: the cold cache
    chosen = []
    for _ in range(PROBE_AFTER + 1):
        k = chooser.choose()
        chosen.append(k)
        if k:  # 4 ms draft steps and a verification of 8.7 ms and more, half the drafts kept
            chooser.record(k, min(k, len(chosen) % 2), 0.004 * k, 0.0087 + 0.001 * k, 0.0002)
        else:
            chooser.record(0, 0, 0.0, 0.005, 0.0002)  # the cache has warmed: 5 ms
    assert all(chosen[:PROBE_AFTER]) and chosen[PROBE_AFTER] == 0
    assert chooser.verify_s[0] == pytest.approx(0.005)  # replaced, not averaged with 25 ms
    assert chooser.choose() == 0


def test_plain_steps_measured_cold_do_not_keep_generations_drafting() -> None:
    """Qwen3-30B-A3B shapes at 24 GiB (H100, 2026-12-06 10:56), simulated: a plain step costs 5 ms once the expert
    cache has warmed and 5x that over a first generation's first iterations; a draft step 3.9 ms, a verification of
    depth k 8.7 + 0.6 k ms, 55% acceptance. Over the two generations after the first (one chooser for all three, as
    a server or the benchmark keeps it), decoding comes to within 25% of plain steps' 5.3 ms a token (before the
    plain-step probe it drafted on at 8-9 ms a token in many runs: plain steps stayed priced at their cold time)."""
    def per_token_ms(seed: int) -> float:
        rng = random.Random(seed)
        chooser = DepthChooser(first=4)
        spent = made = 0.0
        for generation in range(3):
            n = iteration = 0
            while n < 64:
                k = chooser.choose()
                cold = 5.0 if generation == 0 and iteration < 4 else 1.0
                kept = 0
                while kept < k and rng.random() < 0.55:
                    kept += 1
                draft = 0.0039 * k
                verify = (0.0087 + 0.0006 * k if k else 0.005) * cold * (1 + rng.uniform(-0.05, 0.05))
                if iteration:  # the decoder leaves a generation's first iteration out
                    chooser.record(k, kept, draft, verify, 0.0003)
                if generation:
                    spent, made = spent + draft + verify + 0.0003, made + kept + 1
                n, iteration = n + kept + 1, iteration + 1
        return 1000 * spent / made

    mean = sum(per_token_ms(seed) for seed in range(10)) / 10
    assert mean < 1.25 * 5.3, mean


def test_a_restarted_mean_averages_its_first_measurements() -> None:
    """A depth's verification time, first measured or measured again after PROBE_AFTER iterations away, is the plain
    average of its measurements until a running mean's weight (MEAN) takes over: one measurement, cheap by chance,
    does not set the price for the next several iterations."""
    chooser = DepthChooser(first=1)
    first = [0.004, 0.008, 0.012]
    for t in first:
        chooser.record(0, 0, 0.0, t, 0.0)
    assert chooser.verify_s[0] == pytest.approx(sum(first) / 3)
    for _ in range(PROBE_AFTER):
        chooser.record(1, 1, 0.004, 0.009, 0.0)
    again = [0.005, 0.011, 0.008, 0.006, 0.010, 0.020]
    for t in again:
        chooser.record(0, 0, 0.0, t, 0.0)
    five = sum(again[:5]) / 5
    assert chooser.verify_s[0] == pytest.approx((1 - MEAN) * five + MEAN * again[5])


def test_untried_depths_are_predicted_optimistically() -> None:
    chooser = DepthChooser(first=4)
    chooser.record(4, 4, 0.004, 0.010, 0.0)
    assert chooser.verification_s(8) == pytest.approx(0.010)  # deeper: no dearer than the tried depth
    assert chooser.verification_s(1) == pytest.approx(0.010 * 2 / 5)  # shallower: in proportion to tokens
    assert chooser.choose() == 0  # a plain step predicted at a fifth of the verification: it could win, tried
    chooser.record(0, 0, 0.0, 0.008, 0.0)  # it did not: a step of one token costs most of one of five
    assert chooser.choose() > 4  # everything kept so far: a deeper depth could win, so it is tried


def test_plain_steps_do_not_price_drafting_iterations() -> None:
    """The time outside the steps is kept apart for plain steps (whose host work overlaps the step run ahead) and
    drafting iterations (the device idles meanwhile): many cheap plain steps do not make drafting look cheap."""
    chooser = DepthChooser(first=4)
    chooser.record(4, 4, 0.004, 0.010, 0.003)
    for _ in range(20):
        chooser.record(0, 0, 0.0, 0.008, 0.0001)
    assert chooser.other_s == pytest.approx(0.003) and chooser.plain_other_s == pytest.approx(0.0001)
    want = (4 * 0.001 + 0.010 + 0.003) / expected_tokens(4, chooser.acceptance)
    assert chooser.seconds_per_token(4) == pytest.approx(want)
    assert chooser.seconds_per_token(0) == pytest.approx(0.008 + 0.0001)


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("AUTO", "auto"), ("3", 3), (5, 5), ("16", 16)])
def test_parse_depth(text, value) -> None:
    assert parse_depth(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "17", "two", "", 2.5, True])
def test_bad_depths_are_refused(text) -> None:
    with pytest.raises(SpecterError, match="--n-draft must be a whole number from 1 to 16 or auto"):
        parse_depth(text)


def test_auto_is_the_default_and_lossless(tiny_models) -> None:
    target, draft = tiny_models[("qwen3moe", "f16")], tiny_models[("qwen3moe", "q2_k")]
    greedy = SamplingParams(temperature=0)
    spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256)
    assert spec.decoder.depth is not None
    want = Model.load(target, device="cpu", progress=False, ctx_size=256).generate([5, 17, 300], 64, greedy).wait()
    got = spec.generate([5, 17, 300], 64, greedy).wait()
    assert got.tokens == want.tokens
    assert spec.decoder.depth["greedy"].verify_s  # it measured what it chose from
    passes = got.stats.iterations  # in order, as the chooser ran them
    assert passes and any(k > 0 for k, _, _ in passes)
    # each pass yields its kept drafts and one token of the target's; the prefill yields the first token
    assert 1 + sum(kept + 1 for _, kept, _ in passes) == len(got.tokens)
    assert sum(kept for _, kept, _ in passes) == got.stats.draft_accepted and all(0 <= n <= k for k, n, _ in passes)
    assert Model.load(target, draft=draft, device="cpu", progress=False, n_draft=3).decoder.depth is None
    # the summary says how many of the verifications were plain steps, and "no token drafted" rather than 0 of 0
    s = got.stats
    plain = s.depth_rounds.get(0, 0)
    assert (f"{plain} of {s.draft_rounds} of them plain steps (depth 0)" in s.summary()) == (plain > 0)
    s = dataclasses.replace(s, draft_accepted=0, iterations=[(0, 0, 0.001)] * s.draft_rounds)
    assert "speculative: no token drafted (0.0 drafted per verification" in s.summary()


def test_the_stats_count_drafts_and_depths_from_the_iterations() -> None:
    """Drafted tokens, verification passes and the per-depth counts and times are read off the iterations, in the
    order their depths were first run; a generation without a draft has none of them."""
    from specter_gguf.engine import GenerationStats

    s = GenerationStats(draft_accepted=7, iterations=[(4, 2, 0.010), (0, 0, 0.002), (4, 4, 0.012), (2, 1, 0.005)])
    assert (s.draft_tokens, s.draft_rounds) == (10, 4)
    assert list(s.depth_rounds.items()) == [(4, 2), (0, 1), (2, 1)]
    assert s.depth_verify_s == pytest.approx({4: 0.022, 0: 0.002, 2: 0.005})
    plain = GenerationStats()
    assert (plain.draft_tokens, plain.draft_rounds, plain.depth_rounds, plain.depth_verify_s) == (None,) * 4


def test_the_summary_says_when_the_draft_did_not_pay() -> None:
    """Depth auto running plain steps in most of a generation's iterations means drafting was slower there: the
    summary says that decoding without the draft may be faster; not for a few iterations or mostly drafting ones."""
    from specter_gguf.engine import DRAFT_IDLE_AFTER, GenerationStats

    def summary(plain: int, drafting: int) -> str:
        return GenerationStats(prompt_tokens=4, generated_tokens=plain + 3 * drafting + 1, prefill_s=0.01,
                               decode_s=0.1, draft_accepted=2 * drafting, draft_s=0.01, verify_s=0.08,
                               iterations=[(0, 0, 0.001)] * plain + [(4, 2, 0.01)] * drafting).summary()

    hint = "depth auto found drafting slower than plain steps in most iterations: decoding without the draft may be"
    assert hint in summary(94, 22) and hint in summary(DRAFT_IDLE_AFTER, 0)
    assert hint not in summary(40, 40) and hint not in summary(DRAFT_IDLE_AFTER - 1, 0)


def test_a_generation_s_first_iteration_is_not_measured(tiny_models) -> None:
    """The first verification after a prompt turns the expert cache over (on the GPU 4-6x the next ones at any
    depth): measured, it kept the depth it ran at from being chosen again. Every later iteration is measured."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256)
    recorded = []
    chooser = spec.decoder.depth.setdefault("greedy", DepthChooser(first=4))
    record = chooser.record
    chooser.record = lambda k, *a: (recorded.append(k), record(k, *a))
    rounds = 0
    for prompt in ([5, 17, 300], [9, 40]):
        rounds += spec.generate(prompt, 24, SamplingParams(temperature=0)).wait().stats.draft_rounds
    assert len(recorded) == rounds - 2 > 0


def _settled_on_plain_steps() -> DepthChooser:
    """A chooser whose measurements make plain steps (1 ms) far cheaper than drafting (4 ms a draft step, 9 ms a
    verification, one draft in five kept)."""
    chooser = DepthChooser(first=4)
    for i in range(40):
        chooser.record(1, int(i % 5 == 0), 0.004, 0.009, 0.0002)
    for _ in range(PROBE_AFTER // 2):  # fewer than a drafting probe waits for
        chooser.record(0, 0, 0.0, 0.001, 0.0002)
    return chooser


def test_a_generation_opens_with_a_drafting_iteration() -> None:
    """A generation's first iteration drafts at the best depth of at least 1 even where plain steps are priced
    cheapest: after a new prompt a plain step waits for each layer's missed experts in turn (Qwen3-30B-A3B shapes
    at 16 GiB, H100, 2026-12-06 13:33: the first three of each greedy generation took 81-97 ms against 6-9 later),
    where a drafting iteration's lookahead copies them while the draft runs."""
    chooser = _settled_on_plain_steps()
    assert chooser.choose() == 0
    best = min(range(1, chooser.max_depth + 1), key=chooser.seconds_per_token)
    assert chooser.choose(opening=True) == best >= 1
    # plain steps measured dear, then PROBE_AFTER drafting iterations: drafting is priced best, and a plain-step
    # probe is due (`test_plain_steps_are_probed_and_a_stale_time_is_replaced`); the opening drafts all the same
    chooser = DepthChooser(first=1)
    for _ in range(3):
        chooser.record(0, 0, 0.0, 0.025, 0.0002)
    for i in range(PROBE_AFTER):
        chooser.record(1, i % 2, 0.004, 0.0097, 0.0002)
    assert min(range(chooser.max_depth + 1), key=chooser.seconds_per_token) >= 1
    assert chooser.choose() == 0 and chooser.choose(opening=True) >= 1


def test_offloaded_generations_open_with_a_drafting_iteration_and_stay_lossless(tiny_models) -> None:
    """With the experts offloaded (host buffers as the cache's slots on the CPU) a generation opens drafting, then
    runs the plain steps its chooser prices best, and its tokens are the target's; with every expert resident (no
    cache to warm) it follows the chooser from the first iteration."""
    target, draft = tiny_models[("qwen3moe", "f16")], tiny_models[("qwen3moe", "q2_k")]
    greedy = SamplingParams(temperature=0)
    plan = plan_memory(GGUFFile(target), 1 << 40, 256, "cpu", draft=GGUFFile(draft))
    want = Model.load(target, device="cpu", progress=False, ctx_size=256).generate([5, 17, 300], 32, greedy).wait()
    for budget, first in [(plan.minimum + plan.n_moe_layers * plan.slot_bytes, "drafts"), (None, "plain")]:
        spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256, gpu_budget=budget,
                          offload="lru" if budget else None)
        assert (spec.decoder.lookahead is not None) == (budget is not None)
        spec.decoder.depth["greedy"] = _settled_on_plain_steps()
        got = spec.generate([5, 17, 300], 32, greedy).wait()
        assert got.tokens == want.tokens
        depths = [k for k, _, _ in got.stats.iterations]
        assert (depths[0] >= 1) == (first == "drafts") and depths[1:4] == [0, 0, 0], (first, depths)


def test_cli_n_draft_errors_are_one_line(tiny_models) -> None:
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    runner = CliRunner()
    r = runner.invoke(cli, ["run", str(target), "-p", "hi", "--draft", str(draft), "--n-draft", "zero",
                            "--device", "cpu"])
    assert r.exit_code == 2 and "Invalid value for '--n-draft': must be a whole number from 1 to 16 or auto" in r.output
    r = runner.invoke(cli, ["run", str(target), "-p", "hi", "--n-draft", "3", "--device", "cpu"])
    assert r.exit_code == 1 and "--n-draft needs a draft" in r.output and "Traceback" not in r.output


def test_profile_depth_writes_the_table_and_the_plot(tiny_models, tmp_path) -> None:
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    out = tmp_path / "profile"
    r = CliRunner().invoke(cli, ["profile-depth", str(target), "--draft", str(draft), "--device", "cpu", "-n", "16",
                                 "--depths", "1,3", "--repeats", "1", "--temp", "0", "-o", str(out)])
    assert r.exit_code == 0, r.output
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table] == ["k", "1", "3", "auto"]
    rows = json.loads((out / "depth.json").read_text())["rows"]
    assert [row["depth"] for row in rows] == ["1", "3", "auto"]
    assert rows[0]["mean_depth"] == 1.0 and rows[1]["mean_depth"] <= 3.0  # depth 3 less near the context end
    for row in rows:
        assert row["tpot_ms"] > 0
        if row["mean_depth"] == 0:  # auto ran plain steps only: no acceptance or draft step to show
            assert row["acceptance"] is None and row["draft_step_ms"] is None and row["mean_accepted_len"] == 1
            continue
        assert 0 <= row["acceptance"] <= 1 and row["draft_step_ms"] > 0
        assert row["mean_accepted_len"] == pytest.approx(1 + row["acceptance"] * row["mean_depth"])
    assert (out / "depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "depth.md").read_text().count("\n| ") == 4


def test_a_profile_row_without_drafts_shows_no_acceptance_or_draft_step() -> None:
    """auto may run plain steps only: its row has no acceptance or draft step (not 0% and the plain steps' time)."""
    from specter_gguf.engine import GenerationStats
    from specter_gguf.speculation.profile import _row, markdown_table

    stats = GenerationStats(prompt_tokens=4, generated_tokens=9, prefill_s=0.01, decode_s=0.08, draft_accepted=0,
                            draft_s=0.004, verify_s=0.07, iterations=[(0, 0, 0.07 / 8)] * 8)
    row = _row("auto", [stats])
    assert row.acceptance is None and row.draft_step_ms is None and row.mean_accepted_len == 1
    assert markdown_table([row]).splitlines()[-1].startswith("| auto | 10.00 | 100.00 | 0.00 | — | 1.00 | — |")


@pytest.mark.parametrize("args, message", [(["--depths", "0-3"], "each depth must be from 1 to 8"),
                                           (["--depths", "a"], "write whole numbers and ranges"),
                                           (["--depths", "4-2"], "the range 4-2 runs backwards; write it low-high"),
                                           (["--depths", " , "], "--depths is empty"),
                                           ([], "profile-depth needs a draft")])
def test_profile_depth_errors(tiny_models, tmp_path, args, message) -> None:
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    with_draft = ["--draft", str(draft)] if args else []
    r = CliRunner().invoke(cli, ["profile-depth", str(target), *with_draft, "--device", "cpu", "-n", "8", *args,
                                 "-o", str(tmp_path / "p")])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0),
                                      SamplingParams(temperature=0, repeat_penalty=1.3)], ids=["device", "host"])
def test_depth_zero_iterations_are_plain_steps(tiny_models, sampling: SamplingParams) -> None:
    """Iterations of depth 0 (auto's choice when drafting does not pay) mixed with drafting ones, on the
    device-chained path and on the host path (penalties): the output is the target's own."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    want = Model.load(target, device="cpu", progress=False, ctx_size=256).generate([5, 17, 300], 40, sampling).wait()
    spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256)
    depths = iter([0, 3, 0, 0, 2, 1, 0] * 20)
    chooser = DepthChooser(first=4)
    chooser.choose = lambda opening=False: next(depths)
    spec.decoder.depth = {kind: chooser for kind in GENERATION_KINDS}
    got = spec.generate([5, 17, 300], 40, sampling).wait()
    assert got.tokens == want.tokens
    assert got.stats.draft_rounds > got.stats.draft_tokens / 3  # the plain steps count as verification passes


def test_a_fixed_depth_beyond_auto_s_range(tiny_models) -> None:
    """--n-draft may exceed auto's range (MAX_DEPTH): the buffers that follow drafted rows (the agreement's) are
    sized by the depth, and the output stays the target's own."""
    from specter_gguf.speculation.depth import MAX_DEPTH

    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    greedy = SamplingParams(temperature=0)
    want = Model.load(target, device="cpu", progress=False, ctx_size=256).generate([5, 17, 300], 40, greedy).wait()
    spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256, n_draft=MAX_DEPTH + 4)
    got = spec.generate([5, 17, 300], 40, greedy).wait()
    assert got.tokens == want.tokens and got.stats.draft_tokens > MAX_DEPTH
    assert got.stats.expert_agreement is not None


def test_each_kind_of_generation_has_its_own_chooser(tiny_models) -> None:
    """Greedy, sampled and penalized generations are measured apart (their verifications cost their own and keep
    drafts at their own rates), and alternating them keeps what each learnt."""
    target, draft = tiny_models[("qwen2moe", "f16")], tiny_models[("qwen2moe", "q2_k")]
    spec = Model.load(target, draft=draft, device="cpu", progress=False, ctx_size=256)
    kinds = {"greedy": SamplingParams(temperature=0), "sampled": SamplingParams(temperature=1.0, seed=3),
             "penalties": SamplingParams(temperature=0, repeat_penalty=1.3)}
    assert tuple(kinds) == GENERATION_KINDS
    seen = set()
    for name, params in kinds.items():
        spec.generate([5, 17, 300], 24, params).wait()
        seen.add(name)
        assert set(spec.decoder.depth) == seen  # a chooser for each kind run so far
    greedy = spec.decoder.depth["greedy"]
    measured = dict(greedy.verify_s)
    spec.generate([9, 40], 24, kinds["sampled"]).wait()
    assert spec.decoder.depth["greedy"] is greedy and greedy.verify_s == measured  # a sampled run leaves it alone
    assert len({id(c) for c in spec.decoder.depth.values()}) == 3
