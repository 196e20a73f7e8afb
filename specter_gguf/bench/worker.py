"""The worker subprocess of one of our modes (started by `runner`): ``python -m specter_gguf.bench.worker JOB.json``
loads the model as the job's mode does (`ours`), runs the job's prompts and writes the result JSON the job names.

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
    """Run one of our modes over the job's prompts and write the result JSON (see `runner._run_ours`)."""
    job = json.loads(Path(job_path).read_text())
    out = Path(job["result"])
    result: dict[str, Any] = {"runs": [], "error": None}
    t_begin = time.monotonic()
    try:
        import torch

        from specter_gguf.engine import tpot_ms
        from specter_gguf.sampling import SamplingParams

        mode = OURS_MODES[job["mode"]]
        cuda = str(job["device"]).startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.monotonic()
        forced = bool(os.environ.get("SPECTER_BENCH_NO_LLAMA_CPP"))
        model = mode.load(job, IdsOnlyTokenizer() if forced else ids_only_unless_llama_cpp())
        result["load_s"] = time.monotonic() - t0
        settings = RunSettings(**{**job["settings"], "decodings": tuple(job["settings"]["decodings"])})
        left = job["time_budget_s"] - (time.monotonic() - t_begin)
        settings.seconds_per_system = min(settings.seconds_per_system, 0.5 * left)
        prompts = [Prompt(**p) for p in job["prompts"]]

        def gen(ids: list[int], n: int, dec: str, seed: int) -> dict[str, Any]:
            sp = SamplingParams(**DECODINGS[dec], seed=seed)
            g = model.generate(list(ids), n, sp, ignore_eos=True).wait()  # llama-server's ignore_eos
            d = g.stats.to_dict()
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


def main(argv: Sequence[str]) -> int:
    if len(argv) == 1:
        return ours_worker(argv[0])
    print("usage: python -m specter_gguf.bench.worker JOB.json  (started by scripts/bench.py)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
