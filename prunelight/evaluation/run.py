"""The run's one evaluator: dense, pruned and recovered are measured with the same data and settings.

The PruningCallback measures "dense" (before the cut) and "pruned" (right after it); the
ExportCallback measures "recovered" at the end. Results go into the run record and to the Lightning
loggers (`ppl/<state>`, `zeroshot/<state>_acc`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from prunelight.console import log_metrics, progress
from prunelight.data import overlap_fraction
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.evaluation.suite import Evaluator, capture_hidden_states, hidden_similarity
from prunelight.settings import RunEvaluation

log = logging.getLogger(__name__)


class RunEvaluator:
    """Measures each model state of a run the same way: perplexity on `data.eval`, then the optional suite."""

    def __init__(self, settings: RunEvaluation | None = None) -> None:
        self.settings = settings or RunEvaluation()
        self.max_eval_batches = self.settings.max_eval_batches
        self._suite: Evaluator | None = None
        self._dense_hidden: list[torch.Tensor] | None = None
        self._ready = False

    def setup(self, trainer: Any, pl_module: Any) -> None:
        """Prepare once per fit (both callbacks call it): smoke tests read one batch; the suite's data is checked."""
        if self._ready:
            return
        self._ready = True
        if trainer.fast_dev_run:
            self.max_eval_batches = 1
        if self.settings.suite is not None and trainer.datamodule is not None:
            trainer.datamodule.setup("fit")  # its own overlap guard first, then the suite's
            self.suite(trainer, pl_module)

    def suite(self, trainer: Any, pl_module: Any) -> Evaluator | None:
        """The full-evaluation runner (rank 0 only; None when no suite is configured)."""
        if self.settings.suite is None or not trainer.is_global_zero:
            return None
        if self._suite is None:
            tok = pl_module.load_tokenizer()
            if tok is None:
                raise ValueError("the evaluation suite needs a tokenizer: model.pretrained must be a folder or hub id "
                                 "with one")
            self._suite = Evaluator(self.settings.suite, tok)
            if self.settings.suite.perplexity:
                self._check_suite_overlap(trainer, pl_module)
        return self._suite

    def measure(self, state: str, trainer: Any, pl_module: Any, folder: str | None = None) -> None:
        """Measure the module's current model as `state` (dense | pruned | recovered) into its record."""
        if state == "dense" and self.settings.dense_cache and trainer.is_global_zero and trainer.world_size == 1:
            if self._cached_dense(trainer, pl_module):
                return
            self._measure(state, trainer, pl_module, folder)
            self._store_dense(trainer, pl_module)
            return
        self._measure(state, trainer, pl_module, folder)

    def same_as(self, state: str, source: str, trainer: Any, pl_module: Any) -> None:
        """Record `state` as the measurement of `source` (the same weights: a prune-only run's final model)."""
        record = pl_module.record
        for table in (record.ppl, record.ppl_detail, record.evaluation):
            if source in table:
                table[state] = table[source]
        if state in record.ppl:
            log_metrics(trainer, {f"ppl/{state}": record.ppl[state]})
        zs = ((record.evaluation.get(state) or {}).get("zeroshot") or {}).get("average") or {}
        if zs.get("acc") is not None:
            log_metrics(trainer, {f"zeroshot/{state}_acc": zs["acc"]})

    def _measure(self, state: str, trainer: Any, pl_module: Any, folder: str | None = None) -> None:
        record = pl_module.record
        dm = trainer.datamodule
        if self.settings.data_eval and dm is not None:
            t0 = time.perf_counter()
            loader = dm.eval_dataloader()
            total = len(loader) if self.max_eval_batches is None else min(len(loader), self.max_eval_batches)
            res = evaluate_perplexity(pl_module.model, progress(loader, f"perplexity of the {state} model", total),
                                      self.max_eval_batches)
            record.times_s[f"eval_{state}"] = time.perf_counter() - t0
            record.ppl[state] = res["ppl"]
            record.ppl_detail[state] = res
            record.eval = {"source": dm.eval.describe(), "seq_len": dm.eval_seq_len, "tokens": res["tokens"],
                           **(dm.window_protocol() if hasattr(dm, "window_protocol") else {})}
            log_metrics(trainer, {f"ppl/{state}": res["ppl"]})
        ev = self.suite(trainer, pl_module)
        if ev is not None:
            t0 = time.perf_counter()
            res = ev.evaluate(pl_module.model, state, folder)
            record.evaluation[state] = res
            record.times_s[f"evaluation_{state}"] = time.perf_counter() - t0
            zs = (res.get("zeroshot") or {}).get("average") or {}
            first_ppl = (res.get("perplexity") or [{}])[0].get("ppl")
            log_metrics(trainer, {f"zeroshot/{state}_acc": zs.get("acc"), f"suite_ppl/{state}": first_ppl})
            self._similarity(state, trainer, pl_module)
        if self.settings.suite is not None and trainer.world_size > 1:
            trainer.strategy.barrier("prunelight-evaluation")  # other ranks wait while rank 0 evaluates

    # The dense cache (evaluation.dense_cache): one JSON file per key, the key stored inside and compared on read.
    def _dense_key(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        """What the dense results depend on: the model's files and loading options, the eval data, the settings."""
        from pathlib import Path

        hp = dict(getattr(pl_module, "hparams", {}) or {})
        path = Path(str(pl_module.pretrained)).expanduser()
        files = sorted([p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in path.iterdir()
                       if p.suffix in (".safetensors", ".bin", ".json")) if path.is_dir() else []
        dm = trainer.datamodule
        data = None if dm is None else {"source": dm.eval.describe() if dm.eval is not None else None,
                                        "seq_len": dm.eval_seq_len, "batch_size": dm.eval_batch_size,
                                        "max_eval_blocks": getattr(dm, "max_eval_blocks", None),
                                        "bos_per_window": getattr(dm, "bos_per_window", "auto")}
        suite = self.settings.suite.as_dict() if self.settings.suite is not None else None
        if path.is_file():  # a GGUF file
            files = [[path.name, path.stat().st_size, int(path.stat().st_mtime)]]
        key = {"model": str(path.resolve()) if path.exists() else str(pl_module.pretrained), "files": files,
               **{k: hp.get(k) for k in ("dtype", "attn_implementation", "trust_remote_code")},
               "data_eval": self.settings.data_eval, "max_eval_batches": self.max_eval_batches, "eval": data,
               "suite": suite}
        if hp.get("gguf_file"):  # only when set, so the keys of folder and hub models stay as they were
            key["gguf_file"] = hp["gguf_file"]
        return key

    def _dense_file(self, key: dict[str, Any]):
        import hashlib
        import json
        from pathlib import Path

        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return Path(self.settings.dense_cache) / f"dense-{digest}.json"

    def _cached_dense(self, trainer: Any, pl_module: Any) -> bool:
        """Fill the record's dense results from the cache when its stored key matches; False on a miss."""
        import json

        key = self._dense_key(trainer, pl_module)
        path = self._dense_file(key)
        record = pl_module.record
        try:
            cached = json.loads(path.read_text()) if path.is_file() else None
        except ValueError:
            cached = None
        hit = cached is not None and cached.get("key") == json.loads(json.dumps(key, default=str))
        record.evaluation["reuse"] = {"dense": {"hit": hit, "file": str(path)}}
        if not hit:
            return False
        res = cached["results"]
        for name in ("ppl", "ppl_detail", "evaluation"):
            if res.get(name) is not None:
                getattr(record, name)["dense"] = res[name]
        if res.get("eval") is not None:
            record.eval = res["eval"]
        log.info("dense evaluation reused from %s", path)
        log_metrics(trainer, {"ppl/dense": res.get("ppl"),
                              "zeroshot/dense_acc": ((res.get("evaluation") or {}).get("zeroshot") or {})
                              .get("average", {}).get("acc")})
        if self.settings.suite is not None:
            self._similarity("dense", trainer, pl_module)  # later states compare against these hidden states
        return True

    def _store_dense(self, trainer: Any, pl_module: Any) -> None:
        """Write the dense results just measured under their key (write-then-rename)."""
        from prunelight.atomic import atomic_write_json

        key = self._dense_key(trainer, pl_module)
        record = pl_module.record
        results = {"ppl": record.ppl.get("dense"), "ppl_detail": record.ppl_detail.get("dense"),
                   "evaluation": record.evaluation.get("dense"), "eval": record.eval}
        path = self._dense_file(key)
        atomic_write_json(path, {"key": key, "results": results})
        record.evaluation["reuse"] = {"dense": {"hit": False, "file": str(path)}}

    def _similarity(self, state: str, trainer: Any, pl_module: Any) -> None:
        """Hidden states of the dense model, and each later state's cosine similarity to them."""
        dm, n = trainer.datamodule, self.settings.suite.similarity_batches
        if dm is None or not n:
            return
        hidden = capture_hidden_states(pl_module.model, dm.calibration_batches()[:n])
        if state == "dense":
            self._dense_hidden = hidden
        elif self._dense_hidden:
            sims = pl_module.record.evaluation.setdefault("hidden_similarity", {})
            sims[state] = hidden_similarity(self._dense_hidden, hidden)

    def _check_suite_overlap(self, trainer: Any, pl_module: Any) -> None:
        """The suite's perplexity texts get the same calibration/training overlap guard as `data.eval`."""
        dm = trainer.datamodule
        if dm is None:
            return
        report_overlap = pl_module.record.overlap
        report_overlap.update({k: v for k, v in (getattr(dm, "overlap", {}) or {}).items() if k not in report_overlap})
        texts = {"calibration": dm.calibration, "train": dm.train}
        for name, src in self._suite.ppl_data().sources.items():
            eval_lines = src.lines()
            for role, other in texts.items():
                if other is None:
                    continue
                frac, n = overlap_fraction(other.lines(), eval_lines)
                if other.describe() == src.describe() or frac > 0.01:
                    report_overlap.setdefault("evaluation_sets", {})[f"{role}/{name}"] = {
                        "shared_lines": n, "fraction": frac}
                    report_overlap.update(flagged=True, allowed=dm.allow_overlap)
                    if not dm.allow_overlap:
                        raise ValueError(
                            f"{role} text {other.describe()} overlaps the perplexity set {name!r} ({src.describe()}): "
                            f"{n} shared lines ({100 * frac:.1f}%). Use a different split, or set "
                            "data.allow_overlap=true")
