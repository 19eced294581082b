"""Running a model's decoder from a cached layer input, so the layers before it are not run again.

The calibrated probes change one sub-block at a time and the search's offspring a few; every layer before the first
changed one would recompute hidden states that are already known. `started_at` lets the model's own forward
(embeddings, position embeddings, masks, final norm, head) run with the earlier layers stood in for: the last
stand-in returns the cached input of the first layer run, the others pass their input through at no cost.

The layer list keeps its length, so every layer that runs keeps its index: models index per-layer facts by position
(`config.layer_types[i]` picks a sliding or full mask and, in Gemma-3, local or global rotary embeddings).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from prunelight.families import get_family, unwrap


class _StandIn(nn.Module):
    """Takes the place of a decoder layer that is not run: passes its input on, or returns `state` when set."""

    def __init__(self, replaced: nn.Module) -> None:
        super().__init__()
        self.state: torch.Tensor | None = None
        if hasattr(replaced, "attention_type"):  # transformers versions that read the layer's own attribute
            self.attention_type = replaced.attention_type

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states if self.state is None else self.state


@contextlib.contextmanager
def started_at(model: nn.Module, layer: int) -> Iterator[_StandIn | None]:
    """Within the block the model's forward starts at decoder layer `layer` from the state set on the yielded
    stand-in (`.state`: that layer's input, [batch, tokens, hidden]); None and no change for layer 0."""
    base = unwrap(model)
    family = get_family(base)
    layers = family.layers(base)
    if not 0 <= layer < len(layers):
        raise ValueError(f"started_at: layer={layer} is not a decoder layer index (0..{len(layers) - 1})")
    if layer == 0:
        yield None
        return
    stand = [_StandIn(layers[j]) for j in range(layer)]
    family.set_layers(base, nn.ModuleList([*stand, *list(layers)[layer:]]))
    try:
        yield stand[-1]
    finally:
        family.set_layers(base, layers)


@contextlib.contextmanager
def recorded_inputs(model: nn.Module, start: int = 0) -> Iterator[list[list[torch.Tensor]]]:
    """Within the block every forward appends each decoder layer's input from `start` on to the yielded lists
    (one list per layer, one tensor per forward; layers before `start` get none)."""
    layers = get_family(unwrap(model)).layers(unwrap(model))
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]

    def keep(i: int):
        def hook(module, args, kwargs):
            inputs[i].append((args[0] if args else kwargs["hidden_states"]).detach())
        return hook

    handles = [layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in range(start, len(layers))]
    try:
        yield inputs
    finally:
        for h in handles:
            h.remove()
