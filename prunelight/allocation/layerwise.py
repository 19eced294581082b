"""`layerwise`: per-layer pruning rates from measured layer importance, then units chosen inside each layer.

Importance is scaled to z in [0, 1] (`minmax`, or `rank` when one layer dwarfs the rest); a layer's
weight is exp(-alpha*z) (`inverse`: important layers are cut less), exp(alpha*z) (`proportional`)
or 1 (`uniform`). Rates are
r_i = clip(c * w_i, lo, hi_i) with c found by bisection so that sum_i r_i * P_i equals the target
(P_i: the layer's prunable parameters; hi_i also respects min_groups/min_channels). The `freeze_top_n`
most important layers get rate 0. Rounding to whole units is corrected globally at the end so the
budget is met within one MLP channel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from prunelight.allocation.base import AllocationInputs, Removal, Shape
from prunelight.allocation.budget import Budget, Removed, empty_removed, fill, meet, trim, units
from prunelight.allocation.split_search import SplitSearch, split_search_of
from prunelight.allocation.width import asked, check_removable, kind_targets, limits
from prunelight.importance.base import UnitScores
from prunelight.validate import bad, choice, integer, number

RATE_STRATEGIES = ("inverse", "proportional", "uniform")
IMPORTANCE_SCALES = ("minmax", "rank")
ARGS = "prune.allocation_args"


@dataclass
class LayerwiseOptions:
    """The options of `prune.allocation: layerwise` (`prune.allocation_args`): how layer importance becomes per-layer
    pruning rates (docs/methods.md)."""

    rate_strategy: Literal[RATE_STRATEGIES] = "inverse"  # type: ignore[valid-type]
    """inverse: important layers are cut less; proportional: more; uniform: the same rate everywhere."""
    alpha: float = 1.0
    """Spread of the rates: weight exp(-alpha*z) for importance z in [0, 1]."""
    importance_scale: Literal[IMPORTANCE_SCALES] = "minmax"  # type: ignore[valid-type]
    """How raw layer importance becomes z: minmax, or rank when one layer dwarfs the rest."""
    freeze_top_n: int = 0
    """The n most important layers are not pruned."""
    rate_range: tuple[float, float] = (0.0, 1.0)
    """[low, high] bounds of every layer's rate."""
    split_search: SplitSearch = field(default_factory=SplitSearch)
    """The search of the attention share when `prune.attn_mlp_split: auto`."""

    def __post_init__(self) -> None:
        choice(f"{ARGS}.rate_strategy", self.rate_strategy, RATE_STRATEGIES)
        number(f"{ARGS}.alpha", self.alpha, 0.0, math.inf, False, True)
        choice(f"{ARGS}.importance_scale", self.importance_scale, IMPORTANCE_SCALES)
        integer(f"{ARGS}.freeze_top_n", self.freeze_top_n, 0)
        r = tuple(self.rate_range)
        if len(r) != 2 or not all(isinstance(v, (int, float)) for v in r) or not 0.0 <= r[0] < r[1] <= 1.0:
            raise bad(f"{ARGS}.rate_range", list(r), "must be [low, high] with 0 <= low < high <= 1")
        self.rate_range = (float(r[0]), float(r[1]))
        self.split_search = split_search_of(self.split_search)


def layer_rates(importance: Sequence[float], budget: Budget, rates: LayerwiseOptions) -> list[float]:
    """Per-layer removal fractions of the prunable parameters that together meet the budget exactly."""
    strategy, alpha, freeze_top_n = rates.rate_strategy, rates.alpha, rates.freeze_top_n
    rate_range, scale = rates.rate_range, rates.importance_scale
    n = budget.num_layers
    imp = [float(v) for v in importance]
    if scale == "rank":
        ranks = sorted(range(n), key=lambda i: (imp[i], i))
        z = [0.0] * n
        for r, i in enumerate(ranks):
            z[i] = r / (n - 1) if n > 1 else 0.0
    else:
        lo_v, hi_v = min(imp), max(imp)
        z = [(v - lo_v) / (hi_v - lo_v) if hi_v > lo_v else 0.0 for v in imp]
    sign = {"inverse": -1.0, "proportional": 1.0, "uniform": 0.0}[strategy]
    w = [math.exp(sign * alpha * zi) for zi in z]
    frozen = set(sorted(range(n), key=lambda i: (-imp[i], i))[:freeze_top_n])
    sizes, lo_all, hi_all = _rate_bounds(budget, rate_range)
    lo = [0.0 if i in frozen else v for i, v in enumerate(lo_all)]
    hi = [0.0 if i in frozen else h for i, h in enumerate(hi_all)]
    # The rates meet the budget whichever layers are frozen: `check_layerwise` refused, before any data, a freeze or
    # rate range that could not.

    def rates(c: float) -> list[float]:
        return [min(max(c * wi, l), h) for wi, l, h in zip(w, lo, hi)]

    a, b = 0.0, 1.0
    while sum(r * s for r, s in zip(rates(b), sizes)) < budget.target:
        b *= 2
    for _ in range(100):
        mid = (a + b) / 2
        if sum(r * s for r, s in zip(rates(mid), sizes)) < budget.target:
            a = mid
        else:
            b = mid
    return rates(b)


