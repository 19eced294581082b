"""`prepare_run`: the run plan, made once before any weights or data load.

Every refusal that needs neither weights nor data happens here, once per run: the settings against the export's
shape constraint, the run's facts (trainer, strategy, data: prune_step vs max_steps, DeepSpeed, ZeRO-3 with an
allocation whose measurement runs masked forwards), the model's config (min_groups / min_channels vs its widths,
a saved plan or scores vs the config, the shape's config check, the allocation's and the shape's size checks on a
weightless twin) and the distillation teacher's config (its vocabulary and hidden size). Settings alone were
checked earlier still, in `PruneSettings.__post_init__`.

The `RunPlan` it returns carries what the checks made (the budget, the allocation row and its options, the shape)
and is handed on: the CLI's `before_fit` makes it, `PruningCallback` and `prunelight.prune` take it, and
`cut.run_cut` cuts from it; none of them re-checks. Every refusal is one line naming the bad value and what is
allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from prunelight.allocation import Allocation, Budget, Shape, allocation_of, check_shape, precheck
from prunelight.allocation.shapes import SHAPES
from prunelight.families import unwrap
from prunelight.checks import check_deepspeed_criterion, check_facts, check_teacher_config, check_widths
from prunelight.plan import PrunePlan
from prunelight.saved import SavedScores, read_saved_inputs
from prunelight.settings import PruneSettings
from prunelight.zero3 import meta_model


@dataclass(frozen=True)
class RunFacts:
    """What the trainer, the module and the data say about the run (None: not known, e.g. the Python API)."""

    recovery: str | None = None  # model.recovery
    max_steps: int | None = None  # trainer.max_steps (None or < 0: no limit)
    deepspeed: bool = False  # the cut model continues in a fresh engine (DeepSpeed)
    zero_stage: int | None = None  # DeepSpeed's ZeRO stage (None: not DeepSpeed)
    world_size: int = 1
    num_samples: int | None = None  # data.num_samples
    has_calibration: bool | None = None  # prunelight.prune: whether calibration tokens were given
    has_scores: bool = False  # prunelight.prune(scores=...): unit scores handed in (the criterion reads no text)
    distillation: Any = None  # model.distillation (DistillationSettings), or None
    teacher_config: Any = None  # the config of model.distillation.teacher, when one is named


@dataclass(frozen=True)
class RunPlan:
    """What a run cuts with, checked once before anything loads: the settings, the shape, the row and the budget."""

    settings: PruneSettings
    shape: Shape
    row: Allocation  # the registry row of settings.allocation
    budget: Budget | None = None  # counted on the config's twin; None with a saved plan (it fixes the cut)
    facts: RunFacts | None = None
    saved_plan: PrunePlan | None = None  # prune.plan, read once and checked against the config
    saved_scores: SavedScores | None = None  # prune.scores, read once (its weights fingerprint is checked at the cut)

    @property
    def options(self) -> Any:
        """The allocation row's options (`prune.allocation_args`), or None for a row without options."""
        return self.settings.allocation_options

    def with_settings(self, **changes: Any) -> RunPlan:
        """The same plan with settings that change no budget (e.g. a smoke test's fewer calibration batches)."""
        return replace(self, settings=replace(self.settings, **changes))


def prepare_run(settings: PruneSettings, shape: Shape = Shape.FREE, config=None,
                run: RunFacts | None = None, model: nn.Module | None = None) -> RunPlan:
    """Refuse settings that this shape constraint, the run and (given its `config`) the model cannot meet; the plan.

    The budget is counted on a weightless twin of `config`, or on `model` when one is already loaded (the Python
    API; its config is then the model's). Without either, the plan has no budget (a Trainer built in Python:
    `PruningCallback.setup` makes the plan again with the module's config, still before the weights load).
    """
    if model is not None:
        config = unwrap(model).config
    row = allocation_of(settings.allocation)
    check_shape(settings, shape)
    if run is not None:
        check_facts(settings, row, run)
    if config is None:
        return RunPlan(settings, shape, row, facts=run)
    if run is not None and run.distillation is not None and run.teacher_config is not None:
        check_teacher_config(run.distillation, config, run.teacher_config)
    check_widths(settings, config)
    saved_plan, saved_scores = read_saved_inputs(settings, config)  # prune.plan / prune.scores fit the model
    twin = model if model is not None else meta_model(config)
    if run is not None and run.deepspeed:
        check_deepspeed_criterion(settings, twin)
    budget = None
    if settings.plan:  # a saved plan fixes the cut: no budget applies, only the shape's config check
        if SHAPES[shape].check_config is not None:
            SHAPES[shape].check_config(config)
    else:
        budget = precheck(twin, settings, shape)  # the shape's config check, the row's and the shape's size checks
    return RunPlan(settings, shape, row, budget, run, saved_plan, saved_scores)


