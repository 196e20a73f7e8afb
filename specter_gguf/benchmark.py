"""Benchmark library: the systems compared, how they are run and measured, and how results are reported.

`scripts/bench.py` is the driver; everything it does lives here so that it can be tested on the CPU.

What is measured, per system (one configuration of llama.cpp or of our engine) on one model file:
- the same prompts (``scripts/bench_prompts.json``, as token ids: every system is fed identical ids),
  the same number of generated tokens (end-of-generation tokens are ignored everywhere, so every run
  generates exactly ``n_predict`` tokens), greedy and sampled decoding (temperature 1, top-k 40, top-p 0.95,
  min-p 0.05 on both sides, seed ``seed + prompt index``);
- one warm-up generation first (not counted), then TPOT per prompt = decode time / (generated - 1), the
  same definition as llama-server's ``predicted_per_token_ms`` and our ``GenerationStats.tpot_ms``;
  a system's TPOT is the median over prompts, its tokens/s is ``1000 / TPOT``;
- peak GPU memory: ``nvidia-smi`` device memory in use above the idle level measured just before the
  system started (its own process only, since systems run one at a time; includes the CUDA context), and for
  ours also ``torch.cuda.max_memory_allocated``;
- where the system reports them: draft acceptance (llama-server ``timings.draft_n`` /
  ``draft_n_accepted``; ours: see :data:`STAT_COUNTS`), expert-cache hit rate, bytes copied per token and
  the share of copy time hidden behind compute;
- for ours, where the stats carry them (a second report table, see :data:`SPEC_COLUMNS`): tokens per
  verification pass, prefetch precision (prefetched experts the verification used / prefetched) and recall
  (used and prefetched / experts the verifications used that were prefetched or read in place), the share of
  prefetches that landed after their verification began, counted experts refused a slot per iteration, expert
  bytes moved over PCIe per processed token (copied plus read in place, prompt and generated tokens), the
  draft step time (drafting time / drafted tokens) and the speculative iteration in ms per verification
  pass: drafting, verification, the exposed copy time (compute waiting for copies) and the other decode time
  (outside drafting and verification).

Our engine's statistics contract: a ``Generation.stats`` object may carry, besides the timings, any of the
count fields of :data:`STAT_COUNTS`, :data:`STAT_MS` and :data:`STAT_BYTES` (summed over prompts, then
divided) or the rate fields of :data:`STAT_RATES` (median over prompts, used where the counts are missing).
Missing fields simply leave the column empty.

Systems run one after another; each llama.cpp process is started, waited for (``/health``) and killed in a
``finally``; ours run in a worker subprocess (``python -m specter_gguf.benchmark worker JOB.json``) so that a
crash, a hang or CUDA memory left behind cannot affect the next system. A failing system records its error
and the matrix goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import fnmatch
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .engine import tpot_ms
from .errors import SpecterError
from .runtime.budget import GiB, MiB, parse_size
from .runtime.budget import format_size as _format_size

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS_FILE = REPO_ROOT / "scripts" / "bench_prompts.json"

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
# ... or ready-made per-generation rates (median over prompts).
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
}
# bytes over PCIe during a generation, prefill included, summed and divided by prompt + generated tokens:
# copied host->GPU (`bytes_copied_per_token`), and moved = copied + read in place by the kernels
# (`bytes_moved_per_token`). The first field must be present; the others count as 0 when missing.
STAT_BYTES = {
    "bytes_per_token": ("bytes_copied",),
    "bytes_moved_per_token": ("bytes_copied", "zero_copy_bytes"),
}


# =========================================================================================== sizes
def format_size(n: float | None) -> str:
    """The report's sizes: "12.3 GiB" (sizes under 1 GiB in MiB); "—" for None."""
    return _format_size(n, ".1f", smallest="MiB", none="—")


@dataclass(frozen=True)
class Budget:
    """A GPU memory budget: its label as given and its size in bytes."""

    label: str
    bytes: int

    @property
    def gib(self) -> float:
        return self.bytes / GiB


def parse_budgets(text: str, model_bytes: int | None = None) -> list[Budget]:
    """Comma-separated budgets: absolute sizes ("16GiB,20GiB") or shares of the target model's file size
    ("50%,70%", handy with --layers); the latter need `model_bytes`."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        if part.endswith("%"):
            if model_bytes is None:
                raise SpecterError(f"budget {part!r} is relative to the model's size, which is not known yet")
            try:
                share = float(part[:-1]) / 100.0
            except ValueError:
                raise SpecterError(f"cannot read the budget {part!r}: write e.g. 60%") from None
            if share <= 0:
                raise SpecterError(f"budget {part!r} must be positive")
            out.append(Budget(part, int(model_bytes * share)))
        else:
            b = parse_size(part)
            if b <= 0:
                raise SpecterError(f"budget {part!r} must be positive")
            out.append(Budget(part.replace(" ", ""), b))
    return out


# ========================================================================================= metrics
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
        processed = sum(int(r.get("prompt_tokens") or 0) + int(r.get("generated_tokens") or 0) for r in rs)
        for metric, keys in STAT_BYTES.items():  # per processed token, as GenerationStats.bytes_*_per_token
            if any(keys[0] in e for e in extra):
                s[metric] = _ratio(sum(_total(extra, k) for k in keys), processed)
        for metric, key in STAT_RATES.items():
            if metric not in s and any(key in e for e in extra):
                s[metric] = median(e.get(key) for e in extra)
        out[dec] = s
    return out


# ========================================================================================= prompts
@dataclass
class Prompt:
    id: str
    kind: str
    text: str
    ids: list[int] = field(default_factory=list)


def load_prompts(path: str | Path = PROMPTS_FILE, n: int | None = None) -> list[Prompt]:
    """The first `n` prompts, taken round-robin over kinds (code, math, prose, chat, code, ...) so that a
    short run still sees every kind."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    by_kind: dict[str, list[dict]] = {}
    for p in data["prompts"]:
        by_kind.setdefault(p["kind"], []).append(p)
    order: list[dict] = []
    queues = [list(v) for v in by_kind.values()]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    if n is not None:
        if n < 1:
            raise SpecterError("--prompts must be at least 1")
        order = order[:n]
    return [Prompt(p["id"], p["kind"], p["text"]) for p in order]


def vocab_fingerprint(gguf_path: str | Path) -> str:
    """A short hash of every tokenizer.* key of a GGUF: equal fingerprints tokenize identically."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path), "r")
    h = hashlib.sha256()
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        f = reader.fields[key]
        h.update(key.encode())
        for i in f.data:
            h.update(bytes(f.parts[i]))
    return h.hexdigest()[:16]


def stored_token_ids(prompts_path: str | Path, fingerprint: str) -> dict[str, list[int]]:
    data = json.loads(Path(prompts_path).read_text(encoding="utf-8"))
    return {k: list(v) for k, v in data.get("token_ids", {}).get(fingerprint, {}).items()}


def store_token_ids(prompts_path: str | Path, vocab_gguf: str | Path) -> tuple[str, int]:
    """Tokenize every prompt with llama.cpp's tokenizer (llama-cpp-python) of `vocab_gguf` and store the ids
    in the prompts file under the vocab's fingerprint. Returns (fingerprint, prompts stored)."""
    from .tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(vocab_gguf)
    path = Path(prompts_path)
    data = json.loads(path.read_text(encoding="utf-8"))
    fp = vocab_fingerprint(vocab_gguf)
    data.setdefault("token_ids", {})[fp] = {p["id"]: tok.encode(p["text"]) for p in data["prompts"]}
    path.write_text(_compact_json(data), encoding="utf-8")  # one prompt per line keeps it readable
    return fp, len(data["prompts"])


