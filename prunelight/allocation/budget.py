"""Parameter bookkeeping shared by every allocation: unit costs, the target, greedy filling, plan building."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from prunelight.allocation.targets import Target, human_bytes, kv_bytes_per_token, target_figures
from prunelight.families import get_family, unwrap
from prunelight.importance.base import UnitScores
from prunelight.plan import LayerPlan, PrunePlan


class CutSettings(Protocol):
    """The `prune:` settings the allocations read. `prunelight.settings.PruneSettings` is the one implementation; the
    allocations name this view instead, since the settings module imports them (it lists their rows and options)."""

    ratio: float
    target_kv_cache: str | None
    allocation: str
    criterion: str
    min_groups: int
    min_channels: int
    align_channels: int
    reconstruct: str
    reconstruct_ridge: float
    max_calibration_batches: int | None

    @property
    def target(self) -> Target | None:
        """The parsed deployment target, or None when `ratio` is the budget."""

    @property
    def attn_share(self) -> float | None:
        """The attention share of a fixed "x:y" split, or None."""

    @property
    def allocation_options(self) -> Any:
        """The allocation row's options instance (`prune.allocation_args`), or None."""

    @property
    def row(self) -> Any:
        """The registry row of `allocation` (`base.Allocation`)."""

Removed = dict[str, list[set[int]]]  # kind -> per layer, the removed unit indices
Unit = tuple[float, str, int, int, int]  # (score per parameter, kind, layer, index, cost)


def count_params(model: nn.Module) -> int:
    """Distinct parameters of a model (tied weights counted once)."""
    return sum(p.numel() for p in unwrap(model).parameters())


def decoder_params(model: nn.Module) -> int:
    """Parameters inside the decoder layers (what width pruning can remove)."""
    return sum(p.numel() for p in get_family(model).layers(model).parameters())


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


@dataclass
class Budget:
    """Sizes and costs of one model, and how many parameters the ratio asks to remove."""

    n_groups: list[int]
    n_chans: list[int]
    g_cost: int
    c_cost: int
    attn_extra: list[int]  # attention parameters owned by no group (e.g. o_proj bias): gone with the sub-block
    mlp_extra: list[int]
    layer_extra: list[int]  # norms: gone only with the whole layer
    total: int
    decoder: int
    target: int
    ratio: float
    min_groups: int
    min_channels: int
    goal: Target | None = None  # a deployment target (prune.target_*) that set `target`
    kv_groups: int = 0  # a KV-cache target: exactly this many GQA groups go, and no MLP channel
    head_dim: int = 0
    align: int = 1  # prune.align_channels: a kept MLP is a multiple of this, so it keeps at least one multiple

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.n_groups)

    def cost(self, kind: str) -> int:
        """Parameters of one unit of `kind`."""
        return self.g_cost if kind == "attn" else self.c_cost

    def sizes(self, kind: str) -> list[int]:
        """Units per layer of `kind`."""
        return self.n_groups if kind == "attn" else self.n_chans

    def limits(self, kind: str) -> list[int]:
        """Most units of `kind` a width allocation may remove per layer: a layer keeps min_groups / min_channels, and
        with aligned channels an MLP that is kept keeps at least one multiple (`keeps`)."""
        return [max(n - self.keeps(kind), 0) for n in self.sizes(kind)]

    def keeps(self, kind: str) -> int:
        """Fewest units of `kind` a kept sub-block keeps (0: it may be emptied)."""
        if kind == "attn":
            return self.min_groups
        return max(self.min_channels, self.align) if self.min_channels else 0

    def removable(self, kind: str) -> int:
        """Most parameters width pruning may take from `kind`."""
        return sum(self.limits(kind)) * self.cost(kind)

    def layer_units(self, i: int) -> int:
        """Unit parameters of layer i (what width pruning counts)."""
        return self.n_groups[i] * self.g_cost + self.n_chans[i] * self.c_cost

    def layer_total(self, i: int) -> int:
        """Every parameter of layer i (what dropping it removes)."""
        return self.layer_units(i) + self.attn_extra[i] + self.mlp_extra[i] + self.layer_extra[i]


