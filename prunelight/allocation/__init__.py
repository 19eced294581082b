"""Allocation: turn per-unit (and per-layer) importance into a prune plan that meets a parameter budget.

- `global`: one fractional knapsack over every GQA group and MLP channel (importance per parameter);
  with `min_groups: 0` and `min_channels: 0` it may empty sub-blocks, and an emptied layer is dropped.
- `uniform`: the same number of groups and channels removed in every layer.
- `layerwise`: per-layer rates from layer importance (see layerwise.py), units chosen inside each layer.
- `blockwise`: whole attention / MLP sub-blocks by importance per parameter, width pruning for the rest.
- `depth`: whole layers by layer importance (ShortGPT-style), optionally width pruning for the rest.
- `search` (the default): every sub-block's width chosen by an evolutionary search on the KL of whole candidate
  models from the dense model's next-token distributions, over a levels database of OBS-chosen, refitted units
  (search.py, levels.py); under stock every uniform shape is measured, under nemotron_nas the served layouts.
- `calibrated`: the global knapsack on scores rescaled per sub-block by the measured
  calibration-loss increase of a probe removal (calibrated.py: the row's own measurement), each sub-block capped
  at `prune.allocation_args.reach` x its probe; under a stock or served layout, global's shape search on the
  rescaled scores.
Any of them can split the budget x:y between attention and MLP (global, layerwise, calibrated) and round kept
MLP channels to a hardware-friendly multiple.

Each allocation is a row of `registry.ALLOCATIONS` (what it needs, the shape constraints it honours,
its pre-check); `precheck` and `allocate` below are the same for all of them. The shape constraint comes
from `export.format` (`shapes.EXPORT_SHAPES`): FREE (auto), UNIFORM (stock: stock.py), SERVED
(nemotron_nas: served.py; under it the served layout's budget is target <= P < target + align * c_cost).

Budget: global, layerwise, blockwise and depth (with fill_width) remove target <= P < target + c_cost
(one MLP channel); uniform keeps equal layer shapes, so target <= P < target + num_layers * c_cost;
align_channels=m gives target <= P < target + m * c_cost; blockwise/depth without fill_width remove
whole structures only (within one structure).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from prunelight.allocation.base import Allocation, AllocationInputs, CutInputs, MeasureInputs, Removal, Shape
from prunelight.allocation.budget import (
    Budget,
    CutSettings,
    build_plan,
    check_scores,
    count_params,
    decoder_params,
    empty_removed,
    lowest,
    make_budget,
    plan_meta,
    units,
)
from prunelight.allocation.registry import ALLOCATIONS, allocation_of, honouring, names_with, register
from prunelight.allocation.shapes import SHAPES, format_of_shape, shape_of_format
from prunelight.importance.base import UnitScores
from prunelight.plan import PrunePlan

__all__ = ["ALLOCATIONS", "Allocation", "AllocationInputs", "Budget", "CutInputs", "CutSettings", "MeasureInputs", "Removal", "Shape", "allocate",
           "allocation_of", "check_shape", "count_params", "decoder_params", "make_budget", "precheck", "register", "shape_of_format"]


def check_shape(settings: CutSettings, shape: Shape = Shape.FREE) -> None:
    """Settings-only refusals of a shape constraint: the allocation must honour it, and the shape's own checks."""
    row = allocation_of(settings.allocation)
    if shape not in row.by_shape:
        raise ValueError(f"prune.allocation={row.name!r} is not allowed with export.format={format_of_shape(shape)} "
                         f"({SHAPES[shape].why}): use one of {', '.join(honouring(shape))}")
    SHAPES[shape].check_settings(settings)


