#!/usr/bin/env python3
"""Benchmark matrix: llama.cpp (all on GPU, -ncmoe, its own speculative decoding) and our engine's modes on the
same model file, prompts, generated-token count and GPU budget. Library code: specter_gguf/benchmark.py.

On the GPU machine (carry .gpu; see ../shared/gpu/prepare.sh), from the repository root:
  source .gpu/on-device.sh
  python3 scripts/bench.py --model-preset qwen1.5-moe-a2.7b --budgets 16GiB,20GiB --out $OUT/bench \\
      --n-predict 128 --prompts 20 --deadline 560
It builds llama.cpp's tools unless /tmp/llama/build/bin has them (or --llama-bin), writes the random-weight
target (F16; --target-type q8_0 writes Q8_0 directly, for disks that cannot hold an F16 copy) and its drafts
(requantized from a Q8_0 target) into --work-dir unless they are there, then runs the systems one at a time and
writes into --out: results.json (raw, rewritten after every system), section.md (the report section), PNG
plots and logs/. Render again or merge parts (e.g. after --part 1/2 and 2/2) without running anything:
  python scripts/bench.py --from-results a/results.json,b/results.json --out merged \\
      --report docs/BENCHMARKS.md --img-dir docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specter_gguf import benchmark as B  # noqa: E402
from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.synthetic import DTYPES  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("model")
    g.add_argument("--model-preset", help="synthetic model preset (specter_gguf.synthetic.PRESETS)")
    g.add_argument("--layers", type=int, default=None, help="shrink the preset to N layers (quick runs)")
    g.add_argument("--model", type=Path, help="use this GGUF as the target instead of making one")
    g.add_argument("--draft", type=Path, help="use this GGUF as the draft instead of making one")
    g.add_argument("--target-type", default="f16", choices=DTYPES,
                   help="type of the synthetic target's matrices (q8_0: quantized as written, e.g. "
                        "--model-preset qwen3-30b-a3b --target-type q8_0 --draft-types q2_k)")
    g.add_argument("--draft-types", default="q4_k_m",
                   help="drafts to make from the target (comma list; the first is used by speculative systems)")
    g.add_argument("--vocab-from", type=Path, help="vocab GGUF for real-shape presets (default: found in llama.cpp's tree)")
    g.add_argument("--work-dir", type=Path, default=Path("/tmp/specter-bench"), help="where models are made and kept")
    g.add_argument("--make-device", default=None, help="torch device making the random weights (default: --device)")
    g = ap.add_argument_group("matrix")
    g.add_argument("--systems", default="*", help=f"comma list of names/globs from: {', '.join(B.ALL_FAMILIES)}")
    g.add_argument("--budgets", default="", help="GPU budgets: 16GiB,20GiB or shares of the target file: 50%%,70%%")
    g.add_argument("--n-predict", type=int, default=128)
    g.add_argument("--prompts", type=int, default=20, help="how many prompts of the prompts file")
    g.add_argument("--prompts-file", type=Path, default=B.PROMPTS_FILE)
    g.add_argument("--decodings", default="greedy,sampled")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--ctx-size", type=int, default=1024, help="context of every system (KV cache size)")
    g.add_argument("--device", default="cuda", help="device of our engine (cpu for a smoke test)")
    g.add_argument("--margin", default="1GiB", help="GPU memory kept for llama.cpp compute buffers and CUDA context")
    g.add_argument("--draft-margin", default="512MiB", help="the same for the draft model")
    g.add_argument("--ncmoe-sweep", default="-1,0,1", help="offsets around the smallest fitting -ncmoe (write --ncmoe-sweep=-1,0,1)")
    g.add_argument("--synth-lens", default="2,4,6,8", help="synthetic mean accepted lengths L")
    g.add_argument("--draft-n-max", type=int, default=8,
                   help="tokens drafted per verification, llama.cpp's and ours alike")
    g.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: its own)")
    g.add_argument("--part", default=None, help="run only part i/n of the matrix, e.g. 1/2")
    g = ap.add_argument_group("time limits")
    g.add_argument("--seconds-per-system", type=float, default=60.0,
                   help="no further prompt is started after this much measuring time")
    g.add_argument("--job-timeout", type=float, default=420.0, help="hard limit per system, loading included")
    g.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from start after which no system starts (0: none); results are always written")
    g = ap.add_argument_group("tools")
    g.add_argument("--llama-bin", type=Path, help="directory holding llama-server (default /tmp/llama/build/bin)")
    g.add_argument("--no-build", action="store_true", help="never build llama.cpp")
    g = ap.add_argument_group("output")
    g.add_argument("--out", type=Path, help="output folder (results.json, section.md, plots, logs)")
    g.add_argument("--report", type=Path, help="also append the section to this Markdown file")
    g.add_argument("--img-dir", type=Path, help="also copy the plots here (referenced from --report)")
    g.add_argument("--from-results", help="comma list of results.json to render (and merge) instead of running")
    g.add_argument("--prepare-only", action="store_true", help="build tools and make models, then stop")
    g.add_argument("--dry-run", action="store_true", help="print the matrix with memory estimates, run nothing")
    g.add_argument("--store-token-ids", type=Path, metavar="VOCAB.gguf",
                   help="maintenance: store the prompts' ids for this vocab in the prompts file, then stop")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    print(msg, flush=True)


def render(doc: dict, out: Path, report: Path | None, img_dir: Path | None) -> None:
    stem = "bench-" + doc["meta"].get("stamp", "run")
    plots = B.write_plots(doc, out, stem)
    (out / "section.md").write_text(B.render_markdown(doc, [p.name for p in plots]))
    if report is not None:
        images = []
        for p in plots:
            dst = p
            if img_dir is not None:
                img_dir.mkdir(parents=True, exist_ok=True)
                dst = img_dir / p.name
                shutil.copyfile(p, dst)
            images.append(os.path.relpath(dst, report.resolve().parent))
        B.append_report(report, B.render_markdown(doc, images))
        log(f"appended to {report}")
    log(f"wrote {out / 'section.md'}" + (f" and {len(plots)} plot(s)" if plots else
                                         " (no plots: nothing measured, or matplotlib missing)"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.deadline if args.deadline > 0 else None
    try:
        if args.store_token_ids:
            fp, n = B.store_token_ids(args.prompts_file, args.store_token_ids)
            log(f"stored ids of {n} prompts for vocab {fp} in {args.prompts_file}")
            return 0
        if args.out is None:
            raise SpecterError("--out is required")
        args.out.mkdir(parents=True, exist_ok=True)
        if args.from_results:
            docs = [json.loads(Path(p).read_text()) for p in args.from_results.split(",") if p.strip()]
            doc = B.merge_docs(docs)
            B.write_json(args.out / "results.json", doc)
            render(doc, args.out, args.report, args.img_dir)
            return 0
        return run(args, t_start, deadline)
    except SpecterError as e:
        log(f"error: {e}")
        return 2


def run(args: argparse.Namespace, t_start: float, deadline: float | None) -> int:
    families = B.select_families(args.systems)
    wants_llama = any(f.startswith("llama") for f in families)
    wants_draft = any(f in ("llama-spec", "llama-spec-synth") or (f in B.OURS_MODES and B.OURS_MODES[f].needs_draft)
                      for f in families)
    if args.model is None and not args.model_preset:
        raise SpecterError("give --model-preset (or --model)")

    # -- tools (built in the background while the target is written)
    llama_bin = B.find_llama_bin(args.llama_bin)
    build = None
    need_tools = wants_llama or (wants_draft and args.draft is None and not _have_llama_cpp())
    if llama_bin is None and need_tools:
        if args.no_build or args.llama_bin:
            raise SpecterError(f"llama-server not found in {args.llama_bin or B.LLAMA_BUILD_DIR}")
        log("building llama.cpp tools in the background (about 4 minutes)")
        build = B.start_llama_build(("llama-server", "llama-bench"), args.out / "build-llama.log")

    # -- models
    try:
        if args.model is not None:
            target = args.model.resolve()
        else:
            from specter_gguf.synthetic import SUGGESTED_VOCAB, get_preset

            get_preset(args.model_preset)
            vocab = args.vocab_from
            if vocab is None and args.model_preset in SUGGESTED_VOCAB:
                vocab = B.find_vocab(SUGGESTED_VOCAB[args.model_preset], args.work_dir)
            target = B.make_target(args.model_preset, args.layers, args.work_dir, args.make_device or args.device,
                                   vocab, log, target_type=args.target_type)
        if build is not None:
            log("waiting for the llama.cpp build")
            llama_bin = B.wait_llama_build(build, timeout=1200)
            build = None
            log(f"llama.cpp tools in {llama_bin}")
    finally:
        if build is not None and build.poll() is None:
            import signal

            os.killpg(build.pid, signal.SIGKILL)
    draft = args.draft.resolve() if args.draft else None
    draft_types = [q.strip().lower() for q in args.draft_types.split(",") if q.strip()]
    if wants_draft and draft is None:
        for q in draft_types:
            d = B.make_draft(target, q, llama_bin, log)
            draft = draft or d
    if args.prepare_only:
        log(f"prepared in {time.monotonic() - t_start:.0f} s: target {target}, draft {draft}, tools {llama_bin}")
        return 0

    # -- matrix
    sizes = B.ModelSizes.from_gguf(target)
    dsizes = B.ModelSizes.from_gguf(draft) if draft else None
    budgets = B.parse_budgets(args.budgets, sizes.file_bytes)
    cfg = B.MatrixConfig(sizes, dsizes, _draft_label(draft), budgets, args.ctx_size, B.parse_size(args.margin),
                         B.parse_size(args.draft_margin), tuple(int(x) for x in args.ncmoe_sweep.split(",") if x.strip()),
                         tuple(float(x) for x in args.synth_lens.split(",") if x.strip()), args.draft_n_max)
    specs, notes = B.build_matrix(families, cfg)
    specs = B.split_part(specs, args.part)
    log(f"target {target.name}: {B.format_size(sizes.file_bytes)}, {sizes.n_layer} layers, non-expert "
        f"{B.format_size(sizes.nonexpert_bytes)} (+{B.format_size(sizes.cpu_only_bytes)} embeddings on the CPU), "
        f"experts {B.format_size(sum(sizes.expert_bytes))}")
    for s in specs:
        log(f"  {s.key:<70} est. GPU {B.format_size(s.est_gpu_bytes)}  {s.note}")
    for n in notes:
        log(f"  not run: {n}")
    if args.dry_run:
        return 0
    if not specs:
        raise SpecterError("nothing to run: check --systems and --budgets")

    prompts = B.load_prompts(args.prompts_file, args.prompts)
    with B.server_tokenizer(llama_bin, target, args.out / "logs" / "tokenize.log") as stok:
        how = B.tokenize_prompts(prompts, target, args.prompts_file, stok if llama_bin else None)
    log(f"{len(prompts)} prompts tokenized by {how}: {[len(p.ids) for p in prompts]} tokens")

    decodings = tuple(d.strip() for d in args.decodings.split(",") if d.strip())
    bad = [d for d in decodings if d not in B.DECODINGS]
    if bad or not decodings:
        raise SpecterError(f"--decodings: choose from {', '.join(B.DECODINGS)}")
    settings = B.RunSettings(args.n_predict, decodings, args.seed, args.seconds_per_system)
    ctx = B.BenchContext(str(target), _model_label(args, sizes), prompts, settings, args.out, args.ctx_size,
                         args.device, llama_bin, args.threads, args.job_timeout, deadline, log)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    meta = {
        "date": B.now_utc(), "stamp": stamp, "gpu": B.gpu_info(),
        "model": str(target), "model_label": ctx.model_label, "model_bytes": sizes.file_bytes,
        "draft": str(draft) if draft else None, "draft_bytes": dsizes.file_bytes if dsizes else None,
        "budgets": {b.label: b.bytes for b in budgets}, "n_prompts": len(prompts), "n_predict": args.n_predict,
        "decodings": list(decodings), "seed": args.seed, "ctx_size": args.ctx_size, "tokenized_by": how,
        "llama_version": B.llama_version(llama_bin) if llama_bin else None, "part": args.part,
        "command": "python3 scripts/bench.py " + shlex.join(sys.argv[1:] if argv_is_cli() else []),
    }
    doc = {"meta": meta, "notes": notes, "results": []}

    def on_result(r: dict) -> None:
        doc["results"].append(r)
        B.write_json(args.out / "results.json", doc)

    B.write_json(args.out / "results.json", doc)
    B.run_matrix(specs, ctx, on_result)
    render(doc, args.out, args.report, args.img_dir)
    n_ok = sum(r["status"] == "ok" for r in doc["results"])
    log(f"done in {time.monotonic() - t_start:.0f} s: {n_ok} of {len(doc['results'])} systems ok")
    return 0


def argv_is_cli() -> bool:
    return Path(sys.argv[0]).name == "bench.py"


def _have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def _draft_label(draft: Path | None) -> str | None:
    if draft is None:
        return None
    stem = draft.stem.lower()
    for q in sorted(B.QTYPE_LLAMA, key=len, reverse=True):
        if stem.endswith(q):
            return B.QTYPE_LLAMA[q]
    return draft.name


def _model_label(args: argparse.Namespace, sizes: B.ModelSizes) -> str:
    if args.model_preset and args.model is None:
        from specter_gguf.synthetic import get_preset

        name = get_preset(args.model_preset).name or args.model_preset
        return (f"{name}, {sizes.n_layer} layers, {args.target_type.upper()}"
                + (" (shrunk with --layers)" if args.layers else ""))
    return f"{Path(sizes.path).name} ({sizes.arch}, {sizes.n_layer} layers)"


if __name__ == "__main__":
    sys.exit(main())
