"""The Python API for notebooks: `prune(model, settings, calibration)` and `apply_plan(model, plan_or_path)`.

`prune` is the run's own cut (`run_plan.prepare_run`, then `cut.run_cut` with that plan: saved plan or scores,
scoring, allocation, reconstruction and surgery); `apply_plan` is `surgery.apply_plan` behind the saved plan's fit
check; nothing is cut any other way. `import prunelight` stays cheap: the package reaches this module on first use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from prunelight.allocation import Shape
from prunelight.cut import run_cut
from prunelight.pipeline import load_plan_checked
from prunelight.plan import PrunePlan
from prunelight.run_plan import RunFacts, prepare_run
from prunelight.saved import check_plan_fits, model_facts
from prunelight.settings import PruneSettings
from prunelight.surgery import apply_plan as cut

CALIBRATION_BATCH = 8  # rows per batch when the calibration is one [samples, seq_len] tensor


def as_settings(settings: PruneSettings | dict[str, Any] | None) -> PruneSettings:
    """PruneSettings from itself, a dict like the YAML `prune:` section, or None (the defaults)."""
    if settings is None:
        return PruneSettings()
    if isinstance(settings, PruneSettings):
        return settings
    if isinstance(settings, dict):
        return PruneSettings(**settings)
    raise TypeError(f"settings must be a PruneSettings or a dict of prune options, not {type(settings).__name__}")


def as_batches(calibration: torch.Tensor | Sequence | None) -> list[torch.Tensor]:
    """Token-id batches [batch, seq_len] from a 2-D tensor (split by 8 rows), a 1-D one, or a list of those."""
    if calibration is None:
        return []
    if isinstance(calibration, torch.Tensor):
        if calibration.dim() == 1:
            return [calibration[None].long()]
        if calibration.dim() == 2:
            return [b.long() for b in torch.split(calibration, CALIBRATION_BATCH)]
        raise ValueError(f"calibration must be token ids of shape [samples, seq_len], got {tuple(calibration.shape)}")
    out = []
    for b in calibration:
        out.extend(as_batches(torch.as_tensor(b)) if not isinstance(b, torch.Tensor) or b.dim() != 2 else [b.long()])
    return out


def prune(model: nn.Module, settings: PruneSettings | dict[str, Any] | None = None,
          calibration: torch.Tensor | Sequence | None = None) -> tuple[nn.Module, PrunePlan]:
    """Score, allocate and cut a Hugging Face causal LM in place (as `prunelight fit` does); returns (model, plan).

    `calibration`: token ids, a [samples, seq_len] tensor or a list of [batch, seq_len] batches (needed by
    data-driven criteria and by `reconstruct` other than none). `settings.plan` applies a saved plan and
    `settings.scores` re-allocates from saved scores, as on the command line.
    """
    s = as_settings(settings)
    batches = as_batches(calibration)
    run = prepare_run(s, Shape.FREE, run=RunFacts(has_calibration=bool(batches)), model=model)
    return model, run_cut(model, batches, run).plan


def apply_plan(model: nn.Module, plan_or_path: PrunePlan | dict | str | os.PathLike) -> nn.Module:
    """Cut `model` in place to a plan: a PrunePlan, its dict, or a saved plan.json / report.json / .ckpt."""
    if isinstance(plan_or_path, (str, os.PathLike)):
        plan = load_plan_checked(model, str(plan_or_path))
    else:
        plan = plan_or_path if isinstance(plan_or_path, PrunePlan) else PrunePlan.from_dict(plan_or_path)
        check_plan_fits(plan, plan.meta.get("applies_to"), model_facts(model), "<in-memory plan>", option="plan")
    cut(model, plan)
    return model
