"""PruningCallback: calibrate, score, allocate and cut at a chosen step, then hand over to recovery."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import lightning as L

from prunelight.allocation import precheck
from prunelight.allocation.served import check_served_settings
from prunelight.allocation.stock import check_stock_settings
from prunelight.console import cut_summary, log_metrics, show_progress
from prunelight.distributed import needs_fresh_engine, strategy_sum, zero_stage
from prunelight.evaluation.run import RunEvaluator
from prunelight.export import export_pretrained
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.pipeline import adopt_plan, load_plan_checked, make_plan
from prunelight.record import CalibrationRecord
from prunelight.saved import (
    PLAN_FILE,
    RUN_KEY_PARTS,
    SCORES_FILE,
    calibration_identity,
    check_key,
    load_scores,
    plan_document,
    save_scores,
    scores_key,
    write_plan,
)
from prunelight.settings import PruneSettings
from prunelight.zero3 import gathered_pruned_copy, shape_twin

log = logging.getLogger(__name__)


class PruningCallback(L.Callback):
    """Removes whole GQA groups and MLP channels once, at `settings.prune_step`, so `settings.ratio` of the parameters is gone.

    The cut, for one process, DDP and DeepSpeed alike: measure the dense model, score the units on
    this rank's share of the calibration samples (statistics summed across ranks), allocate, then
    either cut the module in place and rebuild the optimizer, or, under DeepSpeed (whose engine
    cannot be reshaped), write the cut model from rank 0 and stop so the CLI continues the recovery
    from it in a fresh engine.
    """

    def __init__(self, settings: PruneSettings | None = None, evaluator: RunEvaluator | None = None,
                 out_dir: str | None = None, uniform_shape: bool = False, served_layout: bool = False) -> None:
        super().__init__()
        self.settings = settings or PruneSettings()
        self.evaluator = evaluator
        self.out_dir = out_dir  # plan.json and scores.pt go here (default: the trainer's default_root_dir)
        self.uniform_shape = uniform_shape  # export.format: stock (ExportSettings.uniform_shape) keeps one layer shape
        self.served_layout = served_layout  # export.format: nemotron_nas (ExportSettings.served_layout)
        self.pruned = False

    # --- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.fast_dev_run:
            # One batch runs in a smoke test: cut at once, on one calibration batch, so surgery is exercised.
            self.settings = dataclasses.replace(self.settings, prune_step=0, max_calibration_batches=1,
                                                importance_batches=1)
        if self.uniform_shape:
            check_stock_settings(self.settings)
        if self.served_layout:
            check_served_settings(self.settings)
        step = self.settings.prune_step
        if step and trainer.max_steps is not None and trainer.max_steps >= 0 and step >= trainer.max_steps:
            raise ValueError(f"prune.prune_step={step} is not allowed: the run stops at trainer.max_steps="
                             f"{trainer.max_steps}; use a step below it")
        if step and pl_module.recovery == "none":
            raise ValueError(f"prune.prune_step={step} is not allowed with model.recovery=none (nothing trains before "
                             "or after the cut); use prune_step: 0")
        if step and needs_fresh_engine(trainer.strategy):
            raise ValueError(f"prune.prune_step={step} is not allowed under DeepSpeed: the cut happens before "
                             "recovery; use prune_step: 0")
        if self.settings.reconstruct != "none" and needs_fresh_engine(trainer.strategy):
            raise ValueError(f"prune.reconstruct={self.settings.reconstruct} is not allowed under DeepSpeed: the cut "
                             "model is written from gathered weights without calibration activations; use "
                             "reconstruct: none, or DDP")
        if self.evaluator is not None:
            self.evaluator.setup(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if pl_module.pretrained_is_pruned:  # recovery continuing after the DeepSpeed hand-off
            self.pruned = True
            if pl_module.recovery == "none":
                trainer.should_stop = True  # prune-only: straight to evaluation and export
        elif not self.pruned and self.settings.prune_step == 0:
            # Before the first batch: a prune-only run then stops without entering the training loop.
            self.cut(trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if not self.pruned and trainer.global_step >= self.settings.prune_step:
            self.cut(trainer, pl_module)

    def state_dict(self) -> dict:
        return {"pruned": self.pruned}

    def load_state_dict(self, state_dict: dict) -> None:
        self.pruned = bool(state_dict.get("pruned", False))

    # --- the cut --------------------------------------------------------------------------------
    def cut(self, trainer: L.Trainer, pl_module) -> None:
        """Measure, calibrate, score, allocate and cut; then recovery (or the fresh-engine hand-off) follows."""
        with show_progress(trainer.is_global_zero and trainer.progress_bar_callback is not None):
            self._cut(trainer, pl_module)

    def _cut(self, trainer: L.Trainer, pl_module) -> None:
        s, record, dm = self.settings, pl_module.record, trainer.datamodule
        times = record.times_s
        base = pl_module.base_model
        fresh = needs_fresh_engine(trainer.strategy)
        sharded = zero_stage(trainer.strategy) == 3
        if fresh and not (s.plan or s.scores):  # with a saved plan or scores nothing is scored here
            self._check_deepspeed(trainer, base)
        twin = shape_twin(base) if sharded else base
        saved = None
        if s.plan:  # the saved plan must fit before any work; no budget, no scoring
            saved_plan = load_plan_checked(twin, s.plan)
        else:
            # Size checks (frozen layers, split feasibility, units available) before evaluation and calibration.
            budget = precheck(twin, s, self.uniform_shape, self.served_layout)
            if s.scores:
                saved = load_scores(s.scores)
                check_key(saved.key, scores_key(base, s, calibration_identity(dm, s)), s.scores,
                          parts=RUN_KEY_PARTS)
        self._measure("dense", trainer, pl_module, folder=pl_module.pretrained if pl_module.model_config is None
                      else None)

        t0 = time.perf_counter()
        batches = dm.calibration_batches(trainer.global_rank, trainer.world_size)
        scores = None
        if s.plan:
            plan, budget = adopt_plan(twin, saved_plan, s.plan)
            made = plan.meta["made_with"]
            log.info("no scoring pass: plan from %s (made with %s / %s, ratio %s; the plan wins over this run's ratio, "
                     "criterion and allocation); %s", s.plan, made.get("criterion", "?"), made.get("allocation", "?"),
                     made.get("ratio", "?"), _repair_reads(s, batches))
        else:
            if saved is not None:
                log.info("no scoring pass: unit scores from %s (%s, %d samples); %s", s.scores, saved.key["criterion"],
                         saved.samples, _repair_reads(s, batches))
            plan, scores = make_plan(base, batches, s, reduce_sum=strategy_sum(trainer, pl_module.device),
                                     sharded=sharded, budget=budget, saved=saved,
                                     uniform_shape=self.uniform_shape, served_layout=self.served_layout)
        times["calibration_and_allocation"] = time.perf_counter() - t0
        made = plan.meta
        record.calibration = CalibrationRecord(
            criterion=made.get("criterion", s.criterion), allocation=made.get("allocation", s.allocation),
            ratio=made.get("ratio", s.ratio), settings=s.as_dict(), samples=made.get("samples", 0),
            seq_len=dm.seq_len, source=dm.calibration.describe(), seed=dm.seed, prune_step=trainer.global_step,
            plan_source=s.plan, scores_source=s.scores, target=made.get("target"))
        record.plan = plan.meta
        if scores is not None:
            record.unit_scores = {k: [t.tolist() for t in v] for k, v in scores.items()}
        record.layer_importance = plan.meta.get("layer_importance")
        record.params_before = budget.total
        record.params_after = budget.total - plan.meta["params_removed"]
        record.prune_plan = {k: v for k, v in plan.to_dict().items() if k != "meta"}
        self._write_saved(trainer, base, plan, scores, saved, record)

        t0 = time.perf_counter()
        if fresh:
            out = Path(trainer.default_root_dir) / "pruned"
            pruned = gathered_pruned_copy(base, plan, keep=trainer.is_global_zero)
            if pruned is not None:
                export_pretrained(pruned, out, tokenizer=pl_module.load_tokenizer(),
                                  license_from=pl_module.pretrained)  # the licenses travel to the final export
                record.layers = [x.as_dict() for x in get_family(pruned).layer_shapes(pruned)]
            del pruned
            trainer.strategy.barrier("prunelight_pruned_model_written")
            times["surgery_and_write"] = time.perf_counter() - t0
            pl_module.handoff = {"pretrained": str(out), "plan": plan.to_dict()}
            trainer.should_stop = True  # checked before the first epoch: no step and no checkpoint of the dense model
        else:
            pl_module.snapshot_teacher()  # distillation's dense teacher: a frozen copy before the surgery
            if s.reconstruct != "none":  # the cut, layer by layer, with each layer's repair fitted before it
                record.reconstruction = pl_module.apply_plan_reconstructed(
                    plan, batches, s, reduce_sum=strategy_sum(trainer, pl_module.device))
                _log_reconstruction(trainer, record.reconstruction)
            else:
                pl_module.apply_plan(plan)
            times["surgery"] = time.perf_counter() - t0
            record.layers = [x.as_dict() for x in get_family(pl_module.base_model).layer_shapes(pl_module.base_model)]
            self._measure("pruned", trainer, pl_module)
            pl_module.start_recovery()
            _rebuild_training_state(trainer, pl_module)
            if pl_module.recovery == "none":
                trainer.should_stop = True  # nothing will step the optimizer: go straight to evaluation/export
        self.pruned = True
        self._report(trainer, record)
        if fresh:
            log.info("pruned model written to %s; recovery continues in a fresh %s", out,
                     type(trainer.strategy).__name__)

    def _out_dir(self, trainer: L.Trainer) -> Path:
        from prunelight.callbacks.export import FAST_DEV_RUN_DIR

        out = Path(self.out_dir or trainer.default_root_dir)
        return out / FAST_DEV_RUN_DIR if trainer.fast_dev_run else out  # a smoke test never overwrites a real run

    def _write_saved(self, trainer: L.Trainer, base, plan, scores, saved, record) -> None:
        """plan.json and scores.pt into the output folder (rank 0; the fingerprint is taken on every rank)."""
        s, dm = self.settings, trainer.datamodule
        key = None
        if scores is not None:
            key = saved.key if saved is not None else scores_key(base, s, calibration_identity(dm, s))
        if not trainer.is_global_zero:
            return
        out = self._out_dir(trainer)
        write_plan(out / PLAN_FILE, plan_document(plan, base, record.params_before, record.params_after, s,
                                                  source=s.plan))
        if scores is not None:
            save_scores(out / SCORES_FILE, scores, key, layer_importance=plan.meta.get("layer_importance"),
                        block_importance=plan.meta.get("block_importance"),
                        samples=plan.meta.get("samples"), split_search=plan.meta.get("split_search"),
                        pretrained=getattr(trainer.lightning_module, "pretrained", None),
                        copied_from=saved.source if saved is not None else None,
                        **({} if saved is None else {"made": saved.provenance}))
        log.info("plan written to %s%s", out / PLAN_FILE, f", scores to {out / SCORES_FILE}" if scores is not None
                 else "")

    def _measure(self, state: str, trainer: L.Trainer, pl_module, folder: str | None = None) -> None:
        if self.evaluator is not None:
            self.evaluator.measure(state, trainer, pl_module, folder=folder)

    def _check_deepspeed(self, trainer: L.Trainer, base) -> None:
        """What the DeepSpeed hand-off cannot do, refused before any work."""
        dm = trainer.datamodule
        if dm.num_samples % trainer.world_size:
            # ZeRO-3 gathers weights collectively in every forward: all ranks must run the same number of batches.
            raise ValueError(f"data.num_samples={dm.num_samples} must be a multiple of the number of processes "
                             f"({trainer.world_size}) under DeepSpeed")
        s = self.settings
        if build_criterion(s.criterion, **s.criterion_args).grad_params(base):
            # DeepSpeed reduces and frees weight gradients in its own hooks; scores must come from activations.
            raise ValueError(f"prune.criterion={s.criterion!r} is not allowed under DeepSpeed: it reads weight "
                             "gradients, which DeepSpeed partitions; use an activation-gradient criterion (taylor, "
                             "fisher, entropy) or a weight-only one (magnitude)")

    def _report(self, trainer: L.Trainer, record) -> None:
        """Print the cut summary and send its numbers to the Lightning loggers."""
        meta = record.plan
        if trainer.is_global_zero and record.layers is not None:
            log.info("%s", cut_summary(meta, record.layers, record.params_before, record.params_after, record.ppl,
                                       record.calibration.criterion, record.calibration.allocation))
        log_metrics(trainer, {
            "prune/params_before": record.params_before,
            "prune/params_after": record.params_after,
            "prune/removed_fraction": meta["removed_fraction_total"],
            "prune/budget_error_params": meta["budget_error_params"],
            "prune/groups_removed": meta["groups_removed"],
            "prune/channels_removed": meta["channels_removed"],
        })


def _repair_reads(settings: PruneSettings, batches) -> str:
    """What the cut still reads from the calibration batches (the repair only, forward)."""
    if settings.reconstruct == "none":
        return "no calibration batches are read"
    n = len(list(batches)[: settings.max_calibration_batches])
    return f"reconstruction ({settings.reconstruct}) reads {n} calibration batches, forward only"


def _log_reconstruction(trainer: L.Trainer, figures: dict) -> None:
    """One line for the cut summary: how much of the cut's output error the repair removed."""
    if trainer.is_global_zero and figures.get("rel_err_before_mean") is not None:
        log.info("reconstruction (%s, %s inputs): relative output error of the cut sub-blocks %.4f -> %.4f on "
                 "%d calibration tokens, %.1f s", figures["method"], figures["inputs"], figures["rel_err_before_mean"],
                 figures["rel_err_after_mean"], figures["tokens"], figures["time_s"])


def _rebuild_training_state(trainer: L.Trainer, pl_module) -> None:
    """After parameters changed: re-wrap for data parallel and rebuild optimizers and schedulers."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        # DDP caches the parameter list (and its reducer hooks the old tensors); wrap the cut module afresh.
        # The new wrapper broadcasts rank 0's parameters, so fresh LoRA weights agree across ranks.
        strategy.model = strategy._setup_model(strategy.precision_plugin.convert_module(pl_module))
    strategy.setup_optimizers(trainer)
