"""The pruning pipeline in one call: calibrate -> score -> (layer importance, the measured split) -> allocate (no cut).

The PruningCallback (one process, DDP and the DeepSpeed hand-off alike) and the benchmark scripts go
through `make_plan`, so a method measured in a benchmark is exactly the method a `prunelight fit` run
applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelight import zero3
from prunelight.allocation import Budget, MeasureInputs, Shape, allocate, allocation_of, make_budget, precheck
from prunelight.allocation.budget import plan_meta, plan_params_removed
from prunelight.allocation.measured_split import measure_split
from prunelight.calibration import run_calibration
from prunelight.distributed import ReduceSum, mean_over_ranks
from prunelight.families import unwrap
from prunelight.importance import UnitScores, build_criterion
from prunelight.layer_importance import layer_importances, subblock_removal
from prunelight.plan import PrunePlan
from prunelight.saved import SavedScores, check_plan_fits, check_scores_cover, load_plan, model_facts
from prunelight.settings import PruneSettings



@dataclass
class Planned:
    """`make_plan`'s answer: the plan, the unit scores it was allocated from, and what the allocation row measured
    (None for a row without a measurement), which the row's own cut step reads."""

    plan: PrunePlan
    scores: UnitScores
    measured: Any = None


def make_plan(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    settings: PruneSettings,
    reduce_sum: ReduceSum | None = None,
    sharded: bool = False,
    budget: Budget | None = None,
    saved: SavedScores | None = None,
    shape: Shape = Shape.FREE,
    state_dir: Path | None = None,
) -> Planned:
    """Score every unit of `model` on `batches` with the settings' criterion and allocate its budget.

    `reduce_sum` sums statistics over ranks (DDP, DeepSpeed). `sharded` is for ZeRO-3 partitioned
    weights: weight-only criteria read one gathered layer at a time and the budget is counted on a
    weightless twin (options that run extra forwards on masked weights were refused by the run plan,
    `run_plan.check_partitioned`). A `budget` already made by the run plan for this model and settings is reused. `saved` scores
    (`prune.scores`, already checked against the model) replace the scoring pass and the layer
    importance measures: nothing is run on `batches`. `shape` is the layer-shape constraint (export.format);
    `attn_mlp_split: auto` is measured on calibration NLL (`measured_split`). A row with a `measure` runs it once
    after scoring (`state_dir`: where it may keep resumable state).
    """
    if budget is None:
        budget = precheck(zero3.shape_twin(model) if sharded else model, settings, shape)
    row = allocation_of(settings.allocation)
    batches = list(batches)  # read more than once: calibration, layer importance, the measured split
    collected = None
    if saved is not None:
        check_scores_cover(saved, settings)
        scores, layer_measured, samples = saved.unit_scores, dict(saved.layer_importance), saved.samples
        block_scores = saved.block_importance if row.block_removal(settings) else None
        imp_batches: list[torch.Tensor] = []
    else:
        # statistics the row's measurement reads, gathered by the scoring pass's forwards (e.g. a levels database's)
        collected = row.collect(settings, state_dir) if row.collect is not None and not sharded else None
        scores, layer_measured, block_scores, samples, imp_batches = _score(model, batches, settings, reduce_sum,
                                                                            sharded, collected)
    layer_scores = layer_measured.get(settings.layer_importance) if row.layer_importance else None

    measured = None
    if row.measure is not None:  # saved or handed-in scores (prune.scores, a benchmark's) still leave the batches
        measured = row.measure(MeasureInputs(
            unwrap(model), imp_batches or _importance_batches(batches, settings), budget, scores, settings, shape,
            settings.allocation_options, reduce_sum, state_dir, calibration=batches, collected=collected))
    extras = dict(layer_scores=layer_scores, measured=measured)
    split = measure_split(model, budget, scores, settings, shape, extras, imp_batches, reduce_sum)
    plan = allocate(budget, scores, settings, block_scores=block_scores, attn_share=split.share, shape=shape,
                    groups_removed=split.groups_removed, groups_kept=split.groups_kept, **extras)
    plan.meta.update(criterion=settings.criterion, criterion_args=dict(settings.criterion_args), samples=samples,
                     applies_to=model_facts(model))
    if saved is not None:
        plan.meta["scores_source"] = saved.source
    if layer_measured:
        plan.meta["layer_importance"] = layer_measured
    if block_scores is not None:
        plan.meta["block_importance"] = block_scores
    split.record(plan.meta)
    return Planned(plan, scores, measured)


