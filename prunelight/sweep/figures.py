"""The sweep's figures, from results.json alone: a seq_len × num_samples heatmap per model and method, and
perplexity vs zero-shot accuracy (one scatter per model, coloured by method, Pearson r in the title)."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path

from prunelight.sweep.tables import _complete, lower_is_better, method_of, model_of, pearson, table_metrics

ROW_KEY, COL_KEY = "data.seq_len", "data.num_samples"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")


def heatmaps(results: dict, folder: Path) -> list[Path]:
    """One PNG per model and method: panels per value of the other varying keys, cells = mean of the metric."""
    space = results.get("space") or {}
    if ROW_KEY not in space or COL_KEY not in space:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = table_metrics(results)[0]
    fixed = {ROW_KEY, COL_KEY, results.get("model_key"), *(results.get("group_by") or [])}
    others = [k for k, v in space.items() if k not in fixed and isinstance(v, list) and len(v) > 1]
    groups: dict[tuple[str, str], dict[str, dict[tuple, list[float]]]] = defaultdict(lambda: defaultdict(
        lambda: defaultdict(list)))
    for t in _complete(results):
        v = t["value"] if metric == "objective" else t["metrics"].get(metric)
        if v is None:
            continue
        panel = ", ".join(f"{k.split('.')[-1]}={t['params'].get(k)}" for k in others) or "mean per cell"
        groups[(model_of(t, results), method_of(t, results))][panel][(t["params"][ROW_KEY],
                                                                      t["params"][COL_KEY])].append(v)
    done = [t["params"] for t in _complete(results) if ROW_KEY in t["params"] and COL_KEY in t["params"]]
    rows, cols = sorted({p[ROW_KEY] for p in done}), sorted({p[COL_KEY] for p in done})  # values met (ranges too)
    cmap = "viridis_r" if lower_is_better(metric) else "viridis"  # brighter = better either way
    written = []
    folder.mkdir(parents=True, exist_ok=True)
    for (model, method), panels in groups.items():
        names = sorted(panels)
        fig, axes = plt.subplots(1, len(names), figsize=(max(6.0, 3.8 * len(names) + 1.2), 3.6), squeeze=False)
        for ax, name in zip(axes[0], names):
            grid = [[statistics.mean(panels[name][(r, c)]) if panels[name].get((r, c)) else float("nan")
                     for c in cols] for r in rows]
            im = ax.imshow(grid, cmap=cmap, aspect="auto", origin="lower")
            for i, r in enumerate(rows):
                for j, c in enumerate(cols):
                    v = grid[i][j]
                    if v == v:  # not NaN (a cell with no complete trial stays blank)
                        ax.text(j, i, f"{v:.1f}" if abs(v) >= 100 else f"{v:.4g}", ha="center", va="center",
                                fontsize=9, color="white", path_effects=_outline())
            ax.set_xticks(range(len(cols)), [str(c) for c in cols])
            ax.set_yticks(range(len(rows)), [str(r) for r in rows])
            ax.set_xlabel("calibration samples (data.num_samples)")
            ax.set_ylabel("calibration seq_len (data.seq_len)")
            ax.set_title(name, fontsize=10)
            fig.colorbar(im, ax=ax, label=f"{metric} ({'lower' if lower_is_better(metric) else 'higher'} is better)")
        fig.suptitle(f"{model} — {method}: {metric} by seq_len × num_samples", fontsize=11)
        fig.tight_layout()
        path = folder / f"heatmap_{_slug(model)}_{_slug(method)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _outline():
    from matplotlib import patheffects

    return [patheffects.withStroke(linewidth=2, foreground="black")]


def scatter(results: dict, folder: Path, x: str = "ppl", y: str = "zeroshot_avg") -> Path | None:
    """Perplexity vs zero-shot accuracy of every complete trial, one panel per model, coloured by method."""
    per: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for t in _complete(results):
        if t["metrics"].get(x) is not None and t["metrics"].get(y) is not None:
            per[model_of(t, results)][method_of(t, results)].append((t["metrics"][x], t["metrics"][y]))
    if not per:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(per), figsize=(4.6 * len(per), 3.8), squeeze=False)
    for ax, (model, methods) in zip(axes[0], per.items()):
        pts = [p for ps in methods.values() for p in ps]
        for method, ps in methods.items():
            ax.scatter([a for a, _ in ps], [b for _, b in ps], label=method, s=28, alpha=0.8)
        r = pearson([a for a, _ in pts], [b for _, b in pts])
        ax.set_title(f"{model}: r = {r:.2f}" if r is not None else model, fontsize=10)
        ax.set_xlabel(f"perplexity ({x})")
        ax.set_ylabel(f"zero-shot accuracy ({y})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ppl_vs_accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
