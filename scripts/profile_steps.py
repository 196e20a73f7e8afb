#!/usr/bin/env python3
"""Where a speculative iteration's GPU time goes, kernel by kernel: PyTorch's profiler around CUDA-graph replays of
a draft step (greedy, then sampled) and of a verification of `--tokens` tokens, on a model loaded whole on the GPU
(resident experts: the kernels, not the copies).

    python3 scripts/profile_steps.py TARGET.gguf --draft DRAFT.gguf [--tokens 9] [--replays 40] [--order]

A file of a few layers keeps the run short and the per-layer figures the same
(`scripts/make_synthetic.py --preset qwen1.5-moe-a2.7b --layers 4 --dtype f16 --quantize q4_k_m`). For each step:
its time per replay by CUDA events, then a Markdown table of kernels (calls and GPU µs per step, largest first);
with `--order`, one step's kernels in launch order with their start (µs from the first) and duration.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from specter_gguf import native  # noqa: E402
from specter_gguf.bench.metrics import SAMPLED  # noqa: E402
from specter_gguf.engine import Model  # noqa: E402
from specter_gguf.sampling import SamplingParams  # noqa: E402
from specter_gguf.speculation.decoder import SpeculativeDecoder  # noqa: E402
from specter_gguf.steps import Steps  # noqa: E402
from specter_gguf.tokenizer import IdsOnlyTokenizer  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
SAMPLED_PARAMS = SamplingParams(**SAMPLED, seed=1)
PROMPT = list(range(100, 164))


def event_ms(fn: Callable[[], None], n: int) -> float:
    """Mean milliseconds of `fn` over n calls after three, by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / n


def kernel_table(fn: Callable[[], None], n: int, title: str, order: bool) -> None:
    ms = event_ms(fn, n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e.name].append(e.device_time_total)
    total = sum(map(sum, by_name.values())) / n
    print(f"\n## {title}: {ms * 1000:.0f} µs per step by events; {len(events) / n:.0f} kernels, {total:.0f} µs of "
          "kernel time per step\n")
    print("| kernel | calls/step | µs/step |\n|---|---|---|")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name[:100]} | {len(times) / n:.1f} | {sum(times) / n:.1f} |")
    if order:
        events.sort(key=lambda e: e.time_range.start)
        first = events[0].time_range.start
        print("\none step in launch order (start µs, duration µs, kernel):\n```")
        for e in events[:round(len(events) / n)]:
            print(f"{e.time_range.start - first:8.1f} {e.device_time_total:6.1f}  {e.name[:110]}")
        print("```")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--draft", type=Path, required=True, help="the draft GGUF (a quantized copy of the target)")
    ap.add_argument("--tokens", type=int, default=9, help="tokens of the profiled verification (drafted + 1)")
    ap.add_argument("--replays", type=int, default=40, help="replays per profiled step")
    ap.add_argument("--order", action="store_true", help="also list one step's kernels in launch order")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and native.has_cuda()):
        print("profile_steps: needs a CUDA GPU and libspecter built with CUDA", file=sys.stderr)
        return 2
    if not 2 <= args.tokens <= 17:
        print(f"profile_steps: --tokens must be 2 to 17, not {args.tokens}", file=sys.stderr)
        return 2
    with torch.inference_mode():
        model = Model.load(args.target, device="cuda", draft=args.draft, n_draft=args.tokens - 1, progress=False,
                           tokenizer=IdsOnlyTokenizer())
        decoder = model.decoder
        assert isinstance(decoder, SpeculativeDecoder)
        for params in (GREEDY, SAMPLED_PARAMS):  # captures the graphs of both decodings
            model.generate(PROMPT, 40, params, ignore_eos=True).wait()
        cache = model.reusable_cache
        print(f"{args.target.name}: {model.config.n_layer} layers, draft {args.draft.name}, cache length {cache.length}")
        start = cache.length

        def replay(steps: Steps, n_tokens: int) -> Callable[[], None]:
            inputs = torch.tensor([*range(200, 200 + n_tokens), start], device="cuda")  # [tokens, position]

            def fn() -> None:
                cache.length = start  # every replay writes the same positions
                steps.step(inputs)
            return fn

        for name, sampled in (("greedy", None), ("sampled", SAMPLED_PARAMS)):
            steps = decoder.steps(model, cache, 1, draft=True, sampled=sampled)
            kernel_table(replay(steps, 1), args.replays, f"draft step ({name})", args.order)
        verify = decoder.steps(model, cache, args.tokens, draft=False)
        kernel_table(replay(verify, args.tokens), max(1, args.replays // 2),
                     f"verification of {args.tokens} tokens (greedy, resident experts)", args.order)
        cache.length = start
    return 0


if __name__ == "__main__":
    sys.exit(main())
