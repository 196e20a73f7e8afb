"""The report's figures (matplotlib, Agg): TPOT per system per budget, and TPOT against synthetic acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specter_gguf.bench.report import best_llama_setting


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
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        return out_dir / name

    groups = ["no limit"] + list((doc["meta"].get("budgets") or {}).keys())
    rows = [r for r in res if "spec-synth" not in r["family"]]
    if rows:
        labels = list(dict.fromkeys(f"{r['family']} {r['setting']}" for r in rows))
        fig, axes = plt.subplots(1, len(decs), figsize=(max(7, 1.2 * len(labels) + 4) * len(decs) / 1.5, 5),
                                 squeeze=False)
        for ax, dec in zip(axes[0], decs):
            width = 0.8 / max(1, len(labels))
            cmap = plt.get_cmap("tab20")
            for j, lab in enumerate(labels):
                xs, ys = [], []
                for gi, g in enumerate(groups):
                    for r in rows:
                        if f"{r['family']} {r['setting']}" == lab and (r["budget"] or "no limit") == g:
                            t = (r["summary"].get(dec) or {}).get("tpot_ms")
                            if t:
                                xs.append(gi + (j - (len(labels) - 1) / 2) * width)
                                ys.append(t)
                if xs:
                    ax.bar(xs, ys, width=width, label=lab, color=cmap(j % 20))
            ax.set_xticks(range(len(groups)), groups)
            ax.set_ylabel("TPOT (ms, log scale)")
            ax.set_yscale("log")
            ax.set_title(f"{dec} decoding")
            ax.grid(axis="y", which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        written.append(save(fig, f"TPOT per system and GPU budget — {title} — {gpu}", f"{stem}-tpot.png"))

    synth = [r for r in res if "spec-synth" in r["family"]]
    if synth:
        fig, axes = plt.subplots(1, len(decs), figsize=(6 * len(decs), 4.5), squeeze=False)
        for ax, dec in zip(axes[0], decs):
            series: dict[str, list[tuple[float, float]]] = {}
            for r in synth:
                t = (r["summary"].get(dec) or {}).get("tpot_ms")
                if t:
                    series.setdefault(f"{r['family']} @ {r['budget']}", []).append((r["params"]["synth_len"], t))
            # a colour per system, a line style per budget
            budgets = list(doc["meta"].get("budgets") or {})
            families = sorted({r["family"] for r in synth})
            styles = ["-", "--", ":", "-."]
            cmap = plt.get_cmap("tab10")
            for lab, pts in sorted(series.items()):
                pts.sort()
                family, b = lab.rsplit(" @ ", 1)
                style = styles[budgets.index(b) % len(styles)] if b in budgets else "-"
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o" if lab.startswith("llama") else "s",
                        linestyle=style, label=lab, color=cmap(families.index(family) % 10))
            for bi, b in enumerate(budgets):
                best = best_llama_setting(res, b, dec)
                if best:
                    ax.axhline(best["summary"][dec]["tpot_ms"], linestyle=styles[bi % len(styles)], linewidth=1,
                               color="gray", label=f"best llama.cpp, no synthetic acceptance @ {b}")
            ax.set_xlabel("synthetic mean accepted length L")
            ax.set_ylabel("TPOT (ms)")
            ax.set_title(f"{dec} decoding")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        written.append(save(fig, f"TPOT vs synthetic acceptance — {title} — {gpu}", f"{stem}-synth.png"))
    return written
