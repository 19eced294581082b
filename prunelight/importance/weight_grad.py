"""Criteria built from weight gradients, reduced per unit the moment each gradient is accumulated.

Only the weights units own require grad during calibration. A post-accumulate-grad hook folds each
parameter's gradient into per-unit sums and then drops it (p.grad = None), so at most the gradients
autograd is currently producing exist, never a second copy of the model's gradients. Calibration runs
these one sample at a time (`micro_batch_size=1`) by default, so every statistic is a sum over samples
and the per-rank sums of a distributed run add up exactly to the one-process result (`taylor_element`
is the exception: LLM-Pruner's formula needs the gradient of a whole batch's loss).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from prunelight.families import ModelFamily
from prunelight.importance.base import KINDS, Criterion, UnitScores, check_objective
from prunelight.importance.ownership import OwnedTensor, owned_tensors


class WeightGradCriterion(Criterion):
    """Base: per-unit sums of an element-wise function of (w, dL/dw) for every sample."""

    needs_backward = True
    # False: only weight matrices are scored (LLM-Pruner reads `.weight` only), so biases need no gradient.
    scores_biases: bool = True

    def __init__(self, objective: str = "lm", micro_batch_size: int = 1) -> None:
        super().__init__()
        self.loss = check_objective(objective)
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        self.micro_batch_size = micro_batch_size
        self._owned: list[OwnedTensor] = []

    def scored(self, model: nn.Module) -> list[OwnedTensor]:
        """The unit-owned tensors this criterion reads gradients of (weights, and biases if `scores_biases`)."""
        return [o for o in owned_tensors(model) if self.scores_biases or not o.is_bias]

    def grad_params(self, model: nn.Module) -> list[nn.Parameter]:
        # Once each: the slices of a fused projection share one parameter.
        return list({id(o.param): o.param for o in self.scored(model)}.values())

    @abstractmethod
    def accumulate(self, owned: OwnedTensor, w: torch.Tensor, g: torch.Tensor) -> None:
        """Fold one parameter's fp32 weight and gradient into the per-unit statistics."""

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        self._owned = self.scored(model)
        # A fused projection (Phi-3's qkv_proj) is owned by several slices: one hook reads them all, then frees.
        by_param: dict[int, list[OwnedTensor]] = {}
        for owned in self._owned:
            by_param.setdefault(id(owned.param), []).append(owned)
        for slices in by_param.values():
            self._handles.append(slices[0].param.register_post_accumulate_grad_hook(self._hook(slices)))

    def _hook(self, slices: list[OwnedTensor]):
        def hook(p: torch.Tensor) -> None:
            with torch.no_grad():
                w, g = p.detach().float(), p.grad.float()
                for owned in slices:
                    self.accumulate(owned, w, g)
            p.grad = None  # the reduced statistic is all we keep

        return hook

    def scores(self, model: nn.Module) -> UnitScores:
        return {kind: [t.clone() for t in self.stats[kind]] for kind in KINDS}