def make_budget(model: nn.Module, settings: CutSettings) -> Budget:
    """Measure `model` and turn `settings.ratio` of its parameters into a removal target."""
    ratio, min_groups, min_channels = settings.ratio, settings.min_groups, settings.min_channels
    family = get_family(model)
    config = unwrap(model).config
    g_cost, c_cost = family.group_param_cost(config), family.channel_param_cost(config)
    shapes = family.layer_shapes(model)
    n_groups = [s.num_key_value_heads for s in shapes]
    n_chans = [s.intermediate_size for s in shapes]
    attn_extra, mlp_extra, layer_extra = [], [], []
    for layer, g, c in zip(family.layers(model), n_groups, n_chans):
        a, m = _numel(family.attn(layer)), _numel(family.mlp(layer))
        attn_extra.append(a - g * g_cost)
        mlp_extra.append(m - c * c_cost)
        layer_extra.append(_numel(layer) - a - m)
    total = count_params(model)
    hd = family.head_dim(config)
    goal, kv_groups = settings.target, 0
    if goal is None:
        target = int(round(ratio * total))
    elif goal.kind == "kv_cache":
        kv_groups = kv_groups_to_remove(goal, n_groups, hd, min_groups, settings.row.kv_per_layer)
        target = kv_groups * g_cost
    else:
        target = params_to_remove(goal, total)
    if goal is not None:
        ratio = target / total
    return Budget(n_groups, n_chans, g_cost, c_cost, attn_extra, mlp_extra, layer_extra, total,
                  decoder_params(model), target, float(ratio), min_groups, min_channels, goal, kv_groups, hd,
                  settings.align_channels)


def params_to_remove(goal: Target, total: int) -> int:
    """Parameters to remove so the model has at most `goal` parameters (or weight bytes at its dtype)."""
    keep = int(goal.value) if goal.kind == "params" else int(math.floor(goal.value / goal.bytes_per_param))
    if keep >= total:
        have = (f"{total:,} parameters" if goal.kind == "params"
                else f"{human_bytes(total * goal.bytes_per_param)} of weights at {goal.dtype} ({total:,} parameters)")
        raise ValueError(f"{goal.option}={goal.text!r} is not allowed: the model has {have} already; "
                         "use a target below that")
    return total - keep


def kv_groups_to_remove(goal: Target, n_groups: list[int], head_dim: int, min_groups: int, per_layer: bool) -> int:
    """GQA groups to remove so the KV cache per token is at or below `goal` (whole groups: at or below, not equal);
    `per_layer`: the same number from every layer (the row's `kv_per_layer`)."""
    per_group = 2 * head_dim * goal.bytes_per_param  # one K and one V vector per token
    now = kv_bytes_per_token(n_groups, head_dim, goal.bytes_per_param)
    if goal.value >= now:
        raise ValueError(f"{goal.option}={goal.text!r} is not allowed: the model's KV cache takes "
                         f"{human_bytes(now)} per "
                         f"token at {goal.dtype} already (2 x {sum(n_groups)} KV heads x head_dim {head_dim} x "
                         f"{goal.bytes_per_param:g} bytes); use a target below that")
    need = math.ceil((now - goal.value) / per_group - 1e-9)
    if per_layer:
        need = math.ceil(need / len(n_groups)) * len(n_groups)
        most = min(max(n - min_groups, 0) for n in n_groups) * len(n_groups)
    else:
        most = sum(max(n - min_groups, 0) for n in n_groups)
    if need > most:
        floor = now - most * per_group
        raise ValueError(f"{goal.option}={goal.text!r} is not allowed: keeping "
                         f"prune.min_groups={min_groups} KV group(s) "
                         f"per layer{' (the same in every layer)' if per_layer else ''} leaves at least "
                         f"{human_bytes(floor)} per token at {goal.dtype}; use a target at or above that")
    return need


def check_scores(scores: UnitScores, budget: Budget) -> None:
    """Scores must have one value per unit of the model."""
    for kind in ("attn", "mlp"):
        got = [int(t.numel()) for t in scores[kind]]
        if got != budget.sizes(kind):
            raise ValueError(f"{kind} scores have sizes {got}, the model has {budget.sizes(kind)}")


