"""The draft-depth profile (`specter-gguf profile-depth`): the same generation at each fixed depth k and at
"auto", measured side by side on one loaded model, as a table and a plot of time per token against k.

Each depth first runs one generation that is not counted (it captures the CUDA graphs of its windows and, for
auto, lets the chooser measure), then `repeats` measured ones; figures are totals over them (TPOT: decode time
over decode steps).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from specter_gguf.errors import SpecterError
from specter_gguf.sampling import SamplingParams

if TYPE_CHECKING:
    from specter_gguf.engine import GenerationStats, Model


@dataclass
class DepthRow:
    depth: str                  # "1" .. "8", or "auto"
    tpot_ms: float
    tokens_per_s: float
    mean_depth: float           # drafted tokens per verification
    acceptance: float | None    # drafted tokens accepted / drafted; None: nothing drafted (auto's plain steps)
    mean_accepted_len: float    # tokens committed per verification, the target's own included
    draft_step_ms: float | None  # None: nothing drafted
    verify_ms: float            # one verification
    other_ms: float             # per verification: decode time outside drafting and verification


def parse_depths(text: str, max_depth: int) -> list[int]:
    """ "1-8", "1,2,4,8" or a mix ("1-3,6") -> sorted depths, each from 1 to `max_depth`."""
    depths: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            if int(hi or lo) < int(lo):
                raise SpecterError(f"--depths: the range {part} runs backwards; write it low-high, e.g. "
                                   f"{hi}-{lo}")
            depths.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SpecterError(f"--depths: write whole numbers and ranges such as 1-8 or 1,2,4,8, got {text!r}") from None
    if not depths:
        raise SpecterError("--depths is empty: give depths such as 1-8 or 1,2,4,8")
    if min(depths) < 1 or max(depths) > max_depth:
        raise SpecterError(f"--depths: each depth must be from 1 to {max_depth}, got {text!r}")
    return sorted(depths)


def _row(depth: str, runs: Sequence[GenerationStats]) -> DepthRow:
    steps = sum(s.generated_tokens - 1 for s in runs)
    decode_s = sum(s.decode_s for s in runs)
    drafted, accepted = sum(s.draft_tokens for s in runs), sum(s.draft_accepted for s in runs)
    rounds = sum(s.draft_rounds for s in runs)
    draft_s, verify_s = sum(s.draft_s for s in runs), sum(s.verify_s for s in runs)
    if not steps or not rounds:
        raise SpecterError("the generation was too short to verify drafts: raise --n-predict")
    return DepthRow(depth, 1000 * decode_s / steps, steps / decode_s, drafted / rounds,
                    accepted / drafted if drafted else None, (accepted + rounds) / rounds,
                    1000 * draft_s / drafted if drafted else None, 1000 * verify_s / rounds,
                    1000 * max(0.0, decode_s - draft_s - verify_s) / rounds)


def profile_depths(model: Model, prompt: list[int], n_predict: int, sampling: SamplingParams, depths: Sequence[int],
                   repeats: int, done: Callable[[DepthRow], None] = lambda row: None) -> list[DepthRow]:
    """One row per depth of `depths`, then one for "auto" (module docstring); `done` gets each row as it is
    measured (a progress bar)."""
    from specter_gguf.speculation.decoder import SpeculativeDecoder

    decoder = model.decoder
    if not isinstance(decoder, SpeculativeDecoder):
        raise SpecterError("profile-depth needs a draft: give --draft DRAFT.gguf")
    if repeats < 1:
        raise SpecterError(f"--repeats must be at least 1, got {repeats}")
    rows = []
    for depth in [*depths, "auto"]:
        decoder.set_depth(depth)
        model.generate(prompt, n_predict, sampling).wait()  # not counted (module docstring)
        runs = [model.generate(prompt, n_predict, sampling).wait().stats for _ in range(repeats)]
        rows.append(_row(str(depth), runs))
        done(rows[-1])
    return rows


COLUMNS = {"depth": "k", "tpot_ms": "TPOT ms", "tokens_per_s": "tokens/s", "mean_depth": "drafted/iter",
           "acceptance": "accepted", "mean_accepted_len": "tokens/iter", "draft_step_ms": "draft step ms",
           "verify_ms": "verify ms", "other_ms": "other ms/iter"}


def markdown_table(rows: Sequence[DepthRow]) -> str:
    def cell(key: str, value: object) -> str:
        if value is None:
            return "—"
        if key == "acceptance":
            return f"{value:.1%}"
        return value if isinstance(value, str) else f"{value:.2f}"

    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(k, getattr(r, k)) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


OUTPUT_FILES = ("depth.md", "depth.json", "depth.png")  # the table, the data, the plot


def write_profile(rows: Sequence[DepthRow], out: Path, title: str) -> list[Path]:
    """depth.md, depth.json and depth.png (TPOT against k, auto as a line) in `out`; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    table, data, plot = (out / name for name in OUTPUT_FILES)
    table.write_text(f"# {title}\n\n{markdown_table(rows)}\n", encoding="utf-8")
    data.write_text(json.dumps({"title": title, "rows": [asdict(r) for r in rows]}, indent=1), encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = [r for r in rows if r.depth != "auto"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([int(r.depth) for r in fixed], [r.tpot_ms for r in fixed], "o-", label="fixed depth")
    for r in rows:
        if r.depth == "auto":
            ax.axhline(r.tpot_ms, color="tab:red", linestyle="--", label=f"auto (mean depth {r.mean_depth:.1f})")
    ax.set_xlabel("drafted tokens per verification (k)")
    ax.set_ylabel("time per output token (ms)")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    ax.set_xticks([int(r.depth) for r in fixed])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return [table, data, plot]


def best_fixed(rows: Sequence[DepthRow]) -> DepthRow:
    return min((r for r in rows if r.depth != "auto"), key=lambda r: r.tpot_ms)

