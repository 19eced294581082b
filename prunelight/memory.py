"""Free memory where tensors live: what the search's fitness folds and kept prefixes, and the model tuning, may take."""

from __future__ import annotations

import torch


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: the GPU's free memory, the host's available memory for CPU (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        import psutil  # a dependency of accelerate; only needed here

        return int(psutil.virtual_memory().available)
    return None
