"""The pruning pipeline in one call: calibrate -> score -> (layer importance, split search) -> allocate (no cut).

Both the PruningCallback and the benchmark scripts go through `make_plan`, so a method measured
in a benchmark is exactly the method a `prunelight fit` run applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from prunelight.families import unwrap
from prunelight.allocation import allocate, check_allocation_options, precheck
from prunelight.allocation.split_search import masked, parse_split, search_split
from prunelight.calibration import run_calibration
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.importance import UnitScores, build_criterion
from prunelight.layer_importance import layer_importances, subblock_removal
from prunelight.plan import PrunePlan

# Options make_plan handles itself; the rest of allocation_args go to `allocate`.
_PIPELINE_KEYS = ("attn_mlp_split", "layer_importance", "block_importance", "split_step", "split_fine_step",
                  "split_patience", "report_layer_importance")


def _mean_over_ranks(values: list[float], reduce_sum: Callable | None) -> list[float]:
    """Each rank measured its own share of the data; average so every rank builds the same plan."""
    if reduce_sum is None:
        return values
    t = torch.tensor([*values, 1.0], dtype=torch.float64)
    t = reduce_sum(t).cpu()
    return (t[:-1] / t[-1]).tolist()


def make_plan(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    ratio: float,
    criterion: str = "taylor",
    criterion_args: dict | None = None,
    allocation: str = "global",
    allocation_args: dict | None = None,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    max_batches: int | None = None,
    importance_batches: int | None = None,
) -> tuple[PrunePlan, UnitScores]:
    """Score every unit of `model` on `batches` with `criterion` and allocate `ratio` of its parameters.

    `allocation_args` holds allocation options (min_groups, strategy, alpha, importance_scale, freeze_top_n, rate_range,
    attn_mlp_split "x:y" | "auto", align_channels, layer_importance, block_importance, fill_width, split_*)
    and `report_layer_importance` (measures to record for the report). Layer importance and the split
    search use at most `importance_batches` calibration batches (default: `max_batches`).
    """
    args = dict(allocation_args or {})
    own = {k: args.pop(k) for k in _PIPELINE_KEYS if k in args}
    split = own.get("attn_mlp_split")
    li_method = own.get("layer_importance", "block_influence")
    block_imp = own.get("block_importance", "units")
    check_allocation_options(
        allocation, args.get("strategy", "inverse"), args.get("alpha", 1.0), args.get("freeze_top_n", 0),
        args.get("rate_range", (0.0, 1.0)), split, args.get("align_channels", 1), li_method, block_imp,
        own.get("split_step", 0.1), own.get("split_fine_step", 0.025), own.get("split_patience", 2),
        args.get("importance_scale", "minmax"),
    )
    precheck(model, ratio, allocation, args.get("min_groups", 1), args.get("min_channels", 1),
             args.get("freeze_top_n", 0), args.get("rate_range", (0.0, 1.0)), split)

    batches = list(batches)  # read more than once: calibration, layer importance, split search
    crit = build_criterion(criterion, **(criterion_args or {}))
    scores = run_calibration(model, batches if crit.needs_data else [], crit, reduce_sum, max_batches)
    n_imp = importance_batches if importance_batches is not None else max_batches
    imp_batches = list(batches)[: n_imp if n_imp is not None else None]

    wanted = list(dict.fromkeys(own.get("report_layer_importance") or []))
    if allocation in ("layerwise", "depth") and li_method not in wanted:
        wanted.insert(0, li_method)
    measured = {
        name: _mean_over_ranks(values, reduce_sum)
        for name, values in (layer_importances(model, imp_batches, wanted).items() if wanted else ())
    }
    if allocation in ("layerwise", "depth"):
        args["layer_scores"] = measured[li_method]
    if allocation == "blockwise" and block_imp == "removal":
        sub = subblock_removal(model, imp_batches)
        args["block_scores"] = {k: _mean_over_ranks(v, reduce_sum) for k, v in sub.items()}

    search = None
    share = parse_split(split)
    if split == "auto":
        share, search = _search_share(model, scores, ratio, allocation, args, imp_batches, reduce_sum, own)
    if share is not None:
        args["attn_share"] = share
    plan = allocate(model, scores, ratio, allocation, **args)
    plan.meta.update(criterion=criterion, criterion_args=dict(criterion_args or {}), samples=crit.num_samples)
    if measured:
        plan.meta["layer_importance"] = measured
    if block_imp == "removal" and "block_scores" in args:
        plan.meta["block_importance"] = args["block_scores"]
    if search is not None:
        plan.meta["split_search"] = search
    return plan, scores


def calibration_nll(model: nn.Module, plan: PrunePlan, batches: Sequence[torch.Tensor],
                    reduce_sum: Callable | None = None) -> float:
    """Calibration-text NLL of `model` as if `plan` were applied (masked, nothing cut)."""
    with masked(model, plan):
        res = evaluate_perplexity(unwrap(model), batches)
    return _mean_over_ranks([res["nll"]], reduce_sum)[0]


def _search_share(model, scores, ratio, allocation, args, batches, reduce_sum, own) -> tuple[float, dict]:
    """Find the attention share of the budget with the lowest calibration NLL."""
    budget = precheck(model, ratio, allocation, args.get("min_groups", 1), args.get("min_channels", 1))
    start_plan = allocate(model, scores, ratio, allocation, **args)
    start = float(start_plan.meta["attn_share_removed"])
    low = max(0.0, (budget.target - budget.removable("mlp")) / budget.target)
    high = min(1.0, budget.removable("attn") / budget.target)

    def score(share: float) -> float:
        return calibration_nll(model, allocate(model, scores, ratio, allocation, **args, attn_share=share), batches,
                               reduce_sum)

    best, history = search_split(score, start, low, high, own.get("split_step", 0.1),
                                 own.get("split_fine_step", 0.025), own.get("split_patience", 2))
    return best, {"start": start, "best": best, "range": [low, high],
                  "tried": [{"attn_share": s, "calibration_nll": v} for s, v in history]}
