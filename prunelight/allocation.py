"""Allocation: turn per-unit scores into a prune plan that meets a parameter budget."""

from __future__ import annotations

import math

import torch
from torch import nn

from prunelight.adapters import ArchAdapter, get_adapter, unwrap
from prunelight.importance.base import UnitScores
from prunelight.plan import LayerPlan, PrunePlan

ALLOCATIONS = ("global", "uniform")


def count_params(model: nn.Module) -> int:
    """Distinct parameters of a model (tied weights counted once)."""
    return sum(p.numel() for p in unwrap(model).parameters())


def decoder_params(model: nn.Module) -> int:
    """Parameters inside the decoder layers (what width pruning can remove)."""
    return sum(p.numel() for p in get_adapter(model).layers(model).parameters())


def _check_scores(scores: UnitScores, n_groups: list[int], n_chans: list[int]) -> None:
    for kind, sizes in (("attn", n_groups), ("mlp", n_chans)):
        got = [int(t.numel()) for t in scores[kind]]
        if got != sizes:
            raise ValueError(f"{kind} scores have sizes {got}, the model has {sizes}")


def _plan_meta(model: nn.Module, adapter: ArchAdapter, plan: PrunePlan, ratio: float, target: int) -> dict:
    config = unwrap(model).config
    g_cost, c_cost = adapter.group_param_cost(config), adapter.channel_param_cost(config)
    g, c = plan.removed_counts()
    removed = g * g_cost + c * c_cost
    total, dec = count_params(model), decoder_params(model)
    return {
        "ratio": ratio,
        "params_total": total,
        "params_decoder": dec,
        "params_target_removed": target,
        "params_removed": removed,
        "removed_fraction_total": removed / total,
        "removed_fraction_decoder": removed / dec,
        "budget_error_params": removed - target,
        "groups_removed": g,
        "channels_removed": c,
    }


def validate_ratio(ratio: float) -> None:
    """A prune ratio is a fraction of the model's parameters in (0, 1)."""
    if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) < 1.0:
        raise ValueError(f"prune ratio must be a fraction of parameters in (0, 1), got {ratio!r}")


def allocate(
    model: nn.Module,
    scores: UnitScores,
    ratio: float,
    method: str = "global",
    min_groups: int = 1,
    min_channels: int = 1,
) -> PrunePlan:
    """Choose the units to remove so that `ratio` of all parameters is gone."""
    validate_ratio(ratio)
    if method not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {method!r}; available: {', '.join(ALLOCATIONS)}")
    adapter = get_adapter(model)
    config = unwrap(model).config
    shapes = adapter.layer_shapes(model)
    n_groups = [s.num_key_value_heads for s in shapes]
    n_chans = [s.intermediate_size for s in shapes]
    _check_scores(scores, n_groups, n_chans)
    g_cost, c_cost = adapter.group_param_cost(config), adapter.channel_param_cost(config)
    target = int(round(ratio * count_params(model)))
    removable = sum(max(n - min_groups, 0) * g_cost + max(m - min_channels, 0) * c_cost for n, m in zip(n_groups, n_chans))
    if target > removable:
        raise ValueError(
            f"ratio {ratio} asks to remove {target:,} parameters but at most {removable:,} can go "
            f"({removable / count_params(model):.1%} of the model) while keeping {min_groups} group(s) and "
            f"{min_channels} channel(s) per layer"
        )
    if method == "global":
        removed = _global(scores, n_groups, n_chans, g_cost, c_cost, target, min_groups, min_channels)
    else:
        removed = _uniform(scores, n_groups, n_chans, g_cost, c_cost, target, min_groups, min_channels)
    layers = [
        LayerPlan(
            keep_groups=[j for j in range(n_groups[i]) if j not in removed["attn"][i]],
            keep_channels=[j for j in range(n_chans[i]) if j not in removed["mlp"][i]],
        )
        for i in range(len(shapes))
    ]
    plan = PrunePlan(layers=layers, num_groups=n_groups, num_channels=n_chans)
    plan.meta = {"allocation": method, **_plan_meta(model, adapter, plan, ratio, target)}
    return plan


def _global(scores, n_groups, n_chans, g_cost, c_cost, target, min_groups, min_channels) -> dict:
    """Fractional-knapsack greedy: drop the lowest importance-per-parameter units until the budget is met."""
    units = []  # (score per parameter, kind, layer, index, cost)
    for kind, cost in (("attn", g_cost), ("mlp", c_cost)):
        for i, t in enumerate(scores[kind]):
            for j, s in enumerate(t.float().tolist()):
                units.append((s / cost, kind, i, j, cost))
    units.sort(key=lambda u: (u[0], u[1], u[2], u[3]))  # deterministic ties
    removed = {"attn": [set() for _ in n_groups], "mlp": [set() for _ in n_chans]}
    limits = {"attn": [n - min_groups for n in n_groups], "mlp": [n - min_channels for n in n_chans]}
    total = 0
    for _, kind, i, j, cost in units:
        if total >= target:
            break
        if len(removed[kind][i]) >= limits[kind][i]:
            continue
        removed[kind][i].add(j)
        total += cost
    return removed


def _lowest(t: torch.Tensor, k: int) -> set[int]:
    """Indices of the k lowest scores (stable under ties)."""
    if k <= 0:
        return set()
    order = sorted(range(t.numel()), key=lambda j: (float(t[j]), j))
    return set(order[:k])


def _uniform(scores, n_groups, n_chans, g_cost, c_cost, target, min_groups, min_channels) -> dict:
    """The same fraction in every layer: groups rounded to whole groups, channels fill the rest."""
    layers = len(n_groups)
    dec = sum(n * g_cost + m * c_cost for n, m in zip(n_groups, n_chans))
    frac = target / dec
    n_g = min(n_groups)
    k_g = min(int(round(frac * n_g)), n_g - min_groups)
    rest = target - layers * k_g * g_cost
    n_c = min(n_chans)
    k_c = min(max(int(math.ceil(rest / (layers * c_cost))), 0), n_c - min_channels)
    if rest > layers * k_c * c_cost:
        raise ValueError(
            f"uniform allocation cannot reach the budget: after {k_g} group(s) per layer the MLP would need "
            f"more than {n_c - min_channels} channels per layer; use allocation 'global' or a smaller ratio"
        )
    return {
        "attn": [_lowest(scores["attn"][i], k_g) for i in range(layers)],
        "mlp": [_lowest(scores["mlp"][i], k_c) for i in range(layers)],
    }