def layerwise_width(
    scores: UnitScores, budget: Budget, rates: Sequence[float], attn_share: float | None = None
) -> Removed:
    """Remove each layer's quota (rate x its prunable parameters) of its least important units, then fix the total."""
    removed = empty_removed(budget)
    lim = limits(budget)
    targets = kind_targets(budget, attn_share)
    active = [i for i, r in enumerate(rates) if r > 0]
    for i in active:
        quota = rates[i] * budget.layer_units(i)
        if targets is None:
            fill(units(scores, budget, layers={i}), int(round(quota)), removed, lim, 0, nearest=True)
        else:
            for kind in ("attn", "mlp"):
                share = targets[kind] / budget.target
                fill(units(scores, budget, kinds=(kind,), layers={i}), int(round(share * quota)), removed, lim, 0,
                     nearest=True)
    # Whole-unit rounding in each layer leaves the total a little off: correct it over the unfrozen layers,
    # to within one channel (a split: attention to the nearest group, the MLP exactly the rest).
    def done(kinds) -> int:
        return sum(len(s) * budget.cost(k) for k in kinds for s in removed[k])

    if targets is None:
        meet(units(scores, budget, layers=set(active)), budget.target, removed, lim, done(("attn", "mlp")),
             budget.c_cost)
    else:
        cands = units(scores, budget, kinds=("attn",), layers=set(active))
        total = trim(cands, targets["attn"], removed, done(("attn",)))
        fill(cands, targets["attn"], removed, lim, total, nearest=targets["mlp"] > 0)
        meet(units(scores, budget, kinds=("mlp",), layers=set(active)), budget.target - done(("attn",)), removed,
             lim, done(("mlp",)), budget.c_cost)
    return removed


def allocate_layerwise(inp: AllocationInputs) -> Removal:
    """`layerwise`: per-layer rates from layer importance, then each layer's quota of its lowest units."""
    lw = inp.options
    rates = layer_rates(inp.layer_scores, inp.budget, lw)
    removed = layerwise_width(inp.scores, inp.budget, rates, inp.attn_share)
    return Removal(removed, extra=dict(layer_rates=rates, rate_strategy=lw.rate_strategy, alpha=lw.alpha,
                                       freeze_top_n=lw.freeze_top_n, importance_scale=lw.importance_scale))


def _rate_bounds(budget: Budget, rate_range: tuple[float, float]) -> tuple[list[int], list[float], list[float]]:
    """Per layer: its prunable parameters and its lowest and highest rate (the range within min_groups/channels)."""
    n = budget.num_layers
    sizes = [budget.layer_units(i) for i in range(n)]
    lim_g, lim_c = budget.limits("attn"), budget.limits("mlp")
    cap = [(lim_g[i] * budget.g_cost + lim_c[i] * budget.c_cost) / sizes[i] for i in range(n)]
    return sizes, [min(rate_range[0], c) for c in cap], [min(rate_range[1], c) for c in cap]


def check_layerwise(budget: Budget, settings, shape: Shape) -> None:
    """Refuse a freeze or rate range that cannot meet the budget whichever layers importance freezes (model sizes
    only): `layer_rates`' own refusals are then unreachable after scoring. Then the removable check."""
    rates = settings.allocation_options
    n, k = budget.num_layers, rates.freeze_top_n
    if k >= n:
        raise ValueError(
            f"{ARGS}.freeze_top_n={k} is not allowed: the model has {n} layers and at least one must be "
            "prunable"
        )
    sizes, lo, hi = _rate_bounds(budget, rates.rate_range)
    # The worst case: the k layers giving the most frozen for `most`, those giving the least frozen for `least`.
    most = sum(sorted(h * s for h, s in zip(hi, sizes))[:n - k])
    least = sum(sorted(v * s for v, s in zip(lo, sizes))[k:])
    if budget.target > most:
        raise ValueError(
            f"{asked(settings)} is not allowed here: it needs {budget.target:,} parameters but layer rates up to "
            f"{rates.rate_range[1]} on {n - k} unfrozen layer(s) remove at most {int(most):,}"
        )
    if budget.target < least:
        raise ValueError(
            f"{asked(settings)} is not allowed here: the low rate {rates.rate_range[0]} alone removes {int(least):,} "
            f"parameters, more than the {budget.target:,} asked; lower prune.allocation_args.rate_range or raise the ratio"
        )
    check_removable(budget, settings, shape)
