"""The draft-fidelity study (`specter-gguf fidelity`): per draft precision, the draft's expert-id agreement with the
target (overall, per layer, per prompt: the paper's Table 1 and Figure 2), the acceptance rate and the tokens per
verification, greedy and sampled, from the same prompts at a fixed draft depth.

Each (draft, prompt, decoding) is one generation; its figures are `GenerationStats`' (the agreement:
`agreement.RoutingAgreement`). Totals weight each generation by its drafted tokens (the positions it compared).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from specter_gguf.errors import SpecterError
from specter_gguf.sampling import SamplingParams

if TYPE_CHECKING:
    from specter_gguf.engine import GenerationStats, Model

MODES = ("greedy", "sampled")

DEFAULT_PROMPTS = (
    "def read_config(path):\n    \"\"\"",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self",
    "    for key, value in sorted(items.items()):\n",
    "Return a new list containing all items from the iterable in ascending order.",
    "    try:\n        fd = os.open(path, os.O_RDONLY)\n    except OSError",
    "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
    "    if not isinstance(name, str):\n        raise TypeError(",
    "Once upon a time",
    "# Copyright (C) 2001 Python Software Foundation\n",
)
"""Prompts that fit the trained tiny model (Python sources and docs) and a general one."""


@dataclass
class Run:
    prompt: int
    mode: str
    drafted: int
    accepted: int
    rounds: int
    agreement: float | None
    layers: list[float | None]


@dataclass
class DraftFidelity:
    draft: str
    runs: list[Run] = field(default_factory=list)

    def total(self, mode: str) -> dict[str, object]:
        """Agreement (overall and per layer), acceptance and tokens per verification over `mode`'s runs."""
        runs = [r for r in self.runs if r.mode == mode and r.drafted]
        drafted = sum(r.drafted for r in runs)
        rounds = sum(r.rounds for r in runs)
        if not drafted:
            return {"agreement": None, "layers": [], "acceptance": None, "tokens_per_verification": None}
        n_layer = len(runs[0].layers)
        layers = [None if runs[0].layers[i] is None else
                  sum(r.drafted * r.layers[i] for r in runs) / drafted for i in range(n_layer)]
        accepted = sum(r.accepted for r in runs)
        return {"agreement": sum(r.drafted * (r.agreement or 0.0) for r in runs) / drafted, "layers": layers,
                "acceptance": accepted / drafted, "tokens_per_verification": (accepted + rounds) / rounds}


def read_prompts(path: Path) -> list[str]:
    """Prompts from a JSON list of strings or a text file of one prompt per line (`\\n` in a line: a newline)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecterError(f"cannot read the prompts file {path}: {e}") from None
    if path.suffix == ".json":
        try:
            prompts = json.loads(text)
        except ValueError as e:
            raise SpecterError(f"{path}: not JSON ({e}); give a list of strings, or a .txt file of one prompt "
                               f"per line") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise SpecterError(f"{path}: expected a JSON list of strings")
    else:
        prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecterError(f"{path} holds no prompts")
    return prompts


def _run(stats: GenerationStats, prompt: int, mode: str) -> Run:
    return Run(prompt, mode, stats.draft_tokens or 0, stats.draft_accepted or 0, stats.draft_rounds or 0,
               stats.expert_agreement, list(stats.expert_agreement_layers or []))


def measure(load: Callable[[str], Model], drafts: Sequence[str], prompts: Sequence[str], n_predict: int,
            sampled: SamplingParams, advance: Callable[[], None] = lambda: None) -> list[DraftFidelity]:
    """Every draft of `drafts` (`load(draft)` loads the target with it) on every prompt, greedy and `sampled`."""
    greedy = SamplingParams(temperature=0)
    out = []
    for draft in drafts:
        model = load(draft)
        result = DraftFidelity(draft)
        for i, prompt in enumerate(prompts):
            for mode, params in zip(MODES, (greedy, sampled)):
                gen = model.generate(prompt, n_predict, params, ignore_eos=True).wait()
                result.runs.append(_run(gen.stats, i, mode))
                advance()
        out.append(result)
    return out


def _pct(v: object) -> str:
    return "—" if v is None else f"{100 * float(v):.1f}%"


def markdown(results: Sequence[DraftFidelity], title: str) -> str:
    lines = [f"# {title}", "", "| draft | expert-id agreement greedy / sampled | acceptance greedy / sampled | "
             "tokens per verification greedy / sampled |", "|---|---|---|---|"]
    for r in results:
        g, s = r.total("greedy"), r.total("sampled")
        lines.append(f"| {r.draft} | {_pct(g['agreement'])} / {_pct(s['agreement'])} | {_pct(g['acceptance'])} / "
                     f"{_pct(s['acceptance'])} | {g['tokens_per_verification'] or 0:.2f} / "
                     f"{s['tokens_per_verification'] or 0:.2f} |")
    layers = max((len(r.total("greedy")["layers"]) for r in results), default=0)
    if layers:
        lines += ["", "Expert-id agreement per layer (greedy / sampled):", "",
                  "| layer | " + " | ".join(r.draft for r in results) + " |",
                  "|---|" + "---|" * len(results)]
        for i in range(layers):
            cells = []
            for r in results:
                g, s = r.total("greedy")["layers"], r.total("sampled")["layers"]
                cells.append(f"{_pct(g[i] if i < len(g) else None)} / {_pct(s[i] if i < len(s) else None)}")
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


OUTPUT_FILES = ("fidelity.md", "fidelity.json", "fidelity.png")  # the table, the data, the plot


def write(results: Sequence[DraftFidelity], out: Path, title: str) -> list[Path]:
    """fidelity.md, fidelity.json and fidelity.png (per-prompt agreement histograms, greedy and sampled, and the
    per-layer agreement) in `out`; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    table, data, plot = (out / name for name in OUTPUT_FILES)
    table.write_text(markdown(results, title), encoding="utf-8")
    data.write_text(json.dumps({"title": title, "drafts": [
        {"draft": r.draft, "greedy": r.total("greedy"), "sampled": r.total("sampled"),
         "runs": [asdict(x) for x in r.runs]} for r in results]}, indent=1), encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    values = [x.agreement for r in results for x in r.runs if x.agreement is not None]
    low = max(0.0, min(values, default=0.0) - 0.01)  # the bins span the measured range: agreements crowd near 1
    bins = [low + (1.0 - low) * i / 25 for i in range(26)]
    for ax, mode in zip(axes[:2], MODES):
        for r in results:
            values = [x.agreement for x in r.runs if x.mode == mode and x.agreement is not None]
            ax.hist(values, bins=bins, histtype="step", lw=1.5, label=r.draft)
        ax.set_xlabel(f"expert-id agreement per prompt ({mode})")
        ax.set_ylabel("prompts")
        ax.set_xlim(low, 1.0)
        ax.legend()
    for r in results:
        layers = r.total("greedy")["layers"]
        xs = [i for i, v in enumerate(layers) if v is not None]
        axes[2].plot(xs, [layers[i] for i in xs], "o-", label=r.draft)
    axes[2].set_xticks(range(max((len(r.total("greedy")["layers"]) for r in results), default=0)))
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("expert-id agreement (greedy)")
    axes[2].set_ylim(0, 1.02)
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return [table, data, plot]
