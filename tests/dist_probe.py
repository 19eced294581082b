"""A callback for the distributed tests: each rank writes what it computed and holds to a file.

Used through `class_path: dist_probe.RankProbe` in a test YAML (tests/ on PYTHONPATH), so the
worker processes run the real `prunelight fit` command line, as a user's torchrun job would.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import lightning as L
import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankProbe(L.Callback):
    """Saves the plan, unit scores and weights right after the cut and at the end of training, per rank.

    `hold_at_step`: this process stops (sleeps, writing `held<rank>` into out_dir first) when a training step
    starts with that global step, i.e. after that step's checkpoint is on disk, so a test can `kill -9` its node
    at a known point. Given on one node's command line only.
    """

    def __init__(self, out_dir: str, hold_at_step: int | None = None) -> None:
        super().__init__()
        self.out_dir = Path(out_dir)
        self.hold_at_step = hold_at_step
        self.after_cut: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.hold_at_step is not None and trainer.global_step == self.hold_at_step:
            (self.out_dir / f"held{trainer.global_rank}").write_text(str(os.getpid()))
            while True:  # until the test kills this node
                time.sleep(1)
        # The cut happened in PruningCallback.on_train_start (prune_step 0), before the first batch.
        if self.after_cut is None and pl_module.plan is not None:
            # The cut base weights, named as in the unwrapped model (LoRA is already attached here).
            state = pl_module.base_model.state_dict()
            self.after_cut = {
                k.replace(".base_layer", ""): v.detach().clone() for k, v in state.items() if "lora_" not in k
            }

    def on_train_end(self, trainer, pl_module) -> None:
        final = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        torch.save(
            {
                "rank": trainer.global_rank,
                "node_rank": trainer.node_rank,
                "num_nodes": trainer.num_nodes,
                "cwd": os.getcwd(),
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
                "plan": pl_module.plan.to_dict(),
                "unit_scores": pl_module.record.unit_scores,
                "after_cut": self.after_cut,
                "final": final,
                "steps": trainer.global_step,
            },
            self.out_dir / f"rank{trainer.global_rank}.pt",
        )
