"""Surgery is exact: a pruned model equals the original with the removed units zeroed."""

from __future__ import annotations

import copy

import pytest
import torch

from prunelight.families import get_family
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.surgery import apply_plan, mask_units


def _plan(model, keep_groups, keep_channels) -> PrunePlan:
    shapes = get_family(model).layer_shapes(model)
    return PrunePlan(
        layers=[LayerPlan(g, c) for g, c in zip(keep_groups, keep_channels)],
        num_groups=[s.num_key_value_heads for s in shapes],
        num_channels=[s.intermediate_size for s in shapes],
    )


def test_pruned_equals_masked(tiny):
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    plan = _plan(tiny, [[1], [0, 1]], [list(range(0, 96, 2)), list(range(10, 70))])
    masked = copy.deepcopy(tiny)
    mask_units(masked, plan)
    with torch.no_grad():
        ref = masked(ids).logits
        dense = tiny(ids).logits
    apply_plan(tiny, plan)
    with torch.no_grad():
        out = tiny(ids).logits
    assert not torch.allclose(dense, ref, atol=1e-3), "masking changed nothing: the test would be vacuous"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_shapes_and_ratio_kept(tiny):
    plan = _plan(tiny, [[0], [0, 1]], [list(range(32)), list(range(96))])
    shapes = apply_plan(tiny, plan)
    assert [s.num_key_value_heads for s in shapes] == [1, 2]
    assert [s.num_attention_heads for s in shapes] == [2, 4]
    assert [s.intermediate_size for s in shapes] == [32, 96]
    for s in shapes:
        assert s.num_attention_heads // s.num_key_value_heads == 2
    attn = tiny.model.layers[0].self_attn
    q_rows = get_family(tiny).qkv(attn)[0].out_features  # Phi-3's fused qkv_proj also holds the K and V rows
    assert q_rows == (32 + 2 * 16 if get_family(tiny).fused_qkv else 32) and attn.o_proj.in_features == 32
    assert tiny.config.layer_shapes[0] == {"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32}


def test_qwen2_biases_are_sliced():
    from prunelight.testing import tiny_model

    model = tiny_model("qwen2")
    bias_before = model.model.layers[0].self_attn.k_proj.bias.detach().clone()
    apply_plan(model, _plan(model, [[1], [0]], [list(range(96)), list(range(96))]))
    k = model.model.layers[0].self_attn.k_proj
    assert k.bias.shape == (16,)
    torch.testing.assert_close(k.bias, bias_before[16:32])


def test_generate_after_surgery(tiny):
    apply_plan(tiny, _plan(tiny, [[1], [0]], [list(range(40)), list(range(50))]))
    out = tiny.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 8)


@pytest.mark.parametrize(
    "keep_groups, match",
    [([[0, 0], [0]], "distinct"), ([[5], [0]], r"\[0, 2\)")],
)
def test_bad_plan_rejected(tiny, keep_groups, match):
    with pytest.raises(ValueError, match=match):
        apply_plan(tiny, _plan(tiny, keep_groups, [list(range(96))] * 2))
