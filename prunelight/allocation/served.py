"""Served-layout allocation for `export.format: nemotron_nas`: free MLP widths, one GQA group count for attention.

The Nemotron-NAS (DeciLM) layout vLLM serves states every layer's MLP width and whether it keeps attention,
but one query head count (`num_attention_heads`) for every layer that keeps attention; a GQA group cut
removes query heads with their KV head, so every such layer keeps the same number g of groups. Each layer
may also lose its attention whole (`no_op`) when `prune.min_groups` is 0, except the first kept layer
(vLLM's DeciLM model starts its residual stream in the first layer's attention).

Candidates: for each common kept group count g, and (min_groups 0) each number r of layers whose attention
goes whole (the r layers whose kept groups score lowest), the groups each layer loses are its lowest-scoring
ones, and the MLP channels fill the rest of the budget by one knapsack over all layers (lowest score per
parameter first, as `global` does), so target <= removed < target + align * c_cost. The chosen candidate
removes the least importance (the sum of removed unit scores, what the global knapsack minimises), or has
the attention share nearest a fixed "x:y" split; `attn_mlp_split: auto` measures each group count's best
candidate on calibration NLL (pipeline.make_plan). Whole layers may be dropped first (`depth`).

A pure function of (scores, budget, settings): `served_width` returns the removal and a report. The registry
rows of global and uniform (`allocate_served`) and depth (`allocate_depth_served`) honour `Shape.SERVED`;
its `ShapeRule` (allocation/shapes.py) runs `check_served_settings`, `check_served_config` and
`check_served_sizes` before any work.
"""

from __future__ import annotations

from prunelight.allocation.align import align_channels
from prunelight.allocation.base import AllocationInputs, Removal, constrained_removal, zero_scores
from prunelight.allocation.budget import (
    Budget,
    Removed,
    build_plan,
    empty_removed,
    lowest,
    meet,
    plan_params_removed,
    units,
)
from prunelight.allocation.structural import depth
from prunelight.importance.base import UnitScores

BIAS_FREE_RECONSTRUCT = ("none", "least_squares", "obs")  # `bias` adds o_proj/down_proj biases the layout cannot state
FORMAT = "export.format=nemotron_nas"


def check_served_settings(settings) -> None:
    """Refuse prune settings whose plans the Nemotron-NAS layout cannot state (settings only: before any work).

    Which allocations honour the layout is their registry rows' business (`Shape.SERVED` in `by_shape`)."""
    if settings.reconstruct not in BIAS_FREE_RECONSTRUCT:
        raise ValueError(f"prune.reconstruct={settings.reconstruct!r} is not allowed with {FORMAT} (it adds o_proj/"
                         f"down_proj biases the layout cannot state): use one of {', '.join(BIAS_FREE_RECONSTRUCT)}")
    if settings.target_kv_cache is not None:
        raise ValueError(f"prune.target_kv_cache={settings.target_kv_cache!r} is not allowed with {FORMAT}: a KV-cache "
                         "target removes groups where they matter least, which breaks the one group count; use "
                         "prune.ratio, prune.target_params or prune.target_memory")


def check_served_config(config) -> None:
    """Refuse a model the layout cannot state (config only: before any weights load)."""
    from prunelight.families import get_family  # families imports the model classes: only when asked

    if not get_family(config).nemotron_nas:
        raise ValueError(f"{FORMAT} is not allowed for model_type {config.model_type!r}: the layout states Llama "
                         "layers only; use export.format: stock or auto")
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"{FORMAT} is not allowed with sliding_window={config.sliding_window}: the layout's "
                         "attention has no sliding window; use export.format: stock or auto")


def check_served_sizes(budget: Budget, settings, shape, drop: set[int] = frozenset()) -> None:
    """Some served layout of the layers not in `drop` must meet the budget (model sizes only; zero scores stand in
    for the real ones)."""
    candidates(zero_scores(budget), budget, settings.align_channels, drop)


def allocate_served(inp: AllocationInputs, drop: set[int] = frozenset()) -> Removal:
    """`Shape.SERVED` for global and uniform: the served-layout search over the layers not in `drop`."""
    removed, report = served_width(inp.scores, inp.budget, inp.settings.align_channels, drop, inp.attn_share,
                                   inp.groups_kept)
    return constrained_removal(inp, removed, drop, {"served_layout": True, "served_shapes": report})


def allocate_depth_served(inp: AllocationInputs) -> Removal:
    """`Shape.SERVED` for depth: whole layers first, then (fill_width) the served-layout search in the kept ones."""
    removed, drop = depth(inp.scores, inp.budget, inp.layer_scores, inp.options.fill_width)
    if not inp.options.fill_width:
        return Removal(removed, drop, extra={"served_layout": True}, exact=True)
    return allocate_served(inp, drop)


def _live(budget: Budget, drop) -> list[int]:
    live = [i for i in range(budget.num_layers) if i not in drop]
    groups = {budget.n_groups[i] for i in live}
    if len(groups) != 1:
        raise ValueError(f"{FORMAT} needs a model whose layers have equal GQA groups, got "
                         f"{sorted(groups)}; use export.format: auto")
    return live


