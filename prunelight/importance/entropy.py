"""HFPrune's entropy criterion (Zhu, Wang, Shen 2026, arXiv 2603.08083): label-free, element-wise |a * dH/da|.

The objective is H, the entropy of the model's own next-token distribution (mean over a sample's
tokens, summed over samples, so no targets are read). A unit's score is

    I_u = sum_samples sum_tokens sum_{c in u} |a_c(t) * dH/da_c(t)|

with a the unit's output, i.e. the input of o_proj (a GQA group owns its query heads' columns) or of
down_proj (one column per MLP channel). As in HFPrune's code (github:visresearch/HFPrune, prune.py,
`get_importance_taylor`: `abs(act * grad).sum(dim=(0, 1))` on the down_proj input), the absolute value
is taken per token and per channel before any sum. HFPrune prunes MLP channels only; a GQA group here
sums the same per-channel score over its o_proj input columns (abs before summing over the group's
channels, so a group is the sum of its channels' HFPrune scores).

This differs from `taylor` with `criterion_args: {objective: entropy}` (the criterion formerly named
`entropy`), which takes |sum_tokens sum_channels a * g| per sample: products of opposite sign cancel
there and not here.
"""

from __future__ import annotations

import torch

from prunelight.importance.base import ActGradCriterion


class EntropyCriterion(ActGradCriterion):
    """HFPrune: sum over samples, tokens and a unit's channels of |a * dH/da| under the output-entropy objective."""

    name = "entropy"

    def __init__(self) -> None:
        super().__init__("entropy")

    def reduce_products(self, ag: torch.Tensor, units: int) -> torch.Tensor:
        ag = ag.abs_()  # our own temporary: abs in place, no second activation-sized copy
        per_sample = ag.sum(dim=1).view(ag.shape[0], units, -1).sum(-1)  # [batch, units]
        return self.reduce_samples(per_sample)

    def reduce_samples(self, per_sample: torch.Tensor) -> torch.Tensor:
        return per_sample.sum(0)  # already non-negative: a plain sum over samples
