"""Allocations meet the parameter budget, honour their options, and refuse bad input before any work."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from prunelight.allocation import count_params
from prunelight.allocation.budget import make_budget
from prunelight.allocation.layerwise import layer_rates
from prunelight.allocation.split_search import parse_split, search_split
from prunelight.calibration import run_calibration
from prunelight.cli import cli_main
from prunelight.importance import build_criterion
from prunelight.pipeline import make_plan
from prunelight.surgery import apply_plan, mask_units
from prunelight.allocation.layerwise import LayerwiseOptions as LayerRates
from prunelight.settings import PruneSettings
from prunelight.testing import allocate_flat, settings_of, tiny_model

REPO = Path(__file__).resolve().parents[1]
IMPORTANCE = [0.5, 3.0, 1.0, 2.0]  # layer 1 most important, layer 0 least


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", num_hidden_layers=4)
    batches = [torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    scores = run_calibration(model, batches, build_criterion("taylor"))
    return model, batches, scores


def _cut(model, plan) -> int:
    """Apply to a copy; the parameters actually removed."""
    cut = copy.deepcopy(model)
    before = count_params(cut)
    apply_plan(cut, plan)
    return before - count_params(cut)


def _max_unit(budget) -> int:
    """The budget tolerance: one MLP channel (a GQA group that would overshoot is swapped for channels)."""
    return budget.c_cost


@pytest.mark.parametrize("strategy", ["inverse", "proportional", "uniform"])
def test_layerwise_meets_budget(setup, strategy):
    model, _, scores = setup
    budget = make_budget(model, PruneSettings(ratio=0.3))
    plan = allocate_flat(model, scores, 0.3, "layerwise", layer_scores=IMPORTANCE, rate_strategy=strategy, alpha=2.0)
    removed = _cut(model, plan)
    assert removed == plan.meta["params_removed"]
    assert budget.target <= removed < budget.target + _max_unit(budget)
    rates = plan.meta["layer_rates"]
    assert sum(r * budget.layer_units(i) for i, r in enumerate(rates)) == pytest.approx(budget.target, rel=1e-6)
    order = sorted(range(4), key=lambda i: IMPORTANCE[i])
    if strategy == "inverse":  # important layers are cut less
        assert [rates[i] for i in order] == sorted(rates, reverse=True)
    elif strategy == "proportional":
        assert [rates[i] for i in order] == sorted(rates)
    else:
        assert max(rates) - min(rates) < 1e-9


def test_layer_rates_clip_freeze_and_spread(setup):
    model, _, _ = setup
    budget = make_budget(model, PruneSettings(ratio=0.25))
    flat = layer_rates(IMPORTANCE, budget, LayerRates(alpha=0.0))
    assert max(flat) - min(flat) < 1e-9  # alpha 0: no spread
    mild = layer_rates(IMPORTANCE, budget, LayerRates(alpha=0.5))
    steep = layer_rates(IMPORTANCE, budget, LayerRates(alpha=3.0))
    assert max(steep) - min(steep) > max(mild) - min(mild)
    clipped = layer_rates(IMPORTANCE, budget, LayerRates(alpha=5.0, rate_range=(0.1, 0.4)))
    assert all(0.1 - 1e-9 <= r <= 0.4 + 1e-9 for r in clipped)
    frozen = layer_rates(IMPORTANCE, budget, LayerRates(alpha=1.0, freeze_top_n=2))
    assert frozen[1] == 0 and frozen[3] == 0 and min(frozen[0], frozen[2]) > 0
    total = sum(r * budget.layer_units(i) for i, r in enumerate(frozen))
    assert total == pytest.approx(budget.target, rel=1e-6)  # the others take the frozen layers' share


def test_rank_scale_resists_an_outlier(setup):
    model, _, _ = setup
    budget = make_budget(model, PruneSettings(ratio=0.25))
    outlier = [1000.0, 1.0, 2.0, 3.0]  # layer 0 dwarfs the rest, as removal importance of layer 0 often does
    by_value = layer_rates(outlier, budget, LayerRates(alpha=2.0))
    by_rank = layer_rates(outlier, budget, LayerRates(alpha=2.0, importance_scale="rank"))
    assert max(by_value[1:]) - min(by_value[1:]) < 0.01  # min-max squashes layers 1..3 together
    assert by_rank[1] > by_rank[2] > by_rank[3] > by_rank[0]
    assert sum(r * budget.layer_units(i) for i, r in enumerate(by_rank)) == pytest.approx(budget.target, rel=1e-6)


def test_frozen_layers_untouched(setup):
    model, _, scores = setup
    plan = allocate_flat(model, scores, 0.25, "layerwise", layer_scores=IMPORTANCE, freeze_top_n=1)
    assert plan.layers[1].keep_groups == [0, 1] and len(plan.layers[1].keep_channels) == 96


@pytest.mark.parametrize("split, share", [("1:3", 0.25), ("0:1", 0.0)])
def test_attention_mlp_split(setup, split, share):
    model, _, scores = setup
    budget = make_budget(model, PruneSettings(ratio=0.3))
    plan = allocate_flat(model, scores, 0.3, "global", attn_share=parse_split(split))
    attn = plan.removed_counts()[0] * budget.g_cost
    assert abs(attn - share * budget.target) <= budget.g_cost
    assert budget.target <= plan.meta["params_removed"] < budget.target + budget.c_cost  # the MLP takes the rest


def test_alignment_keeps_multiples_and_budget(setup):
    model, _, scores = setup
    budget = make_budget(model, PruneSettings(ratio=0.3))
    plan = allocate_flat(model, scores, 0.3, "global", align_channels=16)
    kept = [len(lp.keep_channels) for lp in plan.layers]
    assert all(k % 16 == 0 and k >= 16 for k in kept), kept
    assert len(set(kept)) > 1  # rebalanced per layer, not one uniform width
    removed = _cut(model, plan)
    assert budget.target <= removed < budget.target + 16 * budget.c_cost  # within one aligned step


def test_blockwise_removes_subblocks_then_width(setup):
    model, _, scores = setup
    budget = make_budget(model, PruneSettings(ratio=0.4))
    plan = allocate_flat(model, scores, 0.4, "blockwise")
    assert plan.meta["blocks_removed"], "no whole sub-block removed"
    empties = [lp for lp in plan.layers if not lp.keep_groups or not lp.keep_channels]
    assert empties
    removed = _cut(model, plan)
    assert budget.target <= removed < budget.target + _max_unit(budget)
    masked, cut = copy.deepcopy(model), copy.deepcopy(model)
    mask_units(masked, plan)
    apply_plan(cut, plan)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(cut(ids).logits, masked(ids).logits, atol=1e-5, rtol=1e-5)


def test_global_may_empty_and_drop_a_layer(setup):
    model, _, scores = setup
    weak = {k: [t.clone() for t in v] for k, v in scores.items()}
    for kind in weak:
        weak[kind][2] = weak[kind][2] * 1e-6  # layer 2 matters least by far
    spine = allocate_flat(model, weak, 0.25, "global")
    assert not spine.drop_layers and spine.layers[2].keep_groups  # default keeps one unit per layer
    plan = allocate_flat(model, weak, 0.25, "global", min_groups=0, min_channels=0)
    assert plan.drop_layers == [2]
    cut = copy.deepcopy(model)
    apply_plan(cut, plan)
    assert len(cut.model.layers) == 3
    assert cut.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_search_stops_early_on_rising_perplexity():
    calls = []

    def score(share):
        calls.append(share)
        return (share - 0.3) ** 2  # rises on both sides of 0.3

    best, tried = search_split(score, start=0.3, low=0.0, high=1.0, step=0.1, fine_step=0.05, patience=2)
    assert best == pytest.approx(0.3)
    coarse = [s for s in calls if abs(s * 10 - round(s * 10)) < 1e-6]
    assert sorted(coarse) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])  # 0.6 ... 1.0 never scored
    assert len(calls) == len(set(calls)) == 7  # + fine points 0.25 and 0.35
    assert len(tried) == 7


def test_search_finds_a_minimum_off_the_grid():
    best, _ = search_split(lambda s: abs(s - 0.62), start=0.2, step=0.1, fine_step=0.02, patience=2)
    assert best == pytest.approx(0.62)


def test_auto_split_in_make_plan(setup, monkeypatch):
    model, batches, _ = setup
    from prunelight.allocation import measured_split

    seen = []
    real = measured_split.calibration_nll

    def spy(model, plan, scored_batches, reduce_sum=None):
        seen.append(scored_batches)
        return real(model, plan, scored_batches, reduce_sum)

    monkeypatch.setattr(measured_split, "calibration_nll", spy)
    settings = settings_of(0.3, attn_mlp_split="auto", split_search={"step": 0.25, "fine_step": 0.125})
    plan = make_plan(model, batches, settings).plan
    search = plan.meta["split_search"]
    assert plan.meta["attn_share_target"] == search["best"]
    assert min(t["calibration_nll"] for t in search["tried"]) == pytest.approx(
        next(t["calibration_nll"] for t in search["tried"] if t["attn_share"] == search["best"]))
    assert seen and all(b is not None and all(any(x is y for y in batches) for x in b) for b in seen)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(allocation="layerwise", rate_strategy="log"), r"prune.allocation_args.rate_strategy='log' .*inverse"),
        (dict(allocation="depth", layer_importance="cka"), "prune.layer_importance='cka'"),
        (dict(allocation="blockwise", block_importance="taylor"), "prune.allocation_args.block_importance='taylor'"),
        (dict(allocation="knapsack"), "prune.allocation='knapsack' is not allowed: use one of global"),
        (dict(attn_mlp_split="3"), "prune.attn_mlp_split='3' is not allowed: use 'x:y'"),
        (dict(attn_mlp_split="-1:2"), "prune.attn_mlp_split='-1:2'"),
        (dict(attn_mlp_split=63), "quote it"),  # what YAML makes of an unquoted 1:3
        (dict(allocation="depth", attn_mlp_split="1:1"), "applies to allocation global or layerwise"),
        (dict(align_channels=0), "prune.align_channels=0 is not allowed: must be an integer >= 1"),
        (dict(allocation="layerwise", rate_range=[0.5, 0.2]), "prune.allocation_args.rate_range"),
        (dict(allocation="layerwise", freeze_top_n=-1), "prune.allocation_args.freeze_top_n=-1"),
        (dict(allocation="layerwise", alpha=-1.0), "prune.allocation_args.alpha=-1.0"),
        (dict(allocation="layerwise", importance_scale="log"), "prune.allocation_args.importance_scale='log'"),
        (dict(attn_mlp_split="auto", split_search={"fine_step": 0.5}), "prune.allocation_args.split_search.fine_step=0.5"),
        (dict(criterion="taylor", criterion_args={"p": 1}), "prune.criterion_args"),
        (dict(min_groups=-1), "prune.min_groups=-1"),
        (dict(ratio=float("nan")), "prune.ratio=nan"),
    ],
)
def test_bad_settings_fail_when_constructed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        settings_of(**kwargs)


@pytest.mark.parametrize(
    "allocation, args, match",
    [
        ("layerwise", {"freeze_top_n": 4}, "freeze_top_n=4 is not allowed: the model has 4 layers"),
        ("layerwise", {"freeze_top_n": 3, "rate_range": [0.0, 0.5]}, "layer rates up to 0.5"),
        ("global", {"attn_mlp_split": "9:1"}, "asks attention for"),
    ],
)
def test_impossible_budgets_fail_before_calibration(setup, monkeypatch, allocation, args, match):
    model, batches, _ = setup
    from prunelight import pipeline

    def no_calibration(*a, **k):
        raise AssertionError("calibration ran before the options were checked")

    monkeypatch.setattr(pipeline, "run_calibration", no_calibration)
    with pytest.raises(ValueError, match=match):
        make_plan(model, batches, settings_of(0.3, allocation=allocation, **args))


@pytest.mark.parametrize("method, allocation", [("taylor", "global"), ("layerwise", "layerwise"),
                                                ("blockwise", "blockwise"), ("depth", "depth")])
def test_method_presets_are_fragments_over_a_base_config(method, allocation, capsys):
    base, path = REPO / "configs" / "reference.yaml", REPO / "configs" / "methods" / f"{method}.yaml"
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(base), "--config", str(path), "--print_config"])
    assert exc.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["prune"]["allocation"] == allocation and printed["prune"]["criterion"] == "taylor"
    assert printed["export"]["out_dir"] == f"runs/{method}"
    assert printed["model"]["pretrained"].endswith("ref-llama-gqa")  # the rest comes from the base config
    assert len(path.read_text().splitlines()) < 25


def test_layerwise_on_reference_model(ref_model_dir):
    """The real 8-layer model: measured block influence, inverse rates, budget met within one channel."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref_model_dir, dtype=torch.float32).eval()
    batches = [torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))]
    plan = make_plan(model, batches, settings_of(0.2, allocation="layerwise", alpha=2.0)).plan
    budget = make_budget(model, PruneSettings(ratio=0.2))
    assert budget.target <= plan.meta["params_removed"] < budget.target + _max_unit(budget)
    imp = plan.meta["layer_importance"]["block_influence"]
    rates = plan.meta["layer_rates"]
    assert rates[max(range(8), key=imp.__getitem__)] < rates[min(range(8), key=imp.__getitem__)]


def test_quoted_split_reaches_the_settings(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text('prune:\n  attn_mlp_split: "1:3"\n')
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(REPO / "configs" / "reference.yaml"), "--config", str(tmp_path / "c.yaml"),
                  "--print_config"])
    assert "attn_mlp_split: '1:3'" in capsys.readouterr().out
