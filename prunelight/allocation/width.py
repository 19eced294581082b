"""Width allocations over units: `global` (one knapsack over the whole model) and `uniform` (same count per layer)."""

from __future__ import annotations

import math

from prunelight.allocation.budget import Budget, Removed, empty_removed, fill, lowest, units
from prunelight.importance.base import UnitScores


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
                f"{budget.removable(kind):,} can be removed there (keeping {budget.min_groups} group(s) / "
                f"{budget.min_channels} channel(s) per layer); give {name} a smaller share"
            )
    return targets


def limits(budget: Budget) -> dict[str, list[int]]:
    """Per-layer removal limits of both kinds."""
    return {kind: budget.limits(kind) for kind in ("attn", "mlp")}


def global_width(scores: UnitScores, budget: Budget, attn_share: float | None = None,
                 removed: Removed | None = None, layers=None) -> Removed:
    """Fractional-knapsack greedy: drop the lowest importance-per-parameter units until the budget is met.

    With `attn_share`, attention and MLP are filled as two knapsacks with their own targets.
    """
    removed = removed if removed is not None else empty_removed(budget)
    lim = limits(budget)
    targets = kind_targets(budget, attn_share)
    if targets is None:
        fill(units(scores, budget, layers=layers), budget.target, removed, lim,
             sum(len(s) * budget.cost(k) for k in removed for s in removed[k]))
    else:
        for kind, t in targets.items():
            done = sum(len(s) for s in removed[kind]) * budget.cost(kind)
            fill(units(scores, budget, kinds=(kind,), layers=layers), t, removed, lim, done)
    return removed


def uniform_width(scores: UnitScores, budget: Budget) -> Removed:
    """The same fraction in every layer: groups rounded to whole groups, channels fill the rest."""
    layers = budget.num_layers
    frac = budget.target / budget.decoder
    n_g = min(budget.n_groups)
    k_g = min(int(round(frac * n_g)), n_g - budget.min_groups)
    rest = budget.target - layers * k_g * budget.g_cost
    n_c = min(budget.n_chans)
    k_c = min(max(int(math.ceil(rest / (layers * budget.c_cost))), 0), n_c - budget.min_channels)
    if rest > layers * k_c * budget.c_cost:
        raise ValueError(
            f"uniform allocation cannot reach the budget: after {k_g} group(s) per layer the MLP would need "
            f"more than {n_c - budget.min_channels} channels per layer; use allocation 'global' or a smaller ratio"
        )
    return {
        "attn": [lowest(scores["attn"][i], k_g) for i in range(layers)],
        "mlp": [lowest(scores["mlp"][i], k_c) for i in range(layers)],
    }
