#!/usr/bin/env python3
"""One routed expert's feed-forward on the CPU, down(silu(gate x) * up x) for T tokens: our native kernel against
llama.cpp's (ggml's CPU matrix products, from the libraries llama-cpp-python installs) and PyTorch's, per expert
shape, GGUF type and token count, beside what copying the expert over PCIe takes — the measurement that decides
where a cold expert of a verification should run (hybrid verification).

    python3 scripts/bench_cpu_experts.py [--threads 4,16] [--tokens 1,2,4,8] [--reps 20] [--rounds 3] [--pcie 55,25]

Weights are random GGUF data of each type (valid quants, small scales), gate/up [d_ff, d_model] and down
[d_model, d_ff]; down takes Q8_0 where d_ff is no multiple of the K-quants' and IQ types' 256 (as llama.cpp's mixes
do). Each system runs the three products and the SwiGLU; a round times each system's median over `--reps` calls,
each on another copy of the weights (512 MiB of copies: none is in the CPU's caches), the systems in turn, and a
cell takes each system's fastest of `--rounds` rounds: a single median was seen 3-4x off when something else held
the cores for a while (a round that meets it is outvoted by the others). Times are in µs, at each thread count of
`--threads` (default: every core) for all three systems (ggml starts its threads in every call; our kernels and
PyTorch keep a pool of them).
PyTorch runs bfloat16 products of the dequantized weights (what the CPU's AMX/AVX-512 BF16 units take). Prints a
Markdown table: µs per system and the weight bytes' rate of the fastest.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specter_gguf import native  # noqa: E402
from specter_gguf.bench.weights import random_weight  # noqa: E402
from specter_gguf.kernels import ExpertTable, QuantizedTensor, moe_ffn  # noqa: E402

SHAPES = {"Qwen1.5-MoE": (2048, 1408), "Qwen3-30B-A3B": (2048, 768), "Phi-3.5-MoE": (4096, 6400)}
TYPES = {"F16": native.F16, "BF16": native.BF16, "Q8_0": native.Q8_0, "Q4_K": native.Q4_K, "IQ4_XS": native.IQ4_XS,
         "IQ3_S": native.IQ3_S, "IQ2_XXS": native.IQ2_XXS, "IQ1_M": native.IQ1_M}
# 256-element block types: where d_ff is no multiple of 256, their down matrix takes Q8_0
BLOCK_256 = (native.Q4_K, native.IQ4_XS, native.IQ3_S, native.IQ2_XXS, native.IQ1_M)
CACHE_DEFEAT_BYTES = 512 << 20  # copies of each expert cycled through: more than any CPU cache holds
WORK_BYTES = 64 << 20  # ggml's work buffer for one expert (x converted to the weights' dot type, per-thread rows)


class GGML:
    """The few ggml calls a CPU matrix product needs, through ctypes on llama-cpp-python's ggml libraries."""

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self) -> None:
        import llama_cpp

        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        for name, res, args in (("ggml_init", vp, [self.InitParams]), ("ggml_free", None, [vp]),
                                ("ggml_reset", None, [vp]),
                                ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64]),
                                ("ggml_get_data", vp, [vp]), ("ggml_nbytes", ctypes.c_size_t, [vp]),
                                ("ggml_mul_mat", vp, [vp, vp, vp]), ("ggml_silu", vp, [vp, vp]),
                                ("ggml_mul", vp, [vp, vp, vp]), ("ggml_new_graph", vp, [vp]),
                                ("ggml_build_forward_expand", None, [vp, vp])):
            fn = getattr(self.base, name)
            fn.restype, fn.argtypes = res, args
        self.cpu.ggml_cpu_init.restype, self.cpu.ggml_cpu_init.argtypes = None, []
        self.cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
        self.cpu.ggml_cpu_init()
        self._contexts: list[int] = []

    def expert(self, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor, x: torch.Tensor,
               threads: int) -> Callable[[], None]:
        """A function computing the expert for x [T, d_model] as one ggml graph (weights copied in once)."""
        T, d = x.shape
        mats = [gate, up, down]
        # the weights, x and y [T, d], gate, up, silu and their product [T, f] in float32, and room for ggml's
        # tensor and graph records
        size = sum(m.data.numel() for m in mats) + T * (2 * d + 4 * gate.shape[0]) * 4 + (16 << 20)
        ctx = self.base.ggml_init(self.InitParams(size, None, False))
        tensors = []
        for m in mats:
            rows, cols = m.shape
            t = self.base.ggml_new_tensor_2d(ctx, m.ggml_type, cols, rows)  # ne0: the row length
            assert self.base.ggml_nbytes(t) == m.data.numel(), "ggml's row layout is GGUF's"
            ctypes.memmove(self.base.ggml_get_data(t), m.data.data_ptr(), m.data.numel())
            tensors.append(t)
        xt = self.base.ggml_new_tensor_2d(ctx, native.F32, d, T)
        ctypes.memmove(self.base.ggml_get_data(xt), x.contiguous().data_ptr(), x.numel() * 4)
        g = self.base.ggml_mul_mat(ctx, tensors[0], xt)
        u = self.base.ggml_mul_mat(ctx, tensors[1], xt)
        y = self.base.ggml_mul_mat(ctx, tensors[2], self.base.ggml_mul(ctx, self.base.ggml_silu(ctx, g), u))
        graph = self.base.ggml_new_graph(ctx)
        self.base.ggml_build_forward_expand(graph, y)
        # ggml_graph_compute_with_ctx takes its work buffer from the context it is given, anew in every call: a
        # context of its own, emptied before each call (in the weights' context the calls ran out of room)
        work = self.base.ggml_init(self.InitParams(WORK_BYTES, None, False))
        self._contexts += [ctx, work]

        def run() -> None:
            self.base.ggml_reset(work)
            if self.cpu.ggml_graph_compute_with_ctx(work, graph, threads) != 0:
                raise RuntimeError("ggml_graph_compute_with_ctx failed")
        return run

    def close(self) -> None:
        """Free the graphs `expert` made."""
        for ctx in self._contexts:
            self.base.ggml_free(ctx)
        self._contexts = []


