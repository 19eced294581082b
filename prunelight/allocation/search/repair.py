"""The row's cut step: a search's plan cut with the levels database's refits instead of fitting them again."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from prunelight.allocation.search.levels import LevelsDatabase, stats_from_gram
from prunelight.distributed import ReduceSum
from prunelight.families import get_family, unwrap
from prunelight.plan import PrunePlan
from prunelight.reconstruct import FIT_INPUTS, output_proj, summary
from prunelight.surgery import LayerWrap, apply_plan, layer_cuts

def cut_with_levels(model: nn.Module, plan: PrunePlan, db: LevelsDatabase, settings, batches,
                    reduce_sum: ReduceSum | None = None, wrap: LayerWrap | None = None) -> dict[str, Any] | None:
    """Cut `model` in place to `plan`, writing the database's refitted columns instead of fitting them again.

    Returns the reconstruction figures (as `reconstruct.cut_and_reconstruct` reports them), or None, with nothing
    changed, when the database does not hold this repair: another `prune.reconstruct` or ridge, fits on pruned
    inputs, other calibration tokens (`prune.max_calibration_batches`), dropped layers, or a sub-block whose removed
    units are not the first of its order. A ridge the search cross-validated (`ridge_validated`) is the cut's.
    The weights are the same either way (`tests/test_search.py`). `wrap` (the layer tuning's `LayerTuner.wrap`)
    wraps each layer's cut with its tuning (it runs the dense layer forward first: nothing here computes the dense
    outputs).
    """
    t0 = time.perf_counter()
    tokens = sum(b.numel() for b in list(batches)[: settings.max_calibration_batches])
    if reduce_sum is not None:
        tokens = int(reduce_sum(torch.tensor([float(tokens)], dtype=torch.float64))[0])
    if (settings.reconstruct != db.repair or (settings.reconstruct_ridge != db.ridge and not db.ridge_validated)
            or FIT_INPUTS != "dense" or tokens != db.key.get("tokens") or plan.drop_layers):
        return None
    base = unwrap(model)
    shapes = get_family(base).layer_shapes(base)
    removed: dict[tuple[str, int], int] = {}
    for i, (lp, shape) in enumerate(zip(plan.layers, shapes)):
        for kind, keep in layer_cuts(lp, shape):
            b = db.blocks.get((kind, i))
            gone = set(range(b.units)) - set(keep) if b is not None else None
            if b is None or gone != set(b.order[:len(gone)]):
                return None
            removed[(kind, i)] = len(gone)
    family = get_family(base)
    figures: list[dict[str, Any]] = []

    def cut_layer(i: int, layer: nn.Module, shape, cuts) -> None:
        for kind, keep in cuts:
            b = db.blocks[(kind, i)]
            w_full = db.weight_at(kind, i, removed[(kind, i)])  # zero columns where units went
            family.cut_sub_block(layer, base.config, shape, kind, keep)
            if not keep:
                continue
            kept_cols = b.columns[keep].reshape(-1).to(w_full.device)
            proj = output_proj(family, layer, kind)
            with torch.no_grad():
                proj.weight.copy_(w_full[:, kept_cols].to(proj.weight.dtype))
            stats = stats_from_gram(b.weight, b.gram, kept_cols, db.tokens, b.wg)  # the cut alone: err0, Σ||y||²
            d = w_full.double() - b.weight.double()
            g = b.gram.double()
            yy = float(stats.yy)
            figures.append({"layer": i, "kind": kind, "kept": len(keep),
                            "rel_err_before": float(stats.err0) / yy if yy > 0 else 0.0,
                            "rel_err_after": max(float((d @ g * d).sum()), 0.0) / yy if yy > 0 else 0.0})

    with torch.no_grad():
        apply_plan(base, plan, wrap(cut_layer) if wrap is not None else cut_layer,
                   desc=f"cut ({settings.reconstruct}, refits from the levels database"
                        f"{', then layer tuning' if wrap is not None else ''})")
    out = summary(settings.reconstruct, "dense", db.tokens, figures, time.perf_counter() - t0, db.ridge)
    return {**out, "from": "levels_database"}
