"""Results documents (JSON: the meta, notes and per-system results of a run; parts merged) and the report: one
Markdown section per run, appended to ``docs/BENCHMARKS.md`` (plots: `plots`)."""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Sequence

from specter_gguf.bench.metrics import summarize_runs
from specter_gguf.errors import SpecterError
from specter_gguf.sizes import format_size as _format_size


def format_size(n: float | None) -> str:
    """The report's sizes: "12.3 GiB" (sizes under 1 GiB in MiB); "—" for None."""
    return _format_size(n, ".1f", smallest="MiB", none="—")


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def read_results(path: Path) -> dict[str, Any]:
    """A results.json of `scripts/bench.py`; a missing or foreign file is one error naming it."""
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise SpecterError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecterError(f"{path} is not JSON ({e}); give the results.json a run wrote") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("results"), list):
        raise SpecterError(f"{path} is not a benchmark's results (no 'meta' and 'results'); give the results.json a "
                           "run wrote")
    return doc


def _spare_slots_run(result: dict[str, Any]) -> int | None:
    """The spare slots a layer that a result of ours ran with (its runs' stats), None where it has none."""
    return next((run["extra"]["spare_slots"] for run in result.get("runs", [])
                 if (run.get("extra") or {}).get("spare_slots") is not None), None)


def merge_docs(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several results documents (e.g. the parts of a split run) as one, each measured result summarized from its
    runs by this version's `summarize_runs`. A system skipped or failed in one part and measured in another (a rerun
    of what was left) appears once, measured; one measured greedy in one part and sampled in another appears once
    with both. Documents of different `--spare-slots` (a sweep) keep each row: its setting says the spare slots it
    ran with."""
    if not docs:
        raise SpecterError("nothing to merge")
    meta = dict(docs[0]["meta"])
    meta["budgets"] = {k: v for d in docs for k, v in (d["meta"].get("budgets") or {}).items()}
    cmds = [d["meta"].get("command") for d in docs if d["meta"].get("command")]
    meta["command"] = " ; ".join(dict.fromkeys(cmds))
    decodings = {dec for d in docs for dec in d["meta"].get("decodings", [])}
    if decodings:  # (a document without the key renders greedy and sampled)
        meta["decodings"] = sorted(decodings, key=lambda dec: (dec != "greedy", dec))
    sweep = len({d["meta"].get("spare_slots") for d in docs}) > 1
    if sweep:
        meta["spare_slots"] = None  # each row says its own
    results: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    for r in (r for d in docs for r in d["results"]):
        if r["status"] == "ok" and r.get("runs"):  # summarized anew: results written before a column came get it
            r = dict(r, summary=summarize_runs(r["runs"]))
        n_spare = _spare_slots_run(r) if sweep else None
        if n_spare is not None:
            r = dict(r, setting=f"{r['setting']}, {n_spare} spare slot{'' if n_spare == 1 else 's'} a layer")
        key = (r["family"], r["setting"], r["budget"])
        old = results.get(key)
        if old is None or old["status"] == "skipped" or (old["status"] != "ok" and r["status"] == "ok"):
            results[key] = r
        elif old["status"] == "ok" and r["status"] == "ok":
            results[key] = _with_decodings_of(old, r)
    return {"meta": meta, "notes": list(dict.fromkeys(n for d in docs for n in d.get("notes", []))),
            "results": list(results.values())}


def _with_decodings_of(kept: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """`kept` with the runs of the decodings that only `other` measured (one part ran greedy, another sampled)."""
    have = {run["decoding"] for run in kept["runs"]}
    extra = [run for run in other["runs"] if run["decoding"] not in have]
    if not extra:
        return kept
    runs = kept["runs"] + extra
    peaks = [p for p in (kept["peak_gpu_bytes"], other["peak_gpu_bytes"]) if p is not None]
    return dict(kept, runs=runs, summary=summarize_runs(runs), peak_gpu_bytes=max(peaks, default=None))


def _fmt(v: Any, spec: str = ".2f", pct: bool = False, size: bool = False, depths: bool = False) -> str:
    if v is None:
        return "—"
    if depths:  # [[depth, verifications, mean verification ms], ...]
        return " ".join(f"{k}:{n} ({ms:.1f})" for k, n, ms in v)
    if size:  # three significant digits in the largest unit under the value (per-token sizes are small)
        return _format_size(v, ".3g")
    return f"{100 * v:.1f}%" if pct else format(v, spec)


def _pair(summary: dict[str, Any], key: str, decs: Sequence[str], **kw: Any) -> str:
    vals = [_fmt((summary.get(d) or {}).get(key), **kw) for d in decs]
    return " / ".join(vals) if any(v != "—" for v in vals) else "—"


def tpot_of(result: dict[str, Any], decoding: str) -> float | None:
    """A result's median TPOT (ms) for `decoding`; None where it measured none."""
    return (result["summary"].get(decoding) or {}).get("tpot_ms")


