"""The Python API for notebooks and benchmarks: `prune`, `score` and `apply_plan`.

`prune(model, settings, calibration)` is the run's own cut (`run_plan.prepare_run`, then `cut.run_cut` with that
plan: saved plan or scores, scoring, allocation, reconstruction and surgery). `score` is that run's scoring pass
alone, and `prune(..., scores=...)` the rest of it from those scores (the same `run_cut`, with its default repair): score
once, cut many ways, and every cut is one a `prunelight fit` run would make. `apply_plan` is `surgery.apply_plan`
behind the saved plan's fit check; nothing is cut any other way. `import prunelight` stays cheap: the package
reaches this module on first use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from prunelight.allocation import Shape, shape_of_format
from prunelight.allocation.shapes import EXPORT_SHAPES
from prunelight.cut import run_cut
from prunelight.pipeline import load_plan_checked, scoring_pass
from prunelight.plan import PrunePlan
from prunelight.run_plan import RunFacts, prepare_run
from prunelight.saved import SavedScores, check_plan_fits, model_facts
from prunelight.settings import PruneSettings
from prunelight.surgery import apply_plan as _apply_plan

# What `score` returns and `prune(scores=...)` takes: unit scores and the layer / sub-block measures of one scoring
# pass (the same record a saved scores.pt is read into).
Scores = SavedScores

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
          calibration: torch.Tensor | Sequence | None = None, scores: Scores | None = None,
          export_format: str = "auto") -> tuple[nn.Module, PrunePlan]:
    """Score, allocate and cut a Hugging Face causal LM in place (as `prunelight fit` does); returns (model, plan).

    `calibration`: token ids, a [samples, seq_len] tensor or a list of [batch, seq_len] batches (needed by
    data-driven criteria and by `reconstruct` other than none). `scores` (from `score`) replace the scoring pass:
    the calibration text is then read only by the calibrated allocation's probe removals and the repair
    (`settings.reconstruct`, least squares by default). `settings.plan` applies a saved plan and `settings.scores`
    re-allocates from saved scores, as on the command line. `export_format` is the run's `export.format`: the
    layer shapes the cut must keep (stock: one shape in every layer; nemotron_nas: vLLM's per-layer layout).
    """
    s = as_settings(settings)
    batches = as_batches(calibration)
    shape = _shape(export_format)
    run = prepare_run(s, shape, run=RunFacts(has_calibration=bool(batches), has_scores=scores is not None,
                                             export_format=export_format), model=model)
    return model, run_cut(model, batches, run, scores=scores).plan


def score(model: nn.Module, settings: PruneSettings | dict[str, Any] | None = None,
          calibration: torch.Tensor | Sequence | None = None) -> Scores:
    """The scoring pass of a `prunelight fit` run with these settings (nothing is cut): unit scores and the measures
    its allocation needs, plus `settings.report_layer_importance` (list there what other allocations will need).

    Score once, then cut many ways: `prune(copy_of_model, other_settings, calibration, scores=scores)`.
    """
    s = as_settings(settings)
    batches = as_batches(calibration)
    prepare_run(s, Shape.FREE, run=RunFacts(has_calibration=bool(batches)), model=model)  # its refusals, nothing else
    return scoring_pass(model, batches, s)


def _shape(export_format: str) -> Shape:
    """The layer-shape constraint of an `export.format` value, or one line naming the allowed values."""
    if export_format not in EXPORT_SHAPES:
        raise ValueError(f"export_format={export_format!r} is not allowed: use one of {', '.join(EXPORT_SHAPES)}")
    return shape_of_format(export_format)


def apply_plan(model: nn.Module, plan_or_path: PrunePlan | dict | str | os.PathLike) -> nn.Module:
    """Cut `model` in place to a plan: a PrunePlan, its dict, or a saved plan.json / report.json / .ckpt."""
    if isinstance(plan_or_path, (str, os.PathLike)):
        plan = load_plan_checked(model, str(plan_or_path))
    else:
        plan = plan_or_path if isinstance(plan_or_path, PrunePlan) else PrunePlan.from_dict(plan_or_path)
        check_plan_fits(plan, plan.meta.get("applies_to"), model_facts(model), "<in-memory plan>", option="plan")
    _apply_plan(model, plan)
    return model
