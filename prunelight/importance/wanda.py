"""Wanda importance (Sun et al. 2023) aggregated per unit: sum of |W_ij| * ||X_j||_2 over all a unit's weights.

||X_j||_2 is the L2 norm of input feature j over every calibration token, for the activation the
weight multiplies: the attention input for q/k/v rows, the o_proj input for o columns, the MLP input
for gate/up rows and the down_proj input for down columns. Forward hooks accumulate sum_t X_j(t)^2
(O(hidden) per layer, fp32); no backward pass and no labels are needed. Biases are not scored (as in
Wanda), so a unit's score comes from its weight matrices alone.

A variant of our own, not FLAP's structured Wanda: `wanda_sp` (importance/flap.py) scores only the
o_proj / down_proj input columns, with the mean (not the sum) of |W_ij| * ||X_j||_2 over a column's
rows. This one also sums the unit's q/k/v rows (for a group) or gate/up rows (for a channel), each
element weighted by the norm of the activation it multiplies, and sums (not averages) every element.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import ModelFamily
from prunelight.importance.base import KINDS, Criterion, UnitScores, all_reduce_per_layer
from prunelight.importance.ownership import input_modules, owned_tensors


class WandaCriterion(Criterion):
    """Per-unit sum of |W| times the input activation norm over every weight the unit owns (q/k/v/o or gate/up/down)."""

    name = "wanda"
    needs_backward = False

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        self.sq_norms: list[dict[str, torch.Tensor]] = []
        for mods in input_modules(model):
            norms = {}
            for key, module in mods.items():
                norms[key] = torch.zeros(module.in_features, dtype=torch.float32, device=module.weight.device)
                self._handles.append(module.register_forward_pre_hook(self._hook(norms[key])))
            self.sq_norms.append(norms)

    @staticmethod
    def _hook(acc: torch.Tensor):
        def pre_hook(module, args):
            x = args[0].detach()
            acc.add_(x.float().pow(2).reshape(-1, x.shape[-1]).sum(0))

        return pre_hook

    def all_reduce(self, reduce_sum) -> None:
        super().all_reduce(reduce_sum)
        all_reduce_per_layer(self.sq_norms, reduce_sum)

    @torch.no_grad()
    def scores(self, model: nn.Module) -> UnitScores:
        out: UnitScores = {kind: [torch.zeros_like(t) for t in self.stats[kind]] for kind in KINDS}
        for owned in owned_tensors(model):
            if owned.is_bias:
                continue
            norm = self.sq_norms[owned.layer][owned.input].sqrt()
            out[owned.kind][owned.layer] += owned.to_units(owned.param.float().abs() * norm)
        return out
