"""ExportCallback: at the end of training, merge LoRA, measure recovered perplexity, export and report."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L

from prunelight.adapters import get_adapter
from prunelight.allocation import count_params
from prunelight.export import export_pretrained
from prunelight.perplexity import evaluate_perplexity
from prunelight.report import write_report

log = logging.getLogger(__name__)


class ExportCallback(L.Callback):
    """Writes `<out_dir>/model` (a Hugging Face folder) and `<out_dir>/report.{json,md}` from rank 0."""

    def __init__(self, out_dir: str = "runs/prunelight", export_model: bool = True, evaluate: bool = True,
                 max_eval_batches: int | None = None) -> None:
        super().__init__()
        self.out_dir = Path(out_dir)
        self.export_model, self.evaluate, self.max_eval_batches = export_model, evaluate, max_eval_batches

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if trainer.fast_dev_run:
            self.max_eval_batches = 1

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        pl_module.merge_adapters()
        report = pl_module.run_report
        times = report.setdefault("times_s", {})
        dm = trainer.datamodule
        if self.evaluate and dm is not None and pl_module.plan is not None:
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
        report["layers"] = [s.as_dict() for s in get_adapter(base).layer_shapes(base)]
        if dm is not None:
            report["eval"] = {"source": dm.eval.describe(), "seq_len": dm.eval_seq_len,
                              "tokens": report.get("ppl_detail", {}).get("recovered", {}).get("tokens")}
            report["overlap"] = dm.overlap
        if trainer.is_global_zero:
            if self.export_model:
                t0 = time.perf_counter()
                tok = pl_module.load_tokenizer()
                export_pretrained(pl_module.model, self.out_dir / "model", tokenizer=tok)
                times["export"] = time.perf_counter() - t0
                report["export_dir"] = str(self.out_dir / "model")
            write_report(report, self.out_dir)
            log.info("wrote %s", self.out_dir / "report.json")
