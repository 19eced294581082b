"""PruningCallback: calibrate, score, allocate and cut at a chosen step, then hand over to recovery."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from prunelight.allocation import Shape
from prunelight.console import cut_summary, log_metrics, show_progress
from prunelight.cut import prepare_cut, record_cut, run_cut, write_saved
from prunelight.distributed import needs_fresh_engine, strategy_sum, zero_stage
from prunelight.evaluation.run import RunEvaluator
from prunelight.export import export_pretrained
from prunelight.families import get_family
from prunelight.layer_tuning import tuning_line
from prunelight.model_tuning import model_tuning_line
from prunelight.paths import FAST_DEV_RUN_DIR
from prunelight.run_plan import RunFacts, RunPlan, prepare_run
from prunelight.saved import calibration_identity, scores_key
from prunelight.settings import ExportSettings, PruneSettings
from prunelight.zero3 import gathered_pruned_copy, shape_twin

log = logging.getLogger(__name__)


class PruningCallback(L.Callback):
    """Removes whole GQA groups and MLP channels once, at `settings.prune_step`, so `settings.ratio` of the parameters is gone.

    Lightning glue around `prunelight.cut.run_cut`, for one process, DDP and DeepSpeed alike: measure the
    dense model, score the units on this rank's share of the calibration samples (statistics summed across
    ranks), allocate, then either cut the module in place and rebuild the optimizer, or, under DeepSpeed
    (whose engine cannot be reshaped), write the cut model from rank 0 and stop so the CLI continues the
    recovery from it in a fresh engine.
    """

    def __init__(self, settings: PruneSettings | None = None, evaluator: RunEvaluator | None = None,
                 export: ExportSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or PruneSettings()
        self.evaluator = evaluator
        # export.format constrains the cut's layer shapes, export.gguf its widths; plan.json and scores.pt go to
        # export.out_dir (without export settings: the trainer's default_root_dir, any layer shape)
        self.export = export
        self.shape = export.shape if export is not None else Shape.FREE
        self.out_dir = export.out_dir if export is not None else None
        # The run plan: the CLI's before_fit hands it over; a Trainer built in Python gets it in `setup`.
        self.run_plan: RunPlan | None = None

    # --- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.run_plan is None:  # a Trainer built in Python: the plan from the module's config, still weightless
            self.run_plan = prepare_run(self.settings, self.shape, pl_module.check_pretrained(),
                                        run_facts(trainer, pl_module, self.export))
        if trainer.fast_dev_run:
            # One batch runs in a smoke test: cut at once, on one calibration batch, so surgery is exercised.
            self.run_plan = self.run_plan.with_settings(prune_step=0, max_calibration_batches=1, importance_batches=1)
        self.settings = self.run_plan.settings
        if self.evaluator is not None:
            self.evaluator.setup(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if pl_module.cut_state.pretrained_is_cut:  # recovery continuing after the DeepSpeed hand-off
            if pl_module.recovery == "none":
                trainer.should_stop = True  # prune-only: straight to evaluation and export
        elif not pl_module.cut_state.done and self.settings.prune_step == 0:
            # Before the first batch: a prune-only run then stops without entering the training loop.
            self.cut(trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if not pl_module.cut_state.done and trainer.global_step >= self.settings.prune_step:
            self.cut(trainer, pl_module)

    # --- the cut --------------------------------------------------------------------------------
    def cut(self, trainer: L.Trainer, pl_module) -> None:
        """Measure, calibrate, score, allocate and cut; then recovery (or the fresh-engine hand-off) follows."""
        with show_progress(trainer.is_global_zero and trainer.progress_bar_callback is not None):
            self._cut(trainer, pl_module)

    def _cut(self, trainer: L.Trainer, pl_module) -> None:
        s, record, dm = self.settings, pl_module.record, trainer.datamodule
        base = pl_module.base_model
        fresh = needs_fresh_engine(trainer.strategy)
        sharded = zero_stage(trainer.strategy) == 3
        twin = shape_twin(base) if sharded else base
        # The saved plan or scores (their weights fingerprint), before evaluation and calibration.
        source = prepare_cut(base, self.run_plan, calibration=calibration_identity(dm, s), twin=twin)
        self._measure("dense", trainer, pl_module, folder=pl_module.pretrained if pl_module.model_config is None
                      else None)
        # The scores key of the dense weights, taken on every rank (the weights fingerprint may gather); rank 0 writes.
        key = None
        if not s.plan:
            key = source.saved.key if source.saved is not None else scores_key(base, s, calibration_identity(dm, s))
        batches = dm.calibration_batches(trainer.global_rank, trainer.world_size)
        reduce_sum = strategy_sum(trainer, pl_module.device)
        result = run_cut(base, batches, self.run_plan, source=source, reduce_sum=reduce_sum, sharded=sharded,
                         twin=twin, surgery=not fresh, before_surgery=pl_module.snapshot_teacher,
                         state_dir=self._out_dir(trainer))
        record_cut(record, result, s, prune_step=trainer.global_step, seq_len=dm.seq_len,
                   source=dm.calibration.describe(), seed=dm.seed)
        if trainer.is_global_zero:
            write_saved(self._out_dir(trainer), result, base, s, key,
                        pretrained=getattr(trainer.lightning_module, "pretrained", None))
        if fresh:
            out = Path(trainer.default_root_dir) / "pruned"
            self._hand_off(trainer, pl_module, result.plan, out)
        else:
            pl_module.cut_state.mark_cut(result.plan, reconstructed=result.reconstruction is not None)
            if result.reconstruction is not None:
                _log_reconstruction(trainer, result.reconstruction)
            record.layers = [x.as_dict() for x in get_family(base).layer_shapes(base)]
            self._measure("pruned", trainer, pl_module)
            pl_module.start_recovery()
            _rebuild_training_state(trainer, pl_module)
            if pl_module.recovery == "none":
                trainer.should_stop = True  # nothing will step the optimizer: go straight to evaluation/export
        self._report(trainer, record)
        if fresh:
            log.info("pruned model written to %s; recovery continues in a fresh %s", out,
                     type(trainer.strategy).__name__)

    def _hand_off(self, trainer: L.Trainer, pl_module, plan, out: Path) -> None:
        """DeepSpeed: write the cut model from gathered weights on rank 0 and stop; the CLI continues from it."""
        record = pl_module.record
        t0 = time.perf_counter()
        pruned = gathered_pruned_copy(pl_module.base_model, plan, keep=trainer.is_global_zero)
        if pruned is not None:
            export_pretrained(pruned, out, tokenizer=pl_module.load_tokenizer(),
                              license_from=pl_module.pretrained)  # the licenses travel to the final export
            record.layers = [x.as_dict() for x in get_family(pruned).layer_shapes(pruned)]
        del pruned
        trainer.strategy.barrier("prunelight_pruned_model_written")
        record.times_s["surgery_and_write"] = time.perf_counter() - t0
        pl_module.cut_state.hand_off(plan, str(out))
        trainer.should_stop = True  # checked before the first epoch: no step and no checkpoint of the dense model

    def _out_dir(self, trainer: L.Trainer) -> Path:
        out = Path(self.out_dir or trainer.default_root_dir)
        return out / FAST_DEV_RUN_DIR if trainer.fast_dev_run else out  # a smoke test never overwrites a real run

    def _measure(self, state: str, trainer: L.Trainer, pl_module, folder: str | None = None) -> None:
        if self.evaluator is not None:
            self.evaluator.measure(state, trainer, pl_module, folder=folder)

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
            **_tuning_metrics(record.reconstruction),
        })


def _tuning_metrics(figures: dict | None) -> dict[str, float]:
    """The layer and model tunings' held-out errors for the Lightning loggers (none for a tuning that did not run)."""
    out = {}
    tuning = (figures or {}).get("tuning") or {}
    if tuning.get("mean_held_out_error_after") is not None:
        out.update({"prune/tuning_held_out_error_before": tuning["mean_held_out_error_before"],
                    "prune/tuning_held_out_error_after": tuning["mean_held_out_error_after"]})
    model = (figures or {}).get("model_tuning") or {}
    if model.get("held_out_kl_after") is not None:
        out.update({"prune/model_tuning_held_out_kl_before": model["held_out_kl_before"],
                    "prune/model_tuning_held_out_kl_after": model["held_out_kl_after"]})
    return out


