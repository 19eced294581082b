"""Lightning callbacks of the pruning job: prune at a chosen step, then evaluate, export and report at the end."""

from prunelight.callbacks.export import ExportCallback, job_callbacks
from prunelight.callbacks.pruning import PruningCallback

__all__ = ["ExportCallback", "PruningCallback", "job_callbacks"]
