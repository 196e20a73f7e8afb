"""Running the systems of a matrix, one after another, each over the same prompts (`run_prompt_set`): a llama.cpp
system is a llama-server started, waited for (``/health``) and killed in a ``finally``; ours run in a worker
subprocess (``python -m specter_gguf.bench.worker JOB.json``) so that a crash, a hang or CUDA memory left behind
cannot affect the next system, one worker for consecutive rows that load alike (`ours.OursMode`: the real and
synthetic acceptance rows of one draft and budget), whose peak GPU memory they then share. A failing system records
its error and the matrix goes on."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from specter_gguf.bench import REPO_ROOT
from specter_gguf.bench.gpu import GpuMemoryMonitor
from specter_gguf.bench.llamacpp import LlamaServer, llama_server_args
from specter_gguf.bench.matrix import SystemSpec
from specter_gguf.bench.metrics import summarize_runs
from specter_gguf.bench.process import kill_group, tail
from specter_gguf.bench.prompts import Prompt
from specter_gguf.bench.report import format_size
from specter_gguf.errors import SpecterError

MIN_SYSTEM_S = 30  # a system is started only with this much time left before the --deadline


@dataclass
class RunSettings:
    n_predict: int
    decodings: tuple[str, ...] = ("greedy", "sampled")
    seed: int = 1234
    seconds_per_system: float = 60.0  # decode time after which no further prompt is started
    warmup_tokens: int = 32


def run_prompt_set(generate: Callable[[list[int], int, str, int], dict[str, Any]], prompts: Sequence[Prompt],
                   rs: RunSettings, log: Callable[[str], None] = lambda s: None,
                   warmup: Prompt | None = None) -> tuple[list[dict], str]:
    """Decoding by decoding: one warm-up generation of `warmup` (ours captures the CUDA graphs of each decoding:
    sampled steps are other graphs than greedy ones), then every prompt, until the decoding's share of the time
    allowance is spent (at least one prompt always runs). A measured generation thus follows another prompt's, as
    a new prompt meets an expert cache that served other text: never a generation of its own prompt, whose experts
    it would find in place (`warmup` None: the first prompt warms up, and its measured runs are flattered).
    Returns the run records and a note when prompts were left out."""
    runs: list[dict] = []
    warm = prompts[0] if warmup is None else warmup
    done = len(prompts)
    for dec in rs.decodings:
        w = generate(warm.ids, min(rs.n_predict, rs.warmup_tokens), dec, rs.seed)
        w.update(prompt_id=warm.id, decoding=dec, warmup=True, tokens=[])
        runs.append(w)
        start = time.monotonic()
        for i, p in enumerate(prompts):
            if i > 0 and time.monotonic() - start > rs.seconds_per_system / len(rs.decodings):
                done = min(done, i)
                break
            seed = rs.seed + i
            r = generate(p.ids, rs.n_predict, dec, seed)
            r.update(prompt_id=p.id, decoding=dec, seed=seed, warmup=False)
            if dec != "greedy":
                r["tokens"] = []  # keep greedy outputs only (for cross-system checks)
            runs.append(r)
            log(f"    {p.id:<18} {dec:<8} {r['generated_tokens']:4d} tok  TPOT {r.get('tpot_ms') or 0:8.2f} ms")
    note = "" if done == len(prompts) else f"time allowance: {done} of {len(prompts)} prompts"
    return runs, note


@dataclass
class BenchContext:
    model: str
    model_label: str
    prompts: list[Prompt]
    settings: RunSettings
    out_dir: Path
    ctx_size: int = 1024
    device: str = "cuda"
    llama_bin: Path | None = None
    threads: int | None = None
    job_timeout: float = 600.0
    deadline: float | None = None  # time.monotonic() value after which no system starts
    log: Callable[[str], None] = print
    pcie_gbps: float | None = None  # ours' expert transfers paced to this rate (OffloadRuntime.pace_transfers)
    warmup: Prompt | None = None  # the warm-ups' prompt, one not measured (`run_prompt_set`)
    spare_slots: int | None = None  # --spare-slots of ours-lru, ours-lru-hybrid, speculative rows (None: the engine's)

    def remaining(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()


def _result(spec: SystemSpec) -> dict[str, Any]:
    return {"family": spec.family, "kind": spec.kind, "setting": spec.setting,
            "budget": spec.budget.label if spec.budget else None,
            "budget_bytes": spec.budget.bytes if spec.budget else None,
            "params": spec.params, "est_gpu_bytes": spec.est_gpu_bytes, "note": spec.note,
            "status": "ok", "error": None, "runs": [], "summary": {}, "peak_gpu_bytes": None,
            "torch_peak_bytes": None, "load_s": None, "wall_s": None}


def run_system(spec: SystemSpec, ctx: BenchContext) -> dict[str, Any]:
    """Run one system; never raises (errors are recorded in the result)."""
    return run_systems([spec], ctx)[0]


def run_systems(specs: Sequence[SystemSpec], ctx: BenchContext) -> list[dict[str, Any]]:
    """Run one llama.cpp system, or rows of ours that load alike in one worker (`ours.OursMode`); never raises
    (errors are recorded in the results)."""
    results = [_result(spec) for spec in specs]
    if ctx.remaining() < MIN_SYSTEM_S:
        for res in results:
            res.update(status="skipped", error=f"skipped: fewer than {MIN_SYSTEM_S} s were left before the run's "
                       "--deadline")
        return results
    t0 = time.monotonic()
    for spec in specs:
        ctx.log(f"== {spec.key}")
    try:
        if specs[0].kind == "llama":
            _run_llama(specs[0], ctx, results[0])
        else:
            _run_ours(specs, ctx, results)
    except Exception as e:  # noqa: BLE001 - a failed system must not stop the matrix
        msg = str(e).strip() or type(e).__name__
        for res in results:
            if res["error"] is None and not res["runs"]:
                res["error"] = f"{type(e).__name__}: {msg}" if not isinstance(e, SpecterError) else msg
    for spec, res in zip(specs, results):
        if res["error"] is None and not any(not r.get("warmup") for r in res["runs"]):
            res["error"] = "no measured run"
        if res["error"] is not None:
            res["status"] = "error"
            ctx.log(f"   {spec.key} FAILED: {res['error'][:2000]}")
        res["summary"] = summarize_runs([r for r in res["runs"] if not r.get("warmup")])
        if res["wall_s"] is None:
            res["wall_s"] = time.monotonic() - t0
        for dec, sm in res["summary"].items():
            ctx.log(f"   {spec.key}: {dec}: TPOT {sm['tpot_ms'] or 0:.2f} ms, {sm['tokens_per_s'] or 0:.1f} tok/s over "
                    f"{sm['n_prompts']} prompts"
                    + (f", acceptance {sm['acceptance']:.1%}" if sm.get("acceptance") is not None else ""))
        if res["peak_gpu_bytes"] is not None:
            ctx.log(f"   peak GPU memory {format_size(res['peak_gpu_bytes'])}")
    return results


def _run_llama(spec: SystemSpec, ctx: BenchContext, res: dict[str, Any]) -> None:
    if ctx.llama_bin is None:
        raise SpecterError("no llama.cpp tools (give --llama-bin or let bench.py build them)")
    binary = ctx.llama_bin / "llama-server"
    if not binary.exists():
        raise SpecterError(f"{binary} not found")
    args = llama_server_args(spec, ctx.model, ctx.ctx_size, ctx.threads)
    slug = _slug(spec)
    budget_s = min(ctx.job_timeout, ctx.remaining())
    t_start = time.monotonic()
    mon = GpuMemoryMonitor().start()
    try:
        with LlamaServer(binary, args, ctx.out_dir / "logs" / f"{slug}.log",
                         ready_timeout=min(300.0, budget_s)) as srv:
            res["command"] = shlex.join(srv.command[:-4])
            res["load_s"] = time.monotonic() - t_start

            def gen(ids: list[int], n: int, dec: str, seed: int) -> dict[str, Any]:
                left = budget_s - (time.monotonic() - t_start)
                if left <= 5:
                    raise SpecterError(f"job timeout ({ctx.job_timeout:.0f} s or the deadline) reached")
                return srv.complete(ids, n, dec, seed, timeout=left)

            runs, note = run_prompt_set(gen, ctx.prompts, _clip_settings(ctx, budget_s, t_start), ctx.log, ctx.warmup)
            res["runs"] = runs
            if note:
                res["note"] = "; ".join(x for x in (res["note"], note) if x)
            mon.sample()
    finally:
        res["peak_gpu_bytes"] = mon.stop()


def _clip_settings(ctx: BenchContext, budget_s: float, t_start: float) -> RunSettings:
    """The per-system time allowance, shortened so that the job ends well within its timeout."""
    left = budget_s - (time.monotonic() - t_start)
    return dataclasses.replace(ctx.settings, seconds_per_system=min(ctx.settings.seconds_per_system, 0.5 * left))


def _slug(spec: SystemSpec) -> str:
    """A file name for the system's logs and results: its key, with a hash of the whole key where the name is cut
    (two long settings that differ only at the end, e.g. in L=, would share one otherwise)."""
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.key)
    if len(slug) <= 120:
        return slug
    return f"{slug[:111]}-{hashlib.sha1(spec.key.encode()).hexdigest()[:8]}"


def _run_ours(specs: Sequence[SystemSpec], ctx: BenchContext, results: list[dict[str, Any]]) -> None:
    """The rows `specs` in one worker process: one load, then each row (`worker`); fills `results` row by row."""
    budget_s = min(ctx.job_timeout * len(specs), ctx.remaining())
    work = ctx.out_dir / "logs"
    work.mkdir(parents=True, exist_ok=True)
    first = specs[0]
    rows = [{"key": spec.key, "mode": spec.params["mode"], "synth_len": spec.params.get("synth_len"),
             "result": str(work / f"{_slug(spec)}.result.json")} for spec in specs]
    for row in rows:
        Path(row["result"]).unlink(missing_ok=True)
    job = {"model": ctx.model, "device": ctx.device, "ctx_size": ctx.ctx_size,
           "budget_bytes": first.budget.bytes if first.budget else None, "draft": first.params.get("draft"),
           "draft_n_max": first.params.get("draft_n_max"), "rows": rows,
           "prompts": [dataclasses.asdict(p) for p in ctx.prompts],
           "warmup": dataclasses.asdict(ctx.warmup) if ctx.warmup else None,
           "settings": dataclasses.asdict(ctx.settings) | {"decodings": list(ctx.settings.decodings)},
           "time_budget_s": budget_s, "pcie_gbps": ctx.pcie_gbps, "spare_slots": ctx.spare_slots}
    job_path = work / f"{_slug(first)}.job.json"
    job_path.write_text(json.dumps(job))
    log_path = work / f"{_slug(first)}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "specter_gguf.bench.worker", str(job_path)]
    shared = f", one load for {len(specs)} rows" if len(specs) > 1 else ""
    for res, spec in zip(results, specs):
        res["command"] = f"specter_gguf.bench.worker ({spec.params['mode']}, device {ctx.device}{shared})"
    mon = GpuMemoryMonitor(enabled=ctx.device.startswith("cuda")).start()
    killed = None
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=str(REPO_ROOT), env=env, start_new_session=True)
            try:
                proc.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.wait(timeout=30)
                killed = f"worker killed after {budget_s:.0f} s (job timeout or deadline):\n{tail(log_path)}"
            finally:
                if proc.poll() is None:
                    kill_group(proc)
    finally:
        peak = mon.stop()  # the process's: its rows share the device
    for row, res in zip(rows, results):
        res["peak_gpu_bytes"] = peak
        out = Path(row["result"])
        if not out.exists():
            res["error"] = killed or f"worker exited with code {proc.returncode} and no result:\n{tail(log_path)}"
            continue
        w = json.loads(out.read_text())
        res["runs"] = w.get("runs", [])
        res["torch_peak_bytes"] = w.get("torch_peak_bytes")
        res["load_s"] = w.get("load_s")
        res["wall_s"] = w.get("row_s")
        if w.get("note"):
            res["note"] = "; ".join(x for x in (res["note"], w["note"]) if x)
        if w.get("error"):
            res["error"] = w["error"]


def _load_group(spec: SystemSpec) -> tuple[Any, ...] | None:
    """Rows of ours with the same key load alike (`ours.OursMode`); None: a system of its own."""
    from specter_gguf.bench.ours import OURS_MODES

    if spec.kind != "ours":
        return None
    return (OURS_MODES[spec.params["mode"]].load, spec.budget.label if spec.budget else None,
            spec.params.get("draft"), spec.params.get("draft_n_max"))


def run_matrix(specs: Sequence[SystemSpec], ctx: BenchContext,
               on_result: Callable[[dict[str, Any]], None] = lambda r: None) -> list[dict[str, Any]]:
    """Every system in order; consecutive rows of ours that load alike run in one worker."""
    results: list[dict[str, Any]] = []
    i = 0
    while i < len(specs):
        key, j = _load_group(specs[i]), i + 1
        while key is not None and j < len(specs) and _load_group(specs[j]) == key:
            j += 1
        for r in run_systems(specs[i:j], ctx):
            results.append(r)
            on_result(r)
        i = j
    return results