def empty_removed(budget: Budget) -> Removed:
    """Nothing removed yet."""
    return {kind: [set() for _ in budget.sizes(kind)] for kind in ("attn", "mlp")}


def units(scores: UnitScores, budget: Budget, kinds=("attn", "mlp"), layers=None) -> list[Unit]:
    """Candidate units sorted by importance per parameter (ties broken deterministically)."""
    out = []
    for kind in kinds:
        cost = budget.cost(kind)
        for i, t in enumerate(scores[kind]):
            if layers is not None and i not in layers:
                continue
            for j, s in enumerate(t.float().tolist()):
                out.append((s / cost, kind, i, j, cost))
    out.sort(key=lambda u: (u[0], u[1], u[2], u[3]))
    return out


def _take(removed: Removed, limits: dict[str, list[int]], kind: str, i: int, j: int) -> bool:
    """Whether unit (kind, i, j) may still be removed."""
    return j not in removed[kind][i] and len(removed[kind][i]) < limits[kind][i]


def fill(candidates: list[Unit], target: int, removed: Removed, limits: dict[str, list[int]], total: int,
         nearest: bool = False, step: int = 0) -> int:
    """Remove candidates in order until `target` parameters are gone; returns the new total.

    `step` > 0 passes over a unit that would overshoot the target by `step` or more (a GQA group
    crossing it) in favour of cheaper units further down the order; passed-over units are taken, in
    order, only when the cheaper ones cannot reach the target. `nearest` takes a unit only when that
    brings the total closer to the target (used for per-layer quotas, where overshooting one layer by
    a whole GQA group would starve the others).
    """
    passed: list[Unit] = []
    for unit in candidates:
        _, kind, i, j, cost = unit
        if total >= target:
            break
        if not _take(removed, limits, kind, i, j):
            continue
        if nearest and total + cost - target > target - total:
            continue
        if step and total + cost - target >= step:
            passed.append(unit)
            continue
        removed[kind][i].add(j)
        total += cost
    for _, kind, i, j, cost in passed:
        if total >= target:
            break
        if _take(removed, limits, kind, i, j):
            removed[kind][i].add(j)
            total += cost
    return total


def trim(candidates: list[Unit], target: int, removed: Removed, total: int) -> int:
    """Give back the most important removed units while the total stays >= target."""
    for _, kind, i, j, cost in reversed(candidates):
        if j in removed[kind][i] and total - cost >= target:
            removed[kind][i].discard(j)
            total -= cost
    return total


def meet(candidates: list[Unit], target: int, removed: Removed, limits: dict[str, list[int]], total: int,
         step: int) -> int:
    """Bring `total` to within [target, target + step): fill from below, trim from above; returns the new total.

    Filling passes over units that would overshoot by `step` or more; trimming gives back the most
    important removed units. If only coarse units are left to give back, the most important of them is
    swapped for cheaper ones. Each unit must change the total by exactly its cost (no sub-block emptied).
    """
    total = fill(candidates, target, removed, limits, total, step=step)
    total = trim(candidates, target, removed, total)
    if total - target >= step:
        taken = [u for u in reversed(candidates) if u[3] in removed[u[1]][u[2]]]
        if taken:
            _, kind, i, j, cost = taken[0]
            removed[kind][i].discard(j)
            total = fill(candidates, target, removed, limits, total - cost, step=step)
            total = trim(candidates, target, removed, total)
    return total


