"""Which weight tensors a unit owns, and how to fold an element-wise score of a tensor into per-unit sums.

A GQA group owns its query rows, one K and one V head's rows (plus their biases) and the o_proj
columns that read its query heads; an MLP channel owns one gate row, one up row (plus biases) and
one down_proj column. Shared biases (o_proj, down_proj) belong to no unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prunelight.families import get_family, unwrap

# Which activation feeds a tensor (used by Wanda): the attention input, o_proj input, MLP input, down_proj input.
INPUTS = ("attn_in", "o_in", "mlp_in", "down_in")


@dataclass(frozen=True)
class OwnedTensor:
    """One parameter whose rows (axis 0) or columns (axis 1) are split evenly among `units` units."""

    param: nn.Parameter
    kind: str  # "attn" | "mlp"
    layer: int
    axis: int  # 0: units own contiguous row blocks (or bias entries); 1: contiguous column blocks
    units: int
    input: str  # which activation this tensor multiplies (see INPUTS)
    is_bias: bool = False

    def to_units(self, elementwise: torch.Tensor) -> torch.Tensor:
        """Sum a tensor shaped like `param` over each unit's share: -> [units] fp32."""
        t = elementwise.float()
        if self.axis == 0:
            return t.reshape(self.units, -1).sum(1)
        return t.reshape(t.shape[0], self.units, -1).sum((0, 2))


def owned_tensors(model: nn.Module) -> list[OwnedTensor]:
    """Every unit-owned weight and bias of the decoder layers, in layer order."""
    family = get_family(model)
    out: list[OwnedTensor] = []
    for i, (layer, shape) in enumerate(zip(family.layers(model), family.layer_shapes(model))):
        if shape.num_key_value_heads:
            attn = family.attn(layer)
            n = shape.num_key_value_heads
            for proj in family.qkv(attn):
                out.append(OwnedTensor(proj.weight, "attn", i, 0, n, "attn_in"))
                if proj.bias is not None:
                    out.append(OwnedTensor(proj.bias, "attn", i, 0, n, "attn_in", is_bias=True))
            out.append(OwnedTensor(family.o(attn).weight, "attn", i, 1, n, "o_in"))
        if shape.intermediate_size:
            gate, up, down = family.gate_up_down(family.mlp(layer))
            n = shape.intermediate_size
            for proj in (gate, up):
                out.append(OwnedTensor(proj.weight, "mlp", i, 0, n, "mlp_in"))
                if proj.bias is not None:
                    out.append(OwnedTensor(proj.bias, "mlp", i, 0, n, "mlp_in", is_bias=True))
            out.append(OwnedTensor(down.weight, "mlp", i, 1, n, "down_in"))
    return out


def input_modules(model: nn.Module) -> list[dict[str, nn.Module]]:
    """Per layer, the module whose forward input is each activation of INPUTS (absent when removed)."""
    family = get_family(unwrap(model))
    out = []
    for layer, shape in zip(family.layers(model), family.layer_shapes(model)):
        mods: dict[str, nn.Module] = {}
        if shape.num_key_value_heads:
            attn = family.attn(layer)
            mods["attn_in"] = family.qkv(attn)[0]
            mods["o_in"] = family.o(attn)
        if shape.intermediate_size:
            gate, _, down = family.gate_up_down(family.mlp(layer))
            mods["mlp_in"], mods["down_in"] = gate, down
        out.append(mods)
    return out