def _llama_rows(results: Sequence[dict[str, Any]], budget: str, decoding: str) -> list[dict[str, Any]]:
    """llama.cpp's results of a budget that measured `decoding` and whose measured peak (when known) fits it."""
    return [r for r in results if r["kind"] == "llama" and r["budget"] == budget and r["status"] == "ok"
            and (r["peak_gpu_bytes"] is None or r["peak_gpu_bytes"] <= (r["budget_bytes"] or math.inf))
            and tpot_of(r, decoding)]


def best_llama_setting(results: Sequence[dict[str, Any]], budget: str, decoding: str = "greedy") -> dict | None:
    """The fastest llama.cpp configuration of a budget whose measured peak (when known) fits it, synthetic
    acceptance left out (its output is invalid)."""
    cands = [r for r in _llama_rows(results, budget, decoding) if r["family"] != "llama-spec-synth"]
    return min(cands, key=lambda r: tpot_of(r, decoding), default=None)


def llama_best_tpot(results: Sequence[dict[str, Any]], budget: str, decoding: str,
                    synth_len: float | None = None) -> float | None:
    """llama.cpp's best TPOT (ms) at `budget` for `decoding`, the one a row of ours is held against: its
    `best_llama_setting` and, for a row at synthetic acceptance L (`synth_len`), its own speculation at the same
    L too. None where neither was measured."""
    best = best_llama_setting(results, budget, decoding)
    times = [tpot_of(best, decoding)] if best else []
    if synth_len is not None:
        times += [tpot_of(r, decoding) for r in _llama_rows(results, budget, decoding)
                  if r["family"] == "llama-spec-synth" and (r.get("params") or {}).get("synth_len") == synth_len]
    return min(times, default=None)


def _against_llama(r: dict[str, Any], results: Sequence[dict[str, Any]], decs: Sequence[str]) -> str:
    """The main table's "/ llama.cpp" cell: a row's TPOT over `llama_best_tpot` at its budget, L and decoding."""
    if r["status"] != "ok" or r.get("budget") is None:
        return "—"
    synth_len = (r.get("params") or {}).get("synth_len")
    vals = []
    for dec in decs:
        tpot, llama = tpot_of(r, dec), llama_best_tpot(results, r["budget"], dec, synth_len)
        vals.append(f"{tpot / llama:.2f}" if tpot and llama else "—")
    return " / ".join(vals) if any(v != "—" for v in vals) else "—"


