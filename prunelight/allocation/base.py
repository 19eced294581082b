"""The types every allocation shares: the shape constraint, what an allocation is given, what it returns, its row.

An allocation is one function per shape constraint it honours, `(AllocationInputs) -> Removal`, and one
`Allocation` row in `allocation.registry` that states what it needs and checks; a row may own a measurement
(`measure`: run once on the calibration batches after scoring, its answer reaching the functions as
`AllocationInputs.measured`), its own options (`options`: a dataclass read from `prune.allocation_args`) and its own
cut step (`cut`: the plan cut and repaired from what the measurement holds, instead of the usual repair).
`allocation.allocate` does the rest (score checks, the shape's finishing step, the plan and its figures).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelight.allocation.budget import Budget, CutSettings, Removed
from prunelight.distributed import ReduceSum
from prunelight.importance.base import UnitScores
from prunelight.plan import PrunePlan
from prunelight.surgery import LayerWrap


class Shape(enum.Enum):
    """The layer-shape constraint a cut must honour; `export.format` chooses it (`shapes.EXPORT_SHAPES`)."""

    FREE = "free"  # per-layer widths (export.format: auto)
    UNIFORM = "uniform"  # one shape in every kept layer: a stock config (export.format: stock)
    SERVED = "served"  # free MLP widths, one GQA group count in every layer keeping attention (nemotron_nas)


@dataclass(frozen=True)
class AllocationInputs:
    """What an allocation function is given: the budget, the unit scores, the settings and the measured extras."""

    budget: Budget
    scores: UnitScores
    settings: CutSettings
    layer_scores: Sequence[float] | None = None  # layer importance (rows with layer_importance=True)
    block_scores: dict[str, Sequence[float]] | None = None  # measured sub-block removal (rows that ask for it)
    attn_share: float | None = None  # the attention share of the budget (fixed split, or the split search's try)
    groups_removed: int | None = None  # Shape.UNIFORM: the groups removed per layer, when the search fixes it
    groups_kept: int | None = None  # Shape.SERVED: the groups kept in every layer keeping attention, when fixed
    measured: Any = None  # what the row's `measure` returned (None for a row without one)
    options: Any = None  # the row's options instance (`prune.allocation_args`), or None for a row without options


@dataclass(frozen=True)
class MeasureInputs:
    """What a row's `measure` is given: the dense model, the calibration batches and what scoring produced."""

    model: nn.Module  # the dense model, unwrapped (a peft wrapper's base model)
    batches: list[torch.Tensor]  # token ids [batch, seq_len]: the calibration batches measures run on
    budget: Budget
    scores: UnitScores  # the criterion's scores
    settings: CutSettings
    shape: Shape
    options: Any = None  # the row's options instance, or None
    reduce_sum: ReduceSum | None = None  # cross-rank sum (DDP), or None
    state_dir: Path | None = None  # a folder for resumable state (the run's output folder; None in the notebook API)
    # every calibration batch the run scored on; `batches` is its first `prune.importance_batches` (what probes
    # read). A measure that fits weights from statistics (search's levels database) reads all of them.
    calibration: list[torch.Tensor] | None = None
    collected: Any = None  # what the row's `collect` gathered during the scoring pass (None: nothing)


@dataclass(frozen=True)
class CutInputs:
    """What a row's own cut step is given: the model to cut in place, its plan, what the row measured, the run's
    settings and calibration batches."""

    model: nn.Module
    plan: PrunePlan
    measured: Any  # what the row's `measure` returned for this plan
    settings: CutSettings
    batches: list[torch.Tensor]  # every calibration batch of the run
    reduce_sum: ReduceSum | None = None  # cross-rank sum (DDP), or None
    wrap: LayerWrap | None = None  # work around each layer's cut (the layer tuning), or None


@dataclass
class Removal:
    """An allocation's answer: the units (and whole layers) it removes and what it adds to `plan.meta`."""

    removed: Removed
    drop: set[int] = field(default_factory=set)
    extra: dict[str, Any] = field(default_factory=dict)  # plan.meta entries, after "allocation"
    exact: bool = False  # True: the count is final (no true-up to within one MLP channel of the target)


AllocateFn = Callable[[AllocationInputs], Removal]
Precheck = Callable[[Budget, CutSettings, Shape], None]
CutStep = Callable[[CutInputs], "dict[str, Any] | None"]


