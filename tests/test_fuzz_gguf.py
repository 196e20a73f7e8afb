"""Fuzzing the loader: mutated GGUF files end in one clean `SpecterError` or in a correct load, never worse.

Small valid files of four architectures (written by `specter_gguf.synthetic`) are mutated by a seeded mutator:
truncations, bit flips and overwrites of header fields (counts, lengths, types, offsets), mostly in the header,
metadata and tensor table, where a parser can go wrong. Each case is loaded by `Model.load` in a worker process,
since llama.cpp's vocabulary loader (reached by every load) aborts the process on some malformed files. Every
outcome must be a `SpecterError` (one line) or a load whose forward pass gives finite logits or a clean error,
within a second, without growing the worker's peak memory beyond a few times the file size.

CI runs SPECTER_FUZZ_CASES (default 400, about 10 s) cases; a campaign raises it: SPECTER_FUZZ_CASES=5000 pytest -q -s
tests/test_fuzz_gguf.py (SPECTER_FUZZ_SEED picks another sequence). The outcome counts are printed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from gguf import GGUFReader

from specter_gguf.synthetic.shapes import TINY_ARCH_PRESETS, get_preset
from specter_gguf.synthetic.writer import write_synthetic

N_CASES = int(os.environ.get("SPECTER_FUZZ_CASES", "400"))
SEED = int(os.environ.get("SPECTER_FUZZ_SEED", "0"))
CASE_SECONDS = 1.0      # what one load (and forward) may take
HANG_SECONDS = 20.0     # a worker silent this long is hung
RSS_SLACK = 64 << 20    # peak RSS may grow by a few times the file size plus this

WORKER = r"""
import json, resource, sys, time, traceback
import numpy as np
from specter_gguf.engine import Model
from specter_gguf.errors import SpecterError

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

print(json.dumps({"ready": rss()}), flush=True)
for line in sys.stdin:
    path = line.strip()
    t0 = time.perf_counter()
    try:
        m = Model.load(path, device="cpu", progress=False, ctx_size=64)
        try:
            out = m.logits([0, 1])
            kind, msg = ("ok", "") if np.isfinite(out).all() else ("nonfinite", "logits not finite")
        except SpecterError as e:
            kind, msg = "forward-error", str(e)
    except SpecterError as e:
        kind, msg = "error", str(e)
    except BaseException as e:
        kind, msg = "exception", "".join(traceback.format_exception(e))[-2000:]
    print(json.dumps({"kind": kind, "msg": msg, "s": time.perf_counter() - t0, "rss": rss()}), flush=True)
