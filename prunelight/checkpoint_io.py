"""Checkpoint writing that never leaves a half-written file where a good checkpoint was."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from prunelight.atomic import atomic_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves to a temporary file beside the target, fsyncs, then renames over it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        with atomic_file(path, "wb") as f:
            torch.save(checkpoint, f)
