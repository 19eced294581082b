"""Lightning callbacks of the pruning job: prune at a chosen step, then evaluate, export and report at the end."""

from __future__ import annotations

import lightning as L

from prunelight.callbacks.export import ExportCallback
from prunelight.callbacks.pruning import PruningCallback
from prunelight.evaluation.run import RunEvaluator
from prunelight.settings import ExportSettings

__all__ = ["ExportCallback", "PruningCallback", "job_callbacks"]


def job_callbacks(prune=None, export: ExportSettings | None = None, evaluation=None) -> list[L.Callback]:
    """The pruning job's two callbacks sharing one evaluator (what `prunelight fit` adds to the Trainer)."""
    evaluator = RunEvaluator(evaluation)
    export = export or ExportSettings()
    return [PruningCallback(prune, evaluator, export=export),
            ExportCallback(export, evaluator)]
