"""The worker subprocess of one of our modes (started by `runner`): ``python -m specter_gguf.bench.worker JOB.json``
loads the model as the job's mode does (`ours`), then for each row of the job (rows of modes that load alike:
real and synthetic acceptance of one draft and budget) sets the row up, runs the job's prompts and writes the
result JSON the row names.

Where llama-cpp-python is missing (the GPU machine), or ``SPECTER_BENCH_NO_LLAMA_CPP`` is set, the model is loaded
with an ids-only tokenizer: the benchmark gives token ids and reads token ids."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from specter_gguf.bench.metrics import DECODINGS
from specter_gguf.bench.ours import OURS_MODES
from specter_gguf.bench.prompts import Prompt
from specter_gguf.bench.runner import RunSettings, run_prompt_set
from specter_gguf.tokenizer import IdsOnlyTokenizer, ids_only_unless_llama_cpp


def ours_worker(job_path: str | Path) -> int:
    """Run one of our modes over the job's prompts for each of its rows and write each row's result JSON (see
    `runner._run_ours`); a failure ends the rows not yet run with it."""
    job = json.loads(Path(job_path).read_text())
    rows = job["rows"]
    t_begin = time.monotonic()
    done = 0
    load_s = None
    try:
        import torch

        from specter_gguf.engine import tpot_ms
        from specter_gguf.sampling import SamplingParams

        cuda = str(job["device"]).startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.monotonic()
        forced = bool(os.environ.get("SPECTER_BENCH_NO_LLAMA_CPP"))
        model = OURS_MODES[rows[0]["mode"]].load(job, IdsOnlyTokenizer() if forced else ids_only_unless_llama_cpp())
        load_s = time.monotonic() - t0
        prompts = [Prompt(**p) for p in job["prompts"]]
        warmup = Prompt(**job["warmup"]) if job.get("warmup") else None

        def gen(ids: list[int], n: int, dec: str, seed: int) -> dict[str, Any]:
            sp = SamplingParams(**DECODINGS[dec], seed=seed)
            g = model.generate(list(ids), n, sp, ignore_eos=True).wait()  # llama-server's ignore_eos
            d = g.stats.to_dict()
            known = {"prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "tpot_ms", "tokens_per_s"}
            extra = {k: v for k, v in d.items() if k not in known and isinstance(v, (int, float))}
            extra.update({k: d[k] for k in ("depth_rounds", "depth_verify_s", "iterations") if d.get(k)})
            return {"generated_tokens": int(d["generated_tokens"]), "prompt_tokens": int(d["prompt_tokens"]),
                    "prefill_ms": 1000.0 * d["prefill_s"], "decode_ms": 1000.0 * d["decode_s"],
                    "tpot_ms": tpot_ms(d["decode_s"], int(d["generated_tokens"])), "tokens": list(g.tokens),
                    "extra": extra}

        for row in rows:
            t_row = time.monotonic()
            print(f"== {row['key']}", flush=True)
            OURS_MODES[row["mode"]].prepare(model, job, row)
            settings = RunSettings(**{**job["settings"], "decodings": tuple(job["settings"]["decodings"])})
            left = (job["time_budget_s"] - (time.monotonic() - t_begin)) / (len(rows) - done)  # this row's share
            settings.seconds_per_system = min(settings.seconds_per_system, 0.5 * left)
            runs, note = run_prompt_set(gen, prompts, settings, lambda s: print(s, flush=True), warmup)
            result = {"runs": runs, "note": note, "error": None, "load_s": load_s, "row_s": time.monotonic() - t_row}
            if cuda:  # the process's peak so far: its rows share the device
                result["torch_peak_bytes"] = int(torch.cuda.max_memory_allocated())
                result["torch_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
            _write(row["result"], result)
            done += 1
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        for row in rows[done:]:
            _write(row["result"], {"runs": [], "error": f"{type(e).__name__}: {e}", "load_s": load_s})
        return 1
    return 0


def _write(path: str, result: dict[str, Any]) -> None:
    """`result` as JSON at `path`, whole or not at all (a runner reading it meanwhile sees no file)."""
    out = Path(path)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


def main(argv: Sequence[str]) -> int:
    if len(argv) == 1:
        return ours_worker(argv[0])
    print("usage: python -m specter_gguf.bench.worker JOB.json  (started by scripts/bench.py)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
