"""What the benchmark measures, per system (one configuration of llama.cpp or of our engine) on one model file, and
how a system's runs are summarized:

- the same prompts (``scripts/bench_prompts.json``, as token ids: every system is fed identical ids),
  the same number of generated tokens (end-of-generation tokens are ignored everywhere, so every run
  generates exactly ``n_predict`` tokens), greedy and sampled decoding (temperature 1, top-k 40, top-p 0.95,
  min-p 0.05 on both sides, seed ``seed + prompt index``);
- one warm-up generation per decoding first (not counted), then TPOT per prompt = decode time / (generated - 1), the
  same definition as llama-server's ``predicted_per_token_ms`` and our ``GenerationStats.tpot_ms``;
  a system's TPOT is the median over prompts, its tokens/s is ``1000 / TPOT``;
- peak GPU memory: ``nvidia-smi`` device memory in use above the idle level measured just before the
  system started (its own process only, since systems run one at a time; includes the CUDA context), and for
  ours also ``torch.cuda.max_memory_allocated`` (`gpu`);
- where the system reports them: draft acceptance (llama-server ``timings.draft_n`` /
  ``draft_n_accepted``; ours: see :data:`STAT_COUNTS`), expert-cache hit rate, bytes copied per token and
  the share of copy time hidden behind compute;
- for ours, where the stats carry them (the report's second table, ``report.SPEC_COLUMNS``): tokens per
  verification pass and tokens drafted for it, the verifications per draft depth with their mean time (``depths``:
  where depth auto settles), prefetch precision (prefetched experts the verification used / prefetched) and recall
  (used and prefetched / experts the verifications used that were prefetched or read in place), the share of
  prefetches that landed after their verification began, counted experts refused a slot per iteration, the expert
  cache's slots (what the budget left it beside everything else: with a draft, its experts), expert
  bytes moved over PCIe per processed token (copied plus read in place, prompt and generated tokens), the
  draft step time (drafting time / drafted tokens) and the speculative iteration in ms per verification
  pass: drafting, verification, the exposed copy time (compute waiting for copies) and the other decode time
  (outside drafting and verification); and, per generated token, the time the CPU computed missed experts
  (hybrid) and the time the copy stream copied experts: beside TPOT, the CPU's and the link's busy shares; the
  GPU's time in the decode forwards per decode step (beside TPOT its busy share, its waits included) and the
  time it waited for the CPU's experts.

Our engine's statistics contract: a ``Generation.stats`` object may carry, besides the timings, any of the
count fields of :data:`STAT_COUNTS`, :data:`STAT_MS`, :data:`STAT_MS_PER_TOKEN` and :data:`STAT_BYTES` (summed over
prompts, then divided) or the rate fields of :data:`STAT_RATES` (median over prompts, used where the counts are
missing). Missing fields simply leave the column empty.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Sequence

# Sampled decoding: llama.cpp's default filters with temperature 1 (ours and llama-server alike).
SAMPLED = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
GREEDY = {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
DECODINGS = {"greedy": GREEDY, "sampled": SAMPLED}

# Our Generation.stats fields read when present: (numerator, denominator) count pairs -> metric.
STAT_COUNTS = {
    "acceptance": ("draft_accepted", "draft_tokens"),
    "cache_hit_rate": ("cache_hits", "cache_lookups"),
    "hidden_copy_share": ("copy_hidden_s", "copy_s"),
    "prefetch_precision": ("prefetched_used", "prefetched"),
    "prefetch_recall": ("prefetched_used", "verify_missing"),
    "prefetch_late_share": ("prefetch_late", "prefetched"),
    "prefetch_refused_per_iter": ("prefetch_refused", "draft_rounds"),
    "drafted_per_iter": ("draft_tokens", "draft_rounds"),
}
# ... (seconds, count) pairs -> milliseconds per count: a drafted token's step, and the speculative iteration
# broken down per verification pass (`other_s`: decode time outside drafting and verification; see
# _with_other_s). `copy_exposed_s` covers the whole generation, prefill included, and mostly lies inside
# verification: it is a part of `verify_s`, not a fourth addend.
STAT_MS = {
    "draft_step_ms": ("draft_s", "draft_tokens"),
    "iter_draft_ms": ("draft_s", "draft_rounds"),
    "iter_verify_ms": ("verify_s", "draft_rounds"),
    "iter_copy_exposed_ms": ("copy_exposed_s", "draft_rounds"),
    "iter_other_ms": ("other_s", "draft_rounds"),
}
# ... seconds -> milliseconds per generated token, utilisation beside TPOT: the CPU's worker computing missed experts
# (hybrid), the copy stream busy with expert copies, the forwards waiting for the CPU's answers (the whole
# generation, prefill included)
STAT_MS_PER_TOKEN = {"cpu_experts_ms_per_token": "cpu_expert_s", "copy_ms_per_token": "copy_s",
                     "cpu_wait_ms_per_token": "cpu_wait_s"}
# ... per decode step (generated tokens after each prompt's first, as TPOT): the GPU's time in the decode forwards
STAT_MS_PER_STEP = {"gpu_ms_per_token": "gpu_s"}
# ... or ready-made per-generation rates and sizes (median over prompts; the cache's slots are one load's).
STAT_RATES = {
    "acceptance": "acceptance_rate",
    "cache_hit_rate": "cache_hit_rate",
    "hidden_copy_share": "hidden_copy_share",
    "bytes_per_token": "bytes_copied_per_token",
    "bytes_moved_per_token": "bytes_moved_per_token",
    "mean_accepted_len": "mean_accepted_len",
    "prefetch_precision": "prefetch_precision",
    "prefetch_recall": "prefetch_recall",
    "draft_step_ms": "draft_step_ms",
    "cache_slots": "cache_slots",
}
# bytes over PCIe during a generation, prefill included, summed and divided by prompt + generated tokens:
# copied host->GPU (`bytes_copied_per_token`), and moved = copied + read in place by the kernels
# (`bytes_moved_per_token`). The first field must be present; the others count as 0 when missing.
STAT_BYTES = {
    "bytes_per_token": ("bytes_copied",),
    "bytes_moved_per_token": ("bytes_copied", "zero_copy_bytes"),
}


def median(values: Iterable[float | None]) -> float | None:
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return statistics.median(v) if v else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _total(extra: Sequence[dict[str, Any]], key: str) -> float:
    return sum(float(e.get(key) or 0) for e in extra)


def _with_other_s(run: dict[str, Any]) -> dict[str, Any]:
    """A run's `extra` stats, with `other_s` (decode time outside drafting and verification, as
    GenerationStats.other_s) derived from the run's decode time where the stats give drafting and
    verification times but not it."""
    e = run.get("extra") or {}
    if "other_s" in e or "draft_s" not in e or "verify_s" not in e or run.get("decode_ms") is None:
        return e
    other = float(run["decode_ms"]) / 1000.0 - float(e["draft_s"] or 0) - float(e["verify_s"] or 0)
    return {**e, "other_s": max(0.0, other)}


def _depths(extra: Sequence[dict[str, Any]]) -> list[list[float]]:
    """[depth, verifications, mean verification ms] per draft depth of our speculative runs, summed over them
    (JSON gives the depths as text)."""
    rounds: dict[int, int] = {}
    secs: dict[int, float] = {}
    for e in extra:
        verify = {int(k): float(v) for k, v in (e.get("depth_verify_s") or {}).items()}
        for k, n in (e.get("depth_rounds") or {}).items():
            rounds[int(k)] = rounds.get(int(k), 0) + int(n)
            secs[int(k)] = secs.get(int(k), 0.0) + verify.get(int(k), 0.0)
    return [[k, rounds[k], 1000.0 * secs[k] / rounds[k]] for k in sorted(rounds)]


def summarize_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-decoding summary of measured runs (warm-up excluded): median TPOT, tokens/s = 1000 / median
    TPOT, and the optional metrics (ratios of summed counts where the system gives counts, else medians)."""
    out: dict[str, Any] = {}
    for dec in sorted({r["decoding"] for r in runs}):
        rs = [r for r in runs if r["decoding"] == dec and not r.get("warmup")]
        t = median(r.get("tpot_ms") for r in rs)
        s: dict[str, Any] = {
            "n_prompts": len(rs),
            "tpot_ms": t,
            "tokens_per_s": 1000.0 / t if t else None,
            "tpot_ms_min": min((r["tpot_ms"] for r in rs if r.get("tpot_ms")), default=None),
            "tpot_ms_max": max((r["tpot_ms"] for r in rs if r.get("tpot_ms")), default=None),
            "prefill_ms": median(r.get("prefill_ms") for r in rs),
            "generated_tokens": sum(int(r.get("generated_tokens") or 0) for r in rs),
        }
        extra = [_with_other_s(r) for r in rs]
        for metric, (num, den) in STAT_COUNTS.items():
            if any(num in e and den in e for e in extra):
                s[metric] = _ratio(_total(extra, num), _total(extra, den))
        for metric, (secs, den) in STAT_MS.items():
            if any(secs in e and den in e for e in extra):
                per = _ratio(_total(extra, secs), _total(extra, den))
                s[metric] = 1000.0 * per if per is not None else None
        for metric, secs in STAT_MS_PER_TOKEN.items():
            if any(e.get(secs) is not None for e in extra) and s["generated_tokens"]:
                s[metric] = 1000.0 * _total(extra, secs) / s["generated_tokens"]
        steps = sum(max(0, int(r.get("generated_tokens") or 0) - 1) for r in rs)
        for metric, secs in STAT_MS_PER_STEP.items():
            if any(e.get(secs) is not None for e in extra) and steps:
                s[metric] = 1000.0 * _total(extra, secs) / steps
        processed = sum(int(r.get("prompt_tokens") or 0) + int(r.get("generated_tokens") or 0) for r in rs)
        for metric, keys in STAT_BYTES.items():  # per processed token, as GenerationStats.bytes_*_per_token
            if any(keys[0] in e for e in extra):
                s[metric] = _ratio(sum(_total(extra, k) for k in keys), processed)
        for metric, key in STAT_RATES.items():
            if metric not in s and any(key in e for e in extra):
                s[metric] = median(e.get(key) for e in extra)
        if any(e.get("depth_rounds") for e in extra):
            s["depths"] = _depths(extra)
        out[dec] = s
    return out
