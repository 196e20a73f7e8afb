#!/usr/bin/env python3
"""Expert-cache hit rates over a model's own routing (`specter_gguf.bench.cache_replay`): the lru, lfu and by-uses
policies (by-uses: hybrid's where routing does not repeat) and the best possible (Belady's), each with a missed
expert in a slot for the next forward (delay 0), the one after (1) and as the engine has it (3: it decodes one
step ahead of the host), at the slots per MoE layer of each GPU budget's plan; and lru as the engine has it with
spare slots (`--spare-slots`: a layer's misses copied by the forward itself into that many of its slots, found
from the next forward on). Which misses a better policy could save and which only an earlier copy could. A second
table keeps one cache through every prompt in turn, as a server does, with use counts halved as the engine's or
lifetime counts.

    python3 scripts/bench_cache.py MODEL.gguf [--budgets 12GiB,16GiB,20GiB] [--spares 2,4] [--prompts 2] [-n 64]
        [--device cuda]

Records the routing of the bench prompts (scripts/bench_prompts.json), greedy and sampled (temperature 1, top-k 40,
top-p 0.95, min-p 0.05), with the whole model loaded (on the CPU when it does not fit the GPU: routing is the
same); prints Markdown tables of decode hit rates, all prompts' lookups together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specter_gguf.bench.cache_replay import ENGINE_DELAY, POLICIES, RoutingRecorder, replay, replay_served  # noqa: E402
from specter_gguf.runtime.offload import MAX_SPARES, residency_max_tokens  # noqa: E402
from specter_gguf.bench.metrics import SAMPLED  # noqa: E402
from specter_gguf.bench.prompts import load_prompts  # noqa: E402
from specter_gguf.engine import Model  # noqa: E402
from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.gguf_file import GGUFFile  # noqa: E402
from specter_gguf.runtime.budget import plan_memory  # noqa: E402
from specter_gguf.runtime.cache import USES_HALVED_AFTER  # noqa: E402
from specter_gguf.sampling import SamplingParams  # noqa: E402

DECODINGS = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(**SAMPLED, seed=1234)}
DELAYS = (0, 1, ENGINE_DELAY)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--budgets", default="12GiB,16GiB,20GiB", help="GPU budgets whose plans give the slots")
    ap.add_argument("--spares", default="2,4", help="spare slots a layer of the engine's lru columns")
    ap.add_argument("--ctx-size", type=int, default=1024, help="the context the plans are made for")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="where the model runs to record its routing")
    args = ap.parse_args()
    f = GGUFFile(args.model)
    budgets = []
    try:
        spares = [int(x) for x in args.spares.split(",") if x.strip()]
        if any(not 0 < n <= MAX_SPARES for n in spares):
            raise ValueError
    except ValueError:
        sys.exit(f"bench_cache.py: --spares takes spare slot counts from 1 to {MAX_SPARES}, not {args.spares!r}")
    try:
        for b in args.budgets.split(","):
            plan = plan_memory(f, b, args.ctx_size, "cuda")
            plan.check()  # a budget the engine would refuse has no slots to replay
            budgets.append((b, plan.n_slots // plan.n_moe_layers, plan.n_experts_total // plan.n_moe_layers))
    except SpecterError as e:
        sys.exit(f"bench_cache.py: {e}")
    model = Model.load(args.model, device=args.device, progress=False, ctx_size=args.ctx_size)
    waves_above = residency_max_tokens(model.config)  # a longer prompt's experts come in waves (`replay`)
    recorder = RoutingRecorder()
    model.routing_observer = recorder
    traces = {}
    for name, sampling in DECODINGS.items():
        traces[name] = []
        for p in load_prompts(n=args.prompts):
            g = model.generate(p.text, args.n_predict, sampling, ignore_eos=True).wait()
            traces[name].append((recorder.take(), g.stats.prompt_tokens > waves_above))
    heads = [f"{policy} d{d}" for policy in POLICIES for d in DELAYS] + [f"lru d{ENGINE_DELAY} + {n} spares"
                                                                          for n in spares]
    print(f"Decode hit rate, {args.model.name}, {args.prompts} prompts × {args.n_predict} tokens (dN: a missed expert "
          f"is in a slot from the N+1-th forward after it on; + S spares: S of the layer's slots kept for the "
          f"forward's own copies of its misses, as the engine's --spare-slots)\n")
    print("| Decoding | Budget | Slots/layer | " + " | ".join(heads) + " |")
    print("|---|---|---|" + "---|" * len(heads))
    for name, runs in traces.items():
        for budget, slots, experts in budgets:
            cases = [(policy, d, 0) for policy in POLICIES for d in DELAYS] + [("lru", ENGINE_DELAY, n)
                                                                                 for n in spares]
            rates = []
            for policy, d, n in cases:
                if n >= slots:
                    rates.append("—")
                    continue
                hits = sum(replay(t, slots, policy, d, n, prompt_in_waves=waves) * _lookups(t) for t, waves in runs)
                rates.append(f"{100 * hits / sum(_lookups(t) for t, _ in runs):.1f}%")
            print(f"| {name} | {budget} | {slots} of {experts} | " + " | ".join(rates) + " |")
    served = [(policy, halve) for policy in ("lru", "lfu", "by-uses") for halve in (USES_HALVED_AFTER, 0)
              if policy != "lru" or halve]  # lru counts no uses
    print(f"\nThe same prompts one after another in one cache, as a server keeps it (d{ENGINE_DELAY}; use counts "
          f"halved after each {USES_HALVED_AFTER} × the slots in counted uses as the engine's, or lifetime counts)\n")
    heads = ["lru" if policy == "lru" else f"{policy}, {'halved' if halve else 'lifetime'}" for policy, halve in served]
    print("| Decoding | Budget | Slots/layer | " + " | ".join(heads) + " |")
    print("|---|---|---|" + "---|" * len(heads))
    for name, runs in traces.items():
        for budget, slots, experts in budgets:
            rates = [f"{100 * replay_served(runs, slots, policy, ENGINE_DELAY, halve_after=halve):.1f}%"
                     for policy, halve in served]
            print(f"| {name} | {budget} | {slots} of {experts} | " + " | ".join(rates) + " |")
    return 0


def _lookups(trace: list) -> int:
    return sum(len(experts) for forward in trace[1:] for experts in forward.values())


if __name__ == "__main__":
    sys.exit(main())
