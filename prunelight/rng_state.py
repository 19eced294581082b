"""The random states a training step draws from, per rank: gathered into checkpoints, restored on resume.

Every process has its own streams (torch CPU, its current CUDA device, Python, NumPy): under DDP each rank's
LoRA dropout draws its own masks. Only rank 0 writes the checkpoint, so `gather` collects every rank's states
into one list indexed by global rank, and `restore` gives each rank its own entry back. A checkpoint resumed
on a different number of processes says so once; ranks without an entry keep the streams seeded at startup.
Checkpoints written before the states were per rank hold one dict (rank 0's, CUDA as every device's state).
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from prunelight import distributed

log = logging.getLogger(__name__)


def current() -> dict:
    """This process's random states: torch CPU, its current CUDA device (where CUDA runs), Python, NumPy."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # Plain types: Lightning loads checkpoints with weights_only=True, which refuses NumPy arrays.
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()  # the current device: the one this rank draws from
    return states


def gather() -> list[dict]:
    """Every rank's `current()` states, indexed by global rank (a collective: every rank must call it)."""
    return distributed.all_gather_object(current())


def restore(saved: dict | list[dict]) -> None:
    """Set this rank's entry of a checkpoint's states (an old one-process dict counts as rank 0's)."""
    per_rank = [saved] if isinstance(saved, dict) else list(saved)
    rank, world = distributed.rank_and_world_size()
    if len(per_rank) != world and rank == 0:
        log.warning("the checkpoint holds the random states of %d process(es), this run has %d: each rank with a "
                    "saved state continues it, the others keep their seeded streams (no exact replay)",
                    len(per_rank), world)
    if rank < len(per_rank):
        _apply(per_rank[rank])


def _apply(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    cuda = states.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return  # a CUDA state is restored only where CUDA runs
    if isinstance(cuda, (list, tuple)):  # an old checkpoint: every device's state, in device order
        device = torch.cuda.current_device()
        if device >= len(cuda):
            return
        cuda = cuda[device]
    torch.cuda.set_rng_state(cuda)
