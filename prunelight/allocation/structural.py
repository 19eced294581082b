"""Allocations that remove whole structures: `blockwise` (attention / MLP sub-blocks) and `depth` (whole layers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prunelight.allocation.base import AllocationInputs, Removal, Shape, zero_scores
from prunelight.allocation.budget import Budget, Removed, empty_removed
from prunelight.allocation.stock import allocate_uniform_shape
from prunelight.allocation.width import asked, check_removable, global_width
from prunelight.importance.base import UnitScores
from prunelight.validate import choice, flag

BLOCK_IMPORTANCE = ("units", "removal")


@dataclass
class BlockwiseOptions:
    """The options of `prune.allocation: blockwise` (`prune.allocation_args`)."""

    block_importance: Literal[BLOCK_IMPORTANCE] = "removal"  # type: ignore[valid-type]
    """How sub-blocks are ranked: measured removal loss (each sub-block removed alone, the calibration loss read), or
    the criterion's unit scores summed (cheaper, but criteria standardized per layer, as flap's, do not compare across
    sub-blocks: 380x dense at 20% on SmolLM2 against 2.9x measured)."""
    fill_width: bool = True
    """Width-prune what whole sub-blocks leave of the budget (false: whole sub-blocks only)."""

    def __post_init__(self) -> None:
        choice("prune.allocation_args.block_importance", self.block_importance, BLOCK_IMPORTANCE)
        flag("prune.allocation_args.fill_width", self.fill_width)


@dataclass
class DepthOptions:
    """The options of `prune.allocation: depth` (`prune.allocation_args`)."""

    fill_width: bool = True
    """Width-prune what whole layers leave of the budget (false: whole layers only, the count nearest the
    budget)."""

    def __post_init__(self) -> None:
        flag("prune.allocation_args.fill_width", self.fill_width)


def block_scores_from_units(scores: UnitScores) -> dict[str, list[float]]:
    """A sub-block's importance as the sum of its units' scores (first-order: the loss change of removing all)."""
    return {kind: [float(t.float().sum()) for t in scores[kind]] for kind in ("attn", "mlp")}


def _block_total(budget: Budget, kind: str, i: int) -> int:
    """Every parameter of one sub-block (its units and what only it holds: biases, its norm)."""
    return budget.sizes(kind)[i] * budget.cost(kind) + (budget.attn_extra if kind == "attn" else budget.mlp_extra)[i]


def _remove_block(budget: Budget, removed: Removed, kind: str, i: int) -> int:
    removed[kind][i] = set(range(budget.sizes(kind)[i]))
    return _block_total(budget, kind, i)


def check_blockwise(budget: Budget, settings, shape: Shape) -> None:
    """With fill_width, the width can always take what whole sub-blocks leave when it could take the whole target
    (a removed sub-block gives at least what width pruning could take from it): the knapsack's own check. Without it,
    whole sub-blocks must reach the budget whichever one importance keeps last (the last is never removed)."""
    if settings.allocation_options.fill_width:
        check_removable(budget, settings, shape)
        return
    totals = [_block_total(budget, k, i) for k in ("attn", "mlp") for i in range(budget.num_layers)
              if budget.sizes(k)[i]]
    most = sum(totals) - max(totals, default=0)
    if budget.target > most:
        raise ValueError(f"{asked(settings)} is not allowed with allocation blockwise and fill_width: false: whole "
                         f"sub-blocks give at most {most:,} of the {budget.target:,} parameters asked (one sub-block "
                         "always stays); lower the ratio or set prune.allocation_args.fill_width: true")


def check_depth(budget: Budget, settings, shape: Shape) -> None:
    """Whichever layers importance orders first, depth must drop at least one layer and keep at least one (model
    sizes only): `depth`'s own refusals are unreachable after scoring."""
    sizes = [budget.layer_total(i) for i in range(budget.num_layers)]
    total, largest = sum(sizes), max(sizes)
    if settings.allocation_options.fill_width:
        every = budget.target >= total  # layers go while they fit in the target
        check_removable(budget, settings, shape)  # the width fills the kept layers (as blockwise's, any drop order)
    else:
        if 2 * budget.target < largest:  # the first layer in the order must be nearer the target than nothing
            raise ValueError(f"{asked(settings)} is not allowed with allocation depth and fill_width: false: it asks "
                             f"{budget.target:,} parameters, less than half a layer ({largest:,}); raise the ratio or "
                             "set prune.allocation_args.fill_width: true")
        every = 2 * total - largest <= 2 * budget.target  # the last layer too is nearer the target than without it
    if every:
        raise ValueError(f"{asked(settings)} is not allowed with allocation depth: it would drop all "
                         f"{budget.num_layers} layers ({total:,} parameters); lower the ratio")


