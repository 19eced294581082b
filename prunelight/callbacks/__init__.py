"""Lightning callbacks: prune at a chosen step, then evaluate, export and report at the end."""

from prunelight.callbacks.export import ExportCallback
from prunelight.callbacks.pruning import PruningCallback

__all__ = ["ExportCallback", "PruningCallback"]
