"""Random baseline: seeded uniform scores, the floor every criterion must beat."""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import get_family
from prunelight.importance.base import Criterion, UnitScores


class RandomCriterion(Criterion):
    """Uniform random scores from a fixed seed (identical on every rank)."""

    name = "random"
    needs_data = False
    needs_backward = False

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed

    def scores(self, model: nn.Module) -> UnitScores:
        gen = torch.Generator().manual_seed(self.seed)
        out: UnitScores = {"attn": [], "mlp": []}
        for shape in get_family(model).layer_shapes(model):
            out["attn"].append(torch.rand(shape.num_key_value_heads, generator=gen))
            out["mlp"].append(torch.rand(shape.intermediate_size, generator=gen))
        return out
