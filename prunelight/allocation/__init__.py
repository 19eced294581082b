"""Allocation: turn per-unit (and per-layer) importance into a prune plan that meets a parameter budget.

- `global`: one fractional knapsack over every GQA group and MLP channel (importance per parameter);
  with `min_groups: 0` and `min_channels: 0` it may empty sub-blocks, and an emptied layer is dropped.
- `uniform`: the same number of groups and channels removed in every layer.
- `layerwise`: per-layer rates from layer importance (see layerwise.py), units chosen inside each layer.
- `blockwise`: whole attention / MLP sub-blocks by importance per parameter, width pruning for the rest.
- `depth`: whole layers by layer importance (ShortGPT-style), optionally width pruning for the rest.
Any of them can split the budget x:y between attention and MLP (global, layerwise) and round kept
MLP channels to a hardware-friendly multiple.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from prunelight.allocation.align import align_channels as _align
from prunelight.allocation.align import check_alignment
from prunelight.allocation.budget import (
    Budget,
    build_plan,
    check_scores,
    count_params,
    decoder_params,
    make_budget,
    plan_meta,
    validate_ratio,
)
from prunelight.allocation.layerwise import (
    SCALES,
    STRATEGIES,
    check_scale,
    check_strategy,
    layer_rates,
    layerwise_width,
)
from prunelight.allocation.split_search import check_search, parse_split
from prunelight.allocation.structural import BLOCK_IMPORTANCE, blockwise, depth
from prunelight.allocation.width import global_width, kind_targets, uniform_width
from prunelight.importance.base import UnitScores
from prunelight.layer_importance import LAYER_IMPORTANCE, check_layer_importance
from prunelight.plan import PrunePlan

ALLOCATIONS = ("global", "uniform", "layerwise", "blockwise", "depth")
SPLIT_ALLOCATIONS = ("global", "layerwise")  # the ones that can honour an attention:MLP split
NEEDS_LAYER_IMPORTANCE = ("layerwise", "depth")

__all__ = [
    "ALLOCATIONS",
    "BLOCK_IMPORTANCE",
    "LAYER_IMPORTANCE",
    "SCALES",
    "STRATEGIES",
    "allocate",
    "check_allocation_options",
    "count_params",
    "decoder_params",
    "precheck",
    "validate_ratio",
]


def check_allocation_options(
    allocation: str = "global",
    strategy: str = "inverse",
    alpha: float = 1.0,
    freeze_top_n: int = 0,
    rate_range: Sequence[float] = (0.0, 1.0),
    attn_mlp_split: str | None = None,
    align_channels: int = 1,
    layer_importance: str = "block_influence",
    block_importance: str = "units",
    split_step: float = 0.1,
    split_fine_step: float = 0.025,
    split_patience: int = 2,
    importance_scale: str = "minmax",
) -> None:
    """Every allocation option checked by name and range, before any model or data is touched."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; available: {', '.join(ALLOCATIONS)}")
    check_strategy(strategy, alpha, freeze_top_n, rate_range)
    check_scale(importance_scale)
    check_layer_importance(layer_importance)
    if block_importance not in BLOCK_IMPORTANCE:
        raise ValueError(f"unknown block importance {block_importance!r}; available: {', '.join(BLOCK_IMPORTANCE)}")
    parse_split(attn_mlp_split)
    if attn_mlp_split is not None and allocation not in SPLIT_ALLOCATIONS:
        raise ValueError(
            f"attn_mlp_split applies to allocations {', '.join(SPLIT_ALLOCATIONS)}, not {allocation!r}; remove it"
        )
    if attn_mlp_split == "auto":
        check_search(split_step, split_fine_step, split_patience)
    check_alignment(align_channels)


