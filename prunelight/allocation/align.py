"""Hardware alignment: every layer keeps a multiple of `multiple` MLP channels, budget rebalanced across layers.

GPU matmul kernels run best when matrix sides are multiples of 64/128; a layer left with 1000
channels is slower per parameter than one with 1024. Alignment rounds each layer's kept count to
the nearest multiple (never below one multiple unless the sub-block is removed), then moves whole
steps between layers (cheapest importance per parameter first) until the total is within one
step above the target: target <= removed < target + multiple * c_cost (one aligned step is the finest
move that keeps every count a multiple).
"""

from __future__ import annotations

from prunelight.allocation.budget import Budget, Removed, build_plan, plan_params_removed
from prunelight.importance.base import UnitScores


def align_channels(
    scores: UnitScores, budget: Budget, removed: Removed, multiple: int, fixed: set[int] = frozenset()
) -> Removed:
    """Round kept MLP channels per layer to `multiple` and rebalance so the budget is met within one step."""
    if multiple == 1:
        return removed
    n = budget.num_layers
    live = [i for i in range(n) if i not in fixed and len(removed["mlp"][i]) < budget.n_chans[i]]
    order = {i: sorted(range(budget.n_chans[i]), key=lambda j: (-float(scores["mlp"][i][j]), j)) for i in live}
    top = {i: budget.n_chans[i] // multiple * multiple for i in live}
    keep = {}
    for i in live:
        k = budget.n_chans[i] - len(removed["mlp"][i])
        keep[i] = min(max(int(round(k / multiple)) * multiple, multiple), top[i])
    # Everything but the live layers' channels, counted exactly (biases of emptied sub-blocks, norms of dropped
    # layers): a live layer keeps at least one step of channels unless min_channels is 0, so those barely change.
    exact = plan_params_removed(budget, build_plan(budget, removed, set(fixed)))
    others = exact - sum(len(removed["mlp"][i]) for i in live) * budget.c_cost
    step = multiple * budget.c_cost

    def total() -> int:
        return others + sum(budget.n_chans[i] - keep[i] for i in keep) * budget.c_cost

    def step_score(i: int, k: int) -> float:
        # Importance of the channels ranked k-multiple..k-1 (the next step to cut, or the last step cut).
        return sum(float(scores["mlp"][i][j]) for j in order[i][k - multiple:k]) / step

    # A kept MLP keeps `budget.keeps("mlp")` channels at least (one multiple; 0 where it may be emptied): the width
    # allocations fill within those limits, so the steps below reach the target (the run plan checked the sizes).
    floor = budget.keeps("mlp")
    while total() < budget.target:
        i = min((i for i in keep if keep[i] - multiple >= floor), key=lambda i: (step_score(i, keep[i]), i))
        keep[i] -= multiple
    while total() - step >= budget.target:
        cands = [i for i in keep if keep[i] + multiple <= top[i]]
        if not cands:
            break
        i = max(cands, key=lambda i: (step_score(i, keep[i] + multiple), -i))
        keep[i] += multiple
    for i in keep:
        removed["mlp"][i] = set(order[i][keep[i]:])
    return removed
