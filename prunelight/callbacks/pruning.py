"""PruningCallback: calibrate, score, allocate and cut at a chosen step, then hand over to recovery."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L

from prunelight.allocation import check_allocation_options, count_params, precheck, validate_ratio
from prunelight.distributed import (
    gathered_pruned_copy,
    make_plan_sharded,
    needs_fresh_engine,
    strategy_sum,
    write_pruned_model,
    zero_stage,
)
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.importance import CRITERIA, build_criterion
from prunelight.pipeline import make_plan

log = logging.getLogger(__name__)


class PruningCallback(L.Callback):
    """Removes whole GQA groups and MLP channels once, at `prune_step`, so that `ratio` of the parameters is gone.

    Calibration runs the datamodule's calibration samples through the model with the criterion's
    hooks (each rank its share; statistics summed across ranks), the allocation turns scores into a
    plan, the module cuts itself, and the optimizer is rebuilt for recovery.
    """

    def __init__(
        self,
        ratio: float = 0.2,
        criterion: str = "taylor",
        criterion_args: dict | None = None,
        allocation: str = "global",
        prune_step: int = 0,
        min_groups: int = 1,
        min_channels: int = 1,
        max_calibration_batches: int | None = None,
        evaluate: bool = True,
        max_eval_batches: int | None = None,
        layer_importance: str = "block_influence",
        strategy: str = "inverse",
        alpha: float = 1.0,
        importance_scale: str = "minmax",
        freeze_top_n: int = 0,
        rate_range: list[float] | None = None,
        attn_mlp_split: str | None = None,
        align_channels: int = 1,
        block_importance: str = "units",
        fill_width: bool = True,
        split_step: float = 0.1,
        split_fine_step: float = 0.025,
        split_patience: int = 2,
        importance_batches: int | None = None,
        report_layer_importance: list[str] | None = None,
        plot_layer_importance: bool = True,
    ) -> None:
        """Allocation options (all in docs/methods.md).

        `layer_importance` (removal | activation_change | block_influence) feeds `layerwise` and `depth`;
        `strategy`, `alpha`, `importance_scale`, `freeze_top_n` and `rate_range` shape layerwise rates;
        `attn_mlp_split` is "x:y" or "auto" (searched on calibration text with the `split_*` settings);
        `align_channels` rounds kept MLP channels to a multiple; `block_importance` (units | removal) ranks
        sub-blocks for `blockwise`; `fill_width` lets blockwise/depth width-prune the remainder;
        `importance_batches` caps the batches for layer importance and the split search;
        `report_layer_importance` lists measures to record and plot (default: block_influence, activation_change).
        """
        super().__init__()
        validate_ratio(ratio)  # bad values fail before any model is loaded
        if criterion not in CRITERIA:
            raise ValueError(f"unknown importance criterion {criterion!r}; available: {', '.join(sorted(CRITERIA))}")
        rate_range = [0.0, 1.0] if rate_range is None else [float(r) for r in rate_range]
        report_li = (["block_influence", "activation_change"] if report_layer_importance is None
                     else list(report_layer_importance))
        check_allocation_options(allocation, strategy, alpha, freeze_top_n, rate_range, attn_mlp_split, align_channels,
                                 layer_importance, block_importance, split_step, split_fine_step, split_patience,
                                 importance_scale)
        for name in report_li:
            check_allocation_options(layer_importance=name)
        if importance_batches is not None and importance_batches < 1:
            raise ValueError(f"importance_batches must be >= 1 or null (all calibration batches), "
                             f"got {importance_batches}")
        self.allocation_args = {
            "layer_importance": layer_importance, "strategy": strategy, "alpha": alpha,
            "importance_scale": importance_scale, "freeze_top_n": freeze_top_n,
            "rate_range": rate_range, "attn_mlp_split": attn_mlp_split, "align_channels": align_channels,
            "block_importance": block_importance, "fill_width": fill_width, "split_step": split_step,
            "split_fine_step": split_fine_step, "split_patience": split_patience,
            "report_layer_importance": report_li,
        }
        self.importance_batches = importance_batches
        self.plot_layer_importance = plot_layer_importance
        if prune_step < 0:
            raise ValueError(f"prune_step must be >= 0, got {prune_step}")
        self.ratio, self.criterion, self.criterion_args = ratio, criterion, dict(criterion_args or {})
        self.allocation, self.prune_step = allocation, prune_step
        self.min_groups, self.min_channels = min_groups, min_channels
        self.max_calibration_batches = max_calibration_batches
        self.evaluate, self.max_eval_batches = evaluate, max_eval_batches
        self.pruned = False

    # --- Lightning hooks ------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if trainer.fast_dev_run:
            # One batch runs in a smoke test: cut at once, on one calibration batch, so surgery is exercised.
            self.prune_step, self.max_calibration_batches, self.max_eval_batches = 0, 1, 1
            self.importance_batches = 1

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if not self.pruned and needs_fresh_engine(trainer.strategy):
            self.prune_for_fresh_engine(trainer, pl_module)
        elif getattr(pl_module, "pretrained_is_pruned", False) and pl_module.recovery == "none":
            trainer.should_stop = True  # prune-only run continuing after the hand-off: straight to evaluation/export

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if not self.pruned and trainer.global_step >= self.prune_step:
            self.prune(trainer, pl_module)

    def state_dict(self) -> dict:
        return {"pruned": self.pruned}

    def load_state_dict(self, state_dict: dict) -> None:
        self.pruned = bool(state_dict.get("pruned", False))

    # --- the cut --------------------------------------------------------------------------------
    def _eval_ppl(self, trainer, pl_module) -> dict | None:
        dm = trainer.datamodule
        if not self.evaluate or dm is None:
            return None
        return evaluate_perplexity(pl_module.model, dm.eval_dataloader(), self.max_eval_batches)

    def prune(self, trainer: L.Trainer, pl_module) -> None:
        """Calibrate, score, allocate, cut, and rebuild the optimizer for recovery."""
        report = pl_module.run_report
        times = report.setdefault("times_s", {})
        dm = trainer.datamodule
        base = pl_module.base_model
        params_before = count_params(base)
        a = self.allocation_args
        # Size checks (frozen layers, split feasibility, rate range) before the dense evaluation and calibration.
        precheck(base, self.ratio, self.allocation, self.min_groups, self.min_channels, a["freeze_top_n"],
                 a["rate_range"], a["attn_mlp_split"])

        _notify(trainer, pl_module, "before_cut")  # e.g. ExportCallback evaluates the dense model here
        t0 = time.perf_counter()
        ppl_dense = self._eval_ppl(trainer, pl_module)
        times["eval_dense"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        batches = dm.calibration_batches(trainer.global_rank, trainer.world_size)
        plan, scores = self._plan(make_plan, trainer, pl_module, base, batches, importance_batches=self.importance_batches)
        times["calibration_and_allocation"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        pl_module.apply_plan(plan)
        times["surgery"] = time.perf_counter() - t0
        self.pruned = True

        t0 = time.perf_counter()
        ppl_pruned = self._eval_ppl(trainer, pl_module)
        times["eval_pruned"] = time.perf_counter() - t0

        _notify(trainer, pl_module, "after_cut")
        pl_module.start_recovery()
        _rebuild_training_state(trainer, pl_module)
        if pl_module.recovery == "none":
            # Nothing will step the optimizer, so global_step (and max_steps) would never advance: stop here.
            trainer.should_stop = True

        report["params_before"] = params_before
        report["params_after"] = count_params(pl_module.base_model)
        report["plan"] = plan.meta
        report["calibration"] = {
            "criterion": self.criterion,
            "allocation": self.allocation,
            "allocation_args": {k: v for k, v in self.allocation_args.items() if k != "report_layer_importance"},
            "ratio": self.ratio,
            "samples": plan.meta["samples"],
            "seq_len": getattr(dm, "seq_len", None),
            "source": dm.calibration.describe() if dm is not None else None,
            "seed": getattr(dm, "seed", None),
            "prune_step": trainer.global_step,
        }
        report.setdefault("ppl", {})
        report.setdefault("ppl_detail", {})
        for name, res in (("dense", ppl_dense), ("pruned", ppl_pruned)):
            if res is not None:
                report["ppl"][name] = res["ppl"]
                report["ppl_detail"][name] = res
        report["unit_scores"] = {k: [t.tolist() for t in v] for k, v in scores.items()}
        if plan.meta.get("layer_importance"):
            report["layer_importance"] = plan.meta["layer_importance"]
            if self.plot_layer_importance:
                self._plot(trainer, report)  # every rank: trainer.log_dir is a collective (broadcast)
        removed = plan.meta["params_removed"]
        log.info(
            "pruned %s params (%.1f%% of the model) with %s/%s; ppl dense %s -> pruned %s",
            f"{removed:,}",
            100 * plan.meta["removed_fraction_total"],
            self.criterion,
            self.allocation,
            ppl_dense and round(ppl_dense["ppl"], 2),
            ppl_pruned and round(ppl_pruned["ppl"], 2),
        )

    def _plan(self, planner, trainer: L.Trainer, pl_module, base, batches, **extra):
        """Score and allocate with this callback's settings; statistics are summed across ranks."""
        return planner(
            base,
            batches,
            self.ratio,
            criterion=self.criterion,
            criterion_args=self.criterion_args,
            allocation=self.allocation,
            allocation_args={"min_groups": self.min_groups, "min_channels": self.min_channels, **self.allocation_args},
            reduce_sum=strategy_sum(trainer, pl_module.device),
            max_batches=self.max_calibration_batches,
            **extra,
        )

    def _plot(self, trainer: L.Trainer, report: dict) -> None:
        """Per-layer importance PNG beside the report (the ExportCallback's out_dir, else the log dir)."""
        from prunelight.callbacks.export import ExportCallback
        from prunelight.evaluation.figures import plot_layer_importance

        out = next((cb.out_dir for cb in trainer.callbacks if isinstance(cb, ExportCallback)), None)
        out = out or trainer.log_dir or trainer.default_root_dir
        if trainer.is_global_zero:
            path = plot_layer_importance(report["layer_importance"], f"{out}/layer_importance.png")
            report["layer_importance_plot"] = str(path)

    def prune_for_fresh_engine(self, trainer: L.Trainer, pl_module) -> None:
        """DeepSpeed: score and plan inside the engine, write the cut model from rank 0, stop this fit.

        The engine's modules are not reshaped: the pruned model is gathered one module at a time,
        written to `<default_root_dir>/pruned`, and `PrunelightCLI` continues the recovery from it
        in a freshly set-up engine (same command, same YAML).
        """
        if self.prune_step != 0:
            raise ValueError(
                f"prune_step={self.prune_step}: under DeepSpeed the cut happens before recovery; set prune_step: 0"
            )
        dm = trainer.datamodule
        if dm.num_samples % trainer.world_size:
            # ZeRO-3 gathers weights collectively in every forward: all ranks must run the same number of batches.
            raise ValueError(
                f"data.num_samples={dm.num_samples} must be a multiple of the number of processes "
                f"({trainer.world_size}) under DeepSpeed"
            )
        report = pl_module.run_report
        times = report.setdefault("times_s", {})
        base = pl_module.base_model
        if build_criterion(self.criterion, **self.criterion_args).grad_params(base):
            # DeepSpeed reduces and frees weight gradients in its own hooks; scores must come from activations.
            raise ValueError(f"criterion {self.criterion!r} reads weight gradients, which DeepSpeed partitions; "
                             "use an activation-gradient criterion (taylor) or a weight-only one (magnitude)")
        t0 = time.perf_counter()
        ppl_dense = self._eval_ppl(trainer, pl_module)
        times["eval_dense"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # ZeRO-3 weights are partitioned: plan from gathered layers; ZeRO-1/2 keep them whole.
        planner = make_plan_sharded if zero_stage(trainer.strategy) == 3 else make_plan
        kwargs = {"importance_batches": self.importance_batches} if planner is make_plan else {}
        batches = dm.calibration_batches(trainer.global_rank, trainer.world_size)
        plan, scores = self._plan(planner, trainer, pl_module, base, batches, **kwargs)
        times["calibration_and_allocation"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        pruned = gathered_pruned_copy(base, plan, keep=trainer.is_global_zero)
        out = Path(trainer.default_root_dir) / "pruned"
        if trainer.is_global_zero:
            write_pruned_model(pruned, out, tokenizer=pl_module.load_tokenizer())
        del pruned
        trainer.strategy.barrier("prunelight_pruned_model_written")
        times["surgery_and_write"] = time.perf_counter() - t0
        self.pruned = True
        report["params_before"] = plan.meta["params_total"]
        report["params_after"] = plan.meta["params_total"] - plan.meta["params_removed"]
        report["plan"] = plan.meta
        report["calibration"] = {
            "criterion": self.criterion, "allocation": self.allocation, "ratio": self.ratio,
            "samples": plan.meta["samples"], "seq_len": getattr(dm, "seq_len", None),
            "source": dm.calibration.describe(), "seed": getattr(dm, "seed", None), "prune_step": 0,
        }
        if ppl_dense is not None:
            report.setdefault("ppl", {})["dense"] = ppl_dense["ppl"]
            report.setdefault("ppl_detail", {})["dense"] = ppl_dense
        report["unit_scores"] = {k: [t.tolist() for t in v] for k, v in scores.items()}
        pl_module.handoff = {"pretrained": str(out), "plan": plan.to_dict()}
        trainer.should_stop = True  # checked before the first epoch: no step and no checkpoint of the dense model
        log.info("pruned model written to %s; recovery continues in a fresh %s", out, type(trainer.strategy).__name__)


def _notify(trainer: L.Trainer, pl_module, hook: str) -> None:
    """Call `hook(trainer, pl_module)` on every callback that defines it (before_cut / after_cut)."""
    for cb in trainer.callbacks:
        fn = getattr(cb, hook, None)
        if callable(fn):
            fn(trainer, pl_module)


def _rebuild_training_state(trainer: L.Trainer, pl_module) -> None:
    """After parameters changed: re-wrap for data parallel and rebuild optimizers and schedulers."""
    strategy = trainer.strategy
    from lightning.pytorch.strategies import DDPStrategy

    if needs_fresh_engine(strategy):  # pragma: no cover - prune_for_fresh_engine runs first
        raise RuntimeError(f"{type(strategy).__name__} cannot be re-wrapped in place; the cut must restart the engine")
    if isinstance(strategy, DDPStrategy):
        # DDP caches the parameter list (and its reducer hooks the old tensors); wrap the cut module afresh.
        # The new wrapper broadcasts rank 0's parameters, so fresh LoRA weights agree across ranks.
        strategy.model = strategy._setup_model(strategy.precision_plugin.convert_module(pl_module))
    strategy.setup_optimizers(trainer)
