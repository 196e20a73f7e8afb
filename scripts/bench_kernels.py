#!/usr/bin/env python3
"""Benchmark the native CUDA kernels (needs a GPU): weight-read bandwidth of Y = X.W^T at m = 1 per GGUF type
on MoE expert shapes, and the grouped MoE layer time.

    python3 scripts/bench_kernels.py --out DIR [--iters 200] [--quick]

- GEMV: W [n, k] for Qwen1.5-MoE experts (2048->1408 gate/up, 1408->2048 down) and Phi-3.5-MoE experts
  (4096->6400, 6400->4096). Enough copies of W are cycled through that they do not fit the L2 cache, and the
  calls are captured in a CUDA graph (launches back to back, no Python between them), timed with CUDA events.
  Bandwidth = weight bytes / time per call, against the measured device-to-device copy rate (read+write bytes
  / time) and the H200's nominal 4.3 TB/s. Beside it: torch's fp16 GEMV (F.linear, cuBLAS) on the same shape.
  K-quants need k % 256 == 0: 1408 is not (llama.cpp falls back to Q5_0/Q8_0 there), so those cells are n/a.
- MoE: one Qwen1.5-MoE layer (60 experts, top-4, 2048/1408) and one Qwen3-30B-A3B layer (128 experts, top-8,
  2048/768) for 1, 8, 9 and 16 tokens, different random routings cycled through, captured in a CUDA graph;
  types: all F16, all Q8_0, all Q4_0, Q4_K gate/up + Q8_0 or Q5_0 down, Q2_K gate/up + Q4_0 down (the types
  llama.cpp's quantizer gives a 1408-wide down matrix).
- Decode (`--decode-model FILE`, e.g. the Q4_K_M file of a Qwen1.5-MoE-shaped model): whole-model greedy decoding
  fully on the GPU, our engine with its decode step in CUDA graphs (and eagerly, for comparison) beside
  llama.cpp's `llama-bench -p 0 -n N -ngl 99` on the same file in the same run (`--llama-bin DIR`), plus the GPU
  kernel time of one eager decode step by kernel (torch profiler) to show where a step's time goes.
- Sampling: the sampled verdict's chain on the device (`sampling.chain_sample`: the native `kernels.sample_chain`
  over the top-40 candidates of a 151,936-token vocabulary, with a draw per row and without) for 1 row (a draft
  step) and 9 rows (a verification of 8 drafted tokens), and the whole verdict of such steps
  (`speculation.accept.SampledVerdict`: the chain, the acceptance tests and the writes of the step's outputs), beside
  the greedy verdict's argmax, in a CUDA graph. (The torch ops the native chain replaced took 107.8 us for 1 row and
  133.1 us for 9 with their draw on the H200.)
- Attention: a few queries over an f16 KV cache of the Qwen1.5-MoE shape (16 query heads, 16 KV heads of 128),
  T = 1 (a decode or draft step) and T = 9 (a verification of 8 drafted tokens), windows of 256, 1024 and 4096
  keys with the tokens at the window's end: torch SDPA as `Attention` ran it before (`layers.attend` with the mask
  of `Positions.window`, what the step graphs capture) against the native `kernels.decode_attention`, each in a
  CUDA graph cycling through 24 layers' caches (as a step reads them).
- Dense: the products of a verification and of short prompts at Qwen3-30B-A3B's shapes (attention in and out, the
  output head), 9-64 rows of x, Q8_0/Q4_K/Q6_K through the GEMV (passes of 8 rows) and the tiled kernel, beside
  torch's f16 product of a float matrix of the same shape.
Writes DIR/bench_kernels.json and prints a compact table last.
`--only kernels|gemv|moe|dense|decode|sampling|attention` runs one part (`gemv` and `moe`: the GEMV and the MoE layer
alone, which `kernels` both includes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specter_gguf import kernels, native  # noqa: E402
from specter_gguf.bench.weights import random_weight  # noqa: E402
from specter_gguf.kernels import ExpertTable, QuantizedTensor  # noqa: E402

NOMINAL_TBS = 4.3
L2_DEFEAT_BYTES = 384 << 20  # cycle through at least this much weight memory
TYPES = {"Q8_0": native.Q8_0, "Q4_0": native.Q4_0, "Q4_1": native.Q4_1, "Q5_0": native.Q5_0,
         "Q5_1": native.Q5_1, "Q2_K": native.Q2_K, "Q3_K": native.Q3_K, "Q4_K": native.Q4_K,
         "Q5_K": native.Q5_K, "Q6_K": native.Q6_K, "IQ4_NL": native.IQ4_NL, "IQ4_XS": native.IQ4_XS,
         "IQ3_S": native.IQ3_S, "IQ3_XXS": native.IQ3_XXS, "IQ2_S": native.IQ2_S, "IQ2_XS": native.IQ2_XS,
         "IQ2_XXS": native.IQ2_XXS, "IQ1_M": native.IQ1_M, "IQ1_S": native.IQ1_S,
         "F16": native.F16, "BF16": native.BF16}
SHAPES = {"qwen 2048->1408": (1408, 2048), "qwen 1408->2048": (2048, 1408),
          "phi 4096->6400": (6400, 4096), "phi 6400->4096": (4096, 6400)}


def graph_time(fn_list, iters: int, reps: int = 3) -> float:
    """Seconds per call of the callables in fn_list (cycled), captured in a CUDA graph of `iters` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fn_list[:3]:
            fn()  # warm-up (lazy module loading) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fn_list[i % len(fn_list)]()
    g.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / iters)
    del g
    return best