def precheck(model: nn.Module, ratio: float, allocation: str, min_groups: int = 1, min_channels: int = 1,
             freeze_top_n: int = 0, rate_range: Sequence[float] = (0.0, 1.0),
             attn_mlp_split: str | None = None) -> Budget:
    """Checks that need the model's sizes but no data (run before calibration)."""
    budget = make_budget(model, ratio, min_groups, min_channels)
    if allocation == "layerwise":
        if freeze_top_n >= budget.num_layers:
            raise ValueError(
                f"freeze_top_n={freeze_top_n} but the model has {budget.num_layers} layers; "
                "at least one must be prunable"
            )
        sizes = sorted((budget.layer_units(i), i) for i in range(budget.num_layers))
        pruned = [i for _, i in sizes[freeze_top_n:]]  # optimistic: the smallest layers frozen
        most = sum(min(rate_range[1], 1.0) * budget.layer_units(i) for i in pruned)
        if budget.target > most:
            raise ValueError(
                f"layer rates cannot meet the budget: ratio {ratio} needs {budget.target:,} parameters but rates up to "
                f"{rate_range[1]} on {len(pruned)} unfrozen layer(s) remove at most {int(most):,}"
            )
    if allocation in ("global", "layerwise"):
        removable = budget.removable("attn") + budget.removable("mlp")
        if budget.target > removable:
            raise ValueError(
                f"ratio {ratio} asks to remove {budget.target:,} parameters but at most {removable:,} can go "
                f"({removable / budget.total:.1%} of the model) while keeping {min_groups} group(s) and "
                f"{min_channels} channel(s) per layer"
            )
    share = parse_split(attn_mlp_split)
    if share is not None:
        kind_targets(budget, share)
    return budget


def allocate(
    model: nn.Module,
    scores: UnitScores,
    ratio: float,
    method: str = "global",
    min_groups: int = 1,
    min_channels: int = 1,
    layer_scores: Sequence[float] | None = None,
    strategy: str = "inverse",
    alpha: float = 1.0,
    freeze_top_n: int = 0,
    rate_range: Sequence[float] = (0.0, 1.0),
    attn_share: float | None = None,
    align_channels: int = 1,
    block_scores: dict[str, Sequence[float]] | None = None,
    fill_width: bool = True,
    importance_scale: str = "minmax",
) -> PrunePlan:
    """Choose the units (and sub-blocks / layers) to remove so that `ratio` of all parameters is gone."""
    check_allocation_options(method, strategy, alpha, freeze_top_n, rate_range, None, align_channels,
                             importance_scale=importance_scale)
    if attn_share is not None and method not in SPLIT_ALLOCATIONS:
        raise ValueError(f"an attention:MLP split applies to {', '.join(SPLIT_ALLOCATIONS)}, not {method!r}")
    if attn_share is not None and not 0.0 <= attn_share <= 1.0:
        raise ValueError(f"attn_share must be in [0, 1], got {attn_share!r}")
    budget = precheck(model, ratio, method, min_groups, min_channels, freeze_top_n, rate_range)
    check_scores(scores, budget)
    if method in NEEDS_LAYER_IMPORTANCE and layer_scores is None:
        raise ValueError(f"allocation {method!r} needs layer importance (layer_scores); make_plan measures it")
    extra: dict = {"allocation": method}
    drop: set[int] = set()
    if method == "global":
        removed = global_width(scores, budget, attn_share)
    elif method == "uniform":
        removed = uniform_width(scores, budget)
    elif method == "layerwise":
        rates = layer_rates(layer_scores, budget, strategy, alpha, freeze_top_n, rate_range, importance_scale)
        removed = layerwise_width(scores, budget, rates, attn_share)
        extra.update(layer_rates=rates, strategy=strategy, alpha=alpha, freeze_top_n=freeze_top_n,
                     importance_scale=importance_scale)
    elif method == "blockwise":
        removed, gone = blockwise(scores, budget, block_scores, fill_width)
        extra.update(blocks_removed=[f"{k}{i}" for k, i in gone])
    else:
        removed, drop = depth(scores, budget, layer_scores, fill_width)
    if attn_share is not None:
        extra["attn_share_target"] = attn_share
    if align_channels > 1:
        removed = _align(scores, budget, removed, align_channels, fixed=drop)
        extra["align_channels"] = align_channels
    plan = build_plan(budget, removed, drop)
    plan.meta = {**extra, **plan_meta(budget, plan)}
    return plan