def _log_reconstruction(trainer: L.Trainer, figures: dict) -> None:
    """One line for the cut summary: how much of the cut's output error the repair removed."""
    if trainer.is_global_zero and figures.get("rel_err_before_mean") is not None:
        ridge = f", ridge {figures['ridge']:.4g}" if "ridge" in figures else ""
        log.info("reconstruction (%s, %s inputs%s): relative output error of the cut sub-blocks %.4f -> %.4f on "
                 "%d calibration tokens, %.1f s", figures["method"], figures["inputs"], ridge,
                 figures["rel_err_before_mean"], figures["rel_err_after_mean"], figures["tokens"], figures["time_s"])
    if trainer.is_global_zero and figures.get("tuning"):
        log.info("%s", tuning_line(figures["tuning"]))
    if trainer.is_global_zero and figures.get("model_tuning"):
        log.info("%s", model_tuning_line(figures["model_tuning"]))


def _rebuild_training_state(trainer: L.Trainer, pl_module) -> None:
    """After parameters changed: re-wrap for data parallel and rebuild optimizers and schedulers."""
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        # DDP caches the parameter list (and its reducer hooks the old tensors); wrap the cut module afresh with
        # the strategy's public configure_ddp. The new wrapper broadcasts rank 0's parameters, so fresh LoRA
        # weights agree across ranks.
        strategy.model = strategy.precision_plugin.convert_module(pl_module)
        strategy.configure_ddp()
    strategy.setup_optimizers(trainer)


def run_facts(trainer: L.Trainer, pl_module, export: ExportSettings | None = None) -> RunFacts:
    """What the run plan needs to know about this trainer, module, data and export (configs only, no weights)."""
    dm = trainer.datamodule
    teacher = getattr(pl_module, "teacher_config", None)
    return RunFacts(recovery=getattr(pl_module, "recovery", None), max_steps=trainer.max_steps,
                    deepspeed=needs_fresh_engine(trainer.strategy), zero_stage=zero_stage(trainer.strategy),
                    world_size=trainer.world_size, num_samples=getattr(dm, "num_samples", None),
                    distillation=getattr(pl_module, "distillation", None),
                    teacher_config=teacher() if callable(teacher) else None,
                    gguf=export.gguf if export is not None else None,
                    export_format=export.format if export is not None else None)
