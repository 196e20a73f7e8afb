"""The report's figures (matplotlib, Agg): TPOT per system per budget, and TPOT against synthetic acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specter_gguf.bench.report import best_llama_setting, tpot_of


def write_plots(doc: dict[str, Any], out_dir: str | Path, stem: str = "bench") -> list[Path]:
    """PNG plots (matplotlib, Agg): TPOT per system per budget, and TPOT against synthetic acceptance
    length. Returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = [r for r in doc["results"] if r["status"] == "ok"]
    decs = doc["meta"].get("decodings", ["greedy", "sampled"])
    title = doc["meta"].get("model_label", "")
    gpu = (doc["meta"].get("gpu") or {}).get("gpu") or "CPU"
    written: list[Path] = []

    def save(fig: Any, suptitle: str, name: str) -> Path:
        fig.suptitle(suptitle, fontsize=10)
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        return out_dir / name

    rows = [r for r in res if "spec-synth" not in r["family"]]
    if rows:
        fig = tpot_figure(plt, rows, decs, list(doc["meta"].get("budgets") or {}))
        written.append(save(fig, f"TPOT per system and GPU budget — {title} — {gpu}", f"{stem}-tpot.png"))

    synth = [r for r in res if "spec-synth" in r["family"]]
    fig = synth_figure(plt, res, synth, decs)
    if fig is not None:
        written.append(save(fig, f"TPOT vs synthetic acceptance — {title} — {gpu}", f"{stem}-synth.png"))
    return written


def tpot_figure(plt: Any, rows: list[dict[str, Any]], decs: list[str], budgets: list[str]) -> Any:
    """Bars of TPOT from zero, a group per budget that has rows ("no limit" for rows without one) and a bar per
    system and setting, labelled with its value; one panel per decoding, the systems' legend beneath the panels
    (long settings would otherwise squeeze the panels beside it)."""
    from matplotlib.patches import Patch

    def label(r: dict[str, Any]) -> str:
        return f"{r['family']} {r['setting']}"

    labels = list(dict.fromkeys(label(r) for r in rows))
    present = {r["budget"] or "no limit" for r in rows}
    groups = [g for g in dict.fromkeys(["no limit", *budgets, *(r["budget"] or "no limit" for r in rows)])
              if g in present]
    width = 0.8 / len(labels)
    legend_in = 0.3 + 0.17 * len(labels)  # inches: a line per system
    panel_w = max(4.0, 0.3 * len(labels) * len(groups) + 1.5)
    fig, axes = plt.subplots(1, len(decs), figsize=(panel_w * len(decs), 4.0 + legend_in), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, dec in zip(axes[0], decs):
        for j, lab in enumerate(labels):
            xs, ys = [], []
            for gi, g in enumerate(groups):
                for r in rows:
                    t = tpot_of(r, dec)
                    if t and label(r) == lab and (r["budget"] or "no limit") == g:
                        xs.append(gi + (j - (len(labels) - 1) / 2) * width)
                        ys.append(t)
            bars = ax.bar(xs, ys, width=width, color=cmap(j % 20))
            ax.bar_label(bars, fmt="%.1f", fontsize=6)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel("TPOT (ms)")
        ax.set_ylim(bottom=0)
        ax.margins(y=0.1)
        ax.set_title(f"{dec} decoding")
        ax.grid(axis="y", alpha=0.3)
    # the legend's own patches: a system without a bar in the first panel has no handle there
    fig.legend(handles=[Patch(color=cmap(j % 20), label=lab) for j, lab in enumerate(labels)], loc="lower center",
               fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 0.95))
    return fig


def synth_figure(plt: Any, res: list[dict[str, Any]], synth: list[dict[str, Any]], decs: list[str]) -> Any:
    """TPOT against the synthetic mean accepted length: a line per system and budget, and llama.cpp's best setting
    without synthetic acceptance (from `res`) at each budget the lines are at; one panel per decoding that has
    synthetic rows (None when none has)."""
    decs = [dec for dec in decs if any(tpot_of(r, dec) for r in synth)]
    if not decs:
        return None
    budgets = list(dict.fromkeys(r["budget"] for r in synth))
    families = sorted({r["family"] for r in synth})
    styles = ["-", "--", ":", "-."]  # a colour per system, a line style per budget
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(decs), figsize=(6 * len(decs), 4.5), squeeze=False)
    for ax, dec in zip(axes[0], decs):
        series: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in synth:
            if t := tpot_of(r, dec):
                series.setdefault((r["family"], r["budget"]), []).append((r["params"]["synth_len"], t))
        for (family, b), pts in sorted(series.items()):
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o" if family.startswith("llama") else "s",
                    linestyle=styles[budgets.index(b) % len(styles)], label=f"{family} @ {b}",
                    color=cmap(families.index(family) % 10))
        for bi, b in enumerate(budgets):
            best = best_llama_setting(res, b, dec)
            if best:
                ax.axhline(tpot_of(best, dec), linestyle=styles[bi % len(styles)], linewidth=1,
                           color="gray", label=f"best llama.cpp, no synthetic acceptance @ {b}")
        ax.set_xlabel("synthetic mean accepted length L")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"{dec} decoding")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig
