"""llama.cpp, the system we compare with: where a GGUF's bytes go under ``-ngl all -ncmoe N`` (to choose N for a
budget), llama-server processes, and llama.cpp's tools built on the GPU machine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from specter_gguf.bench.metrics import DECODINGS
from specter_gguf.bench.process import kill_group, tail
from specter_gguf.config import ModelConfig, meta_value
from specter_gguf.errors import SpecterError
from specter_gguf.gguf_file import GGUFFile

if TYPE_CHECKING:  # pragma: no cover
    from specter_gguf.bench.matrix import SystemSpec

# where build_llama_tools of .gpu/on-device.sh unpacks llama.cpp's source (llama-src/) and builds it (build/bin;
# logs cmake.log and build.log): the default of bench.py's --llama-dir
DEFAULT_LLAMA_DIR = Path("/tmp/llama")

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
    def from_gguf(cls, path: str | Path) -> ModelSizes:
        """The sizes of `path`, read as our engine reads it (`GGUFFile`, `ModelConfig`); a head's V width is
        llama.cpp's: ``attention.value_length``, else n_embd / n_head."""
        f = GGUFFile(path)
        c = ModelConfig.from_gguf(f)
        experts = [0] * c.n_layer
        cpu_only = nonexpert = 0
        for t in f.tensors.values():
            m = EXPERT_RE.match(t.name)
            if m:
                experts[int(m.group(1))] += t.n_bytes
            elif t.name in CPU_ONLY_TENSORS:
                cpu_only += t.n_bytes
            else:
                nonexpert += t.n_bytes
        head_dim_v = meta_value(f, f"{c.arch}.attention.value_length", c.n_embd // c.n_head)
        kv = c.n_layer * c.n_head_kv * (c.head_dim + head_dim_v) * 2
        return cls(str(path), c.arch, c.n_layer, f.file_bytes, cpu_only, nonexpert, experts, kv)

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def llama_version(bin_dir: str | Path) -> str:
    try:
        r = subprocess.run([str(Path(bin_dir) / "llama-server"), "--version"], capture_output=True, text=True,
                           timeout=30)
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "version" in ln]
        return lines[0].strip() if lines else "unknown"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


def llama_build_bin(llama_dir: Path) -> Path:
    """Where build_llama_tools puts the tools it builds in `llama_dir`."""
    return llama_dir / "build" / "bin"


def find_llama_bin(bin_dir: Path) -> Path | None:
    """`bin_dir` when it holds llama-server, else None."""
    return bin_dir if (bin_dir / "llama-server").exists() else None


def start_llama_build(gpu_dir: Path, targets: Sequence[str] = ("llama-server", "llama-bench"),
                      log: Path | None = None) -> subprocess.Popen:
    """`build_llama_tools` of `gpu_dir`/on-device.sh in the background (about 4 minutes on 16 cores), run from the
    folder holding `gpu_dir` (the script reads the carried .gpu/ from there)."""
    script = gpu_dir / "on-device.sh"
    if not script.exists():
        raise SpecterError(f"{script} not found: carry .gpu (see ../shared/gpu/prepare.sh) or give --llama-bin")
    cmd = f"source {shlex.quote(str(script))} && build_llama_tools {' '.join(map(shlex.quote, targets))}"
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(["bash", "-c", cmd], cwd=str(gpu_dir.parent), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_llama_build(proc: subprocess.Popen, llama_dir: Path, timeout: float, log: Path | None = None) -> Path:
    """The folder of the tools `proc` (`start_llama_build`, writing to `log`) built in `llama_dir`; a failure shows
    the end of each log it left."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise SpecterError(f"building llama.cpp took more than {timeout:.0f} s") from None
    bin_dir = llama_build_bin(llama_dir)
    if rc != 0 or not (bin_dir / "llama-server").exists():
        logs = [p for p in (log, llama_dir / "cmake.log", llama_dir / "build.log") if p is not None and tail(p)]
        shown = "\n".join(f"--- {p}:\n{tail(p, 15)}" for p in logs) or "(it left no log)"
        raise SpecterError(f"building llama.cpp failed (code {rc}); give --llama-bin with built tools, or run only "
                           f"our systems (--systems 'ours*'):\n{shown}")
    return bin_dir
