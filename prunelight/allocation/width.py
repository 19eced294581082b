"""Width allocations over units: `global` (one knapsack over the whole model) and `uniform` (same count per layer)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prunelight.allocation.base import AllocationInputs, Removal, Shape
from prunelight.allocation.budget import Budget, Removed, empty_removed, fill, lowest, meet, units
from prunelight.allocation.split_search import SplitSearch, split_search_of
from prunelight.importance.base import UnitScores


@dataclass
class GlobalOptions:
    """The options of `prune.allocation: global` (`prune.allocation_args`)."""

    split_search: SplitSearch = field(default_factory=SplitSearch)
    """The search of the attention share when `prune.attn_mlp_split: auto`."""

    def __post_init__(self) -> None:
        self.split_search = split_search_of(self.split_search)


def kind_targets(budget: Budget, attn_share: float | None) -> dict[str, int] | None:
    """Split the target x:y between attention and MLP; a clear error when a side cannot give its share."""
    if attn_share is None:
        return None
    t_attn = int(round(attn_share * budget.target))
    targets = {"attn": t_attn, "mlp": budget.target - t_attn}
    for kind, name in (("attn", "attention"), ("mlp", "MLP")):
        if targets[kind] > budget.removable(kind):
            raise ValueError(
                f"the attention:MLP split asks {name} for {targets[kind]:,} parameters but at most "
                f"{budget.removable(kind):,} can be removed there (keeping {budget.keeps('attn')} group(s) / "
                f"{budget.keeps('mlp')} channel(s) per layer); give {name} a smaller share"
            )
    return targets


def limits(budget: Budget) -> dict[str, list[int]]:
    """Per-layer removal limits of both kinds."""
    return {kind: budget.limits(kind) for kind in ("attn", "mlp")}


def global_width(scores: UnitScores, budget: Budget, attn_share: float | None = None,
                 removed: Removed | None = None, layers=None, lim: dict[str, list[int]] | None = None) -> Removed:
    """Fractional-knapsack greedy: drop the lowest importance-per-parameter units until the budget is met.

    A GQA group that would overshoot the target by a channel's cost or more is passed over for the next
    channels in the order, so the unit count lands within one channel of the target. With `attn_share`,
    attention takes its share to the nearest whole group and the MLP takes exactly the rest. `lim`: per-layer
    removal caps tighter than the budget's limits (calibrated's reach).
    """
    removed = removed if removed is not None else empty_removed(budget)
    lim = lim if lim is not None else limits(budget)
    targets = kind_targets(budget, attn_share)

    def done(kinds) -> int:
        return sum(len(s) * budget.cost(k) for k in kinds for s in removed[k])

    if targets is None:
        meet(units(scores, budget, layers=layers), budget.target, removed, lim, done(("attn", "mlp")), budget.c_cost)
    else:
        # Whole groups cannot hit the attention share exactly; the MLP absorbs the difference so the total is exact.
        # With no MLP share at all, attention alone must reach the target (within one group).
        fill(units(scores, budget, kinds=("attn",), layers=layers), targets["attn"], removed, lim, done(("attn",)),
             nearest=targets["mlp"] > 0)
        meet(units(scores, budget, kinds=("mlp",), layers=layers), budget.target - done(("attn",)), removed, lim,
             done(("mlp",)), budget.c_cost)
    return removed


def uniform_counts(budget: Budget) -> tuple[int, int]:
    """Groups and channels removed in every layer by `uniform`: groups rounded to whole groups, channels the rest.

    Every layer keeps the same shape, so the removal lands in [target, target + num_layers * c_cost):
    one channel per layer is the finest step that keeps the shapes equal. Groups never take more than
    the whole target on their own. Needs only the model's sizes, so `precheck` runs it before scoring.
    """
    layers = budget.num_layers
    frac = budget.target / budget.decoder
    n_g = min(budget.n_groups)
    k_g = min(int(round(frac * n_g)), budget.target // (layers * budget.g_cost), min(budget.limits("attn")))
    rest = budget.target - layers * k_g * budget.g_cost
    most_c = min(budget.limits("mlp"))
    k_c = min(max(int(math.ceil(rest / (layers * budget.c_cost))), 0), most_c)
    if rest > layers * k_c * budget.c_cost:
        raise ValueError(
            f"uniform allocation cannot reach the budget: after {k_g} group(s) per layer the MLP would need "
            f"more than {most_c} channels per layer; use allocation 'global' or a smaller ratio"
        )
    return k_g, k_c


def uniform_width(scores: UnitScores, budget: Budget) -> Removed:
    """The same counts in every layer (`uniform_counts`), the lowest-scored units of each layer."""
    k_g, k_c = uniform_counts(budget)
    return {
        "attn": [lowest(scores["attn"][i], k_g) for i in range(budget.num_layers)],
        "mlp": [lowest(scores["mlp"][i], k_c) for i in range(budget.num_layers)],
    }


def allocate_global(inp: AllocationInputs) -> Removal:
    """`global`: one knapsack over every unit of the model."""
    return Removal(global_width(inp.scores, inp.budget, inp.attn_share))


def allocate_uniform(inp: AllocationInputs) -> Removal:
    """`uniform`: the same counts in every layer (its own rounding: no true-up)."""
    return Removal(uniform_width(inp.scores, inp.budget), exact=True)


def check_removable(budget: Budget, settings, shape: Shape) -> None:
    """Refuse a target above what the layers can give while keeping min_groups / min_channels."""
    removable = budget.removable("attn") + budget.removable("mlp")
    if budget.target > removable:
        raise ValueError(
            f"{asked(settings)} asks to remove {budget.target:,} parameters but at most {removable:,} can go "
            f"({removable / budget.total:.1%} of the model) while keeping prune.min_groups={settings.min_groups} "
            f"group(s) and {budget.keeps('mlp')} channel(s) per layer (prune.min_channels={settings.min_channels}, "
            f"align_channels={settings.align_channels})"
        )
    check_keeps_a_layer(budget, settings, settings.align_channels * budget.c_cost)


def check_keeps_a_layer(budget: Budget, settings, overshoot: int) -> None:
    """With min_groups and min_channels 0 every layer could empty: refuse a target whose removal may reach every
    unit of every layer. The width fills count unit parameters only and land below target + `overshoot`, so below
    that every fill keeps a unit, and `build_plan` never drops every layer."""
    if settings.min_groups or settings.min_channels or budget.kv_groups:
        return  # every layer keeps a unit (a KV-cache target removes groups only)
    units = sum(budget.layer_units(i) for i in range(budget.num_layers))
    if budget.target + overshoot > units:
        raise ValueError(f"{asked(settings)} is not allowed with prune.min_groups=0 and min_channels=0: it would "
                         f"remove every unit of every decoder layer ({units:,} parameters); lower the ratio")


def check_uniform(budget: Budget, settings, shape: Shape) -> None:
    """`uniform` with free shapes: the equal counts must reach the budget (a KV-cache target counts groups only)."""
    if shape is Shape.FREE and not budget.kv_groups:
        try:
            uniform_counts(budget)
        except ValueError as err:
            raise ValueError(f"{asked(settings)} is not allowed with allocation uniform: {err}") from None
        check_keeps_a_layer(budget, settings, budget.num_layers * settings.align_channels * budget.c_cost)


def asked(settings) -> str:
    """The option that set the budget, as the user wrote it (for refusals)."""
    goal = settings.target
    return f"prune.ratio={settings.ratio}" if goal is None else f"{goal.option}={goal.text!r}"
