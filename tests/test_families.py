"""Model families own the architecture facts: the unit layout matches the modules, costs match surgery."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from prunelight.families import MODEL_FAMILIES, get_family
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.recovery import LoRASettings, add_lora
from prunelight.surgery import apply_plan, mask_units
from prunelight.testing import VARIANTS as TINY_VARIANTS
from prunelight.testing import tiny_model

BIASED_LLAMA = dict(attention_bias=True, mlp_bias=True)


def _biased(family: str, **overrides):
    """A tiny model whose biases (if any) are random, so bias slicing is visible in the numbers."""
    model = tiny_model(family, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _plan(model, keep_groups, keep_channels) -> PrunePlan:
    shapes = get_family(model).layer_shapes(model)
    return PrunePlan(
        [LayerPlan(g, c) for g, c in zip(keep_groups, keep_channels)],
        [s.num_key_value_heads for s in shapes],
        [s.intermediate_size for s in shapes],
    )


VARIANTS = [("llama", {}), ("llama", BIASED_LLAMA), ("mistral", {}), ("qwen2", {})]


@pytest.mark.parametrize("name, overrides", VARIANTS)
def test_unit_costs_equal_parameters_cut(name, overrides):
    model = _biased(name, **overrides)
    family, config = get_family(model), model.config
    before = _numel(model)
    one_group = copy.deepcopy(model)
    apply_plan(one_group, _plan(model, [[1], [0, 1]], [list(range(96))] * 2))
    assert before - _numel(one_group) == family.group_param_cost(config)
    one_channel = copy.deepcopy(model)
    apply_plan(one_channel, _plan(model, [[0, 1]] * 2, [list(range(95)), list(range(96))]))
    assert before - _numel(one_channel) == family.channel_param_cost(config)


@pytest.mark.parametrize("name, overrides", VARIANTS)
def test_layout_matches_the_modules(name, overrides):
    model = _biased(name, **overrides)
    family = get_family(model)
    shape = family.layer_shapes(model)[0]
    for owned in family.owned_by_layer(model)[0]:
        spec, p = owned.spec, owned.param
        assert p.shape[spec.axis] == spec.units * spec.block
        assert p.numel() == spec.units * spec.unit_cost and (spec.is_bias or p.shape[1 - spec.axis] == spec.width)
        assert owned.module is getattr(family.sub_block(model.model.layers[0], spec.kind), spec.module)
    # Every attention / MLP parameter is either owned by units or a shared bias (o_proj, down_proj).
    owned_ids = {id(o.param) for o in family.owned_tensors(model)}
    layer = model.model.layers[0]
    for sub in (layer.self_attn, layer.mlp):
        for pname, p in sub.named_parameters():
            assert id(p) in owned_ids or pname in ("o_proj.bias", "down_proj.bias"), pname
    # A group's query rows are its `rep` consecutive heads (transformers' repeat_kv layout).
    q = family.unit_layout(model.config, shape)[0]
    rep, hd = shape.num_attention_heads // shape.num_key_value_heads, family.head_dim(model.config)
    assert torch.equal(q.indices([1]), torch.arange(rep * hd, 2 * rep * hd))


def test_pruned_equals_masked_with_shared_biases():
    """Llama with attention and MLP biases: o_proj / down_proj biases are shared and survive the cut."""
    model = _biased("llama", **BIASED_LLAMA)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = _plan(model, [[1], [0]], [list(range(0, 96, 3)), list(range(50))])
    masked = copy.deepcopy(model)
    mask_units(masked, plan)
    shapes = apply_plan(model, plan)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, masked(ids).logits, atol=1e-5, rtol=1e-5)
    assert all(s.num_attention_heads == 2 * s.num_key_value_heads for s in shapes)


@pytest.mark.parametrize("name", sorted(MODEL_FAMILIES))
def test_family_states_its_classes(name):
    family = MODEL_FAMILIES[name]
    model = tiny_model(name)
    assert get_family(model) is family and isinstance(model, family.model_class)
    assert isinstance(model.config, family.config_class)
    assert issubclass(family.pruned_model_class, family.model_class)
    assert issubclass(family.pruned_config_class, family.config_class)
    assert family.model_types[:2] == (name, f"prunelight_{name}")  # then extra types (Llama: nemotron-nas)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(family.lora_targets) <= linear


def test_lora_targets_default_to_the_family():
    settings = LoRASettings(r=2, dropout=0.0)
    assert settings.as_dict()["target_modules"] is None
    peft_model = add_lora(tiny_model("qwen2"), settings)
    adapted = {n.split(".")[-4] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert adapted == set(get_family(peft_model).lora_targets)


@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_logits_head_gives_the_forward_logits(name):
    """The family's head on the decoder's output is the forward's logits; Gemma 2's soft-cap included."""
    family, overrides = TINY_VARIANTS[name]
    model = tiny_model(family, **overrides)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # logits past the tiny Gemma 2's cap (3.0), so the cap bends them
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        logits = model(input_ids=ids).logits
        torch.testing.assert_close(get_family(model).logits_head(model)(hidden), logits, rtol=0, atol=0)
        if get_family(model).logit_softcap(model.config) is not None:  # the bare LM head is not the logits there
            assert (model.get_output_embeddings()(hidden) - logits).abs().max() > 0.1