def precheck(model: nn.Module, settings: CutSettings, shape: Shape = Shape.FREE) -> Budget:
    """Measure the model once and refuse settings its sizes cannot meet (model sizes only: before any data).

    Runs the shape constraint's config check, the allocation's pre-check and the shape's size check; the settings
    against the shape (`check_shape`) are the run plan's (`run_plan.prepare_run`), checked once before this.
    """
    rule = SHAPES[shape]
    if rule.check_config is not None:
        rule.check_config(model.config)
    budget = make_budget(model, settings)
    m = settings.align_channels
    if m > 1 and m > min(budget.n_chans):  # no layer could keep an aligned MLP, under any allocation and shape
        raise ValueError(f"prune.align_channels={m} is not allowed: it exceeds the {min(budget.n_chans)} MLP channels "
                         "of the model's narrowest layer; use a smaller multiple")
    row = allocation_of(settings.allocation)
    if row.precheck is not None:
        row.precheck(budget, settings, shape)
    drop = row.drops(budget, settings) if row.drops is not None else set()
    if rule.check_sizes is not None and drop is not None:
        rule.check_sizes(budget, settings, shape, drop)
    return budget


def allocate(
    budget: Budget,
    scores: UnitScores,
    settings: CutSettings,
    layer_scores: Sequence[float] | None = None,
    block_scores: dict[str, Sequence[float]] | None = None,
    attn_share: float | None = None,
    shape: Shape = Shape.FREE,
    groups_removed: int | None = None,
    groups_kept: int | None = None,
    measured: Any = None,
) -> PrunePlan:
    """Choose the units (and sub-blocks / layers) to remove so that the budget's target is met.

    `attn_share` overrides the settings' fixed split (the split search tries several); allocations with
    `layer_importance` need `layer_scores`, blockwise with `block_importance: removal` takes `block_scores`.
    `shape` is the layer-shape constraint (`Shape.UNIFORM` for export.format: stock); `groups_removed` then
    fixes the groups removed per layer (the calibration search tries each); under `Shape.SERVED`
    (export.format: nemotron_nas) `groups_kept` fixes the groups kept in every layer keeping attention.
    A row with a `measure` takes what it measured as `measured` (`pipeline.make_plan` runs it); the row's options
    come from the settings (`prune.allocation_args`).
    """
    row = allocation_of(settings.allocation)
    rule = SHAPES[shape]
    if shape not in row.by_shape:  # the run plan refused it before any work; a direct caller hears the same
        check_shape(settings, shape)
    share = settings.attn_share if attn_share is None else attn_share
    check_scores(scores, budget)
    if row.measure is not None and measured is None:
        raise ValueError(f"allocation {row.name!r} needs its measurement (measured); make_plan runs the row's measure")
    if row.rescale is not None:  # one scale for every shape's function and the KV-cache target (calibrated)
        scores = row.rescale(scores, measured)
    recorded = {row.record_as: measured.as_dict()} if row.record_as and measured is not None else {}
    if budget.kv_groups and rule.kv_target:
        return _kv_plan(budget, scores, row, recorded)
    if share is not None and not row.splits:
        raise ValueError(f"an attention:MLP split applies to {', '.join(names_with('splits'))}, not {row.name!r}")
    if row.layer_importance and layer_scores is None:
        raise ValueError(f"allocation {row.name!r} needs layer importance (layer_scores); make_plan measures it")
    inp = AllocationInputs(budget, scores, settings, layer_scores, block_scores, share, groups_removed, groups_kept,
                           measured, settings.allocation_options)
    removal = rule.finish(inp, row.by_shape[shape](inp))
    plan = build_plan(budget, removal.removed, removal.drop)
    plan.meta = {"allocation": row.name, **removal.extra, **recorded, **plan_meta(budget, plan)}
    return plan


def _kv_plan(budget: Budget, scores: UnitScores, row: Allocation, extra: dict | None = None) -> PrunePlan:
    """A KV-cache target: exactly `budget.kv_groups` GQA groups go (lowest scores; `kv_per_layer`: as many per layer).

    `allocate` has checked the scores (before rescaling them)."""
    removed = empty_removed(budget)
    if row.kv_per_layer:
        k = budget.kv_groups // budget.num_layers
        for i, t in enumerate(scores["attn"]):
            removed["attn"][i] = lowest(t, k)
    else:
        limits = budget.limits("attn")
        left = budget.kv_groups
        for _, _, i, j, _ in units(scores, budget, kinds=("attn",)):
            if left == 0:
                break
            if len(removed["attn"][i]) < limits[i]:
                removed["attn"][i].add(j)
                left -= 1
    plan = build_plan(budget, removed)
    plan.meta = {"allocation": row.name, **(extra or {}), **plan_meta(budget, plan)}
    return plan
