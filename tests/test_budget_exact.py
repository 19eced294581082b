"""Every allocation meets the parameter target within one MLP channel (or its documented step), counted exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from prunelight.allocation import count_params
from prunelight.allocation.budget import Budget, empty_removed, fill, make_budget, meet, units
from prunelight.importance import build_criterion
from prunelight.surgery import apply_plan
from prunelight.testing import allocate_flat, settings_of, tiny_model

RATIOS = (0.1, 0.2, 0.33, 0.5)
LAYER_SCORES = [0.5, 3.0, 1.0, 2.0]
# Qwen2 with 3:1 query:KV heads and q/k/v biases: the layout where a group is the coarsest unit.
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": dict(num_attention_heads=6, num_key_value_heads=2)}
ALLOCATIONS = [
    ("global", {}),
    ("global", dict(attn_share=0.25)),
    ("global", dict(min_groups=0, min_channels=0)),
    ("layerwise", {}),
    ("layerwise", dict(attn_share=0.3)),
    ("blockwise", {}),
    ("depth", {}),
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_setup(request):
    model = tiny_model(request.param, num_hidden_layers=4, **FAMILIES[request.param])
    scores = build_criterion("random", seed=1).scores(model)
    # Groups look cheap per parameter, so the greedy order crosses the target on a GQA group.
    scores["attn"] = [t * 1e-3 for t in scores["attn"]]
    return model, scores


def _removed_by_surgery(model, plan) -> int:
    cut = copy.deepcopy(model)
    before = count_params(cut)
    apply_plan(cut, plan)
    return before - count_params(cut)


def _check(model, plan, ratio, tolerance_units: int = 1) -> None:
    budget = make_budget(model, settings_of(ratio))
    assert plan.meta["params_removed"] == _removed_by_surgery(model, plan), "plan counts what surgery removes"
    error = plan.meta["budget_error_params"]
    assert error == plan.meta["params_removed"] - budget.target
    assert 0 <= error < tolerance_units * budget.c_cost, (error, budget.c_cost, budget.g_cost)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("allocation, options", ALLOCATIONS, ids=lambda v: str(v))
def test_within_one_channel(family_setup, ratio, allocation, options):
    model, scores = family_setup
    plan = allocate_flat(model, scores, ratio, allocation, layer_scores=LAYER_SCORES, **options)
    _check(model, plan, ratio)


@pytest.mark.parametrize("ratio", RATIOS)
def test_uniform_within_one_channel_per_layer(family_setup, ratio):
    model, scores = family_setup
    plan = allocate_flat(model, scores, ratio, "uniform")
    _check(model, plan, ratio, tolerance_units=model.config.num_hidden_layers)
    shapes = {(len(lp.keep_groups), len(lp.keep_channels)) for lp in plan.layers}
    assert len(shapes) == 1, "uniform keeps equal layer shapes"


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("allocation", ["global", "depth"])
def test_aligned_within_one_step(family_setup, ratio, allocation):
    model, scores = family_setup
    plan = allocate_flat(model, scores, ratio, allocation, layer_scores=LAYER_SCORES, align_channels=8)
    _check(model, plan, ratio, tolerance_units=8)
    assert all(len(lp.keep_channels) % 8 == 0 for i, lp in enumerate(plan.layers) if i not in plan.drop_layers)


def test_emptied_layer_norms_are_counted():
    """global with min_groups/min_channels 0 drops a useless layer; its norms count toward the budget."""
    model = tiny_model("qwen2", num_hidden_layers=4, **FAMILIES["qwen2"])
    scores = build_criterion("random", seed=2).scores(model)
    for kind in scores:
        scores[kind][2] = scores[kind][2] * 1e-6
    plan = allocate_flat(model, scores, 0.3, "global", min_groups=0, min_channels=0)
    assert plan.drop_layers == [2]
    _check(model, plan, 0.3)


def test_qwen2_taylor_weight_no_longer_overshoots_by_a_group():
    """The reported case: a 3:1 Qwen2 with biases, weight-Taylor scores, 20%: within a channel of 20%."""
    model = tiny_model("qwen2", num_hidden_layers=4, **FAMILIES["qwen2"])
    batches = [torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    from prunelight.calibration import run_calibration

    scores = run_calibration(model, batches, build_criterion("taylor_weight"))
    plan = allocate_flat(model, scores, 0.2, "global")
    _check(model, plan, 0.2)


def _toy_budget() -> Budget:
    return Budget(n_groups=[2], n_chans=[20], g_cost=10, c_cost=1, attn_extra=[0], mlp_extra=[0], layer_extra=[0],
                  total=40, decoder=40, target=15, ratio=0.375, min_groups=0, min_channels=0)


def test_fill_passes_over_a_crossing_group_for_the_next_channels():
    budget = _toy_budget()
    scores = {"attn": [torch.tensor([0.5, 100.0])], "mlp": [torch.arange(20.0) * 0.1]}
    # Order by score per parameter: ch0 (0), group0 (0.05), ch1 (0.1), ...: taking group0 early is fine; the
    # second group would cross the target by far, so channels fill the rest.
    removed = empty_removed(budget)
    lim = {"attn": [2], "mlp": [20]}
    total = meet(units(scores, budget), budget.target, removed, lim, 0, budget.c_cost)
    assert total == 15 and removed["attn"][0] == {0} and removed["mlp"][0] == set(range(5))
    # Without the step the old greedy stops where it crosses.
    removed = empty_removed(budget)
    assert fill(units(scores, budget), 12, removed, lim, 0) == 12
    removed = empty_removed(budget)
    scores = {"attn": [torch.tensor([0.0, 0.0])], "mlp": [torch.arange(20.0) + 1]}
    assert fill(units(scores, budget), 15, removed, lim, 0) == 20  # two groups: overshoots by 5 channels
    removed = empty_removed(budget)
    assert meet(units(scores, budget), 15, removed, lim, 0, budget.c_cost) == 15
    assert removed["attn"][0] == {0} and removed["mlp"][0] == set(range(5))  # cheapest channels after the group


def test_meet_swaps_a_group_when_only_groups_were_taken():
    budget = _toy_budget()
    scores = {"attn": [torch.tensor([0.0, 0.1])], "mlp": [torch.arange(20.0) + 1]}
    removed = {"attn": [{0, 1}], "mlp": [set()]}  # 20 removed, target 15: giving back a group undershoots
    total = meet(units(scores, budget), 15, removed, {"attn": [2], "mlp": [20]}, 20, budget.c_cost)
    assert total == 15 and removed["attn"][0] == {0} and len(removed["mlp"][0]) == 5
