"""Weight-magnitude baseline: the norm of all weights a unit owns (no data needed)."""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import get_family, unwrap
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
        family = get_family(model)
        hd = family.head_dim(unwrap(model).config)
        out: UnitScores = {"attn": [], "mlp": []}
        for layer, shape in zip(family.layers(model), family.layer_shapes(model)):
            n_kv, n_c = shape.num_key_value_heads, shape.intermediate_size
            if n_kv:
                q, k, v = family.qkv(family.attn(layer))
                o = family.o(family.attn(layer))
                rep = shape.num_attention_heads // n_kv
                qw = q.weight.float().view(n_kv, rep * hd, -1).flatten(1)
                kw = k.weight.float().view(n_kv, hd, -1).flatten(1)
                vw = v.weight.float().view(n_kv, hd, -1).flatten(1)
                ow = o.weight.float().t().reshape(n_kv, rep * hd, -1).flatten(1)
                out["attn"].append(self._norm([qw, kw, vw, ow]))
            else:
                out["attn"].append(torch.zeros(0))
            if n_c:
                gate, up, down = family.gate_up_down(family.mlp(layer))
                out["mlp"].append(self._norm([gate.weight.float(), up.weight.float(), down.weight.float().t()]))
            else:
                out["mlp"].append(torch.zeros(0))
        return out


class MagnitudeL1Criterion(MagnitudeCriterion):
    """L1 norm of each unit's weights (the `magnitude` criterion with p=1)."""

    name = "magnitude_l1"

    def __init__(self, p: int = 1) -> None:
        super().__init__(p)