def median_us(fns: list[Callable[[], None]], reps: int) -> float:
    """Median µs of one call, cycling through `fns` (the same work on different copies of the weights, so that no
    call finds its weights in the CPU's caches), after one call of each."""
    for fn in fns:
        fn()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _names(value: str, known: dict, option: str, ap: argparse.ArgumentParser) -> list[str]:
    """The comma list `value` of `option` as keys of `known` (any case); an unknown one ends the run with a usage
    error."""
    by_lower = {k.lower(): k for k in known}
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in names if v.lower() not in by_lower]
    if bad:
        ap.error(f"{option}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    return [by_lower[v.lower()] for v in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="0", help="comma list of CPU thread counts, each for every system (0: every "
                    "core): how the products scale with threads")
    ap.add_argument("--tokens", default="1,2,4,8", help="tokens per expert (a verification's few)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per system in a round (their median)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every system's calls in turn; each system's "
                    "fastest round is reported")
    ap.add_argument("--pcie", default="55,25", help="copy rates in GB/s to set beside (the H200 host; PCIe 4.0)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of: {', '.join(SHAPES)}")
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma list of: {', '.join(TYPES)}")
    args = ap.parse_args()
    if args.reps < 1 or args.rounds < 1:
        ap.error("--reps and --rounds take a count of 1 or more")
    shapes, types = _names(args.shapes, SHAPES, "--shapes", ap), _names(args.types, TYPES, "--types", ap)
    thread_counts = [int(n) or os.cpu_count() or 1 for n in args.threads.split(",") if n.strip()]
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    rates = [float(r) for r in args.pcie.split(",") if r.strip()]
    try:
        ggml: GGML | None = GGML()
    except (ImportError, OSError, AttributeError) as e:
        print(f"bench_cpu_experts: llama.cpp's ggml libraries not usable ({e}); its column is left out",
              file=sys.stderr)
        ggml = None
    gen = torch.Generator().manual_seed(0)
    print(f"{os.cpu_count()} cores; torch {torch.__version__}; µs per expert (gate, up, SwiGLU, down)\n")
    print("| shape | type | expert MB | T | threads | ours | llama.cpp (ggml) | torch bf16 | best GB/s | "
          + " | ".join(f"copy at {r:g} GB/s" for r in rates) + " |")
    print("|" + "---|" * (9 + len(rates)))
    for shape in shapes:
        d, f = SHAPES[shape]
        for tname in types:
            ty = TYPES[tname]
            down_ty = native.Q8_0 if ty in BLOCK_256 and f % 256 else ty
            experts = [(random_weight(ty, f, d, "cpu", gen), random_weight(ty, f, d, "cpu", gen),
                        random_weight(down_ty, d, f, "cpu", gen))]
            nbytes = sum(m.data.numel() for m in experts[0])
            while len(experts) * nbytes < CACHE_DEFEAT_BYTES:
                experts.append((random_weight(ty, f, d, "cpu", gen), random_weight(ty, f, d, "cpu", gen),
                                random_weight(down_ty, d, f, "cpu", gen)))
            tables = [ExpertTable.from_tensors(*(QuantizedTensor(m.data, m.ggml_type, (1, *m.shape)) for m in e))
                      for e in experts]
            dense = [[m.dequantize(torch.float32).to(torch.bfloat16) for m in e] for e in experts]
            for T, threads in ((T, n) for T in tokens for n in thread_counts):
                torch.set_num_threads(threads)
                x = torch.randn(T, d, generator=gen)
                xb = x.to(torch.bfloat16)
                ids, wts, out = torch.zeros(T, 1, dtype=torch.int32), torch.ones(T, 1), torch.empty(T, d)
                systems = {"ours": [lambda t=t: moe_ffn(x, ids, wts, t, out=out) for t in tables],
                           "torch": [lambda w=w: F.linear(F.silu(F.linear(xb, w[0])) * F.linear(xb, w[1]), w[2])
                                     for w in dense]}
                if ggml is not None:
                    systems["ggml"] = [ggml.expert(*e, x, threads) for e in experts]
                rounds = [{name: median_us(fns, args.reps) for name, fns in systems.items()}
                          for _ in range(args.rounds)]
                if ggml is not None:
                    ggml.close()
                for name in systems:
                    times = [r[name] for r in rounds]
                    if max(times) > 1.5 * min(times):
                        print(f"bench_cpu_experts: {shape} {tname} T={T} {threads} threads, {name}'s rounds disagree: "
                              + ", ".join(f"{t:.0f}" for t in times) + " µs", file=sys.stderr)
                ours, tb, theirs = (min((r[name] for r in rounds if name in r), default=float("nan"))
                                    for name in ("ours", "torch", "ggml"))
                best = min(v for v in (ours, theirs, tb) if v == v)
                copies = " | ".join(f"{nbytes / (r * 1e9) * 1e6:.0f}" for r in rates)
                print(f"| {shape} | {tname}{'+Q8_0' if down_ty != ty else ''} | {nbytes / 1e6:.1f} | {T} | {threads} | "
                      f"{ours:.0f} | {theirs:.0f} | {tb:.0f} | {nbytes / best / 1e3:.1f} | {copies} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