def copy_rate(dev: torch.device) -> float:
    """Device-to-device copy, TB/s counting bytes read + written."""
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    t = e0.elapsed_time(e1) / 1e3 / 10
    return 2 * n / t / 1e12


def l2_copies(first, make) -> list:
    """`first` and enough more weights from `make()` (at least one) that together they exceed L2_DEFEAT_BYTES."""
    return [first] + [make() for _ in range(max(2, math.ceil(L2_DEFEAT_BYTES / first.nbytes)) - 1)]


def bench_gemv(dev: torch.device, iters: int, types: list[str]) -> list[dict]:
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device=dev)
        # torch fp16 baseline
        w16 = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        ws16 = l2_copies(w16, lambda w=w16: torch.randn_like(w))
        x16 = x.half()
        t = graph_time([lambda w=w: F.linear(x16, w) for w in ws16], iters)
        rows.append(dict(kind="gemv", shape=shape_name, type="torch-f16", n=n, k=k, m=1, bytes=w16.nbytes,
                         us=t * 1e6, tbs=w16.nbytes / t / 1e12))
        del ws16, w16
        for tname in types:
            ty = TYPES[tname]
            elems, _ = native.block_size(ty)
            if k % elems:
                rows.append(dict(kind="gemv", shape=shape_name, type=tname, n=n, k=k, m=1, na=f"k % {elems} != 0"))
                continue
            w0 = random_weight(ty, n, k, dev)
            ws = l2_copies(w0, lambda: random_weight(ty, n, k, dev))
            res = dict(kind="gemv", shape=shape_name, type=tname, n=n, k=k, m=1, bytes=w0.nbytes)
            for m in (1, 8, 16):
                xm = torch.randn(m, k, device=dev)
                algo = kernels.ALGO_AUTO
                t = graph_time([lambda w=w: kernels.qmatmul(xm, w, algo) for w in ws], iters)
                if m == 1:
                    res.update(us=t * 1e6, tbs=w0.nbytes / t / 1e12)
                else:
                    res[f"us_m{m}"] = t * 1e6
            rows.append(res)
            del ws, w0
            torch.cuda.empty_cache()
    return rows


DENSE_SHAPES = {"qwen3 attn qkv 2048->5120": (5120, 2048), "qwen3 attn out 4096->2048": (2048, 4096),
                "qwen3 head 2048->151936": (151936, 2048)}
DENSE_ROWS = (9, 16, 32, 64)


