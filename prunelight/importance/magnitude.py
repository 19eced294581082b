"""Weight-magnitude baseline: an additive magnitude of all weights a unit owns (no data needed).

`magnitude` scores a unit by sum w^2 (the squared L2 norm), `magnitude_l1` by sum |w|. Both are sums of
one term per parameter, so a unit's importance per parameter (what the `global` allocation ranks) does
not depend on the unit's size. The plain L2 norm did: it grows like sqrt(n), so importance per parameter
fell like 1/sqrt(n) and large GQA groups always looked cheaper than MLP channels.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import KINDS, get_family
from prunelight.importance.base import Criterion, UnitScores


class MagnitudeCriterion(Criterion):
    """Sum of w^2 (p=2) or |w| (p=1) over each unit's q/k/v rows + o columns, or gate/up rows + down column."""

    name = "magnitude"
    needs_data = False
    needs_backward = False

    def __init__(self, p: int = 2) -> None:
        super().__init__()
        if p not in (1, 2):
            raise ValueError(f"magnitude norm p={p!r} is not supported; use 1 or 2")
        self.p = p

    def _norm(self, parts: list[torch.Tensor]) -> torch.Tensor:
        # parts: per-unit blocks, each [units, n]. No square root: the score must stay additive per parameter.
        if self.p == 1:
            return sum(t.abs().sum(-1) for t in parts)
        return sum(t.pow(2).sum(-1) for t in parts)

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
    """Sum of |w| over each unit's weights (the `magnitude` criterion with p=1)."""

    name = "magnitude_l1"

    def __init__(self, p: int = 1) -> None:
        super().__init__(p)
