"""Weight-magnitude baseline: the norm of all weights a unit owns (no data needed)."""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import KINDS, get_family
from prunelight.importance.base import Criterion, UnitScores


class MagnitudeCriterion(Criterion):
    """L2 (or L1) norm of each unit's q/k/v rows + o columns, or gate/up rows + down column."""

    name = "magnitude"
    needs_data = False
    needs_backward = False

    def __init__(self, p: int = 2) -> None:
        super().__init__()
        if p not in (1, 2):
            raise ValueError(f"magnitude norm p={p!r} is not supported; use 1 or 2")
        self.p = p

    def _norm(self, parts: list[torch.Tensor]) -> torch.Tensor:
        # parts: per-unit blocks, each [units, n]; combine as one vector per unit.
        if self.p == 1:
            return sum(t.abs().sum(-1) for t in parts)
        return torch.sqrt(sum(t.pow(2).sum(-1) for t in parts))

    @torch.no_grad()
    def scores(self, model: nn.Module) -> UnitScores:
        out: UnitScores = {kind: [] for kind in KINDS}
        for layer_owned in get_family(model).owned_by_layer(model):
            for kind in KINDS:
                # Biases are left out: the norm is over the weight matrices a unit owns.
                parts = [o.spec.unit_blocks(o.param.float()) for o in layer_owned if o.kind == kind and not o.is_bias]
                out[kind].append(self._norm(parts) if parts else torch.zeros(0))
        return out


class MagnitudeL1Criterion(MagnitudeCriterion):
    """L1 norm of each unit's weights (the `magnitude` criterion with p=1)."""

    name = "magnitude_l1"

    def __init__(self, p: int = 1) -> None:
        super().__init__(p)