def _never(settings: CutSettings) -> bool:
    return False


@dataclass(frozen=True)
class Allocation:
    """One `prune.allocation` choice: how it allocates under each shape constraint, what it needs, its checks."""

    name: str
    by_shape: Mapping[Shape, AllocateFn]
    """The allocation function per shape constraint it honours (a missing shape is refused before any work)."""
    layer_importance: bool = False
    """Needs per-layer importance (`prune.layer_importance`, measured on calibration text before the cut)."""
    block_removal: Callable[[CutSettings], bool] = _never
    """Whether, with these settings, it needs measured sub-block removal importance."""
    splits: bool = False
    """Honours an attention:MLP split (`prune.attn_mlp_split`)."""
    kv_target: bool = False
    """Can meet a KV-cache target (`prune.target_kv_cache`: GQA groups only)."""
    kv_per_layer: bool = False
    """A KV-cache target removes the same number of GQA groups from every layer (else the lowest-scored anywhere)."""
    measure: Callable[[MeasureInputs], Any] | None = None
    """Run once after scoring, on the calibration batches, before allocating (also when the unit scores come from
    a saved `prune.scores`); its answer reaches the functions as `AllocationInputs.measured`. An answer whose
    `dense_hidden` is a list (the dense model's final hidden states on every calibration batch, recorded by a pass
    it ran anyway) spares the model tuning its own dense pass."""
    collect: Callable[[CutSettings, Path | None], Any] | None = None
    """Statistics its `measure` reads, gathered during the scoring pass instead of a dense pass of its own: called
    with the settings and the state folder before scoring, it returns a collector (`attach(model)`, `detach()`) or
    None; the collector reaches the measure as `MeasureInputs.collected`."""
    record_as: str | None = None
    """The `plan.meta` key the measurement's `as_dict()` is recorded under (None: not recorded)."""
    options: type | None = None
    """A dataclass of the row's own options (docstrings on fields, checks in `__post_init__`), made once from
    `prune.allocation_args` by the settings; it reaches the functions as `AllocationInputs.options`."""
    zero3: bool = True
    """Runs on ZeRO-3 partitioned weights; False for a row whose measurement runs masked forwards (refused by the
    run plan before the weights load)."""
    rescale: Callable[[UnitScores, Any], UnitScores] | None = None
    """(scores, measured) -> scores on a common scale, applied before any shape's function and a KV-cache target's
    choice (calibrated: the calibration loss); None: the criterion's scores as they are."""
    drops: Callable[[Budget, CutSettings], set[int] | None] | None = None
    """A row that drops whole layers before its shape's width step: the layers it drops as far as model sizes tell
    (which ones goes by importance, but under a stock or served layout every layer has one size, so the count is
    known), for the shape's size check before any data; None from it: no width step follows."""
    precheck: Precheck | None = None
    """Model-size checks before any data is read: raise a one-line ValueError when the budget cannot be met."""
    cut: CutStep | None = None
    """The row's own cut step, run at the cut in place of the usual repair when the row measured: it cuts the model
    to the plan and returns the repair's figures (as `reconstruct.cut_and_reconstruct` does), or None, with nothing
    changed, to leave the cut to the usual repair (search: the plan cut with its levels database's refits)."""

    def needs_data(self, settings: CutSettings) -> bool:
        """Whether it reads calibration text beyond the criterion's scores (layer or sub-block measures)."""
        return self.layer_importance or self.measure is not None or self.block_removal(settings)


def zero_scores(budget: Budget) -> UnitScores:
    """All-zero scores of the model's units: shape pre-checks search candidates from model sizes alone."""
    return {k: [torch.zeros(n) for n in budget.sizes(k)] for k in ("attn", "mlp")}


def constrained_removal(inp: AllocationInputs, removed: Removed, drop: set[int], extra: dict) -> Removal:
    """A shape-constrained search's exact removal, its meta noting the split target and channel alignment asked."""
    if inp.attn_share is not None:
        extra["attn_share_target"] = inp.attn_share
    if inp.settings.align_channels > 1:
        extra["align_channels"] = inp.settings.align_channels
    return Removal(removed, set(drop), extra, exact=True)
