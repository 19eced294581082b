"""Multi-process helpers: cross-rank sums and what kind of strategy a run uses.

Data parallel (DDP): every rank scores its share of the calibration samples, the per-unit
statistics are summed with the strategy's all-reduce, and every rank applies the same plan.
DeepSpeed: the cut never happens inside the running engine (see `zero3` and `callbacks.pruning`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

# Sums a tensor over every rank (the strategy's all-reduce; the identity where there is one process).
ReduceSum = Callable[[torch.Tensor], torch.Tensor]


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


def strategy_sum(trainer, device: torch.device) -> ReduceSum:
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


def mean_over_ranks(values: list[float], reduce_sum: ReduceSum | None) -> list[float]:
    """Each rank measured its own share of the data; average so every rank builds the same plan."""
    if reduce_sum is None:
        return values
    t = torch.tensor([*values, 1.0], dtype=torch.float64)
    t = reduce_sum(t).cpu()
    return (t[:-1] / t[-1]).tolist()


def sum_over_ranks(values: list[float], reduce_sum: ReduceSum | None) -> list[float]:
    """`values` summed over the ranks (as they are without DDP)."""
    if reduce_sum is None:
        return values
    return reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()


def split_holdout(sizes: Sequence[int], holdout_sequences: int, reduce_sum: ReduceSum | None = None
                  ) -> tuple[list[int], list[int]]:
    """(training, held-out) batch indices: the last whole batches holding at least `holdout_sequences` sequences (over
    all ranks) held out, at least one batch trained. A batch's masks and positions are built for its size, so batches
    are never split; under DDP every rank holds out and trains on as many batches as the others, so their
    collectives pair up."""
    world = int(sum_over_ranks([1.0], reduce_sum)[0])
    held, n = 0, 0
    while held < len(sizes) - 1 and n < math.ceil(holdout_sequences / world):
        held += 1
        n += sizes[-held]
    held = _min_over_ranks(held, reduce_sum)
    train = _min_over_ranks(len(sizes) - held, reduce_sum)
    return list(range(train)), list(range(len(sizes) - held, len(sizes)))


def _min_over_ranks(n: int, reduce_sum: ReduceSum | None) -> int:
    """The least `n` of all ranks, from a sum (a one-hot count per rank; counts above 4095 read as 4095)."""
    if reduce_sum is None:
        return n
    hot = torch.zeros(4096, dtype=torch.float64)
    hot[min(n, 4095)] = 1.0
    return int(torch.nonzero(reduce_sum(hot))[0])


def sum_gradients(params: Sequence[nn.Parameter], loss: torch.Tensor, reduce_sum: ReduceSum | None) -> float:
    """After `loss.backward()`: under DDP, every parameter's gradient replaced by its sum over ranks (every rank then
    takes the same step; Adam ignores the sum's scale); returns the loss, summed over ranks under DDP. The loss
    travels with the gradients, so a non-finite loss on one rank stops every rank together instead of leaving the
    others waiting at this sum."""
    if reduce_sum is None:
        return float(loss.detach())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = reduce_sum(torch.cat([*(g.reshape(-1) for g in grads), loss.detach().reshape(1)]))
    for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
        p.grad = g.view_as(p).to(p.dtype)
    return float(flat[-1])
