"""Which weight tensors a unit owns: a thin view of `ModelFamily.unit_layout` for the importance criteria.

The ownership rules themselves live in `prunelight.families` (one statement for surgery, masking,
scoring and parameter costs); these helpers bind them to a model.
"""

from __future__ import annotations

from torch import nn

from prunelight.families import INPUTS, OwnedSlice, OwnedTensor, get_family

__all__ = ["INPUTS", "OwnedSlice", "OwnedTensor", "input_modules", "owned_tensors"]


def owned_tensors(model: nn.Module) -> list[OwnedTensor]:
    """Every unit-owned weight and bias of the decoder layers, in layer order."""
    return get_family(model).owned_tensors(model)


def input_modules(model: nn.Module) -> list[dict[str, nn.Module]]:
    """Per layer, the module whose forward input is each activation of INPUTS (absent when removed)."""
    return get_family(model).input_modules(model)