# The second table's columns: (header, summary key, _fmt options); `ITER_KEYS` make up the iteration breakdown.
SPEC_COLUMNS = (
    ("Tokens/iter", "mean_accepted_len", {}),
    ("Drafted/iter", "drafted_per_iter", {}),
    ("Depth:iterations (verify ms)", "depths", {"depths": True}),
    ("Draft step ms", "draft_step_ms", {}),
    ("Prefetch precision", "prefetch_precision", {"pct": True}),
    ("Prefetch recall", "prefetch_recall", {"pct": True}),
    ("Late prefetches", "prefetch_late_share", {"pct": True}),
    ("Refused/iter", "prefetch_refused_per_iter", {"spec": ".1f"}),
    ("Cache slots", "cache_slots", {"spec": ".0f"}),
    ("Moved/token", "bytes_moved_per_token", {"size": True}),
    ("Draft ms/iter", "iter_draft_ms", {}),
    ("Verify ms/iter", "iter_verify_ms", {}),
    ("Copy wait ms/iter", "iter_copy_exposed_ms", {}),
    ("Other ms/iter", "iter_other_ms", {}),
    ("CPU experts ms/token", "cpu_experts_ms_per_token", {}),
    ("Copies ms/token", "copy_ms_per_token", {}),
    ("CPU wait ms/token", "cpu_wait_ms_per_token", {}),
    ("GPU ms/token", "gpu_ms_per_token", {}),
)
SPEC_KEYS = tuple(key for _, key, _ in SPEC_COLUMNS
                  if key not in ("mean_accepted_len", "drafted_per_iter", "depths"))