def _compact_json(data: dict) -> str:
    lines = ["{"]
    lines.append(f' "description": {json.dumps(data["description"], ensure_ascii=False)},')
    lines.append(' "prompts": [')
    lines.append(",\n".join("  " + json.dumps(p, ensure_ascii=False) for p in data["prompts"]))
    lines.append(" ],")
    lines.append(' "token_ids": {')
    blocks = []
    for fp, ids in data.get("token_ids", {}).items():
        inner = ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in ids.items())
        blocks.append(f"  {json.dumps(fp)}: {{\n{inner}\n  }}")
    lines.append(",\n".join(blocks))
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def server_tokenizer(llama_bin: Path | None, model: str | Path, log_path: Path):
    """A tokenize function backed by a llama-server on `model` (CPU only, started on first use)."""
    holder: dict[str, LlamaServer] = {}

    def tok(text: str) -> list[int]:
        if llama_bin is None:
            raise SpecterError("no llama-server to tokenize with")
        if "srv" not in holder:
            srv = LlamaServer(llama_bin / "llama-server", ["-m", str(model), "-ngl", "0", "--fit", "off",
                                                           "--no-warmup", "-c", "512", "-np", "1"], log_path)
            holder["srv"] = srv.__enter__()
        return holder["srv"].tokenize(text)

    try:
        yield tok
    finally:
        if "srv" in holder:
            holder["srv"].stop()


def tokenize_prompts(prompts: list[Prompt], model_path: str | Path, prompts_path: str | Path = PROMPTS_FILE,
                     server_tokenize: Callable[[str], list[int]] | None = None) -> str:
    """Fill `Prompt.ids` for `model_path`'s vocabulary: with llama-cpp-python where importable, else from the
    ids stored in the prompts file for this vocabulary, else with `server_tokenize` (llama-server's
    /tokenize). Returns how it was done."""
    try:
        import llama_cpp  # noqa: F401
        have_llama_cpp = True
    except ImportError:
        have_llama_cpp = False
    if have_llama_cpp:
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(model_path)
        for p in prompts:
            p.ids = tok.encode(p.text)
        return "llama-cpp-python"
    stored = stored_token_ids(prompts_path, vocab_fingerprint(model_path))
    if all(p.id in stored for p in prompts):
        for p in prompts:
            p.ids = stored[p.id]
        return "stored ids"
    if server_tokenize is None:
        raise SpecterError("cannot tokenize the prompts: llama-cpp-python is not installed, the prompts file "
                           "holds no ids for this vocabulary, and no llama-server is available")
    for p in prompts:
        p.ids = server_tokenize(p.text)
    return "llama-server /tokenize"


# ===================================================================================== GGUF sizes
EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")  # llama.cpp's -ncmoe regex
CPU_ONLY_TENSORS = ("token_embd.weight",)  # llama.cpp keeps the input layer on the CPU


@dataclass
class ModelSizes:
    """Where a GGUF's bytes go under llama.cpp with ``-ngl all -ncmoe N``."""

    path: str
    arch: str
    n_layer: int
    file_bytes: int
    cpu_only_bytes: int  # token embeddings
    nonexpert_bytes: int  # everything else that is not a routed expert (GPU-resident)
    expert_bytes: list[int]  # routed experts per layer
    kv_bytes_per_token: int  # F16 K+V over all layers

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ModelSizes":
        import gguf

        reader = gguf.GGUFReader(str(path), "r")

        def meta(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            if f is None:
                return default
            v = f.contents()
            return v

        arch = meta("general.architecture")
        n_layer = int(meta(f"{arch}.block_count"))
        experts = [0] * n_layer
        cpu_only = nonexpert = 0
        for t in reader.tensors:
            m = EXPERT_RE.match(t.name)
            if m:
                experts[int(m.group(1))] += int(t.n_bytes)
            elif t.name in CPU_ONLY_TENSORS:
                cpu_only += int(t.n_bytes)
            else:
                nonexpert += int(t.n_bytes)
        n_embd = int(meta(f"{arch}.embedding_length"))
        n_head = meta(f"{arch}.attention.head_count")
        n_head_kv = meta(f"{arch}.attention.head_count_kv", n_head)

        def per_layer(v: Any) -> list[int]:
            return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)] * n_layer

        heads, heads_kv = per_layer(n_head), per_layer(n_head_kv)
        k_len = meta(f"{arch}.attention.key_length")
        v_len = meta(f"{arch}.attention.value_length")
        kv = 0
        for h, hkv in zip(heads, heads_kv):
            hd_k = int(k_len) if k_len is not None else n_embd // h
            hd_v = int(v_len) if v_len is not None else n_embd // h
            kv += hkv * (hd_k + hd_v) * 2
        return cls(str(path), arch, n_layer, Path(path).stat().st_size, cpu_only, nonexpert, experts, kv)

    def gpu_bytes(self, n_cpu_moe: int, ctx_size: int) -> int:
        """Weights on the GPU with the experts of layers < n_cpu_moe on the CPU, plus the KV cache."""
        n = max(0, min(n_cpu_moe, self.n_layer))
        return self.nonexpert_bytes + sum(self.expert_bytes[n:]) + self.kv_bytes_per_token * ctx_size


def smallest_ncmoe(budget_bytes: int, target: ModelSizes, ctx_size: int, margin_bytes: int,
                   draft: ModelSizes | None = None, draft_margin_bytes: int = 0) -> int | None:
    """The smallest -ncmoe N whose estimated GPU memory (target weights kept on the GPU + KV + margin, plus
    the whole draft with its KV and margin) fits `budget_bytes`; None if even N = n_layer does not fit."""
    fixed = margin_bytes
    if draft is not None:
        fixed += draft.gpu_bytes(0, ctx_size) + draft_margin_bytes
    for n in range(target.n_layer + 1):
        if target.gpu_bytes(n, ctx_size) + fixed <= budget_bytes:
            return n
    return None


# ===================================================================================== GPU memory
def gpu_info() -> dict[str, Any]:
    """Name, driver and memory of the GPU nvidia-smi sees first; on a machine without one, the CPU."""
    info: dict[str, Any] = {"gpu": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader",
                                  "-i", gpu_index()], capture_output=True, text=True, timeout=20).stdout.strip()
            name, driver, total = [x.strip() for x in out.splitlines()[0].split(",")]
            info.update(gpu=name, driver=driver, gpu_memory=total)
        except Exception as e:  # noqa: BLE001
            info["gpu_error"] = str(e)
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info["cpu"] = f"{cpu} ({os.cpu_count()} threads)"
    return info


def gpu_index() -> str:
    v = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return v if v.isdigit() else "0"


