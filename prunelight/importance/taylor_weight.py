"""Per-sample element-wise weight Taylor importance: sum over samples of |w * g_s|, summed over a unit.

score_u = sum over samples s of sum over the weights and biases w that unit u owns of |w * g_s(w)|,
where g_s is the gradient of sample s's mean loss. It estimates, weight by weight, the first-order
loss change of zeroing that weight, and sums the estimates over the unit.

How it differs from LLM-Pruner's `param_first` (our `taylor_element`): LLM-Pruner takes |.| once, of
w times the gradient of the batch's mean loss, |w * mean_s g_s|; here |.| is taken per sample and the
samples are summed, sum_s |w * g_s| >= N |w * g_bar| (gradients of opposite sign across samples add up
instead of cancelling), and biases are scored too (LLM-Pruner reads `.weight` only). It is a variant of
our own; with the default `micro_batch_size=1` it does not depend on how samples are batched.
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