def bench_dense(dev: torch.device, iters: int) -> list[dict]:
    """The dense products of a verification and of short prompts: the GEMV (passes of 8 rows) against the tiled
    kernel at a few rows of x, beside torch's f16 product of a float matrix of the same shape."""
    rows = []
    for shape_name, (n, k) in DENSE_SHAPES.items():
        w16 = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        ws16 = l2_copies(w16, lambda w=w16: torch.randn_like(w))
        for m in DENSE_ROWS:
            x16 = torch.randn(m, k, device=dev, dtype=torch.float16)
            t = graph_time([lambda w=w: F.linear(x16, w) for w in ws16], iters)
            rows.append(dict(kind="dense", shape=shape_name, type="torch-f16", m=m, us=t * 1e6))
        del ws16, w16
        for tname in ("Q8_0", "Q4_K", "Q6_K"):
            ty = TYPES[tname]
            w0 = random_weight(ty, n, k, dev)
            ws = l2_copies(w0, lambda: random_weight(ty, n, k, dev))
            for m in DENSE_ROWS:
                xm = torch.randn(m, k, device=dev)
                res = dict(kind="dense", shape=shape_name, type=tname, m=m)
                for key, algo in (("gemv_us", kernels.ALGO_GEMV), ("tiled_us", kernels.ALGO_TILED)):
                    res[key] = graph_time([lambda w=w, a=algo: kernels.qmatmul(xm, w, a) for w in ws], iters) * 1e6
                rows.append(res)
            del ws, w0
            torch.cuda.empty_cache()
    return rows


MOE_CONFIGS = {"F16": ("F16", "F16", "F16"), "Q8_0": ("Q8_0", "Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q4_0", "Q4_0"),
               "Q4_K+Q8_0": ("Q4_K", "Q4_K", "Q8_0"), "Q4_K+Q5_0": ("Q4_K", "Q4_K", "Q5_0"),
               "Q2_K+Q4_0": ("Q2_K", "Q2_K", "Q4_0")}


MOE_SHAPES = {"Qwen1.5-MoE": (60, 4, 2048, 1408), "Qwen3-30B-A3B": (128, 8, 2048, 768)}  # experts, top-k, d, d_ff
MOE_TOKENS = (1, 8, 9, 16)


def bench_moe(dev: torch.device, iters: int) -> list[dict]:
    return [r for shape in MOE_SHAPES for r in bench_moe_shape(dev, iters, shape)]


def bench_moe_shape(dev: torch.device, iters: int, shape: str) -> list[dict]:
    E, top_k, d, f = MOE_SHAPES[shape]
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for cname, tnames in MOE_CONFIGS.items():
        gt, ut, dt = (TYPES[t] for t in tnames)
        gate, up = random_weight(gt, E * f, d, dev), random_weight(ut, E * f, d, dev)
        down = random_weight(dt, E * d, f, dev)
        gate, up, down = (QuantizedTensor(w.data, w.ggml_type, (E, *s)) for w, s in
                          ((gate, (f, d)), (up, (f, d)), (down, (d, f))))
        table = ExpertTable.from_tensors(gate, up, down)
        expert_bytes = (gate.nbytes + up.nbytes + down.nbytes) / E
        for T in MOE_TOKENS:
            x = torch.randn(T, d, device=dev)
            routings = []
            for _ in range(64):
                ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
                routings.append((ids.to(dev), torch.rand(T, top_k, device=dev), len(set(ids.flatten().tolist()))))
            ws = torch.empty(kernels.moe_workspace_size(T, top_k, E, d, f), dtype=torch.uint8, device=dev)
            out = torch.empty(T, d, device=dev)
            fns = [lambda r=r, tab=table: kernels.moe_ffn(x, r[0], r[1], tab, out=out, workspace=ws) for r in routings]
            t = graph_time(fns, iters)
            distinct = sum(r[2] for r in routings) / len(routings)
            rows.append(dict(kind="moe", shape=shape, config=cname, tokens=T, top_k=top_k, n_expert=E, us=t * 1e6,
                             experts_touched=distinct, tbs=distinct * expert_bytes / t / 1e12))
        del gate, up, down, table
        torch.cuda.empty_cache()
    return rows


