#!/usr/bin/env python3
"""How a speculative verification should meet the lookahead's copies still in flight, measured on one loaded model
(`SpeculativeDecoder.prefetch_wait`):

- layer (the default): each MoE layer of the verification waits on the GPU for its own copies (inside the CUDA
  graph), so later layers' copies land while earlier layers compute;
- all: the verification waits for all of them before it starts;
- none: it reads those experts in place from host memory while their copies land (the same bytes cross PCIe
  twice);

and, with `--bring-in`, the same with lru also bringing the experts a verification read in place into the cache
after it, as plain lru decoding does (the default with a draft leaves the cache to the lookahead buffer:
`OffloadOptions.lookahead`).

    python3 scripts/bench_prefetch.py TARGET.gguf --drafts Q4.gguf[,Q2.gguf] --gpu-budget 16GiB \\
        [--prompts 2] [-n 64] [--bring-in]

The bench prompts (scripts/bench_prompts.json), greedy and sampled (temperature 1, top-k 40, top-p 0.95, min-p
0.05), after one warm-up generation per decoding; prints a Markdown table: TPOT (median over prompts), acceptance, hit rate,
per iteration drafting, verification and copy-wait ms, expert MiB per token read in place and copied,
prefetched, late and refused experts per iteration, prefetch recall.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from specter_gguf.bench.metrics import SAMPLED  # noqa: E402
from specter_gguf.bench.prompts import load_prompts  # noqa: E402
from specter_gguf.engine import Model  # noqa: E402
from specter_gguf.sampling import SamplingParams  # noqa: E402
from specter_gguf.speculation.decoder import PREFETCH_WAITS  # noqa: E402

DECODINGS = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(**SAMPLED, seed=1234)}
SUMMED = ("draft_tokens", "draft_accepted", "draft_rounds", "draft_s", "verify_s", "copy_exposed_s", "cache_hits",
          "cache_lookups", "zero_copy_bytes", "bytes_copied", "prefetched", "prefetched_used", "verify_missing",
          "prefetch_late", "prefetch_refused", "prompt_tokens", "generated_tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--drafts", required=True, help="comma list of draft GGUF files")
    ap.add_argument("--gpu-budget", default="16GiB")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    ap.add_argument("--bring-in", action="store_true", help="also each wait with lru bringing in")
    args = ap.parse_args()
    variants = [(wait, bring_in) for bring_in in ((False, True) if args.bring_in else (False,))
                for wait in PREFETCH_WAITS]
    prompts = load_prompts(n=args.prompts)
    print("| draft | variant | decoding | TPOT ms | acceptance | hit rate | draft ms/iter | verify ms/iter | "
          "copy wait ms/iter | in place MiB/token | copied MiB/token | prefetched/iter | late/iter | "
          "refused/iter | recall |")
    print("|---|---|---|" + "---|" * 12)
    for draft in args.drafts.split(","):
        m = Model.load(args.target, draft=draft, device=args.device, gpu_budget=args.gpu_budget, ctx_size=1024,
                       progress=False)
        ids = [m.tokenize(p.text) for p in prompts]
        for params in DECODINGS.values():  # warm-up: the graphs of each decoding captured
            m.generate(ids[0], 32, params).wait()
        for wait, bring_in in variants:
            m.decoder.prefetch_wait, m.offload.options.lookahead = wait, not bring_in
            name = wait + (", bring-in" if bring_in else "")
            for dec, params in DECODINGS.items():
                gens = [m.generate(i, args.n_predict, params).wait().stats for i in ids]
                t = {f: sum(getattr(s, f) or 0 for s in gens) for f in SUMMED}
                it, tokens = t["draft_rounds"] or 1, t["prompt_tokens"] + t["generated_tokens"]
                cells = [Path(draft).name, name, dec, statistics.median(s.tpot_ms for s in gens),
                         t["draft_accepted"] / max(1, t["draft_tokens"]), t["cache_hits"] / max(1, t["cache_lookups"]),
                         1e3 * t["draft_s"] / it, 1e3 * t["verify_s"] / it, 1e3 * t["copy_exposed_s"] / it,
                         t["zero_copy_bytes"] / tokens / 2**20, t["bytes_copied"] / tokens / 2**20,
                         t["prefetched"] / it, t["prefetch_late"] / it, t["prefetch_refused"] / it,
                         t["prefetched_used"] / max(1, t["verify_missing"])]
                print("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells) + " |",
                      flush=True)
        m.offload.close()
        del m
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