class GpuMemoryMonitor:
    """Peak device memory in use (nvidia-smi, every 100 ms) above the level just before `start`.
    Without nvidia-smi every figure is None."""

    def __init__(self, interval_ms: int = 100, enabled: bool = True) -> None:
        self.smi = shutil.which("nvidia-smi") if enabled else None
        self.interval_ms = interval_ms
        self.baseline_mib: float | None = None
        self.peak_mib: float | None = None
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _query(self) -> float | None:
        if not self.smi:
            return None
        try:
            out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", gpu_index()], capture_output=True, text=True, timeout=20).stdout
            return float(out.strip().splitlines()[0])
        except Exception:  # noqa: BLE001
            return None

    def start(self) -> "GpuMemoryMonitor":
        if not self.smi:
            return self
        # memory of a process that just exited can take a moment to be released
        prev = self._query()
        for _ in range(10):
            time.sleep(0.3)
            cur = self._query()
            if cur is None or prev is None or abs(cur - prev) < 16:
                break
            prev = cur
        self.baseline_mib = self._query()
        self.peak_mib = self.baseline_mib
        self._proc = subprocess.Popen([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                       "-i", gpu_index(), "-lms", str(self.interval_ms)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                v = float(line.strip())
                self.peak_mib = v if self.peak_mib is None else max(self.peak_mib, v)

    def sample(self) -> None:
        """One extra reading (e.g. right before stopping the system)."""
        v = self._query()
        if v is not None:
            self.peak_mib = v if self.peak_mib is None else max(self.peak_mib, v)

    def stop(self) -> float | None:
        """Peak bytes above the baseline."""
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=5)
            if self._thread is not None:
                self._thread.join(timeout=2)
        if self.peak_mib is None or self.baseline_mib is None:
            return None
        return max(0.0, self.peak_mib - self.baseline_mib) * MiB


# ===================================================================================== llama-server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str | Path, n: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    return ""


class LlamaServer:
    """A llama-server process for the duration of a `with` block: started, waited for until /health answers,
    and killed (its whole process group) on exit whatever happened."""

    def __init__(self, binary: str | Path, args: Sequence[str], log_path: str | Path,
                 ready_timeout: float = 300.0) -> None:
        self.binary, self.args, self.log_path = str(binary), list(args), Path(log_path)
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.command = [self.binary, *self.args, "--host", "127.0.0.1", "--port", str(self.port)]

    def __enter__(self) -> "LlamaServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        try:
            log.write("$ " + shlex.join(self.command) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SpecterError(f"llama-server exited with code {self.proc.returncode} while loading:\n"
                                   f"{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SpecterError(f"llama-server not ready after {self.ready_timeout:.0f} s:\n{tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SpecterError(f"llama-server {path}: HTTP {e.code}: {e.read()[:500]!r}") from None

    def tokenize(self, text: str) -> list[int]:
        return list(self.post("/tokenize", {"content": text, "add_special": True, "parse_special": True}, 60)["tokens"])

    def complete(self, ids: list[int], n_predict: int, decoding: str, seed: int, timeout: float) -> dict[str, Any]:
        body = {"prompt": list(ids), "n_predict": n_predict, "seed": seed, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": False, "repeat_penalty": 1.0,
                **DECODINGS[decoding]}
        res = self.post("/completion", body, timeout)
        t = res.get("timings") or {}
        n = int(t.get("predicted_n") or len(res.get("tokens") or []))
        rec = {"generated_tokens": n, "prompt_tokens": int(t.get("prompt_n") or len(ids)),
               "prefill_ms": t.get("prompt_ms"), "decode_ms": t.get("predicted_ms"),
               "tpot_ms": t.get("predicted_per_token_ms") or None, "tokens": res.get("tokens") or [],
               "extra": {}}
        if "draft_n" in t:
            rec["extra"] = {"draft_tokens": int(t["draft_n"]), "draft_accepted": int(t.get("draft_n_accepted", 0))}
        return rec


def llama_version(bin_dir: str | Path) -> str:
    try:
        r = subprocess.run([str(Path(bin_dir) / "llama-server"), "--version"], capture_output=True, text=True,
                           timeout=30)
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "version" in ln]
        return lines[0].strip() if lines else "unknown"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


# ========================================================================================== systems
@dataclass
class SystemSpec:
    """One configuration to measure. `family` is what --systems selects; `budget` None = no limit."""

    family: str
    kind: str  # "llama" | "ours"
    setting: str  # human readable, e.g. "-ncmoe 13"
    budget: Budget | None = None
    params: dict[str, Any] = field(default_factory=dict)
    est_gpu_bytes: int | None = None
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.family} [{self.setting}] @ {self.budget.label if self.budget else 'no limit'}"


@dataclass(frozen=True)
class OursMode:
    """One mode of our engine. `load(job)` returns an object whose ``generate(ids, n_predict, sampling)``
    returns a Generation (``.wait()``, ``.tokens``, ``.stats``). `budget_bound` modes run once per budget and
    get ``job["budget_bytes"]``; `synthetic` modes run once per synthetic acceptance length L
    (``job["synth_len"]``); `needs_draft` modes get ``job["draft"]``."""

    name: str
    description: str
    load: Callable[[dict[str, Any]], Any]
    budget_bound: bool = False
    synthetic: bool = False
    needs_draft: bool = False


def _load_plain(job: dict[str, Any]) -> Any:
    from .engine import Model

    return Model.load(job["model"], device=job["device"], ctx_size=job["ctx_size"], progress=False)


def _load_offload(mode: str) -> Callable[[dict[str, Any]], Any]:
    def load(job: dict[str, Any]) -> Any:
        from .engine import Model

        return Model.load(job["model"], device=job["device"], ctx_size=job["ctx_size"], progress=False,
                          offload=mode, gpu_budget=job["budget_bytes"])  # type: ignore[call-arg]
    return load


def _load_spec(job: dict[str, Any]) -> Any:
    from . import speculation
    from .engine import Model

    # real acceptance: our default depth ("auto", at most speculation.MAX_DEPTH); synthetic: llama.cpp's fixed
    # --spec-draft-n-max of the same matrix
    synthetic = job.get("synth_len") is not None
    model = Model.load(job["model"], draft=job["draft"], device=job["device"], ctx_size=job["ctx_size"],
                       gpu_budget=job["budget_bytes"], progress=False,
                       n_draft=(job.get("draft_n_max") or speculation.DEFAULT_N_DRAFT) if synthetic else "auto")
    if synthetic:
        speculation.synthetic_acceptance(model, job["synth_len"])
    return model


# The registry of our modes: adding a mode is one entry.
OURS_MODES: dict[str, OursMode] = {m.name: m for m in [
    OursMode("ours", "whole model on the device", _load_plain),
    OursMode("ours-on-demand", "experts in host memory, copied on demand",
             _load_offload("on-demand"), budget_bound=True),
    OursMode("ours-lru", "experts in host memory, LRU expert cache",
             _load_offload("lru"), budget_bound=True),
    OursMode("ours-gate-prefetch", "LRU expert cache + next-layer gate prefetch",
             _load_offload("gate-prefetch"), budget_bound=True),
    OursMode("ours-spec", "speculative decoding with the draft's experts, depth auto", _load_spec, budget_bound=True,
             needs_draft=True),
    OursMode("ours-spec-synth", "speculative decoding, synthetic acceptance", _load_spec, budget_bound=True,
             synthetic=True, needs_draft=True),
]}

LLAMA_FAMILIES = ("llama-gpu", "llama-ncmoe", "llama-spec", "llama-spec-synth")
ALL_FAMILIES = (*LLAMA_FAMILIES, *OURS_MODES)


def select_families(pattern: str) -> list[str]:
    """Families matching a comma-separated list of names or globs ("llama-*,ours")."""
    pats = [p.strip() for p in pattern.split(",") if p.strip()]
    out = [f for f in ALL_FAMILIES if any(fnmatch.fnmatchcase(f, p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(f, p) for f in ALL_FAMILIES)]
    if unknown:
        raise SpecterError(f"--systems: no system matches {unknown}; choose from {', '.join(ALL_FAMILIES)}")
    return out


@dataclass
class MatrixConfig:
    target: ModelSizes
    draft: ModelSizes | None
    draft_name: str | None
    budgets: list[Budget]
    ctx_size: int = 1024
    margin_bytes: int = GiB
    draft_margin_bytes: int = GiB // 2
    ncmoe_sweep: tuple[int, ...] = (-1, 0, 1)
    synth_lens: tuple[float, ...] = (2, 4, 6, 8)
    draft_n_max: int = 8


def build_matrix(families: Sequence[str], cfg: MatrixConfig) -> tuple[list[SystemSpec], list[str]]:
    """The systems to run, in run order, and notes on families that cannot run here."""
    specs: list[SystemSpec] = []
    notes: list[str] = []
    t = cfg.target
    if "llama-gpu" in families:
        specs.append(SystemSpec("llama-gpu", "llama", "all on GPU", None, {"n_cpu_moe": 0},
                                t.gpu_bytes(0, cfg.ctx_size) + cfg.margin_bytes))
    for name, mode in OURS_MODES.items():
        if name in families and not mode.budget_bound:
            specs.append(SystemSpec(name, "ours", mode.description, None, {"mode": name}))
    for b in cfg.budgets:
        if "llama-ncmoe" in families:
            n0 = smallest_ncmoe(b.bytes, t, cfg.ctx_size, cfg.margin_bytes)
            note = ""
            if n0 is None:
                n0, note = t.n_layer, "does not fit even with every expert on the CPU (estimate)"
            for n in sorted({min(t.n_layer, max(0, n0 + d)) for d in cfg.ncmoe_sweep}):
                specs.append(SystemSpec("llama-ncmoe", "llama", f"-ncmoe {n}", b, {"n_cpu_moe": n},
                                        t.gpu_bytes(n, cfg.ctx_size) + cfg.margin_bytes,
                                        note or ("smallest N fitting (estimate)" if n == n0 else "")))
        wants_spec = [f for f in ("llama-spec", "llama-spec-synth") if f in families]
        if wants_spec and cfg.draft is None:
            notes.append("llama-spec: no draft model")
        elif wants_spec:
            assert cfg.draft is not None
            n = smallest_ncmoe(b.bytes, t, cfg.ctx_size, cfg.margin_bytes, cfg.draft, cfg.draft_margin_bytes)
            note = ""
            if n is None:
                n, note = t.n_layer, "draft + target do not fit even with every target expert on the CPU (estimate)"
            est = (t.gpu_bytes(n, cfg.ctx_size) + cfg.margin_bytes + cfg.draft.gpu_bytes(0, cfg.ctx_size)
                   + cfg.draft_margin_bytes)
            base = {"n_cpu_moe": n, "draft": cfg.draft.path, "draft_n_max": cfg.draft_n_max}
            if "llama-spec" in families:
                specs.append(SystemSpec("llama-spec", "llama", f"draft {cfg.draft_name}, -ncmoe {n}", b,
                                        dict(base), est, note or "real acceptance"))
            if "llama-spec-synth" in families:
                for L in cfg.synth_lens:
                    specs.append(SystemSpec("llama-spec-synth", "llama", f"draft {cfg.draft_name}, -ncmoe {n}, L={L:g}",
                                            b, {**base, "synth_len": float(L)}, est,
                                            note or "synthetic acceptance (output invalid)"))
        for name, mode in OURS_MODES.items():
            if name in families and mode.budget_bound:
                if mode.needs_draft and cfg.draft is None:
                    if b is cfg.budgets[0]:
                        notes.append(f"{name}: no draft model")
                    continue
                variants = [{"synth_len": float(L)} for L in cfg.synth_lens] if mode.synthetic else [{}]
                # a draft mode drafts as deep as llama.cpp's --spec-draft-n-max in the same matrix
                draft = {"draft": cfg.draft.path, "draft_n_max": cfg.draft_n_max} if mode.needs_draft else {}
                for v in variants:
                    setting = mode.description + (f", L={v['synth_len']:g}" if v else "")
                    specs.append(SystemSpec(name, "ours", setting, b, {"mode": name, **v, **draft}))
    return specs, notes


def split_part(specs: list[SystemSpec], part: str | None) -> list[SystemSpec]:
    """`part` "i/n": every n-th system starting at the i-th (1-based)."""
    if not part:
        return specs
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", part)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise SpecterError(f"--part {part!r}: write i/n with 1 <= i <= n, e.g. 1/2")
    i, n = int(m.group(1)), int(m.group(2))
    return specs[i - 1::n]


def llama_server_args(spec: SystemSpec, model: str, ctx_size: int, threads: int | None) -> list[str]:
    p = spec.params
    args = ["-m", model, "-ngl", "999", "--fit", "off", "-c", str(ctx_size), "-np", "1", "--cache-ram", "0",
            "-ncmoe", str(p.get("n_cpu_moe", 0))]
    if threads:
        args += ["-t", str(threads)]
    if "draft" in p:
        args += ["--model-draft", p["draft"], "--spec-type", "draft-simple", "--spec-draft-n-max",
                 str(p.get("draft_n_max", 8)), "-ngld", "999"]
        if "synth_len" in p:
            args += ["--spec-synth-len", f"{p['synth_len']:g}"]
    return args


# ============================================================================================ running
@dataclass
class RunSettings:
    n_predict: int
    decodings: tuple[str, ...] = ("greedy", "sampled")
    seed: int = 1234
    seconds_per_system: float = 60.0  # decode time after which no further prompt is started
    warmup_tokens: int = 32


def run_prompt_set(generate: Callable[[list[int], int, str, int], dict[str, Any]], prompts: Sequence[Prompt],
                   rs: RunSettings, log: Callable[[str], None] = lambda s: None) -> tuple[list[dict], str]:
    """One warm-up generation, then every prompt under every decoding, until the time allowance is spent
    (at least one prompt always runs). Returns the run records and a note when prompts were left out."""
    runs: list[dict] = []
    w = generate(prompts[0].ids, min(rs.n_predict, rs.warmup_tokens), rs.decodings[0], rs.seed)
    w.update(prompt_id=prompts[0].id, decoding=rs.decodings[0], warmup=True, tokens=[])
    runs.append(w)
    start = time.monotonic()
    done = 0
    for i, p in enumerate(prompts):
        if i > 0 and time.monotonic() - start > rs.seconds_per_system:
            break
        for dec in rs.decodings:
            seed = rs.seed + i
            r = generate(p.ids, rs.n_predict, dec, seed)
            r.update(prompt_id=p.id, decoding=dec, seed=seed, warmup=False)
            if dec != "greedy":
                r["tokens"] = []  # keep greedy outputs only (for cross-system checks)
            runs.append(r)
            log(f"    {p.id:<18} {dec:<8} {r['generated_tokens']:4d} tok  TPOT {r.get('tpot_ms') or 0:8.2f} ms")
        done += 1
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
    res = _result(spec)
    t0 = time.monotonic()
    if ctx.remaining() < 30:
        res.update(status="skipped", error="skipped: the run's --deadline was reached")
        return res
    ctx.log(f"== {spec.key}")
    try:
        if spec.kind == "llama":
            _run_llama(spec, ctx, res)
        else:
            _run_ours(spec, ctx, res)
        if not any(not r.get("warmup") for r in res["runs"]):
            raise SpecterError("no measured run")
    except Exception as e:  # noqa: BLE001 - a failed system must not stop the matrix
        msg = str(e).strip() or type(e).__name__
        res.update(status="error", error=f"{type(e).__name__}: {msg}" if not isinstance(e, SpecterError) else msg)
        ctx.log(f"   FAILED: {res['error'][:2000]}")
    res["summary"] = summarize_runs([r for r in res["runs"] if not r.get("warmup")])
    res["wall_s"] = time.monotonic() - t0
    for dec, s in res["summary"].items():
        ctx.log(f"   {dec}: TPOT {s['tpot_ms'] or 0:.2f} ms, {s['tokens_per_s'] or 0:.1f} tok/s over {s['n_prompts']} prompts"
                + (f", acceptance {s['acceptance']:.1%}" if s.get("acceptance") is not None else ""))
    if res["peak_gpu_bytes"] is not None:
        ctx.log(f"   peak GPU memory {format_size(res['peak_gpu_bytes'])}")
    return res


def _run_llama(spec: SystemSpec, ctx: BenchContext, res: dict[str, Any]) -> None:
    if ctx.llama_bin is None:
        raise SpecterError("no llama.cpp tools (give --llama-bin or let bench.py build them)")
    binary = ctx.llama_bin / "llama-server"
    if not binary.exists():
        raise SpecterError(f"{binary} not found")
    args = llama_server_args(spec, ctx.model, ctx.ctx_size, ctx.threads)
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.key)[:120]
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

            runs, note = run_prompt_set(gen, ctx.prompts, _clip_settings(ctx, budget_s, t_start), ctx.log)
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


def _run_ours(spec: SystemSpec, ctx: BenchContext, res: dict[str, Any]) -> None:
    budget_s = min(ctx.job_timeout, ctx.remaining())
    work = ctx.out_dir / "logs"
    work.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.key)[:120]
    job = {"mode": spec.params["mode"], "model": ctx.model, "device": ctx.device, "ctx_size": ctx.ctx_size,
           "budget_bytes": spec.budget.bytes if spec.budget else None, "draft": spec.params.get("draft"),
           "synth_len": spec.params.get("synth_len"), "draft_n_max": spec.params.get("draft_n_max"),
           "prompts": [dataclasses.asdict(p) for p in ctx.prompts],
           "settings": dataclasses.asdict(ctx.settings) | {"decodings": list(ctx.settings.decodings)},
           "time_budget_s": budget_s, "result": str(work / f"{slug}.result.json")}
    job_path = work / f"{slug}.job.json"
    job_path.write_text(json.dumps(job))
    log_path = work / f"{slug}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "specter_gguf.benchmark", "worker", str(job_path)]
    res["command"] = f"specter_gguf.benchmark worker ({spec.params['mode']}, device {ctx.device})"
    mon = GpuMemoryMonitor(enabled=ctx.device.startswith("cuda")).start()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=str(REPO_ROOT), env=env, start_new_session=True)
            try:
                proc.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                raise SpecterError(f"worker killed after {budget_s:.0f} s (job timeout or deadline):\n{tail(log_path)}")
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        res["peak_gpu_bytes"] = mon.stop()
    out = Path(job["result"])
    if not out.exists():
        raise SpecterError(f"worker exited with code {proc.returncode} and no result:\n{tail(log_path)}")
    w = json.loads(out.read_text())
    res["runs"] = w.get("runs", [])
    res["torch_peak_bytes"] = w.get("torch_peak_bytes")
    res["load_s"] = w.get("load_s")
    if w.get("note"):
        res["note"] = "; ".join(x for x in (res["note"], w["note"]) if x)
    if w.get("error"):
        raise SpecterError(w["error"])


