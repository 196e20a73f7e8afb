#!/usr/bin/env python3
"""Write a random-weight MoE GGUF (llama.cpp layout) from a preset, optionally with quantized drafts.

Examples:
  python scripts/make_synthetic.py --preset tiny-qwen2moe --dtype f16 -o /tmp/tiny-qwen2moe.gguf
  python scripts/make_synthetic.py --preset qwen1.5-moe-a2.7b --device cuda \\
      --vocab-from vendor/llama.cpp/models/ggml-vocab-qwen2.gguf -o /data/qwen2moe-f16.gguf \\
      --quantize q8_0,q4_k_m,q2_k
  # Q8_0 written directly (no F16 copy on disk), and a Q2_K draft requantized from it:
  python scripts/make_synthetic.py --preset qwen3-30b-a3b --dtype q8_0 --device cuda \\
      --vocab-from vendor/llama.cpp/models/ggml-vocab-qwen2.gguf -o /data/qwen3moe-q8_0.gguf --quantize q2_k
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

try:
    import specter_gguf  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.outputs import check_output_file  # noqa: E402
from specter_gguf.quantize import FTYPES, quantize_with_progress, quantized_path  # noqa: E402
from specter_gguf.sizes import format_size  # noqa: E402
from specter_gguf.synthetic.shapes import PRESETS, get_preset  # noqa: E402
from specter_gguf.synthetic.writer import DTYPES, write_synthetic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=list(PRESETS), help="model shape")
    ap.add_argument("--dtype", default="f16", choices=DTYPES,
                    help="type of the weight matrices (q8_0: quantized as generated; routers and 1-D tensors "
                         "stay F32, rows not a multiple of 32 F16)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (quick runs)")
    ap.add_argument("--vocab-from", type=Path, default=None,
                    help="copy tokenizer.* keys (and n_vocab) from this GGUF; default: tiny BPE")
    ap.add_argument("--device", default="cpu", help="torch device for the random numbers (cpu, cuda)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attn-output-scale", type=float, default=1.0,
                    help="attention's output weights at this multiple of their usual std: below 1 the routing "
                         "follows each token more than its context, as a trained model's (0.3: consecutive tokens "
                         "share about twice the experts chance gives; 0.1: about chance; 0.01 to 10, default 1)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="output .gguf path")
    ap.add_argument("--quantize", default="",
                    help=f"comma-separated draft types written next to the output ({', '.join(FTYPES)})")
    ap.add_argument("--threads", type=int, default=0, help="quantizer threads (0 = all)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    try:
        shape = get_preset(args.preset)
        if args.layers is not None:
            if args.layers < 1:
                raise SpecterError("--layers must be >= 1")
            shape = shape.with_layers(args.layers)
        shape = dataclasses.replace(shape, attn_output_scale=args.attn_output_scale)
        qtypes = [q.strip().lower() for q in args.quantize.split(",") if q.strip()]
        bad = [q for q in qtypes if q not in FTYPES]
        if bad:
            raise SpecterError(f"unknown --quantize type(s) {bad}; valid: {', '.join(FTYPES)}")

        check_output_file(args.output, f"-o {args.output}")  # a missing folder is refused, as everywhere
        r = write_synthetic(args.output, shape, args.dtype, seed=args.seed, device=args.device,
                            vocab_from=args.vocab_from, progress=not args.no_progress)
        print(f"wrote {r.path}: {shape.arch} {args.preset} ({shape.n_layer} layers, {r.n_vocab} vocab), "
              f"{r.n_params / 1e6:.1f} M params, {args.dtype}, {format_size(r.n_bytes, '.1f')} in {r.seconds:.1f} s")
        for q in qtypes:
            dst = quantized_path(args.output, q)
            t0 = time.perf_counter()
            quantize_with_progress(args.output, dst, q, show=not args.no_progress, n_threads=args.threads,
                                   allow_requantize=args.dtype == "q8_0")  # llama.cpp's own log: a bar instead
            print(f"wrote {dst}: {q}, {format_size(dst.stat().st_size, '.1f')} in {time.perf_counter() - t0:.1f} s")
    except SpecterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
