"""Multi-process helpers: cross-rank sums and what kind of strategy a run uses.

Data parallel (DDP): every rank scores its share of the calibration samples, the per-unit
statistics are summed with the strategy's all-reduce, and every rank applies the same plan.
DeepSpeed: the cut never happens inside the running engine (see `zero3` and `callbacks.pruning`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


# --- ranks and reductions ---------------------------------------------------------------------
def rank_and_world_size() -> tuple[int, int]:
    """This process's global rank and the world size of the default process group ((0, 1) without one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def all_gather_object(obj) -> list:
    """`obj` of every rank, indexed by global rank (a collective: every rank must call it; [obj] on one process)."""
    _, world = rank_and_world_size()
    if world == 1:
        return [obj]
    out: list = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def strategy_sum(trainer, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function summing a tensor over all ranks with the Trainer's strategy (identity on one process)."""

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        if trainer.world_size == 1:
            return t
        # Collectives need the communication device (CUDA for NCCL); results come back where they were.
        return trainer.strategy.reduce(t.to(device), reduce_op="sum").to(t.device)

    return reduce_sum


# --- strategy kinds ---------------------------------------------------------------------------
def is_deepspeed(strategy) -> bool:
    """True for Lightning's DeepSpeedStrategy (without importing deepspeed when it is absent)."""
    try:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    except ImportError:  # pragma: no cover - Lightning always ships the class
        return False
    return isinstance(strategy, DeepSpeedStrategy)


def zero_stage(strategy) -> int | None:
    """The ZeRO stage of a DeepSpeed strategy, None for other strategies."""
    if not is_deepspeed(strategy):
        return None
    return int(strategy.config.get("zero_optimization", {}).get("stage", 0))


def needs_fresh_engine(strategy) -> bool:
    """Whether the cut model must continue in a newly set-up strategy instead of being re-wrapped in place.

    A DeepSpeed engine owns flat, partitioned copies of the parameters and their optimizer state;
    reshaping modules under it is unsupported, so recovery restarts from the written pruned model.
    """
    return is_deepspeed(strategy)


def uses_checkpoint_io(strategy) -> bool:
    """False for strategies that write checkpoints themselves (DeepSpeed writes sharded folders)."""
    return not is_deepspeed(strategy)


def mean_over_ranks(values: list[float], reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None) -> list[float]:
    """Each rank measured its own share of the data; average so every rank builds the same plan."""
    if reduce_sum is None:
        return values
    t = torch.tensor([*values, 1.0], dtype=torch.float64)
    t = reduce_sum(t).cpu()
    return (t[:-1] / t[-1]).tolist()