# ------------------------------------------------------------------------------------- worker (ours)
class _IgnoreEOG:
    """Wraps a tokenizer so that no token ends generation (llama-server's ignore_eos)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    eog_ids: frozenset[int] = frozenset()

    def is_eog(self, token_id: int) -> bool:  # noqa: ARG002
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


class IdsOnlyTokenizer:
    """Stand-in tokenizer for machines without llama-cpp-python: the benchmark feeds token ids and never
    reads text, so only the vocabulary size and (empty) token pieces are needed."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)  # not read: the engine takes the vocabulary size from the model's config
        self.n_vocab = None
        self.add_bos = False
        self.add_space_prefix = False

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "IdsOnlyTokenizer":
        return cls(path)

    def is_eog(self, token_id: int) -> bool:  # noqa: ARG002
        return False

    def is_control(self, token_id: int) -> bool:  # noqa: ARG002
        return False

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:  # noqa: ARG002
        return b""

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        raise SpecterError("no tokenizer here (llama-cpp-python is missing): give token ids")

    def decode(self, ids: Iterable[int], special: bool = False, continuation: bool = False) -> str:  # noqa: ARG002
        return ""

    def stream(self, special: bool = False, continuation: bool = False) -> "_NullDecoder":  # noqa: ARG002
        return _NullDecoder()

    bos_id = eos_id = eot_id = None
    eog_ids: frozenset[int] = frozenset()