def _mlp_fill(scores: UnitScores, budget: Budget, removed: Removed, drop: set[int], align: int,
              cands: list) -> int | None:
    """Fill the rest of the budget with MLP channels (one knapsack over the live layers' channels `cands`, sorted);
    the exact total, or None when the MLP cannot give the rest."""
    live = [i for i in range(budget.num_layers) if i not in drop]
    lim = {"attn": [0] * budget.num_layers,
           "mlp": [max(budget.n_chans[i] - max(budget.min_channels, 1), 0) if i in live else 0
                   for i in range(budget.num_layers)]}
    total = plan_params_removed(budget, build_plan(budget, removed, set(drop)))
    if total < budget.target:
        total = meet(cands, budget.target, removed, lim, total, budget.c_cost)
    if align > 1:
        try:
            align_channels(scores, budget, removed, align, fixed=set(drop))
        except ValueError:
            return None
    total = plan_params_removed(budget, build_plan(budget, removed, set(drop)))
    if total < budget.target or total - budget.target >= align * budget.c_cost:
        return None
    return total


def candidates(scores: UnitScores, budget: Budget, align: int = 1, drop: set[int] = frozenset()) -> list[dict]:
    """Every (kept group count, attention-free layers) meeting the budget; each with its removal, score and size."""
    drop = set(drop)
    live = _live(budget, drop)
    n_g = budget.n_groups[live[0]]
    align = max(int(align), 1)
    mlp_units = units(scores, budget, kinds=("mlp",), layers=set(live))  # sorted once, shared by every candidate
    out = []
    for keep in range(n_g, max(budget.min_groups, 1) - 1, -1):
        # Attention-free layers: those whose kept groups matter least; never the first live layer.
        kept_score = {i: sum(sorted((float(v) for v in scores["attn"][i]), reverse=True)[:keep]) for i in live[1:]}
        order = sorted(kept_score, key=lambda i: (kept_score[i], i))
        for r in range(0, len(order) + 1 if budget.min_groups == 0 else 1):
            no_attn = set(order[:r])
            removed = empty_removed(budget)
            for i in drop:
                removed["attn"][i] = set(range(budget.n_groups[i]))
                removed["mlp"][i] = set(range(budget.n_chans[i]))
            for i in live:
                removed["attn"][i] = set(range(n_g)) if i in no_attn else lowest(scores["attn"][i], n_g - keep)
            total = _mlp_fill(scores, budget, removed, drop, align, mlp_units)
            if total is None:
                continue
            gone = sum(float(scores[k][i][j]) for k in ("attn", "mlp") for i in live for j in removed[k][i])
            attn = sum(len(removed["attn"][i]) for i in live) * budget.g_cost
            chans = sum(len(removed["mlp"][i]) for i in live) * budget.c_cost
            out.append({"groups_kept": keep, "attention_removed_layers": sorted(no_attn),
                        "params_removed": total, "budget_error_params": total - budget.target,
                        "attn_share_removed": attn / max(attn + chans, 1), "removed_score": gone,
                        "_removed": removed})
    if not out:
        raise ValueError(f"prune.ratio={budget.ratio} is not allowed with export.format=nemotron_nas: no layout meets "
                         f"the budget keeping {max(budget.min_channels, 1)} MLP channel(s) per layer; lower the ratio")
    return out


def served_width(scores: UnitScores, budget: Budget, align: int = 1, drop: set[int] = frozenset(),
                 attn_share: float | None = None, groups_kept: int | None = None) -> tuple[Removed, dict]:
    """The chosen served-layout removal (best with `groups_kept` groups in kept attention, if given) and its report."""
    cands = candidates(scores, budget, align, drop)
    pool = cands
    if groups_kept is not None:
        pool = [c for c in cands if c["groups_kept"] == groups_kept]
    if attn_share is not None:
        chosen = min(pool, key=lambda c: (abs(c["attn_share_removed"] - attn_share), c["removed_score"]))
        how = "attn_mlp_split"
    else:
        chosen = min(pool, key=lambda c: (c["removed_score"], -c["groups_kept"]))
        how = "given" if groups_kept is not None else "importance"
    report = {"candidates": [{k: v for k, v in c.items() if k != "_removed"} for c in best_per_count(cands)],
              "chosen": {k: v for k, v in chosen.items() if k != "_removed"}, "chosen_by": how,
              "candidates_considered": len(cands)}
    return chosen["_removed"], report


def best_per_count(cands: list[dict]) -> list[dict]:
    """The candidate removing the least importance for each kept group count (what `auto` measures)."""
    best: dict[int, dict] = {}
    for c in cands:
        if c["groups_kept"] not in best or c["removed_score"] < best[c["groups_kept"]]["removed_score"]:
            best[c["groups_kept"]] = c
    return [best[k] for k in sorted(best, reverse=True)]
