"""`attn_mlp_split: auto`: the attention share of the budget, the uniform shape (export.format: stock) or the served
layout's group count (nemotron_nas) chosen by the calibration NLL of the masked model (`pipeline.make_plan` runs it
for every allocation that takes a split, before allocating)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from prunelight.allocation import Budget, CutSettings, Shape, allocate
from prunelight.allocation.split_search import masked, search_split
from prunelight.console import progress
from prunelight.distributed import ReduceSum, mean_over_ranks
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.families import unwrap
from prunelight.importance.base import UnitScores
from prunelight.plan import PrunePlan


@dataclass
class SplitChoice:
    """What the measured split fixes for the allocation (at most one of the three), and its report."""

    share: float | None = None  # the attention share (free layer shapes; or the fixed "x:y" split)
    groups_removed: int | None = None  # the groups removed per layer (the uniform shape)
    groups_kept: int | None = None  # the groups kept in every layer keeping attention (the served layout)
    report: dict[str, Any] | None = None  # plan.meta["split_search"]: every try and its calibration NLL

    def record(self, meta: dict[str, Any]) -> None:
        """The report in the plan's meta; a measured uniform shape or served layout marks its candidates."""
        if self.report is None:
            return
        meta["split_search"] = self.report
        if self.groups_removed is not None:  # the uniform shape was chosen by calibration NLL
            meta["stock_shapes"].update(chosen_by="calibration_nll", candidates=self.report["tried"])
        if self.groups_kept is not None:  # the served layout's group count was chosen by calibration NLL
            meta["served_shapes"].update(chosen_by="calibration_nll", candidates=self.report["tried"])


def measure_split(model: nn.Module, budget: Budget, scores: UnitScores, settings: CutSettings, shape: Shape,
                  extras: dict, batches: Sequence[torch.Tensor], reduce_sum: ReduceSum | None = None) -> SplitChoice:
    """With `attn_mlp_split: auto`, the split measured under the shape (`extras`: what `allocate` needs beyond the
    scores, the same for every try); else the settings' fixed share, nothing measured."""
    if settings.attn_mlp_split != "auto":
        return SplitChoice(share=settings.attn_share)
    if shape is Shape.SERVED:
        kept, report = _served(model, budget, scores, settings, extras, batches, reduce_sum)
        return SplitChoice(groups_kept=kept, report=report)
    if shape is Shape.UNIFORM:
        removed, report = _uniform(model, budget, scores, settings, extras, batches, reduce_sum)
        return SplitChoice(groups_removed=removed, report=report)
    share, report = _share(model, budget, scores, settings, extras, batches, reduce_sum)
    return SplitChoice(share=share, report=report)


def calibration_nll(model: nn.Module, plan: PrunePlan, batches: Sequence[torch.Tensor],
                    reduce_sum: ReduceSum | None = None) -> float:
    """Calibration-text NLL of `model` as if `plan` were applied (masked, nothing cut)."""
    with masked(model, plan):
        res = evaluate_perplexity(unwrap(model), batches)
    return mean_over_ranks([res["nll"]], reduce_sum)[0]


def _uniform(model: nn.Module, budget: Budget, scores: UnitScores, settings: CutSettings,
                  extras: dict, batches, reduce_sum) -> tuple[int, dict]:
    """Measure every uniform shape's calibration NLL (masked); the groups removed per layer of the lowest.

    `extras`: what `allocate` needs beyond the scores (layer_scores, measured), the same for every try."""
    first = allocate(budget, scores, settings, shape=Shape.UNIFORM, **extras)
    cands = first.meta["stock_shapes"]["candidates"]
    tried = []
    for cand in progress(cands, desc="uniform shape (calibration NLL)", unit="shape"):
        k = cand["groups_removed_per_layer"]
        plan = allocate(budget, scores, settings, shape=Shape.UNIFORM, groups_removed=k, **extras)
        tried.append({**cand, "calibration_nll": calibration_nll(model, plan, batches, reduce_sum)})
    best = min(tried, key=lambda c: (c["calibration_nll"], c["groups_removed_per_layer"]))
    return best["groups_removed_per_layer"], {"uniform_shape": True, "by": "calibration_nll", "tried": tried,
                                              "best_groups_removed_per_layer": best["groups_removed_per_layer"]}


def _served(model: nn.Module, budget: Budget, scores: UnitScores, settings: CutSettings,
                   extras: dict, batches, reduce_sum) -> tuple[int, dict]:
    """Measure the best served layout of each kept group count on calibration NLL (masked); the count of the lowest."""
    first = allocate(budget, scores, settings, shape=Shape.SERVED, **extras)
    tried = []
    for cand in progress(first.meta["served_shapes"]["candidates"], desc="served layout (calibration NLL)", unit="layout"):
        plan = allocate(budget, scores, settings, shape=Shape.SERVED, groups_kept=cand["groups_kept"], **extras)
        tried.append({**cand, "calibration_nll": calibration_nll(model, plan, batches, reduce_sum)})
    best = min(tried, key=lambda c: (c["calibration_nll"], -c["groups_kept"]))
    return best["groups_kept"], {"served_layout": True, "by": "calibration_nll", "tried": tried,
                                 "best_groups_kept": best["groups_kept"]}


def _share(model: nn.Module, budget: Budget, scores: UnitScores, settings: CutSettings,
                  extras: dict, batches, reduce_sum) -> tuple[float, dict]:
    """Find the attention share of the budget with the lowest calibration NLL."""
    start_plan = allocate(budget, scores, settings, **extras)
    start = float(start_plan.meta["attn_share_removed"])
    low = max(0.0, (budget.target - budget.removable("mlp")) / budget.target)
    high = min(1.0, budget.removable("attn") / budget.target)
    bar = progress(None, desc="attention:MLP split (calibration NLL)", unit="try")

    def score(share: float) -> float:
        plan = allocate(budget, scores, settings, attn_share=share, **extras)
        value = calibration_nll(model, plan, batches, reduce_sum)
        bar.update(1)
        bar.set_postfix(attn_share=f"{share:.3f}", nll=f"{value:.4f}")
        return value

    s = settings.allocation_options.split_search
    try:
        best, history = search_split(score, start, low, high, s.step, s.fine_step, s.patience)
    finally:
        bar.close()
    return best, {"start": start, "best": best, "range": [low, high],
                  "tried": [{"attn_share": v, "calibration_nll": nll} for v, nll in history]}
