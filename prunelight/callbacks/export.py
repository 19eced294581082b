"""ExportCallback: at the end of fit, merge LoRA, measure the recovered model, export it and write the report."""

from __future__ import annotations

import logging
import shlex
import sys
import time
from pathlib import Path

import lightning as L

from prunelight.allocation import count_params
from prunelight.atomic import atomic_write_text
from prunelight.console import progress
from prunelight.distributed import zero_stage
from prunelight.evaluation.figures import write_figures
from prunelight.evaluation.run import RunEvaluator
from prunelight.export import engines_verified, export_config, export_pretrained, format_of
from prunelight.families import get_family, unwrap
from prunelight.gguf_export import gguf_engines, gguf_file_name, gguf_layout, write_gguf
from prunelight.model_card import model_card
from prunelight.paths import FAST_DEV_RUN_DIR
from prunelight.record import RecoveryRecord
from prunelight.report import write_report
from prunelight.settings import ExportSettings
from prunelight.zero3 import gathered_merged_copy

log = logging.getLogger(__name__)



class ExportCallback(L.Callback):
    """Writes `<out_dir>/model` (a Hugging Face folder), `<out_dir>/report.{json,md}` and figures from rank 0.

    The recovered model is measured by the run's evaluator, the same way the PruningCallback measured
    the dense and pruned ones.
    """

    def __init__(self, settings: ExportSettings | None = None, evaluator: RunEvaluator | None = None) -> None:
        super().__init__()
        self.settings = settings or ExportSettings()
        self.evaluator = evaluator
        self.out_dir = Path(self.settings.out_dir)

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if trainer.fast_dev_run:
            self.out_dir = Path(self.settings.out_dir) / FAST_DEV_RUN_DIR
        if stage == "fit" and self.evaluator is not None:
            self.evaluator.setup(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if pl_module.cut_state.handoff is not None:
            return  # the cut model was written for a fresh engine: that run recovers, measures and exports it
        sharded = zero_stage(trainer.strategy) == 3
        final = self._merge(trainer, pl_module, sharded)  # the model to export (None on ranks > 0 under ZeRO-3)
        record = pl_module.record
        record.model = pl_module.pretrained if pl_module.model_config is None else "config"
        record.recovery = RecoveryRecord(mode=pl_module.recovery, steps=trainer.global_step,
                                         lora=pl_module.lora.as_dict() if pl_module.recovery == "lora" else None,
                                         distillation=pl_module.distillation_record())
        base = pl_module.base_model
        if not sharded:
            record.params_after = count_params(base)
            record.layers = [s.as_dict() for s in get_family(base).layer_shapes(base)]
        if trainer.datamodule is not None:
            record.overlap = {**trainer.datamodule.overlap, **record.overlap}
        if self.evaluator is not None and self.evaluator.settings.suite is not None:
            record.evaluation_settings = self.evaluator.settings.suite.as_dict()
        config = None  # the exported folder's config (rank 0, when the model is exported)
        if trainer.is_global_zero:
            if self.settings.model:
                # made once: the export, its format fields and both model cards read it (its layout note said once)
                config = export_config(final, self.settings.format)
                record.export_format, record.engines_verified = format_of(config), engines_verified(config)
                t0 = time.perf_counter()
                with progress(None, "export", total=1, unit="folder") as bar:
                    export_pretrained(final, self.out_dir / "model", tokenizer=pl_module.load_tokenizer(),
                                      format=self.settings.format, card=self._card(record, config),
                                      license_from=pl_module.pretrained if pl_module.model_config is None else None,
                                      config=config)
                    bar.update(1)
                record.times_s["export"] = time.perf_counter() - t0
                record.export_dir = str(self.out_dir / "model")
            if self.settings.gguf is not None:
                self._write_gguf(final, pl_module, record)
        self._measure_final(trainer, pl_module, sharded)
        if trainer.is_global_zero and record.export_dir:  # the card again, now with the recovered perplexity
            atomic_write_text(Path(record.export_dir) / "README.md", self._card(record, config))
        if trainer.is_global_zero:
            report = record.to_dict()
            if self.settings.figures:
                record.figures = report["figures"] = write_figures(report, pl_module.plan, self.out_dir)
            write_report(report, self.out_dir)
            self._print_end(record)
        if trainer.world_size > 1:
            trainer.strategy.barrier("prunelight-export")  # no rank leaves fit before the export is on disk

    def _write_gguf(self, model, pl_module, record) -> None:
        """`export.gguf`: the model as one GGUF file beside the folder (tokenizer keys from a GGUF source)."""
        t0 = time.perf_counter()
        source = pl_module.source() if pl_module.model_config is None else None
        gguf_path = source.gguf_path if source is not None and source.is_gguf else None
        path = self.out_dir / gguf_file_name(self.settings.gguf.dtype)
        with progress(None, "export GGUF", total=1, unit="file") as bar:
            write_gguf(model, path, self.settings.gguf.dtype, tokenizer=pl_module.load_tokenizer(),
                       source_gguf=gguf_path, name=Path(pl_module.pretrained).stem)
            bar.update(1)
        record.times_s["export_gguf"] = time.perf_counter() - t0
        record.export_gguf = str(path)
        base = unwrap(model)
        arch = gguf_layout(base, get_family(base).layer_shapes(base)).arch
        record.engines_verified = [*(record.engines_verified or []), gguf_engines(arch)]

    def _card(self, record, config) -> str:
        """The model card of the exported folder from the record so far (see prunelight.model_card); `config` is
        what config.json states (its fallback family)."""
        return model_card(record.to_dict(), config=config, command=_command_line())

    def _merge(self, trainer: L.Trainer, pl_module, sharded: bool):
        """The model to export, LoRA folded in: the module's own, or under ZeRO-3 a gathered CPU copy on rank 0.

        The module keeps its (partitioned) model: the copy is the callback's, for export only.
        """
        if not sharded:
            pl_module.merge_lora()
            return pl_module.model
        # merging in place would write into partitioned placeholders
        lora = pl_module.lora if pl_module.lora_active else None
        return gathered_merged_copy(pl_module.model, lora, keep=trainer.is_global_zero)

    def _measure_final(self, trainer: L.Trainer, pl_module, sharded: bool) -> None:
        """Measure the recovered model (or the dense one when nothing was cut)."""
        record = pl_module.record
        if self.evaluator is None:
            return
        if sharded:
            # the merged copy lives on rank 0's CPU (a 70B model fits no single GPU): evaluate the export instead
            log.warning("ZeRO-3: no in-run evaluation of the recovered model; run `prunelight evaluate --run %s`",
                        self.out_dir)
            record.notes.append("ZeRO-3 run: recovered model not evaluated in-run")
            return
        measured = "pruned" in record.ppl or "pruned" in record.evaluation  # not after a DeepSpeed hand-off
        if pl_module.plan is not None and pl_module.recovery == "none" and trainer.global_step == 0 and measured:
            # nothing stepped after the cut: the final model is the pruned one, already measured
            self.evaluator.same_as("recovered", "pruned", trainer, pl_module)
            record.notes.append("recovery: none; the final model is the pruned model (measured once)")
        elif pl_module.plan is not None:
            self.evaluator.measure("recovered", trainer, pl_module, folder=record.export_dir)
        elif "dense" not in record.ppl:
            self.evaluator.measure("dense", trainer, pl_module, folder=record.export_dir)

    def _print_end(self, record) -> None:
        ppl = record.ppl
        if ppl:
            log.info("perplexity: %s", ", ".join(f"{k} {v:,.2f}" for k, v in ppl.items()))
        if record.export_dir:
            log.info("model written to %s", record.export_dir)
        log.info("report written to %s", self.out_dir / "report.md")


def _command_line() -> str | None:
    """The `prunelight ...` command that started this process, for the model card (None from other programs)."""
    prog = Path(sys.argv[0]) if sys.argv else Path()
    ours = prog.name.startswith("prunelight") or prog.parent.name == "prunelight"  # console script or python -m
    return shlex.join(["prunelight", *sys.argv[1:]]) if ours else None


__all__ = ["ExportCallback"]
