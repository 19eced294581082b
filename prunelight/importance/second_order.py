"""Element-wise second-order Taylor importance: |w * g| + 0.5 * |w^2 * H_diag| per weight, summed per unit.

With N calibration samples and g_s the gradient of sample s's mean loss,

    score_u = sum over the weights and biases w unit u owns of ( mean_s |w * g_s| + 0.5 * w^2 * H(w) ),
    H(w)    = mean_s g_s(w)^2   (the empirical-Fisher approximation of the Hessian diagonal).

Both terms are sums over samples of per-unit quantities (sum_w w^2 g_s^2 is reduced inside the hook),
so the statistics stay O(units) and add up across ranks; the means are taken at the end.

How it differs from LLM-Pruner's `param_mix` (our `taylor_mix`), |w * g_bar - 0.5 * w^2 * H| with
g_bar = mean_s g_s: here the first-order term is mean_s |w * g_s| (|.| per sample, before averaging)
and the two terms are added as separate non-negative sums rather than combined under one |.| per
weight, which is what keeps it O(units) in memory; biases are scored too. A variant of our own.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import ModelFamily
from prunelight.importance.base import KINDS, UnitScores
from prunelight.importance.ownership import OwnedTensor
from prunelight.importance.weight_grad import WeightGradCriterion


class SecondOrderCriterion(WeightGradCriterion):
    """First- plus diagonal second-order Taylor score of zeroing each weight, summed per unit."""

    name = "second_order"

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        # stats holds sum_s sum_w |w g_s|; curvature holds sum_s sum_w w^2 g_s^2 (same layout).
        self.curvature = {kind: [torch.zeros_like(t) for t in self.stats[kind]] for kind in KINDS}
        super()._register(model, family)

    def accumulate(self, owned: OwnedTensor, w: torch.Tensor, g: torch.Tensor) -> None:
        self.stats[owned.kind][owned.layer] += owned.to_units((w * g).abs())
        self.curvature[owned.kind][owned.layer] += owned.to_units((w * g).pow(2))

    def all_reduce(self, reduce_sum) -> None:
        super().all_reduce(reduce_sum)
        for kind in KINDS:
            if self.curvature[kind]:
                sizes = [t.numel() for t in self.curvature[kind]]
                self.curvature[kind] = list(torch.split(reduce_sum(torch.cat(self.curvature[kind])), sizes))

    def scores(self, model: nn.Module) -> UnitScores:
        n = max(self.num_batches, 1)  # one backward per micro-batch: the means are over micro-batches
        return {kind: [(t + 0.5 * c) / n for t, c in zip(self.stats[kind], self.curvature[kind])] for kind in KINDS}