"""


def micro(arch: str) -> object:
    """A smaller shape than the tiny presets (files of a few hundred KB), so that many cases run in seconds."""
    shape = get_preset(TINY_ARCH_PRESETS[arch])
    kw = dict(n_layer=2, n_embd=64, n_head=2, n_head_kv=2, head_dim=32, n_expert=4, n_expert_used=2, n_ff_exp=64,
              n_ff=64 if shape.n_ff else 0, n_ff_shexp=64 if shape.n_ff_shexp else 0)
    return dataclasses.replace(shape, **kw)


VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, bytes, list[list[tuple[int, int]]]]]:
    """(path, bytes, regions) of each valid file the mutator starts from; regions: byte spans of the header and
    the other metadata, of the vocabulary arrays, of the tensor table, and of the tensor data."""
    d = tmp_path_factory.mktemp("fuzz-seeds")
    out = []
    for arch in TINY_ARCH_PRESETS:
        path = d / f"{arch}.gguf"
        write_synthetic(path, micro(arch), "f16", seed=1)
        reader = GGUFReader(path)

        def span(field) -> tuple[int, int]:
            return field.offset, field.offset + sum(int(part.nbytes) for part in field.parts)

        meta = [(0, 24)] + [span(f) for n, f in reader.fields.items() if not n.startswith("GGUF.") and n not in VOCAB]
        vocab = [span(f) for n, f in reader.fields.items() if n in VOCAB]
        table = [span(t.field) for t in reader.tensors]
        data = [(min(t.data_offset for t in reader.tensors), path.stat().st_size)]
        out.append((path, path.read_bytes(), [meta, vocab, table, data]))
    return out


def mutate(rng: random.Random, data: bytes, regions: list[list[tuple[int, int]]]) -> tuple[bytes, str]:
    """One seeded mutation of `data`: what it did, for the report. Positions fall in the four regions alike."""
    b = bytearray(data)
    header_end = regions[-1][0][0]

    def where() -> int:
        lo, hi = rng.choice(rng.choice(regions))
        return rng.randrange(lo, hi)

    op = rng.choice(("truncate", "flip", "flip", "overwrite", "overwrite", "mixed"))
    if op == "truncate":
        n = rng.randrange(len(b)) if rng.random() < 0.3 else rng.randrange(header_end + 64)
        return bytes(b[:n]), f"truncate {n}"
    done = []
    for _ in range(rng.randint(1, 3) if op != "mixed" else 4):
        if op == "flip" or (op == "mixed" and rng.random() < 0.5):
            at = where()
            bit = rng.randrange(8)
            b[at] ^= 1 << bit
            done.append(f"flip {at}:{bit}")
        else:
            width = rng.choice((4, 8))
            at = where() & ~(width - 1) if rng.random() < 0.5 else where()
            value = rng.choice((0, 1, 2, 255, (1 << (8 * width)) - 1, 1 << (8 * width - 1), rng.getrandbits(8 * width),
                                rng.randrange(64)))
            b[at:at + width] = value.to_bytes(width, "little")
            done.append(f"set {at}:{width}={value}")
    return bytes(b[:len(data)]), ", ".join(done)


class Worker:
    """A process that loads the files it is sent, one per line, and answers with one JSON line each."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
        self.base_rss = json.loads(self._line())["ready"]

    def _line(self) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(HANG_SECONDS):
            self.proc.kill()
            raise TimeoutError(f"no answer in {HANG_SECONDS} s")
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"worker died (exit {rc}): {self.proc.stderr.read()[-2000:]}")
        return line

    def load(self, path: Path) -> dict:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_mutated_files_fail_cleanly_or_load(seeds: list[tuple[Path, bytes, list]], tmp_path: Path) -> None:
    rng = random.Random(SEED)
    worker = Worker()
    outcomes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    slowest = 0.0
    t0 = time.perf_counter()
    try:
        for i in range(N_CASES):
            src, data, regions = seeds[i % len(seeds)]
            mutated, how = mutate(rng, data, regions)
            path = tmp_path / f"case-{i % 8}.gguf"
            path.write_bytes(mutated)
            case = f"case {i} ({src.stem}: {how})"
            try:
                r = worker.load(path)
            except (TimeoutError, RuntimeError) as e:
                (tmp_path / "failing.gguf").write_bytes(mutated)
                pytest.fail(f"{case}: {e}")
            assert r["kind"] in ("ok", "error", "forward-error"), f"{case}: {r['kind']}: {r['msg']}"
            assert "\n" not in r["msg"], f"{case}: multi-line message {r['msg']!r}"
            assert r["s"] < CASE_SECONDS, f"{case}: took {r['s']:.2f} s"
            grown = r["rss"] - worker.base_rss
            assert grown < 4 * len(data) + RSS_SLACK, f"{case}: peak RSS grew by {grown >> 20} MiB"
            outcomes[r["kind"]] += 1
            if r["kind"] != "ok":
                errors[_gist(r["msg"], path)] += 1
            slowest = max(slowest, r["s"])
    finally:
        worker.close()
    print(f"\n{N_CASES} cases (seed {SEED}) in {time.perf_counter() - t0:.1f} s, slowest {slowest:.3f} s: "
          f"{dict(outcomes)}")
    for gist, n in errors.most_common():
        print(f"  {n:5d}  {gist}")
    assert outcomes["error"] > 0 and outcomes["ok"] > 0  # the mutator reaches both ends


def _gist(message: str, path: Path) -> str:
    """An error message without the path and numbers, to count errors by kind."""
    import re

    text = message.replace(str(path), "FILE")
    text = re.sub(r"'[^']*'", "'…'", text)
    return re.sub(r"\d+", "N", text)[:150]