def _speculation_table(res: Sequence[dict[str, Any]], decs: Sequence[str]) -> list[str]:
    """Lines of the report's second table: the speculative systems (llama.cpp's with empty cells where it
    reports nothing) and any system with one of our engine's prefetch, data-movement or iteration figures."""
    rows = [r for r in res if r["status"] == "ok" and ("spec" in r["family"] or any(
        ((r.get("summary") or {}).get(d) or {}).get(k) is not None for d in decs for k in SPEC_KEYS))]
    if not rows:
        return []
    lines = [
        (f"Speculation and data movement (values `{' / '.join(decs)}`; our engine's counts summed over prompts, "
         "then divided; llama.cpp reports none of these). Tokens/iter: tokens committed per verification pass, the "
         "target's own included; Drafted/iter: tokens drafted for it. Depth: the verifications of each draft depth "
         "and their mean time in ms (where depth auto settles; depth 0 is a plain step of the target). Draft step: one drafted token's forward. Prefetch "
         "precision: prefetched experts "
         "the verification used / experts prefetched; recall: the same / experts the verifications used that were "
         "prefetched or read in place (what they would have missed without the lookahead). Late prefetches: "
         "prefetched experts whose copy had not landed when the verification began (read in place). Refused/iter: "
         "experts the lookahead counted that found no evictable slot, per iteration. Cache slots: the target's "
         "expert cache, a slot per expert of one layer (spare slots included): what the budget leaves it beside the "
         "fixed part and, with a draft, the draft's experts. "
         "Moved/token: expert bytes over PCIe (copied plus read in place) per prompt or generated token. Per "
         "iteration (verification pass): drafting, verification, other decode time (host work between them, plain "
         "steps); copy wait: compute waiting for expert copies (whole generation, prefill included), mostly inside "
         "verification. Utilisation per generated token: CPU experts, the time the CPU spent computing missed "
         "experts (--hybrid); copies, the time the copy stream spent on expert copies (prefill included); beside "
         "TPOT they are the CPU's and the link's busy shares (reads in place are in Moved/token, not timed); CPU "
         "wait, the time the GPU's forwards waited for the CPU's experts; GPU, the GPU's time in the decode forwards "
         "per decode step (CUDA events around its steps, or its drafting and verification), beside TPOT its busy "
         "share, its waits for copies and the CPU included."),
        "",
        "| System | Setting | Budget | " + " | ".join(h for h, _, _ in SPEC_COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(SPEC_COLUMNS),
    ]
    for r in rows:
        s = r.get("summary") or {}
        lines.append("| " + " | ".join([r["family"], r["setting"].replace("|", "\\|"), r.get("budget") or "no limit",
                                         *(_pair(s, key, decs, **kw) for _, key, kw in SPEC_COLUMNS)]) + " |")
    return [*lines, ""]


def _warmup_words(meta: dict[str, Any]) -> str:
    """How the report names the warm-ups: on a prompt not measured, each decoding's prompts after it (from
    2026-12-06); before, on the first measured prompt, each prompt's decodings in turn."""
    if meta.get("warmup_prompt"):
        return (f" on a prompt not measured (`{meta['warmup_prompt']}`), then each decoding's prompts in turn (no "
                "generation follows one of its own prompt)")
    return " on the first measured prompt, then each prompt under each decoding"


def render_markdown(doc: dict[str, Any], images: Sequence[str] = ()) -> str:
    """One report section: a header (date, GPU, model, budgets, command), the main table, the speculation and
    data-movement table, notes and plots."""
    m = doc["meta"]
    res = doc["results"]
    decs = m.get("decodings", ["greedy", "sampled"])
    lines = [f"### {m.get('date', '?')} — {m.get('model_label', m.get('model', '?'))}", ""]
    gpu = m.get("gpu") or {}
    lines += [
        f"- GPU: {gpu.get('gpu') or 'none'}" + (f" ({gpu.get('gpu_memory')}, driver {gpu.get('driver')})" if gpu.get("gpu") else "")
        + f"; host CPU: {gpu.get('cpu', '?')}",
        f"- Model: `{Path(m.get('model', '?')).name}` ({format_size(m.get('model_bytes'))}, random weights)"
        + (f"; draft: `{Path(m['draft']).name}` ({format_size(m.get('draft_bytes'))})" if m.get("draft") else ""),
        f"- Budgets: {', '.join(f'{b} ({format_size(v)})' for b, v in (m.get('budgets') or {}).items()) or 'none'}",
        f"- Prompts: {m.get('n_prompts')} (ids via {m.get('tokenized_by', '?')}), {m.get('n_predict')} generated "
        f"tokens each, after one warm-up per decoding{_warmup_words(m)}; decodings: {' / '.join(decs)} (sampled: "
        f"temperature 1, top-k 40, top-p 0.95, min-p 0.05, seed {m.get('seed')} + prompt index)",
        f"- llama.cpp: {m.get('llama_version') or 'not run'}; context {m.get('ctx_size')} tokens",
        *([f"- **PCIe paced to {m['pcie_gbps']:g} GB/s** for ours (a wait after each expert copy and each layer's reads "
           "in place, for the bytes' time at that rate beyond this machine's: `--pcie-gbps`); llama.cpp unpaced (its "
           "decode moves no expert over the link: `-ncmoe` experts run on the CPU)"] if m.get("pcie_gbps") else []),
        *([f"- **{m['spare_slots']} spare slots a layer** for ours-lru, ours-lru-hybrid and the speculative rows "
            "(`--spare-slots`)"]
          if m.get("spare_slots") is not None else []),
        f"- Command: `{m.get('command', '?')}`",
        "",
        f"Values are `{' / '.join(decs)}`. TPOT: median over prompts of decode time per generated token after the "
        "first; tok/s = 1000 / TPOT. / llama.cpp: TPOT over llama.cpp's best at the same budget and decoding (its "
        "fastest setting that fits, synthetic acceptance left out; for a row at synthetic L, its own speculation at "
        "that L too). Prefill: median over prompts of the time to the first generated token "
        "(the same prompts for every system; llama-server's prompt_ms, its prompt cache off). Peak GPU: device "
        "memory in use above idle (nvidia-smi; includes the CUDA context); for ours, torch's peak allocation in "
        "brackets (the rows of one draft and budget run in one process, loaded once, and share its peak). Fits: "
        "measured peak within the budget.",
        "",
        "| System | Setting | Budget | TPOT ms | tok/s | / llama.cpp | Prefill ms | Peak GPU | Fits | Acceptance "
        "| Hit rate | Bytes/token | Hidden copy | Prompts | Note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res:
        s = r.get("summary") or {}
        peak = format_size(r.get("peak_gpu_bytes"))
        if r.get("torch_peak_bytes") is not None:
            peak += f" ({format_size(r['torch_peak_bytes'])})"
        fits = "—"
        if r.get("peak_gpu_bytes") is not None and r.get("budget_bytes"):
            fits = "yes" if r["peak_gpu_bytes"] <= r["budget_bytes"] else "**no**"
        elif r.get("peak_gpu_bytes") is not None and r.get("budget") is None:
            fitting = [b for b, v in (m.get("budgets") or {}).items() if r["peak_gpu_bytes"] <= v]
            fits = ", ".join(fitting) if fitting else "none"
        nprompts = "/".join(str((s.get(d) or {}).get("n_prompts", 0)) for d in decs)
        note = r.get("note") or ""
        if r["status"] != "ok":
            err = (r.get("error") or r["status"]).strip().splitlines()
            note = f"**{r['status']}**: {err[0][:200] if err else ''}" + (f" ({note})" if note else "")
        bpt = _pair(s, "bytes_per_token", decs, spec=".3g")
        lines.append("| " + " | ".join([
            r["family"], r["setting"].replace("|", "\\|"), r.get("budget") or "no limit",
            _pair(s, "tpot_ms", decs), _pair(s, "tokens_per_s", decs, spec=".1f"), _against_llama(r, res, decs),
            _pair(s, "prefill_ms", decs),
            peak, fits,
            _pair(s, "acceptance", decs, pct=True), _pair(s, "cache_hit_rate", decs, pct=True), bpt,
            _pair(s, "hidden_copy_share", decs, pct=True), nprompts, note.replace("|", "\\|").replace("\n", " "),
        ]) + " |")
    lines.append("")
    lines += _speculation_table(res, decs)
    real = [r for r in res if r["family"] in ("llama-spec", "ours-spec") and r["status"] == "ok"]
    synth = [r for r in res if "spec-synth" in r["family"]]
    if synth:
        acc = ", ".join(f"{r['family']} {r['budget']}: {_pair(r['summary'], 'acceptance', decs, pct=True)}"
                        for r in real) or "not measured"
        n_max = next((r["params"].get("draft_n_max") for r in synth if r["params"].get("draft_n_max")), 8)
        lines.append("Rows with `L=` use synthetic acceptance (llama.cpp's `--spec-synth-len L`: each drafted token "
                     "is kept at random with probability p once the one before it was, p such that a depth of "
                     f"`--spec-draft-n-max` {n_max} keeps a mean of L tokens per verification, the target's included; "
                     "the output is invalid, the compute and data movement are real). llama.cpp and "
                     f"ours-spec-synth-fixed(-hybrid) draft {n_max} tokens an iteration (fewer where no more tokens "
                     "are wanted), ours-spec-synth(-hybrid) chooses its depth (auto, as a draft of per-token "
                     "acceptance p would be run). Real acceptance of "
                     f"the same draft on this model ({' / '.join(decs)}): {acc}.")
        lines.append("")
    for b in m.get("budgets") or {}:
        best = best_llama_setting(res, b)
        if best:
            lines.append(f"Best llama.cpp setting within {b} (greedy): {best['family']} {best['setting']}, "
                         f"TPOT {best['summary']['greedy']['tpot_ms']:.2f} ms.")
    for n in doc.get("notes", []):
        lines.append(f"- Not run: {n}")
    lines.append("")
    for img in images:
        lines.append(f"![{Path(img).stem}]({img})")
    if images:
        lines.append("")
    return "\n".join(lines) + "\n"


def append_report(report: str | Path, section: str) -> None:
    """Append a section to the report (created with a header if missing)."""
    report = Path(report)
    report.parent.mkdir(parents=True, exist_ok=True)
    if not report.exists():
        report.write_text("# Benchmarks\n\nSections are appended by `scripts/bench.py`.\n\n")
    with open(report, "a", encoding="utf-8") as f:
        f.write("\n" + section)


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
