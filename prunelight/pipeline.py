"""The pruning pipeline in one call: calibrate -> score -> allocate (no cut).

Both the PruningCallback and the benchmark scripts go through `make_plan`, so a method measured
in a benchmark is exactly the method a `prunelight fit` run applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from prunelight.allocation import allocate
from prunelight.calibration import run_calibration
from prunelight.importance import UnitScores, build_criterion
from prunelight.plan import PrunePlan


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
) -> tuple[PrunePlan, UnitScores]:
    """Score every unit of `model` on `batches` with `criterion` and allocate `ratio` of its parameters."""
    crit = build_criterion(criterion, **(criterion_args or {}))
    scores = run_calibration(model, batches if crit.needs_data else [], crit, reduce_sum, max_batches)
    plan = allocate(model, scores, ratio, allocation, **(allocation_args or {}))
    plan.meta.update(criterion=criterion, criterion_args=dict(criterion_args or {}), samples=crit.num_samples)
    return plan, scores
