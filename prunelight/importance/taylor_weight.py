"""Element-wise weight Taylor importance (LLM-Pruner's "element-1"): sum of |w * dL/dw| over a unit's weights.

score_u = sum over samples s of sum over the weights and biases w that unit u owns of |w * g_s(w)|,
where g_s is the gradient of sample s's mean loss. It estimates, weight by weight, the first-order
loss change of zeroing that weight, and sums the estimates over the unit.
"""

from __future__ import annotations

import torch

from prunelight.importance.ownership import OwnedTensor
from prunelight.importance.weight_grad import WeightGradCriterion


class TaylorWeightCriterion(WeightGradCriterion):
    """Per-unit sum of |w * g| over samples."""

    name = "taylor_weight"

    def accumulate(self, owned: OwnedTensor, w: torch.Tensor, g: torch.Tensor) -> None:
        self.stats[owned.kind][owned.layer] += owned.to_units((w * g).abs())
