"""First-order Taylor importance: |sum over tokens of a * dL/da| per sample, summed over samples.

Removing unit u changes the loss by about -sum_t a_u(t) * g_u(t) (first-order expansion of the
mask at 1 -> 0); the absolute value is taken per sample so opposite signs of different samples do
not cancel (as in LLM-Pruner's vector-wise Taylor and Molchanov et al. 2019).
"""

from __future__ import annotations

import torch

from prunelight.importance.base import ActGradCriterion


class TaylorCriterion(ActGradCriterion):
    """First-order Taylor score of each unit's mask."""

    name = "taylor"

    def reduce_samples(self, per_sample: torch.Tensor) -> torch.Tensor:
        return per_sample.abs().sum(0)