class _NullDecoder:
    def push(self, token_id: int) -> str:  # noqa: ARG002
        return ""

    def push_many(self, ids: Sequence[int]) -> str:  # noqa: ARG002
        return ""

    def flush(self) -> str:
        return ""


@contextlib.contextmanager
def tokenizer_fallback(force: bool = False):
    """Within the block, `Tokenizer.from_gguf` returns an :class:`IdsOnlyTokenizer` when llama-cpp-python is
    not importable (or `force`)."""
    need = force
    if not need:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            need = True
    if not need:
        yield False
        return
    from . import tokenizer as tokmod

    orig = tokmod.Tokenizer.__dict__["from_gguf"]
    tokmod.Tokenizer.from_gguf = classmethod(lambda cls, path: IdsOnlyTokenizer(path))  # type: ignore[method-assign]
    try:
        yield True
    finally:
        tokmod.Tokenizer.from_gguf = orig  # type: ignore[method-assign]


def ours_worker(job_path: str | Path) -> int:
    """Run one of our modes over the job's prompts and write the result JSON (see `_run_ours`)."""
    job = json.loads(Path(job_path).read_text())
    out = Path(job["result"])
    result: dict[str, Any] = {"runs": [], "error": None}
    t_begin = time.monotonic()
    try:
        import torch

        from .sampling import SamplingParams

        mode = OURS_MODES[job["mode"]]
        cuda = str(job["device"]).startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.monotonic()
        with tokenizer_fallback(force=bool(os.environ.get("SPECTER_BENCH_NO_LLAMA_CPP"))):
            model = mode.load(job)
        if hasattr(model, "tokenizer"):
            model.tokenizer = _IgnoreEOG(model.tokenizer)
        result["load_s"] = time.monotonic() - t0
        settings = RunSettings(**{**job["settings"], "decodings": tuple(job["settings"]["decodings"])})
        left = job["time_budget_s"] - (time.monotonic() - t_begin)
        settings.seconds_per_system = min(settings.seconds_per_system, 0.5 * left)
        prompts = [Prompt(**p) for p in job["prompts"]]

        def gen(ids: list[int], n: int, dec: str, seed: int) -> dict[str, Any]:
            sp = SamplingParams(**DECODINGS[dec], seed=seed)
            g = model.generate(list(ids), n, sp).wait()
            st = g.stats
            d = st.to_dict() if hasattr(st, "to_dict") else dataclasses.asdict(st)
            known = {"prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "tpot_ms", "tokens_per_s"}
            extra = {k: v for k, v in d.items() if k not in known and isinstance(v, (int, float))}
            return {"generated_tokens": int(d["generated_tokens"]), "prompt_tokens": int(d["prompt_tokens"]),
                    "prefill_ms": 1000.0 * d["prefill_s"], "decode_ms": 1000.0 * d["decode_s"],
                    "tpot_ms": tpot_ms(d["decode_s"], int(d["generated_tokens"])), "tokens": list(g.tokens),
                    "extra": extra}

        runs, note = run_prompt_set(gen, prompts, settings, lambda s: print(s, flush=True))
        result["runs"], result["note"] = runs, note
        if cuda:
            result["torch_peak_bytes"] = int(torch.cuda.max_memory_allocated())
            result["torch_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    return 0 if result["error"] is None else 1


def run_matrix(specs: Sequence[SystemSpec], ctx: BenchContext,
               on_result: Callable[[dict[str, Any]], None] = lambda r: None) -> list[dict[str, Any]]:
    results = []
    for spec in specs:
        r = run_system(spec, ctx)
        results.append(r)
        on_result(r)
    return results


# ============================================================================================ report
def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def merge_docs(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several results documents (e.g. the parts of a split run) as one. A system skipped in one part (its
    deadline) and measured in a later one (a rerun of what was left) appears once, measured."""
    if not docs:
        raise SpecterError("nothing to merge")
    meta = dict(docs[0]["meta"])
    cmds = [d["meta"].get("command") for d in docs if d["meta"].get("command")]
    meta["command"] = " ; ".join(dict.fromkeys(cmds))
    results: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    for r in (r for d in docs for r in d["results"]):
        key = (r["family"], r["setting"], r["budget"])
        if key not in results or results[key]["status"] == "skipped":
            results[key] = r
    return {"meta": meta, "notes": list(dict.fromkeys(n for d in docs for n in d.get("notes", []))),
            "results": list(results.values())}


def _fmt(v: float | None, spec: str = ".2f", pct: bool = False, size: bool = False) -> str:
    if v is None:
        return "—"
    if size:  # three significant digits in the largest unit under the value (per-token sizes are small)
        return _format_size(v, ".3g")
    return f"{100 * v:.1f}%" if pct else format(v, spec)


def _pair(summary: dict[str, Any], key: str, decs: Sequence[str], **kw: Any) -> str:
    vals = [_fmt((summary.get(d) or {}).get(key), **kw) for d in decs]
    return " / ".join(vals) if any(v != "—" for v in vals) else "—"


def best_llama_setting(results: Sequence[dict[str, Any]], budget: str, decoding: str = "greedy") -> dict | None:
    """The fastest llama.cpp configuration of a budget whose measured peak (when known) fits it."""
    cands = [r for r in results if r["kind"] == "llama" and r["budget"] == budget and r["status"] == "ok"
             and r["family"] != "llama-spec-synth"
             and (r["peak_gpu_bytes"] is None or r["peak_gpu_bytes"] <= (r["budget_bytes"] or math.inf))
             and (r["summary"].get(decoding) or {}).get("tpot_ms")]
    return min(cands, key=lambda r: r["summary"][decoding]["tpot_ms"], default=None)


# The second table's columns: (header, summary key, _fmt options); `ITER_KEYS` make up the iteration breakdown.
SPEC_COLUMNS = (
    ("Tokens/iter", "mean_accepted_len", {}),
    ("Draft step ms", "draft_step_ms", {}),
    ("Prefetch precision", "prefetch_precision", {"pct": True}),
    ("Prefetch recall", "prefetch_recall", {"pct": True}),
    ("Late prefetches", "prefetch_late_share", {"pct": True}),
    ("Refused/iter", "prefetch_refused_per_iter", {"spec": ".1f"}),
    ("Moved/token", "bytes_moved_per_token", {"size": True}),
    ("Draft ms/iter", "iter_draft_ms", {}),
    ("Verify ms/iter", "iter_verify_ms", {}),
    ("Copy wait ms/iter", "iter_copy_exposed_ms", {}),
    ("Other ms/iter", "iter_other_ms", {}),
)
SPEC_KEYS = tuple(key for _, key, _ in SPEC_COLUMNS if key != "mean_accepted_len")


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
         "target's own included. Draft step: one drafted token's forward. Prefetch precision: prefetched experts "
         "the verification used / experts prefetched; recall: the same / experts the verifications used that were "
         "prefetched or read in place (what they would have missed without the lookahead). Late prefetches: "
         "prefetched experts whose copy had not landed when the verification began (read in place). Refused/iter: "
         "experts the lookahead counted that found no evictable slot, per iteration. "
         "Moved/token: expert bytes over PCIe (copied plus read in place) per prompt or generated token. Per "
         "iteration (verification pass): drafting, verification, other decode time (host work between them, plain "
         "steps); copy wait: compute waiting for expert copies (whole generation, prefill included), mostly inside "
         "verification."),
        "",
        "| System | Setting | Budget | " + " | ".join(h for h, _, _ in SPEC_COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(SPEC_COLUMNS),
    ]
    for r in rows:
        s = r.get("summary") or {}
        lines.append("| " + " | ".join([r["family"], r["setting"].replace("|", "\\|"), r.get("budget") or "no limit",
                                         *(_pair(s, key, decs, **kw) for _, key, kw in SPEC_COLUMNS)]) + " |")
    return [*lines, ""]


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
        f"tokens each, after one warm-up; decodings: {' / '.join(decs)} (sampled: temperature 1, top-k 40, "
        f"top-p 0.95, min-p 0.05, seed {m.get('seed')} + prompt index)",
        f"- llama.cpp: {m.get('llama_version', '—')}; context {m.get('ctx_size')} tokens",
        f"- Command: `{m.get('command', '?')}`",
        "",
        f"Values are `{' / '.join(decs)}`. TPOT: median over prompts of decode time per generated token after the "
        "first; tok/s = 1000 / TPOT. Peak GPU: device memory in use above idle (nvidia-smi; includes the CUDA "
        "context); for ours, torch's peak allocation in brackets. Fits: measured peak within the budget.",
        "",
        "| System | Setting | Budget | TPOT ms | tok/s | Peak GPU | Fits | Acceptance | Hit rate | Bytes/token "
        "| Hidden copy | Prompts | Note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            _pair(s, "tpot_ms", decs), _pair(s, "tokens_per_s", decs, spec=".1f"), peak, fits,
            _pair(s, "acceptance", decs, pct=True), _pair(s, "cache_hit_rate", decs, pct=True), bpt,
            _pair(s, "hidden_copy_share", decs, pct=True), nprompts, note.replace("|", "\\|").replace("\n", " "),
        ]) + " |")
    lines.append("")
    lines += _speculation_table(res, decs)
    real = [r for r in res if r["family"] == "llama-spec" and r["status"] == "ok"]
    synth = [r for r in res if r["family"].endswith("spec-synth")]
    if synth:
        acc = ", ".join(f"{r['budget']}: {_pair(r['summary'], 'acceptance', decs, pct=True)}" for r in real) or "not measured"
        lines.append("Rows with `L=` use synthetic acceptance (llama.cpp `--spec-synth-len L`: drafted tokens are "
                     "accepted at random so that the mean accepted length per verification, target token included, "
                     "is L; the output is invalid, the compute and data movement are real). Real acceptance of "
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


def write_plots(doc: dict[str, Any], out_dir: str | Path, stem: str = "bench") -> list[Path]:
    """PNG plots (matplotlib, Agg): TPOT per system per budget, and TPOT against synthetic acceptance
    length. Returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = [r for r in doc["results"] if r["status"] == "ok"]
    decs = doc["meta"].get("decodings", ["greedy", "sampled"])
    title = doc["meta"].get("model_label", "")
    gpu = (doc["meta"].get("gpu") or {}).get("gpu") or "CPU"
    written: list[Path] = []

    groups = ["no limit"] + list((doc["meta"].get("budgets") or {}).keys())
    rows = [r for r in res if r["family"] != "llama-spec-synth" and not r["family"].endswith("spec-synth")]
    if rows:
        labels = list(dict.fromkeys(f"{r['family']} {r['setting']}" for r in rows))
        fig, axes = plt.subplots(1, len(decs), figsize=(max(7, 1.2 * len(labels) + 4) * len(decs) / 1.5, 5),
                                 squeeze=False)
        for ax, dec in zip(axes[0], decs):
            width = 0.8 / max(1, len(labels))
            cmap = plt.get_cmap("tab20")
            for j, lab in enumerate(labels):
                xs, ys = [], []
                for gi, g in enumerate(groups):
                    for r in rows:
                        if f"{r['family']} {r['setting']}" == lab and (r["budget"] or "no limit") == g:
                            t = (r["summary"].get(dec) or {}).get("tpot_ms")
                            if t:
                                xs.append(gi + (j - (len(labels) - 1) / 2) * width)
                                ys.append(t)
                if xs:
                    ax.bar(xs, ys, width=width, label=lab, color=cmap(j % 20))
            ax.set_xticks(range(len(groups)), groups)
            ax.set_ylabel("TPOT (ms, log scale)")
            ax.set_yscale("log")
            ax.set_title(f"{dec} decoding")
            ax.grid(axis="y", which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.suptitle(f"TPOT per system and GPU budget — {title} — {gpu}", fontsize=10)
        fig.tight_layout()
        p = out_dir / f"{stem}-tpot.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(p)

    synth = [r for r in res if r["family"].endswith("spec-synth")]
    if synth:
        fig, axes = plt.subplots(1, len(decs), figsize=(6 * len(decs), 4.5), squeeze=False)
        for ax, dec in zip(axes[0], decs):
            series: dict[str, list[tuple[float, float]]] = {}
            for r in synth:
                t = (r["summary"].get(dec) or {}).get("tpot_ms")
                if t:
                    series.setdefault(f"{r['family']} @ {r['budget']}", []).append((r["params"]["synth_len"], t))
            budgets = list(doc["meta"].get("budgets") or {})
            cmap = plt.get_cmap("tab10")
            for k, (lab, pts) in enumerate(sorted(series.items())):
                pts.sort()
                b = lab.rsplit(" @ ", 1)[-1]
                ci = budgets.index(b) if b in budgets else k
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o" if lab.startswith("llama") else "s",
                        linestyle="-" if lab.startswith("llama") else ":", label=lab, color=cmap(ci % 10))
            for ci, b in enumerate(budgets):
                best = best_llama_setting(res, b, dec)
                if best:
                    ax.axhline(best["summary"][dec]["tpot_ms"], linestyle="--", linewidth=1, color=cmap(ci % 10),
                               label=f"best llama.cpp, no synthetic acceptance @ {b}")
            ax.set_xlabel("synthetic mean accepted length L")
            ax.set_ylabel("TPOT (ms)")
            ax.set_title(f"{dec} decoding")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"TPOT vs synthetic acceptance — {title} — {gpu}", fontsize=10)
        fig.tight_layout()
        p = out_dir / f"{stem}-synth.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(p)
    return written


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


# ============================================================================== tools and models
LLAMA_BUILD_DIR = Path("/tmp/llama/build/bin")


def find_llama_bin(explicit: str | Path | None) -> Path | None:
    for d in [Path(explicit)] if explicit else [LLAMA_BUILD_DIR]:
        if (d / "llama-server").exists():
            return d
    return None


def start_llama_build(targets: Sequence[str] = ("llama-server", "llama-bench"), log: Path | None = None) -> subprocess.Popen:
    """`build_llama_tools` of .gpu/on-device.sh in the background (about 4 minutes on 16 cores)."""
    script = REPO_ROOT / ".gpu" / "on-device.sh"
    if not script.exists():
        raise SpecterError(f"{script} not found: carry .gpu (see ../shared/gpu/prepare.sh) or give --llama-bin")
    cmd = f"source {shlex.quote(str(script))} && build_llama_tools {' '.join(map(shlex.quote, targets))}"
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(["bash", "-c", cmd], cwd=str(REPO_ROOT), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_llama_build(proc: subprocess.Popen, timeout: float) -> Path:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise SpecterError(f"building llama.cpp took more than {timeout:.0f} s") from None
    if rc != 0 or not (LLAMA_BUILD_DIR / "llama-server").exists():
        raise SpecterError(f"building llama.cpp failed (code {rc}):\n{tail('/tmp/llama/build.log', 25)}\n"
                           f"{tail('/tmp/llama/cmake.log', 10)}")
    return LLAMA_BUILD_DIR


def find_vocab(name: str, work_dir: Path) -> Path:
    """A vocab GGUF of llama.cpp's source tree: unpacked by build_llama_tools, in a local llama-cpp-python
    sdist, or extracted from the carried .gpu/llama-src.tar.gz."""
    # the tarball first: build_llama_tools may be unpacking it into /tmp/llama at this very moment
    if (work_dir / name).is_file():
        return work_dir / name
    tarball = REPO_ROOT / ".gpu" / "llama-src.tar.gz"
    if tarball.is_file():
        import tarfile

        with tarfile.open(tarball) as tf:
            try:
                data = tf.extractfile(f"llama-src/vendor/llama.cpp/models/{name}")
            except KeyError:
                data = None
            if data is not None:
                work_dir.mkdir(parents=True, exist_ok=True)
                tmp = work_dir / (name + ".tmp")
                tmp.write_bytes(data.read())
                tmp.replace(work_dir / name)
                return work_dir / name
    cands = [*sorted(Path("/tmp/llsrc").glob(f"*/vendor/llama.cpp/models/{name}")),
             Path("/tmp/llama/llama-src/vendor/llama.cpp/models") / name]
    for c in cands:
        if c.is_file():
            return c
    raise SpecterError(f"vocab GGUF {name} not found (looked in {', '.join(map(str, cands))} and {tarball}); "
                       "give --vocab-from")


QTYPE_LLAMA = {"q4_k_m": "Q4_K_M", "q2_k": "Q2_K", "q8_0": "Q8_0", "q4_0": "Q4_0", "q6_k": "Q6_K",
               "q3_k_m": "Q3_K_M", "q5_k_m": "Q5_K_M"}
# bytes of a quantized file per F16 byte, roughly (for the disk-space check)
QTYPE_SHARE = {"q4_k_m": 0.32, "q2_k": 0.2, "q8_0": 0.54, "q4_0": 0.29, "q6_k": 0.42, "q3_k_m": 0.27,
               "q5_k_m": 0.36}


def _ok_marker(path: Path) -> Path:
    return path.with_name(path.name + ".ok")


def _is_done(path: Path, recipe: dict[str, Any]) -> bool:
    mk = _ok_marker(path)
    if not (path.is_file() and mk.is_file()):
        return False
    with contextlib.suppress(Exception):
        return json.loads(mk.read_text()) == recipe
    return False


def _mark_done(path: Path, recipe: dict[str, Any]) -> None:
    _ok_marker(path).write_text(json.dumps(recipe))


def estimate_bytes(preset: str, layers: int | None, n_vocab: int, target_type: str = "f16") -> int:
    """Tensor bytes of the synthetic `target_type` file of `preset` (specter_gguf.synthetic.DTYPES)."""
    from .synthetic import data_bytes, get_preset

    shape = get_preset(preset)
    if layers:
        shape = shape.with_layers(layers)
    return data_bytes(shape, n_vocab, target_type)


def make_target(preset: str, layers: int | None, work_dir: Path, device: str, vocab: Path | None,
                log: Callable[[str], None] = print, timeout: float = 1800, target_type: str = "f16") -> Path:
    """The target of `preset` (random weights) in `work_dir`, written by scripts/make_synthetic.py unless an
    identical one is there already. `target_type`: f16 (default), bf16, f32, or q8_0 (written in Q8_0 directly,
    slab by slab: no F16 copy is ever on disk)."""
    from .synthetic import DTYPES

    target_type = target_type.lower()
    if target_type not in DTYPES:
        raise SpecterError(f"unknown target type {target_type!r}; choose one of: {', '.join(DTYPES)}")
    name = f"{preset}{f'-l{layers}' if layers else ''}-{target_type}.gguf"
    path = work_dir / name
    recipe: dict[str, Any] = {"preset": preset, "layers": layers, "vocab": vocab.name if vocab else None, "seed": 0}
    if target_type != "f16":  # (F16 recipes have no "type": their existing .ok markers stay valid)
        recipe["type"] = target_type
    if _is_done(path, recipe):
        log(f"reusing {path}")
        return path
    n_vocab = 151936
    if vocab is not None:
        with contextlib.suppress(Exception):
            import gguf

            n_vocab = len(gguf.GGUFReader(str(vocab), "r").fields["tokenizer.ggml.tokens"].data)
    need = estimate_bytes(preset, layers, n_vocab, target_type)
    work_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work_dir).free + (path.stat().st_size if path.exists() else 0)
    if need * 1.02 > free:
        raise SpecterError(f"{path}: needs {format_size(need)} but {work_dir} has {format_size(free)} free; "
                           "use --layers or another --work-dir")
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "make_synthetic.py"), "--preset", preset,
           "--dtype", target_type, "--device", device, "-o", str(path), "--no-progress"]
    if layers:
        cmd += ["--layers", str(layers)]
    if vocab is not None:
        cmd += ["--vocab-from", str(vocab)]
    log("$ " + shlex.join(cmd))
    t0 = time.monotonic()
    _check_call(cmd, timeout)
    _mark_done(path, recipe)
    log(f"wrote {path} ({format_size(path.stat().st_size)}) in {time.monotonic() - t0:.0f} s")
    return path