def true_up(scores: UnitScores, budget: Budget, removed: Removed, drop: set[int] | None = None) -> Removed:
    """Count the plan exactly and move units of live sub-blocks until target <= removed < target + c_cost.

    Width fills count unit costs only; emptying a sub-block also removes its biases, and emptying a
    layer its norms. This pass counts those, then fills or gives back units that keep every live
    sub-block non-empty (so each moves the count by exactly its cost), channels being the fine step.
    """
    plan = build_plan(budget, removed, drop)
    total = plan_params_removed(budget, plan)
    gone = set(plan.drop_layers)
    live = {k: {i for i in range(budget.num_layers) if i not in gone and len(removed[k][i]) < budget.sizes(k)[i]}
            for k in ("attn", "mlp")}
    lim = {k: [min(m, n - 1) if i in live[k] else 0 for i, (m, n) in enumerate(zip(budget.limits(k), budget.sizes(k)))]
           for k in ("attn", "mlp")}
    cands = [u for u in units(scores, budget) if u[2] in live[u[1]]]
    meet(cands, budget.target, removed, lim, total, budget.c_cost)
    return removed


def build_plan(budget: Budget, removed: Removed, drop: set[int] | None = None) -> PrunePlan:
    """A plan from removed units; a layer with both sub-blocks emptied is dropped whole."""
    drop = set(drop or ())
    layers = []
    for i in range(budget.num_layers):
        if i in drop:
            layers.append(LayerPlan([], []))
            continue
        keep_g = [j for j in range(budget.n_groups[i]) if j not in removed["attn"][i]]
        keep_c = [j for j in range(budget.n_chans[i]) if j not in removed["mlp"][i]]
        if not keep_g and not keep_c:
            drop.add(i)
        layers.append(LayerPlan(keep_g, keep_c))
    # Never every layer: each row's feasibility (`check_keeps_a_layer`) refused such a target before any data.
    return PrunePlan(layers=layers, num_groups=list(budget.n_groups), num_channels=list(budget.n_chans),
                     drop_layers=sorted(drop))


def plan_params_removed(budget: Budget, plan: PrunePlan) -> int:
    """Exact parameters the plan removes (units, plus biases of emptied sub-blocks, plus norms of dropped layers)."""
    removed = 0
    for i, lp in enumerate(plan.layers):
        removed += (budget.n_groups[i] - len(lp.keep_groups)) * budget.g_cost
        removed += (budget.n_chans[i] - len(lp.keep_channels)) * budget.c_cost
        removed += budget.attn_extra[i] * (not lp.keep_groups) + budget.mlp_extra[i] * (not lp.keep_channels)
        removed += budget.layer_extra[i] * (i in plan.drop_layers)
    return removed


def plan_meta(budget: Budget, plan: PrunePlan) -> dict:
    """Budget figures for the report."""
    g, c = plan.removed_counts()
    removed = plan_params_removed(budget, plan)
    attn = sum((n - len(lp.keep_groups)) * budget.g_cost for n, lp in zip(budget.n_groups, plan.layers))
    extra = {}
    if budget.goal is not None:
        kv_after = [0 if i in plan.drop_layers else len(lp.keep_groups) for i, lp in enumerate(plan.layers)]
        extra["target"] = target_figures(budget.goal, budget.total - removed, kv_after, budget.head_dim)
    return {**extra,
        "ratio": budget.ratio,
        "params_total": budget.total,
        "params_decoder": budget.decoder,
        "params_target_removed": budget.target,
        "params_removed": removed,
        "removed_fraction_total": removed / budget.total,
        "removed_fraction_decoder": removed / budget.decoder,
        "budget_error_params": removed - budget.target,
        "groups_removed": g,
        "channels_removed": c,
        "layers_dropped": list(plan.drop_layers),
        "attn_share_removed": attn / max(removed_cost_plan(budget, plan), 1),
        "layer_removed_fraction": [
            1 - (len(lp.keep_groups) * budget.g_cost + len(lp.keep_channels) * budget.c_cost) / budget.layer_units(i)
            if i not in plan.drop_layers else 1.0
            for i, lp in enumerate(plan.layers)
        ],
    }


def removed_cost_plan(budget: Budget, plan: PrunePlan) -> int:
    """Unit parameters a plan removes."""
    g, c = plan.removed_counts()
    return g * budget.g_cost + c * budget.c_cost


def lowest(t: torch.Tensor, k: int) -> set[int]:
    """Indices of the k lowest scores (stable under ties)."""
    if k <= 0:
        return set()
    order = sorted(range(t.numel()), key=lambda j: (float(t[j]), j))
    return set(order[:k])
