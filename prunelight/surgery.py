"""Structural surgery: rebuild the projections of every layer with only the kept units.

New `nn.Linear` modules are created (not masked views), so `in_features`/`out_features` are right
for peft and for export, and the memory of removed units is actually freed.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import ModelFamily, LayerShape, get_family, unwrap
from prunelight.modeling import RemovedAttention, RemovedMLP
from prunelight.plan import PrunePlan


def _sliced_linear(old: nn.Linear, rows: torch.Tensor | None, cols: torch.Tensor | None) -> nn.Linear:
    """A new Linear holding old.weight[rows][:, cols] (and the matching bias rows)."""
    weight = old.weight.detach()
    if rows is not None:
        weight = weight.index_select(0, rows.to(weight.device))
    if cols is not None:
        weight = weight.index_select(1, cols.to(weight.device))
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=old.bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if old.bias is not None:
            bias = old.bias.detach()
            new.bias.copy_(bias.index_select(0, rows.to(bias.device)) if rows is not None else bias)
    new.weight.requires_grad_(old.weight.requires_grad)
    if new.bias is not None:
        new.bias.requires_grad_(old.bias.requires_grad)
    return new


def head_rows(groups: list[int], heads_per_group: int, head_dim: int) -> torch.Tensor:
    """Row indices of the given groups' heads in a projection laid out head after head.

    With GQA, query head i reads KV head i // heads_per_group (transformers' repeat_kv), so the
    query heads of group g are g*rep ... g*rep + rep - 1.
    """
    idx = [
        h * head_dim + d
        for g in groups
        for h in range(g * heads_per_group, (g + 1) * heads_per_group)
        for d in range(head_dim)
    ]
    return torch.tensor(idx, dtype=torch.long)


def prune_attention(attn: nn.Module, family: ModelFamily, keep: list[int], rep: int, head_dim: int) -> None:
    """Keep only the GQA groups `keep` (one KV head and its `rep` query heads each)."""
    q, k, v = family.qkv(attn)
    o = family.o(attn)
    q_rows = head_rows(keep, rep, head_dim)
    kv_rows = head_rows(keep, 1, head_dim)
    setattr(attn, family.q_name, _sliced_linear(q, q_rows, None))
    setattr(attn, family.k_name, _sliced_linear(k, kv_rows, None))
    setattr(attn, family.v_name, _sliced_linear(v, kv_rows, None))
    setattr(attn, family.o_name, _sliced_linear(o, None, q_rows))
    # Attention reshapes with -1 heads; only the q/kv ratio is read, and whole groups keep it.
    attn.num_key_value_groups = rep
    attn.num_heads, attn.num_key_value_heads = rep * len(keep), len(keep)


def prune_mlp(mlp: nn.Module, family: ModelFamily, keep: list[int]) -> None:
    """Keep only the MLP channels `keep` (gate/up rows and down columns)."""
    gate, up, down = family.gate_up_down(mlp)
    idx = torch.tensor(keep, dtype=torch.long)
    setattr(mlp, family.gate_name, _sliced_linear(gate, idx, None))
    setattr(mlp, family.up_name, _sliced_linear(up, idx, None))
    setattr(mlp, family.down_name, _sliced_linear(down, None, idx))
    mlp.intermediate_size = len(keep)


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


def apply_plan(model: nn.Module, plan: PrunePlan) -> list[LayerShape]:
    """Cut `model` in place to the kept units of `plan`; returns the new per-layer shapes."""
    check_plan(model, plan)
    family = get_family(model)
    config = unwrap(model).config
    hd = family.head_dim(config)
    for layer, lp, shape in zip(family.layers(model), plan.layers, family.layer_shapes(model)):
        rep = shape.num_attention_heads // shape.num_key_value_heads if shape.num_key_value_heads else 0
        keep_g = sorted(lp.keep_groups)
        if not keep_g:
            old = getattr(layer, family.attn_name)
            setattr(layer, family.attn_name, RemovedAttention(getattr(old, "layer_idx", None)))
        elif len(keep_g) < shape.num_key_value_heads:
            prune_attention(family.attn(layer), family, keep_g, rep, hd)
        keep_c = sorted(lp.keep_channels)
        if not keep_c:
            setattr(layer, family.mlp_name, RemovedMLP())
        elif len(keep_c) < shape.intermediate_size:
            prune_mlp(family.mlp(layer), family, keep_c)
    if plan.drop_layers:
        drop_layers(model, plan.drop_layers)
    shapes = family.layer_shapes(model)
    record_shapes(config, shapes)
    return shapes


def drop_layers(model: nn.Module, indices: list[int]) -> None:
    """Delete whole decoder layers and renumber the rest so config, KV cache and masks stay consistent."""
    family = get_family(model)
    config = unwrap(model).config
    layers = family.layers(model)
    gone = set(indices)
    kept = [i for i in range(len(layers)) if i not in gone]
    new = nn.ModuleList([layers[i] for i in kept])
    for new_idx, layer in enumerate(new):
        attn = getattr(layer, family.attn_name)
        # The KV cache is indexed by layer_idx; gaps would make DynamicCache grow past the config's layers.
        if hasattr(attn, "layer_idx"):
            attn.layer_idx = new_idx
    parent_path, _, name = family.layers_path.rpartition(".")
    parent = unwrap(model)
    for part in parent_path.split(".") if parent_path else []:
        parent = getattr(parent, part)
    setattr(parent, name, new)
    config.num_hidden_layers = len(kept)
    # DynamicCache(config=...) and the mask builders read layer_types per layer.
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in kept]


def record_shapes(config, shapes: list[LayerShape]) -> None:
    """Write the per-layer shapes into the config (used by export and by the report)."""
    # head_dim must be explicit: hidden_size / num_attention_heads no longer gives it.
    if not getattr(config, "head_dim", None):
        config.head_dim = config.hidden_size // config.num_attention_heads
    config.layer_shapes = [s.as_dict() for s in shapes]


def mask_units(model: nn.Module, plan: PrunePlan) -> None:
    """Zero the removed units in place without changing shapes (the reference for surgery tests)."""
    family = get_family(model)
    config = unwrap(model).config
    hd = family.head_dim(config)
    with torch.no_grad():
        for i, (layer, lp, shape, n_g, n_c) in enumerate(zip(
            family.layers(model), plan.layers, family.layer_shapes(model), plan.num_groups, plan.num_channels
        )):
            if i in plan.drop_layers:  # a dropped layer passes its input through: silence both sub-blocks
                lp = type(lp)([], [])
            rep = shape.num_attention_heads // shape.num_key_value_heads
            gone_g = [g for g in range(n_g) if g not in set(lp.keep_groups)]
            if gone_g:
                # Zeroing o_proj's input columns silences the group's heads exactly.
                cols = head_rows(gone_g, rep, hd)
                family.o(family.attn(layer)).weight[:, cols] = 0
            gone_c = [c for c in range(n_c) if c not in set(lp.keep_channels)]
            if gone_c:
                family.gate_up_down(family.mlp(layer))[2].weight[:, torch.tensor(gone_c)] = 0
