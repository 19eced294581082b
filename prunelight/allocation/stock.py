"""Uniform-shape allocation for `export.format: stock`: the same heads, KV heads and MLP width in every kept layer.

A stock Hugging Face config (what vLLM, llama.cpp's converter, TGI and TensorRT-LLM read) states one
shape for all layers. The candidates are the few such shapes near the budget: for each number k of
GQA groups removed per layer (0 = MLP-only pruning, up to n_kv - max(min_groups, 1)), the MLP width
that meets the budget, rounded to `align_channels`, so target <= removed < target + layers * align *
c_cost. Which groups and channels each layer keeps is still chosen per layer by that layer's scores.

The candidate is chosen by the split setting: a fixed "x:y" takes the candidate whose attention share
is nearest x / (x + y); null takes the one removing the least importance (the sum of removed unit
scores, the quantity the global knapsack minimises); "auto" measures every candidate's calibration
NLL (pipeline.make_plan) and takes the lowest. Whole layers may still be dropped first (`depth`).
"""

from __future__ import annotations

import math


from prunelight.allocation.base import AllocationInputs, Removal, Shape, constrained_removal, zero_scores
from prunelight.allocation.budget import Budget, Removed, build_plan, empty_removed, lowest, plan_params_removed
from prunelight.importance.base import UnitScores

BIAS_FREE_RECONSTRUCT = ("none", "least_squares", "obs")  # `bias` adds o_proj/down_proj biases no stock config states


def check_uniform_settings(settings) -> None:
    """Refuse prune settings whose plans a stock config cannot state (settings only: run before any work)."""
    if settings.reconstruct not in BIAS_FREE_RECONSTRUCT:
        raise ValueError(f"prune.reconstruct={settings.reconstruct!r} is not allowed with export.format=stock (it adds "
                         "o_proj/down_proj biases a stock config cannot state): use one of "
                         f"{', '.join(BIAS_FREE_RECONSTRUCT)}")
    if settings.min_groups == 0 or settings.min_channels == 0:
        raise ValueError(f"prune.min_groups={settings.min_groups}, min_channels={settings.min_channels} is not "
                         "allowed with export.format=stock: a stock layer keeps attention and MLP; use values >= 1")
    if settings.target_kv_cache is not None:
        raise ValueError(f"prune.target_kv_cache={settings.target_kv_cache!r} is not allowed with export.format="
                         "stock: a KV-cache target removes groups where they matter least, which breaks the one "
                         "shape per layer; use prune.ratio, prune.target_params or prune.target_memory")


def check_uniform_sizes(budget: Budget, settings, shape: Shape, drop: set[int] = frozenset()) -> None:
    """Some uniform shape of the layers not in `drop` must meet the budget (model sizes only; zero scores stand in
    for the real ones)."""
    candidates(zero_scores(budget), budget, settings.align_channels, drop)


def allocate_uniform_shape(inp: AllocationInputs, drop: set[int] = frozenset()) -> Removal:
    """The uniform-shape removal of the layers not in `drop`, chosen by the split setting (or `groups_removed`)."""
    removed, report = stock_width(inp.scores, inp.budget, inp.settings.align_channels, drop, inp.attn_share,
                                  inp.groups_removed)
    return constrained_removal(inp, removed, drop, {"uniform_shape": True, "stock_shapes": report})


def _uniform(budget: Budget, live: list[int]) -> tuple[int, int]:
    """The units per layer shared by all live layers (a stock config states one shape)."""
    groups = {budget.n_groups[i] for i in live}
    chans = {budget.n_chans[i] for i in live}
    if len(groups) != 1 or len(chans) != 1:
        raise ValueError(f"export.format=stock needs a model whose layers have equal shapes, got GQA groups "
                         f"{sorted(groups)} and MLP channels {sorted(chans)}; use export.format: auto")
    return groups.pop(), chans.pop()


