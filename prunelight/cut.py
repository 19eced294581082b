"""One cut pipeline for every caller: `run_cut` (saved plan, or saved scores / scoring, then allocation,
reconstruction and surgery) and `CutResult`, which the run record, plan.json and scores.pt are written from.

`PruningCallback` (a `prunelight fit` run), `prunelight.prune` (the Python API) and the benchmark scripts
all call `run_cut`, each with the run plan (`run_plan.prepare_run`: every refusal that needs no weights, and the
budget, made once before anything loaded). `prepare_cut` is the part that needs the weights but no data (a saved
plan read, or saved scores read and their weights fingerprint checked): the callback runs it before measuring
the dense model, so a bad saved file fails before any evaluation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelight.allocation import Budget, CutInputs, allocation_of
from prunelight.distributed import ReduceSum
from prunelight.importance import UnitScores
from prunelight.layer_tuning import LayerTuner
from prunelight.model_tuning import ModelTuner, dense_hidden, fits_in_memory
from prunelight.pipeline import adopt_plan, load_plan_checked, make_plan
from prunelight.plan import PrunePlan
from prunelight.reconstruct import cut_and_reconstruct
from prunelight.record import CalibrationRecord, RunRecord
from prunelight.run_plan import RunPlan
from prunelight.saved import (
    PLAN_FILE,
    RUN_KEY_PARTS,
    SCORES_FILE,
    SavedScores,
    check_key,
    load_scores,
    plan_document,
    save_scores,
    scores_key,
    write_plan,
)
from prunelight.settings import PruneSettings

log = logging.getLogger(__name__)


@dataclass
class CutSource:
    """What a cut starts from, read and checked before any data: a saved plan, or the budget (+ saved scores)."""

    plan: PrunePlan | None = None  # prune.plan (fits the model; no budget, no scoring)
    budget: Budget | None = None  # from `allocation.precheck` (model sizes checked)
    saved: SavedScores | None = None  # prune.scores (key checked), or scores a benchmark measured once


@dataclass
class CutResult:
    """The plan, how it was made and what the cut did: everything the record and the saved files are written from."""

    plan: PrunePlan
    budget: Budget
    scores: UnitScores | None  # None when a saved plan was applied (nothing scored or allocated)
    saved: SavedScores | None = None
    reconstruction: dict[str, Any] | None = None  # prune.reconstruct's figures, with "tuning" when layers were tuned
    # (None: no repair, or no surgery)
    cut: bool = False  # whether the surgery ran (False: plan only, e.g. the DeepSpeed hand-off writes its own copy)
    times_s: dict[str, float] = field(default_factory=dict)

    @property
    def params_before(self) -> int:
        """Parameters of the model before the cut."""
        return self.budget.total

    @property
    def params_after(self) -> int:
        """Parameters the plan leaves."""
        return self.budget.total - self.plan.meta["params_removed"]


def prepare_cut(model: nn.Module, run: RunPlan, calibration: dict[str, Any] | None = None,
                twin: nn.Module | None = None) -> CutSource:
    """The saved plan, or the run plan's budget and the saved scores with their key checked on the weights (no data).

    `twin`: a weightless copy that stands in for ZeRO-3 partitioned weights in the plan's fit check;
    `calibration` is the scores key's calibration identity (the key holds a fingerprint of the loaded weights).
    """
    settings = run.settings
    if settings.plan:  # read and checked by the run plan (a plan made without a config reads it here)
        return CutSource(plan=run.saved_plan or load_plan_checked(twin or model, settings.plan))
    saved = None
    if settings.scores:
        saved = run.saved_scores or load_scores(settings.scores)
        check_key(saved.key, scores_key(model, settings, calibration or {}), settings.scores, parts=RUN_KEY_PARTS)
    return CutSource(budget=run.budget, saved=saved)


def run_cut(model: nn.Module, batches: Sequence[torch.Tensor], run: RunPlan,
            source: CutSource | None = None, reduce_sum: ReduceSum | None = None, sharded: bool = False,
            twin: nn.Module | None = None, surgery: bool = True,
            before_surgery: Callable[[], None] | None = None, scores: SavedScores | None = None,
            state_dir: Path | None = None) -> CutResult:
    """Plan (saved plan, saved scores or a scoring pass, then allocation) and, with `surgery`, cut `model` in place.

    `run` is the run plan (`run_plan.prepare_run`, checked once before anything loaded). `source` is `prepare_cut`'s
    answer (made here when not given).
    `twin` is the weightless copy that stands in for ZeRO-3 partitioned weights (`sharded`). `before_surgery` runs just before the
    weights change (the distillation teacher's snapshot). The cut repairs itself with `settings.reconstruct`.
    `scores`: unit scores (and layer importance) measured earlier in this process, used as saved scores
    (`measured_scores`; a benchmark scores once and allocates many times). `state_dir`: where the allocation
    row's measurement may keep resumable state.
    """
    t0 = time.perf_counter()
    settings = run.settings
    advice = alignment_advice(next(model.parameters()).device, settings)
    if advice:
        log.warning(advice)
    source = source or prepare_cut(model, run, twin=twin)
    if scores is not None:
        source = CutSource(plan=source.plan, budget=source.budget, saved=scores)
    scores = measured = None
    if source.plan is not None:
        plan, budget = adopt_plan(twin or model, source.plan, settings.plan)
        made = plan.meta["made_with"]
        log.info("no scoring pass: plan from %s (made with %s / %s, ratio %s; the plan wins over this run's ratio, "
                 "criterion and allocation); %s", settings.plan, made.get("criterion", "?"),
                 made.get("allocation", "?"), made.get("ratio", "?"), _repair_reads(settings, batches))
    else:
        if source.saved is not None and source.saved.source:
            log.info("no scoring pass: unit scores from %s (%s, %d samples); %s", source.saved.source,
                     source.saved.key.get("criterion"), source.saved.samples, _repair_reads(settings, batches))
        budget = source.budget
        planned = make_plan(model, batches, settings, reduce_sum=reduce_sum, sharded=sharded, budget=budget,
                            saved=source.saved, shape=run.shape, state_dir=state_dir)
        plan, scores, measured = planned.plan, planned.scores, planned.measured
    result = CutResult(plan=plan, budget=budget, scores=scores, saved=source.saved)
    result.times_s["calibration_and_allocation"] = time.perf_counter() - t0
    if surgery:
        if before_surgery is not None:
            before_surgery()
        t0 = time.perf_counter()
        calib = list(batches)[: settings.max_calibration_batches]
        tune_model = settings.reconstruct != "none" and settings.model_tuning.epochs > 0 and bool(calib)
        skipped = None
        if tune_model and not fits_in_memory(model, reduce_sum):
            skipped = ("the decoder's float32 weights, gradients and Adam moments do not fit in half the free "
                       "memory; set prune.model_tuning.epochs: 0 to silence this")
            log.warning("model tuning skipped: %s", skipped)
            tune_model = False
        dense = None  # the dense model's targets, before the cut: recorded by the row's measurement, or measured
        if tune_model:
            recorded = getattr(measured, "dense_hidden", None)
            dense = (recorded[:len(calib)] if recorded is not None and len(recorded) >= len(calib)
                     else dense_hidden(model, calib))
        tuner = (LayerTuner(model, calib, settings.layer_tuning,
                            reduce_sum, plan.drop_layers)
                 if settings.reconstruct != "none" and settings.layer_tuning.epochs else None)
        # The row's own cut step, where it measured one; else the usual
        # repair, layer by layer, with the repair settings the plan carries.
        figures = (run.row.cut(CutInputs(model, plan, measured, settings, list(batches), reduce_sum,
                                         tuner.wrap if tuner is not None else None))
                   if measured is not None and run.row.cut is not None else None)
        if figures is None:
            settings = _with_plan_repair(settings, plan)
            figures = cut_and_reconstruct(model, plan, batches, settings, reduce_sum,
                                          tune=tuner.tune if tuner is not None else None)
        result.reconstruction = figures if settings.reconstruct != "none" else None
        if tuner is not None:  # the repair's seconds without the tuning's, which has its own
            result.reconstruction["time_s"] = max(result.reconstruction["time_s"] - tuner.seconds, 0.0)
            result.reconstruction["tuning"] = tuner.summary()
        if result.reconstruction is not None and dense is not None:
            result.reconstruction["model_tuning"] = ModelTuner(model, calib, dense, settings.model_tuning,
                                                               reduce_sum).tune()
        elif result.reconstruction is not None and skipped:
            result.reconstruction["model_tuning"] = {"skipped": skipped}
        result.cut = True
        result.times_s["surgery"] = time.perf_counter() - t0
    return result


def _with_plan_repair(settings: PruneSettings, plan: PrunePlan) -> PruneSettings:
    """The settings with the repair the plan carries (`meta["repair"]`, e.g. a cross-validated ridge) in place of
    their own, said in one line when they differ."""
    repair = {k: v for k, v in (plan.meta.get("repair") or {}).items() if k != "chosen_by"}
    changed = {k: v for k, v in repair.items() if getattr(settings, k) != v}
    if not changed:
        return settings
    log.info("the cut repairs with the plan's %s (chosen by %s when the plan was made; the plan wins over the "
             "settings' %s)", ", ".join(f"{k}={v:.4g}" for k, v in changed.items()),
             (plan.meta.get("repair") or {}).get("chosen_by", "its allocation"),
             ", ".join(f"{k}={getattr(settings, k)}" for k in changed))
    return dataclasses.replace(settings, **changed)


def alignment_advice(device: torch.device, settings: PruneSettings) -> str | None:
    """One line when a cut on a CUDA device chooses MLP widths the tensor cores handle badly, else None."""
    if device.type != "cuda" or settings.align_channels % 8 == 0 or settings.plan:
        return None  # bf16 matrix products want multiples of 8; a saved plan's widths are already chosen
    return (f"prune.align_channels={settings.align_channels} on a CUDA device: MLP widths that are not multiples of 8 "
            "miss the tensor cores (Llama-3-8B shape on an H100, 20% cut: prefill 0.4x dense unaligned, 1.3x with "
            "128); set prune.align_channels: 128 for a model served on GPUs")


def measured_scores(unit_scores: UnitScores, layer_importance: dict[str, list[float]] | None = None,
                    samples: int = 0) -> SavedScores:
    """Scores measured in this process, in the form `run_cut(scores=...)` re-allocates from (no scoring pass)."""
    return SavedScores(unit_scores=unit_scores, key={}, layer_importance=dict(layer_importance or {}),
                       provenance={"samples": samples})


def record_cut(record: RunRecord, result: CutResult, settings: PruneSettings, prune_step: int,
               seq_len: int | None = None, source: str | None = None, seed: int | None = None) -> None:
    """Write the cut's sections of the run record from its result (the one place they are written)."""
    made = result.plan.meta
    record.calibration = CalibrationRecord(
        criterion=made.get("criterion", settings.criterion), allocation=made.get("allocation", settings.allocation),
        ratio=made.get("ratio", settings.ratio), settings=settings.as_dict(), samples=made.get("samples", 0),
        seq_len=seq_len, source=source, seed=seed, prune_step=prune_step,
        plan_source=settings.plan, scores_source=settings.scores, target=made.get("target"))
    record.plan = made
    if result.scores is not None:
        record.unit_scores = {k: [t.tolist() for t in v] for k, v in result.scores.items()}
    record.layer_importance = made.get("layer_importance")
    record.params_before = result.params_before
    record.params_after = result.params_after
    record.prune_plan = {k: v for k, v in result.plan.to_dict().items() if k != "meta"}
    if result.reconstruction is not None:
        record.reconstruction = result.reconstruction
    record.times_s.update(result.times_s)


def write_saved(out: Path, result: CutResult, model: nn.Module, settings: PruneSettings,
                key: dict[str, Any] | None, pretrained: str | None = None) -> None:
    """plan.json (always) and scores.pt (when units were scored or re-allocated) into the output folder `out`."""
    plan, saved = result.plan, result.saved
    write_plan(out / PLAN_FILE, plan_document(plan, model, result.params_before, result.params_after, settings,
                                              source=settings.plan))
    if result.scores is not None:
        save_scores(out / SCORES_FILE, result.scores, key, layer_importance=plan.meta.get("layer_importance"),
                    block_importance=plan.meta.get("block_importance"),
                    samples=plan.meta.get("samples"), split_search=plan.meta.get("split_search"),
                    pretrained=pretrained, copied_from=saved.source if saved is not None else None,
                    **({} if saved is None else {"made": saved.provenance}))
    log.info("plan written to %s%s", out / PLAN_FILE, f", scores to {out / SCORES_FILE}" if result.scores is not None
             else "")


def _repair_reads(settings: PruneSettings, batches) -> str:
    """What the cut still reads from the calibration batches (probe removals, the repair; forward only)."""
    reads = []
    if allocation_of(settings.allocation).measure is not None and not settings.plan:
        n = len(list(batches)[: settings.importance_batches or settings.max_calibration_batches])
        reads.append(f"allocation {settings.allocation} measures on {n} calibration batches")
    if settings.reconstruct != "none":
        n = len(list(batches)[: settings.max_calibration_batches])
        reads.append(f"reconstruction ({settings.reconstruct}) reads {n} calibration batches")
    return ", ".join(reads) + ", forward only" if reads else "no calibration batches are read"
