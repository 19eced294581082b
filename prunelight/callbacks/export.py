"""ExportCallback: evaluate dense / pruned / recovered the same way, export the model, write the report."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L

from prunelight.families import get_family
from prunelight.allocation import count_params
from prunelight.data import overlap_fraction
from prunelight.distributed import gathered_merged_copy, zero_stage
from prunelight.evaluation.figures import write_figures
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.evaluation.suite import EvaluationSettings, Evaluator, capture_hidden_states, hidden_similarity
from prunelight.export import export_pretrained
from prunelight.report import write_report

log = logging.getLogger(__name__)


class ExportCallback(L.Callback):
    """Writes `<out_dir>/model` (a Hugging Face folder), `<out_dir>/report.{json,md}` and figures from rank 0.

    With `evaluation` set, the full evaluation (perplexity suite, zero-shot, efficiency) runs on the
    dense model just before the cut, on the pruned model just after it (PruningCallback calls
    `before_cut`/`after_cut`), and on the recovered model at the end; always on one process.
    """

    def __init__(self, out_dir: str = "runs/prunelight", export_model: bool = True, evaluate: bool = True,
                 max_eval_batches: int | None = None, evaluation: EvaluationSettings | None = None,
                 figures: bool = True) -> None:
        super().__init__()
        self.out_dir = Path(out_dir)
        self.export_model, self.evaluate, self.max_eval_batches = export_model, evaluate, max_eval_batches
        self.evaluation, self.figures = evaluation, figures
        self._evaluator: Evaluator | None = None
        self._dense_hidden = None

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if trainer.fast_dev_run:
            self.max_eval_batches = 1
        if stage == "fit" and self.evaluation is not None and trainer.datamodule is not None:
            trainer.datamodule.setup(stage)  # its own overlap guard first, then the suite's (fail before any work)
            self._suite(trainer, pl_module)

    # --- the full evaluation --------------------------------------------------------------------
    def _suite(self, trainer, pl_module) -> Evaluator | None:
        if self.evaluation is None or not trainer.is_global_zero:
            return None
        if self._evaluator is None:
            tok = pl_module.load_tokenizer()
            if tok is None:
                raise ValueError("the evaluation needs a tokenizer: model.pretrained must be a folder or hub id with one")
            self._evaluator = Evaluator(self.evaluation, tok)
            if self.evaluation.perplexity:
                self._check_suite_overlap(trainer, pl_module)
        return self._evaluator

    def _check_suite_overlap(self, trainer, pl_module) -> None:
        """The perplexity suite's texts get the same calibration/training overlap guard as data.eval."""
        dm = trainer.datamodule
        if dm is None:
            return
        data = self._evaluator.ppl_data()
        report_overlap = pl_module.run_report.setdefault("overlap", dict(getattr(dm, "overlap", {}) or {}))
        texts = {"calibration": dm.calibration, "train": dm.train}
        for name, src in data.sources.items():
            eval_lines = src.lines()
            for role, other in texts.items():
                if other is None:
                    continue
                frac, n = overlap_fraction(other.lines(), eval_lines)
                same = other.describe() == src.describe()
                if same or frac > 0.01:
                    report_overlap.setdefault("evaluation_sets", {})[f"{role}/{name}"] = {"shared_lines": n, "fraction": frac}
                    report_overlap.update(flagged=True, allowed=dm.allow_overlap)
                    if not dm.allow_overlap:
                        raise ValueError(
                            f"{role} text {other.describe()} overlaps the perplexity set {name!r} ({src.describe()}): "
                            f"{n} shared lines ({100 * frac:.1f}%). Use a different split, or set data.allow_overlap=true")

    def _run_suite(self, trainer, pl_module, name: str, folder=None, barrier: bool = True) -> None:
        ev = self._suite(trainer, pl_module)
        if ev is not None:
            t0 = time.perf_counter()
            res = ev.evaluate(pl_module.model, name, folder)
            pl_module.run_report.setdefault("evaluation", {})[name] = res
            pl_module.run_report.setdefault("times_s", {})[f"evaluation_{name}"] = time.perf_counter() - t0
        if barrier and self.evaluation is not None and trainer.world_size > 1:
            trainer.strategy.barrier("prunelight-evaluation")  # other ranks wait while rank 0 evaluates

    def _similarity_batches(self, trainer):
        dm = trainer.datamodule
        if dm is None or not self.evaluation.similarity_batches:
            return []
        return dm.calibration_batches()[: self.evaluation.similarity_batches]

    def before_cut(self, trainer: L.Trainer, pl_module) -> None:
        """Called by PruningCallback while the model is still dense."""
        self._run_suite(trainer, pl_module, "dense", folder=pl_module.pretrained if pl_module.model_config is None else None)
        if self._suite(trainer, pl_module) is not None:
            self._dense_hidden = capture_hidden_states(pl_module.model, self._similarity_batches(trainer))

    def after_cut(self, trainer: L.Trainer, pl_module) -> None:
        """Called by PruningCallback right after surgery, before recovery starts."""
        self._run_suite(trainer, pl_module, "pruned")
        self._record_similarity(trainer, pl_module, "pruned")

    def _record_similarity(self, trainer, pl_module, name: str) -> None:
        if self._dense_hidden:
            other = capture_hidden_states(pl_module.model, self._similarity_batches(trainer))
            sims = pl_module.run_report.setdefault("evaluation", {}).setdefault("hidden_similarity", {})
            sims[name] = hidden_similarity(self._dense_hidden, other)

    # --- end of training ------------------------------------------------------------------------
    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if zero_stage(trainer.strategy) == 3:
            # merging in place would write into partitioned placeholders: gather a merged CPU copy on rank 0
            lora = pl_module.lora if pl_module.lora_active else None
            merged = gathered_merged_copy(pl_module.model, lora, keep=trainer.is_global_zero)
            pl_module.lora_active = False
            if merged is not None:
                pl_module.model = merged
        else:
            pl_module.merge_lora()
        report = pl_module.run_report
        times = report.setdefault("times_s", {})
        dm = trainer.datamodule
        sharded = zero_stage(trainer.strategy) == 3
        if sharded and (self.evaluate or self.evaluation is not None):
            # the merged copy lives on rank 0's CPU (a 70B model fits no single GPU): evaluate the export instead
            log.warning("ZeRO-3: no in-run evaluation of the recovered model; run `prunelight evaluate --run %s`",
                        self.out_dir)
            report.setdefault("notes", []).append("ZeRO-3 run: recovered model not evaluated in-run")
        if self.evaluate and dm is not None and pl_module.plan is not None and not sharded:
            t0 = time.perf_counter()
            res = evaluate_perplexity(pl_module.model, dm.eval_dataloader(), self.max_eval_batches)
            times["eval_recovered"] = time.perf_counter() - t0
            report.setdefault("ppl", {})["recovered"] = res["ppl"]
            report.setdefault("ppl_detail", {})["recovered"] = res
        report["model"] = pl_module.pretrained if pl_module.model_config is None else "config"
        report["recovery"] = {"mode": pl_module.recovery, "steps": trainer.global_step,
                              "lora": pl_module.lora.as_dict() if pl_module.recovery == "lora" else None}
        report["params_after"] = count_params(pl_module.base_model)
        base = pl_module.base_model
        report["layers"] = [s.as_dict() for s in get_family(base).layer_shapes(base)]
        if pl_module.plan is not None:
            report["prune_plan"] = {k: v for k, v in pl_module.plan.to_dict().items() if k != "meta"}
        if dm is not None:
            report["eval"] = {"source": dm.eval.describe(), "seq_len": dm.eval_seq_len,
                              "tokens": report.get("ppl_detail", {}).get("recovered", {}).get("tokens")}
            report["overlap"] = {**dm.overlap, **report.get("overlap", {})}
        if self.evaluation is not None:
            report["evaluation_settings"] = self.evaluation.as_dict()
        if trainer.is_global_zero:
            if self.export_model:
                t0 = time.perf_counter()
                tok = pl_module.load_tokenizer()
                export_pretrained(pl_module.model, self.out_dir / "model", tokenizer=tok)
                times["export"] = time.perf_counter() - t0
                report["export_dir"] = str(self.out_dir / "model")
            if sharded:
                pass
            elif pl_module.plan is not None:
                self._run_suite(trainer, pl_module, "recovered", folder=report.get("export_dir"), barrier=False)
                self._record_similarity(trainer, pl_module, "recovered")
            elif "dense" not in report.get("evaluation", {}):  # nothing was cut: the model is still dense
                self._run_suite(trainer, pl_module, "dense", folder=report.get("export_dir"), barrier=False)
            if self.figures:
                report["figures"] = write_figures(report, pl_module.plan, self.out_dir)
            write_report(report, self.out_dir)
            log.info("wrote %s", self.out_dir / "report.json")
        if trainer.world_size > 1:
            trainer.strategy.barrier("prunelight-export")  # no rank leaves fit before the export is on disk