def depth_drop(budget: Budget, settings) -> set[int] | None:
    """The layers depth drops before filling the width, as far as sizes tell (the first ones in order stand in for
    whichever importance picks: the layouts that need the count have layers of one size); None without fill_width."""
    if not settings.allocation_options.fill_width:
        return None
    return depth(zero_scores(budget), budget, [0.0] * budget.num_layers, True)[1]


def blockwise(scores: UnitScores, budget: Budget, block_scores: dict[str, Sequence[float]] | None = None,
              fill_width: bool = True) -> tuple[Removed, list[tuple[str, int]]]:
    """Remove the sub-blocks with the lowest importance per parameter; width-prune the rest to the exact budget.

    Without `fill_width`, sub-blocks are removed until the budget is met (overshooting by less than one block).
    """
    block_scores = block_scores or block_scores_from_units(scores)
    blocks = []
    for kind in ("attn", "mlp"):
        for i, s in enumerate(block_scores[kind]):
            n = budget.sizes(kind)[i]
            if n == 0 or s is None:
                continue
            size = n * budget.cost(kind)
            blocks.append((float(s) / size, kind, i, size))
    blocks.sort(key=lambda b: (b[0], b[1], b[2]))
    removed = empty_removed(budget)
    total, gone = 0, []
    for _, kind, i, size in blocks:
        if total >= budget.target:
            break
        if fill_width and total + size > budget.target:
            continue  # a smaller block further down may still fit; the rest is width pruning
        if len(gone) == 2 * budget.num_layers - 1:
            break  # never remove the last sub-block
        total += _remove_block(budget, removed, kind, i)
        gone.append((kind, i))
    if fill_width and total < budget.target:
        # Width pruning of the remaining sub-blocks takes the rest; removed ones count as already taken.
        global_width(scores, budget, removed=removed, layers=None)
    return removed, gone


def depth(
    scores: UnitScores, budget: Budget, importance: Sequence[float], fill_width: bool = True
) -> tuple[Removed, set[int]]:
    """Drop the least important whole layers (ShortGPT); optionally width-prune the rest to the exact budget.

    With `fill_width` as many layers as fit in the budget are dropped and width pruning takes the
    remainder; without it the layer count closest to the budget is dropped.
    """
    n = budget.num_layers
    order = sorted(range(n), key=lambda i: (float(importance[i]), i))
    drop: set[int] = set()
    total = 0
    for i in order:
        size = budget.layer_total(i)
        over = total + size - budget.target
        if (fill_width and over > 0) or (not fill_width and over > budget.target - total):
            break
        drop.add(i)
        total += size
    removed = empty_removed(budget)
    for i in drop:
        for kind in ("attn", "mlp"):
            removed[kind][i] = set(range(budget.sizes(kind)[i]))
    if fill_width and total < budget.target:
        # Dropped layers' units already count; width pruning fills the remainder in the kept layers.
        kept = {i for i in range(n) if i not in drop}
        extra = total - sum(budget.layer_units(i) for i in drop)  # norms and biases also went
        shifted = Budget(**{**budget.__dict__, "target": budget.target - extra})
        global_width(scores, shifted, removed=removed, layers=kept)
    return removed, drop


def allocate_blockwise(inp: AllocationInputs) -> Removal:
    """`blockwise`: whole sub-blocks first; with fill_width the rest by width (trued up), else whole blocks only."""
    fill = inp.options.fill_width
    removed, gone = blockwise(inp.scores, inp.budget, inp.block_scores, fill)
    return Removal(removed, extra={"blocks_removed": [f"{k}{i}" for k, i in gone]}, exact=not fill)


def allocate_depth(inp: AllocationInputs) -> Removal:
    """`depth`: whole layers by layer importance; with fill_width the rest by width (trued up)."""
    removed, drop = depth(inp.scores, inp.budget, inp.layer_scores, inp.options.fill_width)
    return Removal(removed, drop, exact=not inp.options.fill_width)


def allocate_depth_uniform(inp: AllocationInputs) -> Removal:
    """`depth` with one layer shape: whole layers first, then one uniform width in every kept layer."""
    removed, drop = depth(inp.scores, inp.budget, inp.layer_scores, inp.options.fill_width)
    if not inp.options.fill_width:
        return Removal(removed, drop, extra={"uniform_shape": True}, exact=True)
    return allocate_uniform_shape(inp, drop)
