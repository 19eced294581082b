"""Shape constraints: what each one refuses before any work and how it finishes an allocation's removal.

`export.format` picks the constraint (`EXPORT_SHAPES`); an allocation honours a constraint when its
registry row has a function for it. Adding a constraint is one `Shape` member, one `ShapeRule` here
and the allocations' functions for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prunelight.allocation.align import align_channels
from prunelight.allocation.base import AllocationInputs, Removal, Shape
from prunelight.allocation.budget import Budget, CutSettings, true_up
from prunelight.allocation.served import check_served_config, check_served_settings, check_served_sizes
from prunelight.allocation.stock import check_uniform_settings, check_uniform_sizes
from prunelight.allocation.width import kind_targets


def _no_settings_check(settings: CutSettings) -> None:
    return None


def _free_sizes(budget: Budget, settings: CutSettings, shape: Shape, drop: set[int]) -> None:
    share = settings.attn_share
    if share is not None:
        kind_targets(budget, share)  # each side can give its share of the budget


def _finish_free(inp: AllocationInputs, r: Removal) -> Removal:
    """The split target, channel alignment, and the true-up to within one channel (unless the count is final)."""
    s, extra, removed = inp.settings, dict(r.extra), r.removed
    scores = inp.scores  # already on the row's scale (`Allocation.rescale`, applied by `allocate`)
    if inp.attn_share is not None:
        extra["attn_share_target"] = inp.attn_share
    if s.align_channels > 1:
        removed = align_channels(scores, inp.budget, removed, s.align_channels, fixed=r.drop)
        extra["align_channels"] = s.align_channels
    elif not r.exact:
        # Count the sub-blocks' biases and layers' norms the fills did not see; land within one channel.
        removed = true_up(scores, inp.budget, removed, r.drop)
    return Removal(removed, r.drop, extra, exact=True)


def _finish_as_is(inp: AllocationInputs, r: Removal) -> Removal:
    return r


@dataclass(frozen=True)
class ShapeRule:
    """One shape constraint's checks and finishing step."""

    shape: Shape
    why: str
    """Why an allocation without a function for this shape is refused (the refusal names it)."""
    check_settings: Callable[[CutSettings], None] = _no_settings_check
    """Settings-only refusals (before any weights load)."""
    check_config: Callable[[Any], None] | None = None
    """Model-config refusals (family, attention kind: before any weights load); the run plan runs it (`prepare_run`, `precheck`)."""
    check_sizes: Callable[[Budget, CutSettings, Shape, set[int]], None] | None = None
    """Model-size refusals (before data is read), given the layers the allocation drops first (`Allocation.drops`)."""
    finish: Callable[[AllocationInputs, Removal], Removal] = _finish_as_is
    """What `allocate` does to every allocation's removal under this constraint."""
    kv_target: bool = True
    """Whether a KV-cache target can be met under it."""


SHAPES: dict[Shape, ShapeRule] = {
    Shape.FREE: ShapeRule(Shape.FREE, why="", check_sizes=_free_sizes, finish=_finish_free),
    Shape.UNIFORM: ShapeRule(Shape.UNIFORM, why="it gives per-layer widths", check_settings=check_uniform_settings,
                             check_sizes=check_uniform_sizes, kv_target=False),
    Shape.SERVED: ShapeRule(Shape.SERVED, why="its attention widths differ per layer",
                            check_settings=check_served_settings, check_config=check_served_config,
                            check_sizes=check_served_sizes, kv_target=False),
}

# export.format -> the shape constraint of the cut (export.py writes the folder; allocation honours the shape).
EXPORT_SHAPES: dict[str, Shape] = {"auto": Shape.FREE, "stock": Shape.UNIFORM, "nemotron_nas": Shape.SERVED,
                                    "prunelight": Shape.FREE}


def shape_of_format(export_format: str) -> Shape:
    """The shape constraint an `export.format` puts on the cut."""
    return EXPORT_SHAPES[export_format]


def format_of_shape(shape: Shape) -> str:
    """The `export.format` that asks for `shape` (for refusals)."""
    return next(f for f, s in EXPORT_SHAPES.items() if s is shape)
