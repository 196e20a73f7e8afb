#!/usr/bin/env python3
"""Benchmark matrix: llama.cpp (all on GPU, -ncmoe, its own speculative decoding) and our engine's modes on the
same model file, prompts, generated-token count and GPU budget. Library code: specter_gguf/bench/.

On the GPU machine (carry .gpu; see ../shared/gpu/prepare.sh), from the repository root:
  source .gpu/on-device.sh
  python3 scripts/bench.py --model-preset qwen1.5-moe-a2.7b --budgets 16GiB,20GiB --out $OUT/bench \\
      --n-predict 128 --prompts 20 --deadline 560
It builds llama.cpp's tools unless /tmp/llama/build/bin (--llama-dir) has them (or --llama-bin), writes the
random-weight target (F16; --target-type q8_0 writes Q8_0 directly, for disks that cannot hold an F16 copy) and its
drafts (requantized from a Q8_0 target) into --work-dir unless they are there, then runs the systems one at a time and
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

from specter_gguf.bench import REPO_ROOT  # noqa: E402
from specter_gguf.bench.gpu import gpu_info  # noqa: E402
from specter_gguf.bench.llamacpp import (DEFAULT_LLAMA_DIR, ModelSizes, find_llama_bin,  # noqa: E402
                                         llama_build_bin, llama_version, start_llama_build, wait_llama_build)
from specter_gguf.bench.matrix import (ALL_FAMILIES, MatrixConfig, build_matrix, parse_budgets,  # noqa: E402
                                       select_families, split_part)
from specter_gguf.bench.metrics import DECODINGS  # noqa: E402
from specter_gguf.bench.model_files import (DEFAULT_SDIST_DIR, QTYPE_LLAMA, find_vocab,  # noqa: E402
                                            llama_sources, make_draft, make_target)
from specter_gguf.bench.ours import OURS_MODES  # noqa: E402
from specter_gguf.bench.plots import write_plots  # noqa: E402
from specter_gguf.bench.process import kill_group  # noqa: E402
from specter_gguf.bench.prompts import (PROMPTS_FILE, load_prompts, server_tokenizer,  # noqa: E402
                                        store_token_ids, tokenize_prompts)
from specter_gguf.bench.report import (append_report, format_size, merge_docs, now_utc, read_results,  # noqa: E402
                                       render_markdown, write_json)
from specter_gguf.bench.runner import BenchContext, RunSettings, run_matrix  # noqa: E402
from specter_gguf.errors import SpecterError  # noqa: E402
from specter_gguf.sizes import parse_size  # noqa: E402
from specter_gguf.synthetic.writer import DTYPES, check_attn_output_scale  # noqa: E402
from specter_gguf.tokenizer import llama_cpp_available  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("model")
    g.add_argument("--model-preset", help="synthetic model preset (specter_gguf.synthetic.shapes.PRESETS)")
    g.add_argument("--layers", type=int, default=None, help="shrink the preset to N layers (quick runs)")
    g.add_argument("--model", type=Path, help="use this GGUF as the target instead of making one")
    g.add_argument("--draft", type=Path, help="use this GGUF as the draft instead of making one")
    g.add_argument("--attn-output-scale", type=float, default=1.0,
                   help="the synthetic target's attention output weights at this multiple of their usual std "
                        "(below 1: routing that follows each token more than its context; see "
                        "specter_gguf/synthetic/writer.py); in the target's name when not 1")
    g.add_argument("--target-type", default="f16", choices=DTYPES,
                   help="type of the synthetic target's matrices (q8_0: quantized as written, e.g. "
                        "--model-preset qwen3-30b-a3b --target-type q8_0 --draft-types q2_k)")
    g.add_argument("--draft-types", default="q4_k_m",
                   help="drafts to make from the target (comma list; the first is used by speculative systems)")
    g.add_argument("--vocab-from", type=Path, help="vocab GGUF for real-shape presets (default: found in llama.cpp's tree)")
    g.add_argument("--work-dir", type=Path, default=Path("/tmp/specter-bench"), help="where models are made and kept")
    g.add_argument("--make-device", default=None, help="torch device making the random weights (default: --device)")
    g = ap.add_argument_group("matrix")
    g.add_argument("--systems", default="*", help=f"comma list of names/globs from: {', '.join(ALL_FAMILIES)}")
    g.add_argument("--budgets", default="", help="GPU budgets: 16GiB,20GiB or shares of the target file: 50%%,70%%")
    g.add_argument("--n-predict", type=int, default=128)
    g.add_argument("--prompts", type=int, default=20, help="how many prompts of the prompts file")
    g.add_argument("--prompts-file", type=Path, default=PROMPTS_FILE)
    g.add_argument("--decodings", default="greedy,sampled")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--ctx-size", type=int, default=1024, help="context of every system (KV cache size)")
    g.add_argument("--device", default="cuda", help="device of our engine (cpu for a smoke test)")
    g.add_argument("--margin", default="1GiB", help="GPU memory kept for llama.cpp compute buffers and CUDA context")
    g.add_argument("--draft-margin", default="512MiB", help="the same for the draft model")
    g.add_argument("--ncmoe-sweep", default="-1,0,1", help="offsets around the smallest fitting -ncmoe (write --ncmoe-sweep=-1,0,1)")
    g.add_argument("--synth-lens", default="2,4,6,8", help="synthetic mean accepted lengths L")
    g.add_argument("--draft-n-max", type=int, default=8,
                   help="llama.cpp's --spec-draft-n-max (and ours-spec-synth-fixed's depth); the depth at which "
                        "synthetic acceptance keeps a mean of L")
    g.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: its own)")
    g.add_argument("--pcie-gbps", type=float, default=None,
                   help="pace our expert transfers (copies into slots, reads in place) to this rate, as on a PC whose "
                   "PCIe is slower than this machine's (PCIe 4.0 x16: ~25); marked in the report; llama.cpp unpaced")
    g.add_argument("--spare-slots", type=int, default=None,
                   help="our --spare-slots for ours-lru, ours-lru-hybrid and the speculative rows (default: the "
                   "engine's; the -inplace rows keep 0); marked in the report")
    g.add_argument("--part", default=None, help="run only part i/n of the matrix, e.g. 1/2")
    g = ap.add_argument_group("time limits")
    g.add_argument("--seconds-per-system", type=float, default=60.0,
                   help="no further prompt is started after this much measuring time")
    g.add_argument("--job-timeout", type=float, default=420.0, help="hard limit per system, loading included")
    g.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from start after which no system starts, nor one with under 30 s left to it "
                   "(0: none); results are always written")
    g = ap.add_argument_group("tools")
    g.add_argument("--llama-bin", type=Path,
                   help="directory holding llama-server and llama-quantize; given, they are never built "
                        "(default: LLAMA_DIR/build/bin, built there when missing)")
    g.add_argument("--no-build", action="store_true", help="never build llama.cpp")
    g.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA_DIR,
                   help="where build_llama_tools of GPU_DIR/on-device.sh unpacks llama.cpp (llama-src/) and builds "
                        "it (build/bin, cmake.log, build.log): the folder that script builds in")
    g.add_argument("--gpu-dir", type=Path, default=REPO_ROOT / ".gpu",
                   help="the GPU machine's carried folder: on-device.sh (the llama.cpp build) and llama-src.tar.gz "
                        "(llama.cpp's source, vocab GGUFs)")
    g.add_argument("--sdist-dir", type=Path, default=DEFAULT_SDIST_DIR,
                   help="where llama-cpp-python sdists are unpacked (their llama.cpp source has vocab GGUFs)")
    g = ap.add_argument_group("output")
    g.add_argument("--out", type=Path, help="output folder (results.json, section.md, plots, logs)")
    g.add_argument("--report", type=Path, help="also append the section to this Markdown file")
    g.add_argument("--img-dir", type=Path, help="also copy the plots here (referenced from --report)")
    g.add_argument("--from-results", help="comma list of results.json to render (and merge) instead of running")
    g.add_argument("--prepare-only", action="store_true", help="build tools and make models, then stop")
    g.add_argument("--dry-run", action="store_true",
                   help="make what is missing (tools, models), then print the matrix (llama.cpp's rows with memory "
                        "estimates) instead of running it")
    g.add_argument("--store-token-ids", type=Path, metavar="VOCAB.gguf",
                   help="maintenance: store the prompts' ids for this vocab in the prompts file, then stop")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    print(msg, flush=True)


def render(doc: dict, out: Path, report: Path | None, img_dir: Path | None) -> None:
    stem = "bench-" + doc["meta"].get("stamp", "run")
    plots = write_plots(doc, out, stem)
    (out / "section.md").write_text(render_markdown(doc, [p.name for p in plots]))
    if report is not None:
        images = []
        for p in plots:
            dst = p
            if img_dir is not None:
                img_dir.mkdir(parents=True, exist_ok=True)
                dst = img_dir / p.name
                shutil.copyfile(p, dst)
            images.append(os.path.relpath(dst, report.resolve().parent))
        append_report(report, render_markdown(doc, images))
        log(f"appended to {report}")
    log(f"wrote {out / 'section.md'}" + (f" and {len(plots)} plot(s)" if plots else
                                         " (no plots: nothing measured, or matplotlib missing)"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.deadline if args.deadline > 0 else None
    try:
        if args.store_token_ids:
            fp, n = store_token_ids(args.prompts_file, args.store_token_ids)
            log(f"stored ids of {n} prompts for vocab {fp} in {args.prompts_file}")
            return 0
        if args.out is None:
            raise SpecterError("--out is required")
        args.out.mkdir(parents=True, exist_ok=True)
        if args.from_results:
            doc = merge_docs([read_results(Path(p.strip())) for p in args.from_results.split(",") if p.strip()])
            write_json(args.out / "results.json", doc)
            render(doc, args.out, args.report, args.img_dir)
            return 0
        return run(args, t_start, deadline)
    except SpecterError as e:
        log(f"error: {e}")
        return 2


def run(args: argparse.Namespace, t_start: float, deadline: float | None) -> int:
    families = select_families(args.systems)
    wants_llama = any(f.startswith("llama") for f in families)
    wants_draft = any(f in ("llama-spec", "llama-spec-synth") or (f in OURS_MODES and OURS_MODES[f].needs_draft)
                      for f in families)
    if args.model is None and not args.model_preset:
        raise SpecterError("give --model-preset (or --model)")
    if args.model is not None and args.attn_output_scale != 1:
        raise SpecterError("--attn-output-scale shapes the synthetic target of --model-preset; --model's weights are "
                           "used as they are")
    check_attn_output_scale(args.attn_output_scale)

    parse_budgets(args.budgets, model_bytes=1)  # their spelling, before anything is built or written
    # -- tools (built in the background while the target is written)
    bin_dir = args.llama_bin or llama_build_bin(args.llama_dir)
    llama_bin = find_llama_bin(bin_dir)
    build = None
    need_tools = wants_llama or (wants_draft and args.draft is None and not llama_cpp_available())
    if llama_bin is None and need_tools:
        if args.no_build or args.llama_bin:
            raise SpecterError(f"llama-server not found in {bin_dir}")
        log("building llama.cpp tools in the background (about 4 minutes)")
        build = start_llama_build(args.gpu_dir, ("llama-server", "llama-bench"), args.out / "build-llama.log")

    # -- models
    try:
        if args.model is not None:
            target = args.model.resolve()
        else:
            from specter_gguf.synthetic.shapes import SUGGESTED_VOCAB, get_preset

            get_preset(args.model_preset)
            vocab = args.vocab_from
            if vocab is None and args.model_preset in SUGGESTED_VOCAB:
                vocab = find_vocab(SUGGESTED_VOCAB[args.model_preset], args.work_dir, args.gpu_dir,
                                   llama_sources(args.sdist_dir, args.llama_dir))
            target = make_target(args.model_preset, args.layers, args.work_dir, args.make_device or args.device,
                                   vocab, log, target_type=args.target_type,
                                   attn_output_scale=args.attn_output_scale)
        if build is not None:
            log("waiting for the llama.cpp build")
            llama_bin = wait_llama_build(build, args.llama_dir, timeout=1200, log=args.out / "build-llama.log")
            build = None
            log(f"llama.cpp tools in {llama_bin}")
    finally:
        if build is not None and build.poll() is None:
            kill_group(build)
    draft = args.draft.resolve() if args.draft else None
    draft_types = [q.strip().lower() for q in args.draft_types.split(",") if q.strip()]
    if wants_draft and draft is None:
        for q in draft_types:
            d = make_draft(target, q, llama_bin, log)
            draft = draft or d
    if args.prepare_only:
        log(f"prepared in {time.monotonic() - t_start:.0f} s: target {target}, draft {draft}, tools {llama_bin}")
        return 0

    # -- matrix
    sizes = ModelSizes.from_gguf(target)
    dsizes = ModelSizes.from_gguf(draft) if draft else None
    budgets = parse_budgets(args.budgets, sizes.file_bytes)
    cfg = MatrixConfig(sizes, dsizes, _draft_label(draft), budgets, args.ctx_size, parse_size(args.margin),
                       parse_size(args.draft_margin), tuple(int(x) for x in args.ncmoe_sweep.split(",") if x.strip()),
                       tuple(float(x) for x in args.synth_lens.split(",") if x.strip()), args.draft_n_max)
    specs, notes = build_matrix(families, cfg)
    specs = split_part(specs, args.part)
    log(f"target {target.name}: {format_size(sizes.file_bytes)}, {sizes.n_layer} layers, non-expert "
        f"{format_size(sizes.nonexpert_bytes)} (+{format_size(sizes.cpu_only_bytes)} embeddings on the CPU), "
        f"experts {format_size(sum(sizes.expert_bytes))}")
    for s in specs:
        log(f"  {s.key:<70} est. GPU {format_size(s.est_gpu_bytes)}  {s.note}")
    for n in notes:
        log(f"  not run: {n}")
    if args.dry_run:
        return 0
    if not specs:
        raise SpecterError("nothing to run: check --systems and --budgets")

    prompts = load_prompts(args.prompts_file, args.prompts)
    # the warm-ups run the next prompt of the file, not a measured one (`runner.run_prompt_set`)
    warmup = next((p for p in load_prompts(args.prompts_file) if p.id not in {q.id for q in prompts}), None)
    with server_tokenizer(llama_bin, target, args.out / "logs" / "tokenize.log") as stok:
        how = tokenize_prompts(prompts + ([warmup] if warmup else []), target, args.prompts_file,
                               stok if llama_bin else None)
    log(f"{len(prompts)} prompts tokenized by {how}: {[len(p.ids) for p in prompts]} tokens; warm-ups on "
        + (f"{warmup.id} ({len(warmup.ids)} tokens)" if warmup else f"{prompts[0].id}, a measured one"))

    decodings = tuple(d.strip() for d in args.decodings.split(",") if d.strip())
    bad = [d for d in decodings if d not in DECODINGS]
    if bad or not decodings:
        raise SpecterError(f"--decodings: choose from {', '.join(DECODINGS)}")
    settings = RunSettings(args.n_predict, decodings, args.seed, args.seconds_per_system)
    ctx = BenchContext(str(target), _model_label(args, sizes), prompts, settings, args.out, args.ctx_size,
                       args.device, llama_bin, args.threads, args.job_timeout, deadline, log, args.pcie_gbps, warmup,
                       args.spare_slots)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    meta = {
        "date": now_utc(), "stamp": stamp, "gpu": gpu_info(),
        "model": str(target), "model_label": ctx.model_label, "model_bytes": sizes.file_bytes,
        "draft": str(draft) if draft else None, "draft_bytes": dsizes.file_bytes if dsizes else None,
        "budgets": {b.label: b.bytes for b in budgets}, "n_prompts": len(prompts), "n_predict": args.n_predict,
        "decodings": list(decodings), "seed": args.seed, "ctx_size": args.ctx_size, "tokenized_by": how,
        "llama_version": llama_version(llama_bin) if llama_bin else None, "part": args.part,
        "pcie_gbps": args.pcie_gbps, "spare_slots": args.spare_slots, "warmup_prompt": warmup.id if warmup else None,
        "command": "python3 scripts/bench.py " + shlex.join(sys.argv[1:] if argv_is_cli() else []),
    }
    doc = {"meta": meta, "notes": notes, "results": []}

    def on_result(r: dict) -> None:
        doc["results"].append(r)
        write_json(args.out / "results.json", doc)

    write_json(args.out / "results.json", doc)
    run_matrix(specs, ctx, on_result)
    render(doc, args.out, args.report, args.img_dir)
    n_ok = sum(r["status"] == "ok" for r in doc["results"])
    log(f"done in {time.monotonic() - t_start:.0f} s: {n_ok} of {len(doc['results'])} systems ok")
    return 0


def argv_is_cli() -> bool:
    return Path(sys.argv[0]).name == "bench.py"


def _draft_label(draft: Path | None) -> str | None:
    if draft is None:
        return None
    stem = draft.stem.lower()
    for q in sorted(QTYPE_LLAMA, key=len, reverse=True):
        if stem.endswith(q):
            return QTYPE_LLAMA[q]
    return draft.name


def _model_label(args: argparse.Namespace, sizes: ModelSizes) -> str:
    if args.model_preset and args.model is None:
        from specter_gguf.synthetic.shapes import get_preset

        name = get_preset(args.model_preset).name or args.model_preset
        return (f"{name}, {sizes.n_layer} layers, {args.target_type.upper()}"
                + (" (shrunk with --layers)" if args.layers else "")
                + (f", attention output at {args.attn_output_scale:g}× its std (--attn-output-scale)"
                   if args.attn_output_scale != 1 else ""))
    return f"{Path(sizes.path).name} ({sizes.arch}, {sizes.n_layer} layers)"


if __name__ == "__main__":
    sys.exit(main())