def make_draft(target: Path, qtype: str, llama_bin: Path | None, log: Callable[[str], None] = print,
               timeout: float = 1200) -> Path:
    """A quantized copy of `target` by llama.cpp's quantizer: the llama-quantize tool where built, else
    llama-cpp-python (specter_gguf.quantize). An already quantized target (e.g. Q8_0) is requantized
    (llama-quantize --allow-requantize)."""
    from .quantize import quantized_path

    qtype = qtype.lower()
    dst = quantized_path(target, qtype)
    recipe = {"source": target.name, "source_bytes": target.stat().st_size, "qtype": qtype}
    if _is_done(dst, recipe):
        log(f"reusing {dst}")
        return dst
    source_type, requantize = gguf_weight_type(target)
    need = target.stat().st_size * QTYPE_SHARE.get(qtype, 0.6) / _SOURCE_SHARE.get(source_type, 1.0)
    free = shutil.disk_usage(target.parent).free + (dst.stat().st_size if dst.exists() else 0)
    if need * 1.05 > free:
        raise SpecterError(f"{dst}: needs about {format_size(need)} but only {format_size(free)} is free")
    t0 = time.monotonic()
    tool = llama_bin / "llama-quantize" if llama_bin else None
    if tool is not None and tool.exists():
        if qtype not in QTYPE_LLAMA:
            raise SpecterError(f"unknown draft type {qtype}; choose from {', '.join(QTYPE_LLAMA)}")
        cmd = [str(tool), *(["--allow-requantize"] if requantize else []), str(target), str(dst),
               QTYPE_LLAMA[qtype], str(os.cpu_count() or 1)]
        log("$ " + shlex.join(cmd))
        _check_call(cmd, timeout)
    else:
        from .quantize import quantize_gguf

        log(f"{'requantizing' if requantize else 'quantizing'} {target.name} to {qtype} with llama-cpp-python")
        quantize_gguf(target, dst, qtype, allow_requantize=requantize)
    _mark_done(dst, recipe)
    log(f"wrote {dst} ({format_size(dst.stat().st_size)}) in {time.monotonic() - t0:.0f} s")
    return dst


