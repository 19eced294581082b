"""Allocation meets the parameter budget and respects per-layer minimums."""

from __future__ import annotations

import pytest
import torch

from prunelight.families import get_family
from prunelight.allocation import count_params
from prunelight.importance import build_criterion
from prunelight.surgery import apply_plan
from prunelight.testing import allocate_flat, settings_of, tiny_model


def _scores(model, seed=0):
    return build_criterion("random", seed=seed).scores(model)


@pytest.mark.parametrize("method", ["global", "uniform"])
@pytest.mark.parametrize("ratio", [0.1, 0.25])
def test_budget_met_and_counted_exactly(method, ratio):
    model = tiny_model("llama", num_hidden_layers=4, intermediate_size=128)
    before = count_params(model)
    plan = allocate_flat(model, _scores(model), ratio, method)
    apply_plan(model, plan)
    after = count_params(model)
    assert before - after == plan.meta["params_removed"], "meta must count what surgery actually removed"
    assert plan.meta["params_removed"] >= plan.meta["params_target_removed"]
    # within one MLP channel (uniform: one channel per layer, so every layer keeps the same shape)
    channel_cost = get_family(model).channel_param_cost(model.config)
    assert plan.meta["budget_error_params"] < channel_cost * (4 if method == "uniform" else 1)


def test_global_never_empties_a_layer():
    model = tiny_model("llama")
    scores = _scores(model)
    scores["attn"][0] = torch.zeros(2)  # layer 0 groups look useless: global wants both
    scores["mlp"][0] = torch.zeros(96)
    plan = allocate_flat(model, scores, 0.3, "global")
    assert len(plan.layers[0].keep_groups) >= 1 and len(plan.layers[0].keep_channels) >= 1


def test_uniform_gives_equal_shapes():
    model = tiny_model("qwen2", num_hidden_layers=3)
    shapes = apply_plan(model, allocate_flat(model, _scores(model), 0.2, "uniform"))
    assert len(set(shapes)) == 1


def test_global_removes_lowest_score_per_parameter():
    model = tiny_model("llama")
    scores = {"attn": [torch.full((2,), 1e6), torch.full((2,), 1e6)], "mlp": [torch.arange(96.0), torch.arange(96.0) + 0.5]}
    plan = allocate_flat(model, scores, 0.05, "global")
    removed0 = set(range(96)) - set(plan.layers[0].keep_channels)
    removed1 = set(range(96)) - set(plan.layers[1].keep_channels)
    assert removed0 and all(plan.layers[i].keep_groups == [0, 1] for i in range(2))
    # lowest scores go first: removed channels are prefixes in both layers, interleaved by score
    assert removed0 == set(range(len(removed0))) and removed1 == set(range(len(removed1)))
    assert abs(len(removed0) - len(removed1)) <= 1


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.1, 1.5, float("inf")])
def test_ratio_out_of_range(ratio):
    with pytest.raises(ValueError, match=r"prune.ratio=.* is not allowed: must be a number in \(0.0, 1.0\)"):
        settings_of(ratio)


def test_more_than_exists_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="at most"):
        allocate_flat(model, _scores(model), 0.95)


def test_unknown_allocation():
    with pytest.raises(ValueError, match="prune.allocation='nope' is not allowed: use one of global, uniform"):
        settings_of(0.2, allocation="nope")
