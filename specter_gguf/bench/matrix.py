"""The systems a run measures: GPU budgets, one `SystemSpec` per configuration of llama.cpp or of our engine, and
the matrix of them (`build_matrix`: llama.cpp's -ncmoe chosen from `llamacpp.ModelSizes` estimates), in run order."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from specter_gguf.bench.llamacpp import ModelSizes, smallest_ncmoe
from specter_gguf.bench.ours import OURS_MODES
from specter_gguf.errors import SpecterError
from specter_gguf.sizes import GiB, parse_size


@dataclass(frozen=True)
class Budget:
    """A GPU memory budget: its label as given and its size in bytes."""

    label: str
    bytes: int

    @property
    def gib(self) -> float:
        return self.bytes / GiB


def parse_budgets(text: str, model_bytes: int | None = None) -> list[Budget]:
    """Comma-separated budgets: absolute sizes ("16GiB,20GiB") or shares of the target model's file size
    ("50%,70%", handy with --layers); the latter need `model_bytes`."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        if part.endswith("%"):
            if model_bytes is None:
                raise SpecterError(f"budget {part!r} is relative to the model's size, which is not known yet")
            try:
                share = float(part[:-1]) / 100.0
            except ValueError:
                raise SpecterError(f"cannot read the budget {part!r}: write e.g. 60%") from None
            if share <= 0:
                raise SpecterError(f"budget {part!r} must be positive")
            out.append(Budget(part, int(model_bytes * share)))
        else:
            b = parse_size(part)
            if b <= 0:
                raise SpecterError(f"budget {part!r} must be positive")
            out.append(Budget(part.replace(" ", ""), b))
    return out


@dataclass
class SystemSpec:
    """One configuration to measure. `family` is what --systems selects; `budget` None = no limit."""

    family: str
    kind: str  # "llama" | "ours"
    setting: str  # human readable, e.g. "-ncmoe 13"
    budget: Budget | None = None
    params: dict[str, Any] = field(default_factory=dict)
    est_gpu_bytes: int | None = None
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.family} [{self.setting}] @ {self.budget.label if self.budget else 'no limit'}"


LLAMA_FAMILIES = ("llama-gpu", "llama-ncmoe", "llama-spec", "llama-spec-synth")
ALL_FAMILIES = (*LLAMA_FAMILIES, *OURS_MODES)


def select_families(pattern: str) -> list[str]:
    """Families matching a comma-separated list of names or globs ("llama-*,ours")."""
    pats = [p.strip() for p in pattern.split(",") if p.strip()]
    out = [f for f in ALL_FAMILIES if any(fnmatch.fnmatchcase(f, p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(f, p) for f in ALL_FAMILIES)]
    if unknown:
        raise SpecterError(f"--systems: no system matches {unknown}; choose from {', '.join(ALL_FAMILIES)}")
    return out


@dataclass
class MatrixConfig:
    target: ModelSizes
    draft: ModelSizes | None
    draft_name: str | None
    budgets: list[Budget]
    ctx_size: int = 1024
    margin_bytes: int = GiB
    draft_margin_bytes: int = GiB // 2
    ncmoe_sweep: tuple[int, ...] = (-1, 0, 1)
    synth_lens: tuple[float, ...] = (2, 4, 6, 8)
    draft_n_max: int = 8


def build_matrix(families: Sequence[str], cfg: MatrixConfig) -> tuple[list[SystemSpec], list[str]]:
    """The systems to run, in run order, and notes on families that cannot run here."""
    specs: list[SystemSpec] = []
    notes: list[str] = []
    t = cfg.target
    if "llama-gpu" in families:
        specs.append(SystemSpec("llama-gpu", "llama", "all on GPU", None, {"n_cpu_moe": 0},
                                t.gpu_bytes(0, cfg.ctx_size) + cfg.margin_bytes))
    for name, mode in OURS_MODES.items():
        if name in families and not mode.budget_bound:
            specs.append(SystemSpec(name, "ours", mode.description, None, {"mode": name}))
    for b in cfg.budgets:
        if "llama-ncmoe" in families:
            n0 = smallest_ncmoe(b.bytes, t, cfg.ctx_size, cfg.margin_bytes)
            note = ""
            if n0 is None:
                n0, note = t.n_layer, "does not fit even with every expert on the CPU (estimate)"
            for n in sorted({min(t.n_layer, max(0, n0 + d)) for d in cfg.ncmoe_sweep}):
                specs.append(SystemSpec("llama-ncmoe", "llama", f"-ncmoe {n}", b, {"n_cpu_moe": n},
                                        t.gpu_bytes(n, cfg.ctx_size) + cfg.margin_bytes,
                                        note or ("smallest N fitting (estimate)" if n == n0 else "")))
        wants_spec = [f for f in ("llama-spec", "llama-spec-synth") if f in families]
        if wants_spec and cfg.draft is None:
            notes.append("llama-spec: no draft model")
        elif wants_spec:
            assert cfg.draft is not None
            n = smallest_ncmoe(b.bytes, t, cfg.ctx_size, cfg.margin_bytes, cfg.draft, cfg.draft_margin_bytes)
            note = ""
            if n is None:
                n, note = t.n_layer, "draft + target do not fit even with every target expert on the CPU (estimate)"
            est = (t.gpu_bytes(n, cfg.ctx_size) + cfg.margin_bytes + cfg.draft.gpu_bytes(0, cfg.ctx_size)
                   + cfg.draft_margin_bytes)
            base = {"n_cpu_moe": n, "draft": cfg.draft.path, "draft_n_max": cfg.draft_n_max}
            if "llama-spec" in families:
                specs.append(SystemSpec("llama-spec", "llama", f"draft {cfg.draft_name}, -ncmoe {n}", b,
                                        dict(base), est, note or "real acceptance"))
            if "llama-spec-synth" in families:
                for L in cfg.synth_lens:
                    specs.append(SystemSpec("llama-spec-synth", "llama", f"draft {cfg.draft_name}, -ncmoe {n}, L={L:g}",
                                            b, {**base, "synth_len": float(L)}, est,
                                            note or "synthetic acceptance (output invalid)"))
        for name, mode in OURS_MODES.items():
            if name in families and mode.budget_bound:
                if mode.needs_draft and cfg.draft is None:
                    if b is cfg.budgets[0]:
                        notes.append(f"{name}: no draft model")
                    continue
                variants = [{"synth_len": float(L)} for L in cfg.synth_lens] if mode.synthetic else [{}]
                # a draft mode drafts as deep as llama.cpp's --spec-draft-n-max in the same matrix
                draft = {"draft": cfg.draft.path, "draft_n_max": cfg.draft_n_max} if mode.needs_draft else {}
                for v in variants:
                    setting = mode.description + (f", L={v['synth_len']:g}" if v else "")
                    specs.append(SystemSpec(name, "ours", setting, b, {"mode": name, **v, **draft}))
    return specs, notes


def split_part(specs: list[SystemSpec], part: str | None) -> list[SystemSpec]:
    """`part` "i/n": every n-th system starting at the i-th (1-based)."""
    if not part:
        return specs
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", part)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise SpecterError(f"--part {part!r}: write i/n with 1 <= i <= n, e.g. 1/2")
    i, n = int(m.group(1)), int(m.group(2))
    return specs[i - 1::n]