def scoring_pass(model: nn.Module, batches: Sequence[torch.Tensor], settings: PruneSettings,
                 reduce_sum: ReduceSum | None = None) -> SavedScores:
    """`make_plan`'s scoring pass alone, as scores a cut re-allocates from (`run_cut(scores=...)`): unit scores,
    the layer measures the allocation and `report_layer_importance` ask for, sub-block removal when asked."""
    scores, measured, block_scores, samples, _ = _score(model, list(batches), settings, reduce_sum, sharded=False)
    return SavedScores(unit_scores=scores, key={}, layer_importance=dict(measured), block_importance=block_scores,
                       provenance={"samples": samples})


def load_plan_checked(model: nn.Module, source: str) -> PrunePlan:
    """A saved plan (plan.json, report.json or .ckpt), refused unless it fits `model`'s architecture and shapes."""
    plan, applies_to = load_plan(source)
    check_plan_fits(plan, applies_to, model_facts(model), source)
    return plan


def adopt_plan(model: nn.Module, plan: PrunePlan, source: str | None = None) -> tuple[PrunePlan, Budget]:
    """A saved plan as this run's plan: budget figures recounted on `model`, how it was made kept (no scoring).

    The plan wins over the settings' ratio, criterion and allocation, and its repair (`meta["repair"]`: settings the
    allocation chose for the cut's repair) over the settings'; its figures say what it removes here.
    """
    made = plan.meta
    budget = make_budget(model, PruneSettings())
    removed = plan_params_removed(budget, plan)
    budget = dataclasses.replace(budget, target=removed, ratio=removed / budget.total)
    out = PrunePlan(layers=plan.layers, num_groups=plan.num_groups, num_channels=plan.num_channels,
                    drop_layers=list(plan.drop_layers))
    out.meta = {"allocation": made.get("allocation", "plan"), **plan_meta(budget, out),
                "criterion": made.get("criterion", "plan"), "criterion_args": made.get("criterion_args", {}),
                "samples": 0, "applies_to": model_facts(model), "plan_source": source,
                "made_with": {k: made.get(k) for k in ("criterion", "allocation", "ratio", "target", "scores_source")
                              if made.get(k) is not None}}
    if made.get("repair"):  # the repair is part of the plan: re-applied, it gives the model the run wrote
        out.meta["repair"] = dict(made["repair"])
    return out, budget


def _score(model: nn.Module, batches: list[torch.Tensor], settings: PruneSettings, reduce_sum: ReduceSum | None,
           sharded: bool, collector: Any = None):
    """The scoring pass: unit scores, layer importance measures, sub-block removal scores (when asked).
    `collector`: attached to the scoring forwards as well (`run_calibration(also=...)`)."""
    row = allocation_of(settings.allocation)
    crit = build_criterion(settings.criterion, **settings.criterion_args)
    if sharded and not crit.needs_data:
        scores = zero3.gathered_scores(model, crit)
    else:
        scores = run_calibration(model, batches if crit.needs_data else [], crit, reduce_sum,
                                 settings.max_calibration_batches, also=[collector] if collector is not None else [])
    imp_batches = _importance_batches(batches, settings)

    # Report-only measures need calibration text (none for a weight-only plan made without batches).
    wanted = layer_measures(settings, report=not sharded and bool(imp_batches))
    measured = {name: mean_over_ranks(values, reduce_sum)
                for name, values in (layer_importances(model, imp_batches, wanted).items() if wanted else ())}
    block_scores = None
    if row.block_removal(settings):
        sub = subblock_removal(model, imp_batches)
        block_scores = {k: mean_over_ranks(v, reduce_sum) for k, v in sub.items()}
    return scores, measured, block_scores, crit.num_samples, imp_batches


def layer_measures(settings: PruneSettings, report: bool = True) -> list[str]:
    """The layer importance measures a scoring pass records: the allocation's own (rows with layer_importance),
    then, with `report`, prune.report_layer_importance."""
    wanted = list(settings.report_layer_importance) if report else []
    if allocation_of(settings.allocation).layer_importance and settings.layer_importance not in wanted:
        wanted.insert(0, settings.layer_importance)
    return wanted


def _importance_batches(batches: list[torch.Tensor], settings: PruneSettings) -> list[torch.Tensor]:
    """The calibration batches the layer, sub-block and probe measures run on (prune.importance_batches)."""
    return batches[:settings.importance_batches or settings.max_calibration_batches]