def bench_sampling(dev: torch.device, iters: int, n_vocab: int = 151936) -> list[dict]:
    from specter_gguf.sampling import SamplingParams, chain_knobs, chain_sample, chain_workspace
    from specter_gguf.speculation.accept import SampledVerdict

    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05)
    knobs = chain_knobs(params).to(dev)
    out = []
    for rows in (1, 9):
        logits = torch.randn(rows, n_vocab, device=dev)
        uniforms = torch.rand(rows, dtype=torch.float64, device=dev)
        found = (torch.empty(rows, 40, dtype=torch.long, device=dev), torch.empty(rows, 40, dtype=torch.float64,
                 device=dev), torch.empty(rows, dtype=torch.long, device=dev))
        ws = chain_workspace(rows, n_vocab, 40, dev)
        verdict = SampledVerdict(params, rows, n_vocab, dev)
        verdict.uniforms.copy_(uniforms)
        inputs = torch.cat([torch.randint(n_vocab, (rows,)), torch.tensor([100])]).to(dev)
        choice, next_ = (torch.zeros(n, dtype=torch.long, device=dev) for n in (rows + 1, 2))
        finite = torch.ones(1, dtype=torch.bool, device=dev)
        ops = {"argmax (greedy)": lambda: torch.max(logits, -1),
               "chain + draw": lambda: chain_sample(logits, 40, knobs, uniforms, found, ws),
               "chain": lambda: chain_sample(logits, 40, knobs, out=(*found[:2], None), workspace=ws),
               "sampled verdict": lambda: verdict(logits, inputs, choice, next_, finite)}
        for name, fn in ops.items():
            out.append(dict(op=name, rows=rows, us=1e6 * graph_time([fn], iters)))
    return out


def bench_attention(dev: torch.device, iters: int, n_layers: int = 24) -> list[dict]:
    from specter_gguf.layers import Positions, attend

    H, Hkv, d = 16, 16, 128
    scale = 1.0 / math.sqrt(d)
    out = []
    for window in (256, 1024, 4096):
        caches = [(torch.randn(Hkv, window, d, device=dev, dtype=torch.float16),
                   torch.randn(Hkv, window, d, device=dev, dtype=torch.float16)) for _ in range(n_layers)]
        for T in (1, 9):
            q = torch.randn(H, T, d, device=dev, dtype=torch.float16)
            pos = torch.arange(window - T, window, device=dev)
            bias = Positions.window(pos, window).attn_bias(torch.float16)
            ws = torch.empty(kernels.decode_attention_workspace_size(T, H, d, window), dtype=torch.uint8, device=dev)
            res = torch.empty(H, T, d, device=dev, dtype=torch.float16)
            sdpa = [lambda k=k, v=v: attend(q, k, v, bias, scale) for k, v in caches]
            ours = [lambda k=k, v=v: kernels.decode_attention(q, k, v, window, pos, scale, out=res, workspace=ws)
                    for k, v in caches]
            out.append(dict(window=window, tokens=T, heads=H, heads_kv=Hkv, head_dim=d,
                            sdpa_us=1e6 * graph_time(sdpa, iters), ours_us=1e6 * graph_time(ours, iters)))
        del caches
        torch.cuda.empty_cache()
    return out


def bench_decode(path: Path, llama_bin: Path | None, n_predict: int, runs: int) -> dict:
    from specter_gguf.engine import Model
    from specter_gguf.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    t0 = time.time()
    m = Model.load(path, device="cuda", progress=False, ctx_size=1024)
    res: dict = dict(model=path.name, n_predict=n_predict, runs=runs, load_s=time.time() - t0,
                     gpu_bytes=torch.cuda.memory_allocated())
    prompt = m.tokenize("The history of the printing press")
    m.generate(prompt, 8, greedy).wait()  # captures the decode graph
    tps = [m.generate(prompt, n_predict, greedy).wait().stats.tokens_per_s for _ in range(runs)]
    res.update(ours_graphs_tps=statistics.median(tps), ours_graphs_all=tps)
    res["graph_step_us"] = graph_step_us(m, prompt, n_predict)
    m.cuda_graphs = False
    res["ours_eager_tps"] = m.generate(prompt, 32, greedy).wait().stats.tokens_per_s
    res["kernels"] = step_kernel_times(m)
    if llama_bin is not None:
        cmd = [str(llama_bin / "llama-bench"), "-m", str(path), "-p", "0", "-n", str(n_predict), "-ngl", "99",
               "-r", str(runs), "-o", "json"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        res["llama_command"] = " ".join(cmd[1:]).replace(str(path), path.name)
        try:
            res["llama_tps"] = json.loads(p.stdout)[0]["avg_ts"]
        except (ValueError, IndexError, KeyError):
            res["llama_error"] = (p.stderr or p.stdout)[-2000:]
    return res


@torch.inference_mode()
def graph_step_us(m, prompt: list[int], n_steps: int) -> float:
    """Microseconds per decode step replaying the graphs back to back with no sampling and no host sync between
    steps: the step's GPU time, what generation adds on top of it is host work (sampling, the token read back)."""
    from specter_gguf.cuda_graphs import StepGraphs

    cache = m.transformer.new_cache(1024)
    m.transformer.forward(torch.tensor(prompt, device="cuda"), cache)
    graphs = StepGraphs(m.transformer, cache)
    graphs.step(prompt[-1:])  # captures
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_steps):
        graphs.step(None)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n_steps * 1e6


