"""Structural surgery: rebuild the projections of every layer with only the kept units.

New `nn.Linear` modules are created (not masked views), so `in_features`/`out_features` are right
for peft and for export, and the memory of removed units is actually freed. Which slices a unit
owns and how a layer is resized are the model family's business (`prunelight.families`); this
module checks plans and asks the family to cut.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from prunelight.console import progress
from prunelight.families import LayerShape, get_family, unwrap
from prunelight.plan import LayerPlan, PrunePlan


def check_plan(model: nn.Module, plan: PrunePlan) -> None:
    """Refuse a plan that does not fit the model (wrong depth, indices out of range, duplicates)."""
    family = get_family(model)
    shapes = family.layer_shapes(model)
    if plan.num_layers != len(shapes):
        raise ValueError(f"plan covers {plan.num_layers} layers but the model has {len(shapes)}")
    for i, (lp, shape) in enumerate(zip(plan.layers, shapes)):
        for name, keep, n in (
            ("groups", lp.keep_groups, shape.num_key_value_heads),
            ("channels", lp.keep_channels, shape.intermediate_size),
        ):
            if len(set(keep)) != len(keep) or any(not 0 <= j < n for j in keep):
                raise ValueError(f"layer {i}: kept {name} must be distinct indices in [0, {n}), got {keep[:8]}...")
    drop = plan.drop_layers
    if len(set(drop)) != len(drop) or any(not 0 <= i < len(shapes) for i in drop):
        raise ValueError(f"drop_layers must be distinct layer indices in [0, {len(shapes)}), got {drop}")
    if len(drop) == len(shapes):
        raise ValueError("the plan drops every decoder layer; at least one must remain")


def layer_cuts(lp: LayerPlan, shape: LayerShape) -> list[tuple[str, list[int]]]:
    """The sub-blocks of a layer that lose units, in forward order, with their kept units ascending.

    An untouched sub-block keeps its modules; an emptied one is cut to nothing (the family removes it).
    """
    out = []
    for kind, keep, n in (("attn", lp.keep_groups, shape.num_key_value_heads),
                          ("mlp", lp.keep_channels, shape.intermediate_size)):
        if n and (len(keep) < n or not keep):
            out.append((kind, sorted(keep)))
    return out


LayerCut = Callable[[int, nn.Module, LayerShape, list[tuple[str, list[int]]]], None]
# A per-layer cut step wrapped with more work around it (the layer tuning's `LayerTuner.wrap`).
LayerWrap = Callable[[LayerCut], LayerCut]


def apply_plan(model: nn.Module, plan: PrunePlan, cut_layer: LayerCut | None = None,
               desc: str | None = None) -> list[LayerShape]:
    """Cut `model` in place to the kept units of `plan`, one layer at a time in order; returns the new shapes.

    `cut_layer(i, layer, shape, cuts)` cuts layer i's sub-blocks `cuts` (default: the family cuts each);
    reconstruction plugs in here to fit each layer's repair while the layer is cut. Every layer is passed,
    also those the plan drops (removed after the loop). `desc` shows a progress bar.
    """
    check_plan(model, plan)
    family = get_family(model)
    config = unwrap(model).config

    def family_cut(i: int, layer: nn.Module, shape: LayerShape, cuts: list[tuple[str, list[int]]]) -> None:
        for kind, keep in cuts:
            family.cut_sub_block(layer, config, shape, kind, keep)

    cut_layer = cut_layer or family_cut
    layers, shapes = list(family.layers(model)), family.layer_shapes(model)
    for i in (progress(range(len(layers)), desc, unit="layer") if desc else range(len(layers))):
        cut_layer(i, layers[i], shapes[i], layer_cuts(plan.layers[i], shapes[i]))
    if plan.drop_layers:
        drop_layers(model, plan.drop_layers)
    shapes = family.layer_shapes(model)
    record_shapes(config, shapes)
    return shapes


def drop_layers(model: nn.Module, indices: list[int]) -> None:
    """Delete whole decoder layers and renumber the rest so config, KV cache and masks stay consistent."""
    get_family(model).drop_layers(model, indices)


def record_shapes(config, shapes: list[LayerShape]) -> None:
    """Write the per-layer shapes into the config (used by export and by the report)."""
    get_family(config).record_shapes(config, shapes)


def mask_units(model: nn.Module, plan: PrunePlan) -> None:
    """Zero the removed units in place without changing shapes (the reference for surgery tests).

    Only the weights that read a unit's output (o_proj / down_proj input columns) are zeroed:
    that silences the unit exactly, as removing it would. A sub-block left with no unit (or in a dropped
    layer) also loses that projection's bias, which belongs to no unit but goes with the sub-block.
    """
    family = get_family(model)
    num_units = {"attn": plan.num_groups, "mlp": plan.num_channels}
    with torch.no_grad():
        for i, (layer_owned, lp) in enumerate(zip(family.owned_by_layer(model), plan.layers)):
            if i in plan.drop_layers:  # a dropped layer passes its input through: silence both sub-blocks
                lp = LayerPlan([], [])
            keep = {"attn": set(lp.keep_groups), "mlp": set(lp.keep_channels)}
            for owned in layer_owned:
                if not owned.spec.reads_unit_output:
                    continue
                gone = [u for u in range(num_units[owned.kind][i]) if u not in keep[owned.kind]]
                if gone:
                    owned.param[:, owned.spec.indices(gone)] = 0
                    if len(gone) == num_units[owned.kind][i] and owned.module.bias is not None:
                        owned.module.bias.zero_()