# bytes of a file of that type per F16 byte, for sources other than F16 (QTYPE_SHARE holds the quantized ones)
_SOURCE_SHARE = {"f32": 2.0, "f16": 1.0, "bf16": 1.0, **QTYPE_SHARE}


def gguf_weight_type(path: Path) -> tuple[str, bool]:
    """(the llama ftype name of `path`'s general.file_type, e.g. "f16" or "q8_0", "" when absent or unknown;
    whether any tensor is stored in a quantized type, i.e. llama.cpp's quantizer needs --allow-requantize)."""
    import gguf

    from .quantize import FTYPES

    r = gguf.GGUFReader(str(path), "r")
    f = r.fields.get("general.file_type")
    names = {v: k for k, v in FTYPES.items()}
    name = names.get(int(f.contents()), "") if f is not None else ""
    T = gguf.GGMLQuantizationType
    return name, any(t.tensor_type not in (T.F32, T.F16, T.BF16) for t in r.tensors)


def _check_call(cmd: Sequence[str], timeout: float) -> None:
    with tempfile.TemporaryFile(mode="w+") as out:
        p = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise SpecterError(f"timed out after {timeout:.0f} s: {shlex.join(cmd)}") from None
        if rc != 0:
            out.seek(0)
            last = "\n".join(out.read().splitlines()[-20:])
            raise SpecterError(f"failed (code {rc}): {shlex.join(cmd)}\n{last}")


# ================================================================================== worker entry
def _main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "worker":
        return ours_worker(argv[1])
    print("usage: python -m specter_gguf.benchmark worker JOB.json  (started by scripts/bench.py)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