@torch.inference_mode()
def step_kernel_times(m) -> dict:
    """GPU time of one eager decode step, by kernel name (microseconds), from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    cache = m.transformer.new_cache(64)
    m.transformer.forward(torch.tensor([1, 2, 3], device="cuda"), cache)
    tok = torch.tensor([4], device="cuda")
    m.transformer.forward(tok, cache)
    cache.truncate(3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m.transformer.forward(tok, cache)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(e.name[:90], []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                       else e.cuda_time_total)
    total = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return dict(total_us=total, launches=sum(len(v) for v in by_name.values()),
                top=[dict(name=k, us=sum(v), calls=len(v)) for k, v in top])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="directory for bench_kernels.json")
    ap.add_argument("--iters", type=int, default=200, help="calls per captured CUDA graph")
    ap.add_argument("--quick", action="store_true", help="Q8_0/Q4_K/F16 only")
    ap.add_argument("--types", default=None, help=f"GEMV types, comma-separated (default all: {','.join(TYPES)})")
    ap.add_argument("--only", choices=["kernels", "gemv", "moe", "dense", "decode", "sampling", "attention"],
                    default=None, help="run one part")
    ap.add_argument("--decode-model", type=Path, default=None, help="GGUF for the whole-model decode part")
    ap.add_argument("--llama-bin", type=Path, default=None, help="directory of llama.cpp's llama-bench")
    ap.add_argument("--n-predict", type=int, default=128, help="decode: generated tokens per run")
    ap.add_argument("--runs", type=int, default=3, help="decode: runs per system (median)")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and native.has_cuda()):
        print("bench_kernels: needs a CUDA GPU and libspecter built with CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    types = ["Q8_0", "Q4_K", "F16"] if args.quick else args.types.upper().split(",") if args.types else list(TYPES)
    if unknown := [t for t in types if t not in TYPES]:
        ap.error(f"--types: unknown {', '.join(unknown)}; known: {', '.join(TYPES)}")
    t0 = time.time()
    result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), gpu=torch.cuda.get_device_name(dev),
                  torch=torch.__version__, command=" ".join(sys.argv))
    if args.only in (None, "kernels", "gemv"):
        result.update(copy_tbs=copy_rate(dev), nominal_tbs=NOMINAL_TBS, gemv=bench_gemv(dev, args.iters, types))
    if args.only in (None, "kernels", "moe"):
        result["moe"] = bench_moe(dev, args.iters)
    if args.only in (None, "dense"):
        result["dense"] = bench_dense(dev, args.iters)
    if args.only in (None, "sampling"):
        result["sampling"] = bench_sampling(dev, args.iters)
    if args.only in (None, "attention"):
        result["attention"] = bench_attention(dev, args.iters)
    if args.only in (None, "decode") and args.decode_model is not None:
        result["decode"] = bench_decode(args.decode_model, args.llama_bin, args.n_predict, args.runs)
    result["seconds"] = time.time() - t0
    (out_dir / "bench_kernels.json").write_text(json.dumps(result, indent=1))
    if "gemv" in result:
        print_gemv(result, types)
    if "moe" in result:
        print_moe(result["moe"])
    if "dense" in result:
        print_dense(result["dense"])
    if "sampling" in result:
        print("\nverdict on the device, us per call (CUDA graph):")
        for r in result["sampling"]:
            print(f"  {r['op']:24s} rows {r['rows']}: {r['us']:7.1f}")
    if "attention" in result:
        print("\nattention, Qwen1.5-MoE shape (16/16 heads of 128, f16 cache), us per call (CUDA graph):")
        print(f"  {'window':>6s} {'T':>3s} {'torch sdpa':>11s} {'native':>8s}")
        for r in result["attention"]:
            print(f"  {r['window']:6d} {r['tokens']:3d} {r['sdpa_us']:11.1f} {r['ours_us']:8.1f}")
    if "decode" in result:
        print_decode(result["decode"])
    return 0


def print_gemv(result: dict, types: list[str]) -> None:
    gemv, copy = result["gemv"], result["copy_tbs"]
    print(f"\n{result['gpu']}  device copy {copy:.2f} TB/s (read+write)  nominal {NOMINAL_TBS} TB/s  "
          f"({result['seconds']:.0f} s)")
    print("GEMV m=1: us per call / TB/s of weights / % of 4.3 TB/s   [us at m=8, m=16]")
    shapes = list(SHAPES)
    print(f"{'type':10s}" + "".join(f"{s:>30s}" for s in shapes))
    for tname in ["torch-f16", *types]:
        cells = []
        for s in shapes:
            r = next((r for r in gemv if r["type"] == tname and r["shape"] == s), None)
            if r is None or "na" in r:
                cells.append(f"{'n/a':>30s}")
                continue
            extra = f" [{r['us_m8']:.0f},{r['us_m16']:.0f}]" if "us_m8" in r else ""
            cells.append(f"{r['us']:6.1f} {r['tbs']:5.2f} {100 * r['tbs'] / NOMINAL_TBS:3.0f}%{extra:>11s}")
        print(f"{tname:10s}" + "".join(cells))


def print_moe(moe: list[dict]) -> None:
    for shape, (E, top_k, d, f) in MOE_SHAPES.items():
        print(f"MoE layer ({shape}: {E} experts, top-{top_k}, {d}/{f}): us per layer (TB/s of touched experts)")
        print(f"{'config':12s}" + "".join(f"{f'T={T}':>18s}" for T in MOE_TOKENS))
        for cname in MOE_CONFIGS:
            cells = [next(r for r in moe if r["shape"] == shape and r["config"] == cname and r["tokens"] == T)
                     for T in MOE_TOKENS]
            print(f"{cname:12s}" + "".join(f"{r['us']:10.1f} ({r['tbs']:4.2f})" for r in cells))


def print_dense(dense: list[dict]) -> None:
    print("\ndense products at a few rows of x: us per call, GEMV / tiled (torch f16 for a float matrix)")
    print(f"{'shape':28s}{'type':>10s}" + "".join(f"{f'm={m}':>16s}" for m in DENSE_ROWS))
    for shape in DENSE_SHAPES:
        for tname in ("torch-f16", "Q8_0", "Q4_K", "Q6_K"):
            cells = [next(r for r in dense if r["shape"] == shape and r["type"] == tname and r["m"] == m)
                     for m in DENSE_ROWS]
            text = [f"{r['us']:16.1f}" if "us" in r else f"{r['gemv_us']:8.1f} /{r['tiled_us']:6.1f}" for r in cells]
            print(f"{shape:28s}{tname:>10s}" + "".join(text))


def print_decode(d: dict) -> None:
    k = d["kernels"]
    print(f"\nwhole-model decode, {d['model']} on the GPU ({d['gpu_bytes'] / 2**30:.2f} GiB), "
          f"{d['n_predict']} tokens, median of {d['runs']}: tokens/s")
    print(f"  ours, CUDA graphs  {d['ours_graphs_tps']:8.1f}   (TPOT {1000 / d['ours_graphs_tps']:.2f} ms)")
    print(f"  ours, eager        {d['ours_eager_tps']:8.1f}")
    print(f"  ours, graph replays alone (no sampling, no sync): {d['graph_step_us']:.0f} us per step")
    llama = d.get("llama_tps")
    print(f"  llama.cpp          {llama:8.1f}   ({d['llama_command']})" if llama else
          f"  llama.cpp          n/a {d.get('llama_error', '(no --llama-bin)')[-300:]}")
    print(f"  one eager step: {k['total_us']:.0f} us of GPU time in {k['launches']} kernels; largest:")
    for r in k["top"]:
        print(f"    {r['us']:8.1f} us {r['calls']:5d}x  {r['name']}")

if __name__ == "__main__":
    sys.exit(main())