def candidates(scores: UnitScores, budget: Budget, align: int = 1, drop: set[int] = frozenset()) -> list[dict]:
    """Every uniform shape (groups removed k, MLP width) meeting the budget; each with its removed score and size."""
    live = [i for i in range(budget.num_layers) if i not in drop]
    n_g, n_c = _uniform(budget, live)
    align = max(int(align), 1)
    low_c = max(budget.min_channels, align, 1)
    base = plan_params_removed(budget, build_plan(budget, _removed(scores, budget, live, drop, 0, 0), set(drop)))
    out = []
    for k in range(0, n_g - max(budget.min_groups, 1) + 1):
        rest = budget.target - base - len(live) * k * budget.g_cost
        c = max(math.ceil(rest / (len(live) * budget.c_cost)), 0) if live else 0
        kept = (n_c - c) // align * align
        if kept < low_c:
            continue  # the MLP cannot give the rest at this attention cut
        removed = _removed(scores, budget, live, drop, k, n_c - kept)
        plan = build_plan(budget, removed, set(drop))
        total = plan_params_removed(budget, plan)
        if total - budget.target >= len(live) * align * budget.c_cost:
            continue  # attention alone overshoots by more than the MLP's finest uniform step
        gone = sum(float(scores[kind][i][j]) for kind in ("attn", "mlp") for i in live for j in removed[kind][i])
        attn = len(live) * k * budget.g_cost
        out.append({"groups_removed_per_layer": k, "num_key_value_heads": n_g - k, "intermediate_size": kept,
                    "params_removed": total, "budget_error_params": total - budget.target,
                    "attn_share_removed": attn / max(attn + len(live) * (n_c - kept) * budget.c_cost, 1),
                    "removed_score": gone})
    if not out:
        keep_g = max(budget.min_groups, 1)
        raise ValueError(f"prune.ratio={budget.ratio} is not allowed with export.format=stock: no uniform shape meets "
                         f"the budget keeping {low_c} MLP channel(s) and {keep_g} group(s) per layer; lower the ratio")
    return out


def choose(cands: list[dict], attn_share: float | None) -> dict:
    """The candidate nearest a fixed attention share, else the one removing the least importance."""
    if attn_share is not None:
        return min(cands, key=lambda c: (abs(c["attn_share_removed"] - attn_share), c["removed_score"]))
    return min(cands, key=lambda c: (c["removed_score"], c["groups_removed_per_layer"]))


def _removed(scores: UnitScores, budget: Budget, live: list[int], drop: set[int], k: int, c: int) -> Removed:
    removed = empty_removed(budget)
    for i in range(budget.num_layers):
        if i in drop:
            removed["attn"][i] = set(range(budget.n_groups[i]))
            removed["mlp"][i] = set(range(budget.n_chans[i]))
    for i in live:
        removed["attn"][i] = lowest(scores["attn"][i], k)
        removed["mlp"][i] = lowest(scores["mlp"][i], c)
    return removed


def stock_width(scores: UnitScores, budget: Budget, align: int = 1, drop: set[int] = frozenset(),
                attn_share: float | None = None, groups_removed: int | None = None) -> tuple[Removed, dict]:
    """The chosen uniform-shape removal (or the candidate with `groups_removed` groups per layer) and its report."""
    cands = candidates(scores, budget, align, drop)
    if groups_removed is not None:
        match = [c for c in cands if c["groups_removed_per_layer"] == groups_removed]
        chosen, how = match[0], "given"
    else:
        chosen, how = choose(cands, attn_share), ("attn_mlp_split" if attn_share is not None else "importance")
    live = [i for i in range(budget.num_layers) if i not in drop]
    n_c = budget.n_chans[live[0]]
    removed = _removed(scores, budget, live, set(drop), chosen["groups_removed_per_layer"],
                       n_c - chosen["intermediate_size"])
    return removed, {"candidates": cands, "chosen": chosen["groups_removed_per_layer"], "chosen_by": how}
