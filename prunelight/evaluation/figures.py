"""Report figures (PNG, matplotlib Agg, written atomically): what was kept, why, and what it changed."""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from prunelight.atomic import atomic_file
from prunelight.plan import PrunePlan


def _save(fig: Figure, path: Path) -> Path:
    """Render with the Agg canvas (no GUI backend, no pyplot state), written atomically."""
    FigureCanvasAgg(fig)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    return path


def plot_kept_units(plan: PrunePlan, path: str | Path) -> Path:
    """Kept GQA groups (KV heads) and MLP channels per layer, as counts against the original."""
    layers = list(range(plan.num_layers))
    fig = Figure(figsize=(9, 3.4))
    for ax, kept, total, title in (
        (fig.add_subplot(1, 2, 1), [len(lp.keep_groups) for lp in plan.layers], plan.num_groups, "KV-head groups"),
        (fig.add_subplot(1, 2, 2), [len(lp.keep_channels) for lp in plan.layers], plan.num_channels, "MLP channels"),
    ):
        ax.bar(layers, total, color="#dddddd", label="original")
        ax.bar(layers, kept, color="#3b75af", label="kept")
        ax.set_xlabel("layer")
        ax.set_title(f"kept {title} per layer")
        ax.legend(fontsize=8)
    return _save(fig, Path(path))


def plot_layer_importance(layer_importance: dict[str, list[float]], path: str | Path,
                          title: str = "Layer importance") -> Path:
    """Per-layer bars, one panel per measure (their scales differ: perplexity increase vs 1 - cosine)."""
    names = [k for k, v in layer_importance.items() if v]
    if not names:
        raise ValueError("nothing to plot: no layer importance values")
    fig = Figure(figsize=(7, 2.4 * len(names)))
    for i, name in enumerate(names):
        ax = fig.add_subplot(len(names), 1, i + 1)
        vals = [float(v) for v in layer_importance[name]]
        ax.bar(range(len(vals)), vals, color="tab:blue")
        ax.set_ylabel(name)
        ax.set_xticks(range(len(vals)))
    ax.set_xlabel("decoder layer")
    fig.suptitle(title)
    return _save(fig, Path(path))


def kept_removed_scores(unit_scores: dict, plan: PrunePlan) -> dict[str, tuple[list[float], list[float]]]:
    """Per unit kind ("attn" groups, "mlp" channels): scores of kept units and of removed units."""
    out = {}
    for kind, attr in (("attn", "keep_groups"), ("mlp", "keep_channels")):
        kept, removed = [], []
        for layer, scores in enumerate(unit_scores.get(kind, [])):
            keep = set(getattr(plan.layers[layer], attr))
            for i, s in enumerate(scores):
                (kept if i in keep else removed).append(float(s))
        out[kind] = (kept, removed)
    return out


def plot_importance_distribution(unit_scores: dict, plan: PrunePlan, path: str | Path) -> Path:
    """Histograms of unit importance, kept vs removed, on shared bins.

    log10 of the score when every score is positive; signed scores (e.g. `flap`'s standardised ones) are drawn
    on a linear axis, since clipping them to a log floor would pile every negative unit into one bin.
    """
    split = kept_removed_scores(unit_scores, plan)
    fig = Figure(figsize=(9, 3.4))
    for k, (kind, (kept, removed)) in enumerate(split.items()):
        ax = fig.add_subplot(1, 2, k + 1)
        values = torch.tensor(kept + removed or [1.0], dtype=torch.float64)
        use_log = bool((values > 0).all())
        scale = (lambda xs: torch.tensor(xs, dtype=torch.float64).log10()) if use_log else (
            lambda xs: torch.tensor(xs, dtype=torch.float64))
        lo, hi = float(scale(values.tolist()).min()), float(scale(values.tolist()).max())
        edges = torch.linspace(lo, hi if hi > lo else lo + 1.0, 41).tolist()
        ax.hist(scale(kept).tolist(), bins=edges, alpha=0.6, color="#3b75af", label=f"kept ({len(kept)})")
        if removed:
            ax.hist(scale(removed).tolist(), bins=edges, alpha=0.6, color="#d1495b", label=f"removed ({len(removed)})")
        ax.set_xlabel("log10 importance" if use_log else "importance (signed)")
        ax.set_title({"attn": "attention groups", "mlp": "MLP channels"}[kind])
        ax.legend(fontsize=8)
    return _save(fig, Path(path))


def plot_hidden_similarity(similarity: dict[str, list[float]], path: str | Path) -> Path:
    """Per-layer cosine similarity of hidden states to the dense model's, one line per compared model."""
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot(1, 1, 1)
    for name, values in similarity.items():
        ax.plot(range(len(values)), values, marker="o", label=name)
    ax.set_xlabel("hidden state (0 = embeddings, i = after layer i)")
    ax.set_ylabel("mean cosine similarity to dense")
    ax.set_title("hidden-state similarity to the dense model")
    ax.legend(fontsize=8)
    return _save(fig, Path(path))


def write_figures(report: dict, plan: PrunePlan | None, out_dir: str | Path) -> dict[str, str]:
    """Every figure the report has data for; returns name -> file name relative to `out_dir`."""
    out_dir = Path(out_dir)
    made: dict[str, str] = {}
    if plan is not None:
        made["kept_units"] = plot_kept_units(plan, out_dir / "kept_units.png").name
        if report.get("unit_scores"):
            made["importance_distribution"] = plot_importance_distribution(
                report["unit_scores"], plan, out_dir / "importance_distribution.png").name
    if report.get("layer_importance"):
        made["layer_importance"] = plot_layer_importance(report["layer_importance"], out_dir / "layer_importance.png").name
    sim = (report.get("evaluation") or {}).get("hidden_similarity")
    if sim:
        made["hidden_similarity"] = plot_hidden_similarity(sim, out_dir / "hidden_similarity.png").name
    return made
