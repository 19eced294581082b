"""A callback for the distributed tests: each rank writes what it computed and holds to a file.

Used through `class_path: dist_probe.RankProbe` in a test YAML (tests/ on PYTHONPATH), so the
worker processes run the real `prunelight fit` command line, as a user's torchrun job would.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class RankProbe(L.Callback):
    """Saves the plan, unit scores and weights right after the cut and at the end of training, per rank."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = Path(out_dir)
        self.after_cut: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
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
