"""Fisher importance of a unit's mask: sum over samples of (sum over tokens of a * dL/da)^2.

With a mask m_u multiplying unit u's output, dL/dm_u = sum_t a_u(t) g_u(t) for one sample, and the
empirical Fisher information of that mask is the sum over samples of its square (Molchanov et al.
2019; Kwon et al. 2022). It is the squared counterpart of `taylor` and a diagonal second-order
estimate of the loss increase from removing the unit.
"""

from __future__ import annotations

import torch

from prunelight.importance.base import ActGradCriterion


class FisherCriterion(ActGradCriterion):
    """Empirical Fisher information of each unit's mask."""

    name = "fisher"

    def reduce_samples(self, per_sample: torch.Tensor) -> torch.Tensor:
        return per_sample.pow(2).sum(0)
