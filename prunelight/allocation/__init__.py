"""Allocation: turn per-unit (and per-layer) importance into a prune plan that meets a parameter budget.

- `global`: one fractional knapsack over every GQA group and MLP channel (importance per parameter);
  with `min_groups: 0` and `min_channels: 0` it may empty sub-blocks, and an emptied layer is dropped.
- `uniform`: the same number of groups and channels removed in every layer.
- `layerwise`: per-layer rates from layer importance (see layerwise.py), units chosen inside each layer.
- `blockwise`: whole attention / MLP sub-blocks by importance per parameter, width pruning for the rest.
- `depth`: whole layers by layer importance (ShortGPT-style), optionally width pruning for the rest.
- `calibrated`: the global knapsack on scores rescaled per sub-block by the measured calibration-loss increase
  of a probe removal (calibrated.py), each sub-block capped at `calibrated_reach` x its probe.
Any of them can split the budget x:y between attention and MLP (global, layerwise) and round kept
MLP channels to a hardware-friendly multiple.

Budget: global, layerwise, blockwise and depth (with fill_width) remove target <= P < target + c_cost
(one MLP channel); uniform keeps equal layer shapes, so target <= P < target + num_layers * c_cost;
align_channels=m gives target <= P < target + m * c_cost; blockwise/depth without fill_width remove
whole structures only (within one structure).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from prunelight.allocation.align import align_channels as _align
from prunelight.allocation.calibrated import Probes, calibrated_scores, calibrated_width
from prunelight.allocation.budget import (
    Budget,
    build_plan,
    check_scores,
    count_params,
    empty_removed,
    lowest,
    units,
    decoder_params,
    make_budget,
    plan_meta,
    true_up,
)
from prunelight.allocation.layerwise import layer_rates, layerwise_width
from prunelight.allocation.stock import candidates as stock_candidates
from prunelight.allocation.stock import check_stock_settings, stock_width
from prunelight.allocation.structural import blockwise, depth
from prunelight.allocation.width import global_width, kind_targets, uniform_width
from prunelight.importance.base import UnitScores
from prunelight.plan import PrunePlan
from prunelight.settings import ALLOCATIONS, SPLIT_ALLOCATIONS, PruneSettings

NEEDS_LAYER_IMPORTANCE = ("layerwise", "depth")

__all__ = ["ALLOCATIONS", "Budget", "allocate", "count_params", "decoder_params", "make_budget", "precheck"]


def precheck(model: nn.Module, settings: PruneSettings, uniform_shape: bool = False) -> Budget:
    """Measure the model once and refuse settings its sizes cannot meet (run before calibration).

    `uniform_shape` (export.format: stock) also refuses settings and models no uniform shape suits.
    """
    if uniform_shape:
        check_stock_settings(settings)
        if settings.target_kv_cache is not None:
            raise ValueError(f"prune.target_kv_cache={settings.target_kv_cache!r} is not allowed with export.format="
                             "stock: a KV-cache target removes groups where they matter least, which breaks the one "
                             "shape per layer; use prune.ratio, prune.target_params or prune.target_memory")
    budget = make_budget(model, settings)
    rates = settings.layerwise
    goal = settings.target
    asked = f"prune.ratio={settings.ratio}" if goal is None else f"{goal.option}={goal.text!r}"
    if settings.allocation == "layerwise":
        if rates.freeze_top_n >= budget.num_layers:
            raise ValueError(
                f"prune.layerwise.freeze_top_n={rates.freeze_top_n} is not allowed: the model has {budget.num_layers} "
                "layers and at least one must be prunable"
            )
        sizes = sorted((budget.layer_units(i), i) for i in range(budget.num_layers))
        pruned = [i for _, i in sizes[rates.freeze_top_n:]]  # optimistic: the smallest layers frozen
        most = sum(min(rates.rate_range[1], 1.0) * budget.layer_units(i) for i in pruned)
        if budget.target > most:
            raise ValueError(
                f"{asked} is not allowed here: it needs {budget.target:,} parameters but layer rates up to "
                f"{rates.rate_range[1]} on {len(pruned)} unfrozen layer(s) remove at most {int(most):,}"
            )
    if settings.allocation in ("global", "layerwise"):
        removable = budget.removable("attn") + budget.removable("mlp")
        if budget.target > removable:
            raise ValueError(
                f"{asked} asks to remove {budget.target:,} parameters but at most {removable:,} can go "
                f"({removable / budget.total:.1%} of the model) while keeping prune.min_groups={settings.min_groups} "
                f"group(s) and prune.min_channels={settings.min_channels} channel(s) per layer"
            )
    share = settings.attn_share
    if share is not None and not uniform_shape:
        kind_targets(budget, share)
    if uniform_shape and settings.allocation != "depth":  # depth's dropped layers are known only after scoring
        import torch

        zeros = {k: [torch.zeros(n) for n in budget.sizes(k)] for k in ("attn", "mlp")}
        stock_candidates(zeros, budget, settings.align_channels)
    return budget


def allocate(
    budget: Budget,
    scores: UnitScores,
    settings: PruneSettings,
    layer_scores: Sequence[float] | None = None,
    block_scores: dict[str, Sequence[float]] | None = None,
    attn_share: float | None = None,
    uniform_shape: bool = False,
    groups_removed: int | None = None,
    probes: Probes | None = None,
) -> PrunePlan:
    """Choose the units (and sub-blocks / layers) to remove so that the budget's target is met.

    `attn_share` overrides the settings' fixed split (the split search tries several); layerwise and
    depth need `layer_scores`, blockwise with `block_importance: removal` takes `block_scores`.
    `uniform_shape` (export.format: stock) keeps one shape in every kept layer (allocation/stock.py);
    `groups_removed` then fixes the groups removed per layer (the calibration search tries each).
    `calibrated` needs the `probes` measured by `calibrated.measure_probes` (make_plan measures them).
    """
    if uniform_shape:
        return _allocate_stock(budget, scores, settings, layer_scores, attn_share, groups_removed)
    method = settings.allocation
    if budget.kv_groups:
        return _kv_plan(budget, scores, method)
    share = settings.attn_share if attn_share is None else attn_share
    if share is not None and method not in SPLIT_ALLOCATIONS:
        raise ValueError(f"an attention:MLP split applies to {', '.join(SPLIT_ALLOCATIONS)}, not {method!r}")
    check_scores(scores, budget)
    if method in NEEDS_LAYER_IMPORTANCE and layer_scores is None:
        raise ValueError(f"allocation {method!r} needs layer importance (layer_scores); make_plan measures it")
    if method == "calibrated" and probes is None:
        raise ValueError("allocation 'calibrated' needs its probe removals measured (probes); make_plan measures them")
    extra: dict = {"allocation": method}
    drop: set[int] = set()
    if method == "global":
        removed = global_width(scores, budget, share)
    elif method == "uniform":
        removed = uniform_width(scores, budget)
    elif method == "layerwise":
        rates = layer_rates(layer_scores, budget, settings.layerwise)
        removed = layerwise_width(scores, budget, rates, share)
        lw = settings.layerwise
        extra.update(layer_rates=rates, rate_strategy=lw.rate_strategy, alpha=lw.alpha, freeze_top_n=lw.freeze_top_n,
                     importance_scale=lw.importance_scale)
    elif method == "blockwise":
        removed, gone = blockwise(scores, budget, block_scores, settings.fill_width)
        extra.update(blocks_removed=[f"{k}{i}" for k, i in gone])
    elif method == "calibrated":
        removed = calibrated_width(scores, budget, probes, settings.calibrated_reach)
        scores = calibrated_scores(scores, probes)  # the true-up below moves units on the same (loss) scale
        extra.update(calibrated_reach=settings.calibrated_reach, probes=probes.as_dict())
    else:
        removed, drop = depth(scores, budget, layer_scores, settings.fill_width)
    if share is not None:
        extra["attn_share_target"] = share
    if settings.align_channels > 1:
        removed = _align(scores, budget, removed, settings.align_channels, fixed=drop)
        extra["align_channels"] = settings.align_channels
    elif method != "uniform" and (settings.fill_width or method not in ("blockwise", "depth")):
        # Count the sub-blocks' biases and layers' norms the fills did not see; land within one channel.
        removed = true_up(scores, budget, removed, drop)
    plan = build_plan(budget, removed, drop)
    plan.meta = {**extra, **plan_meta(budget, plan)}
    return plan


def _kv_plan(budget: Budget, scores: UnitScores, method: str) -> PrunePlan:
    """A KV-cache target: exactly `budget.kv_groups` GQA groups go (lowest scores; uniform: as many per layer)."""
    check_scores(scores, budget)
    removed = empty_removed(budget)
    if method == "uniform":
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
    plan.meta = {"allocation": method, **plan_meta(budget, plan)}
    return plan


def _allocate_stock(budget: Budget, scores: UnitScores, settings: PruneSettings, layer_scores, attn_share,
                    groups_removed: int | None) -> PrunePlan:
    """`allocate` under export.format: stock: whole layers (depth) first, then one uniform width everywhere."""
    check_stock_settings(settings)
    check_scores(scores, budget)
    method = settings.allocation
    share = settings.attn_share if attn_share is None else attn_share
    drop: set[int] = set()
    if method == "depth":
        if layer_scores is None:
            raise ValueError("allocation 'depth' needs layer importance (layer_scores); make_plan measures it")
        removed, drop = depth(scores, budget, layer_scores, settings.fill_width)
        if not settings.fill_width:
            plan = build_plan(budget, removed, drop)
            plan.meta = {"allocation": method, "uniform_shape": True, **plan_meta(budget, plan)}
            return plan
    removed, report = stock_width(scores, budget, settings.align_channels, drop, share, groups_removed)
    plan = build_plan(budget, removed, drop)
    extra = {"allocation": method, "uniform_shape": True, "stock_shapes": report}
    if share is not None:
        extra["attn_share_target"] = share
    if settings.align_channels > 1:
        extra["align_channels"] = settings.align_channels
    plan.meta = {**extra, **plan_meta(budget, plan)}
    return plan
