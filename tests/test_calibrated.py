"""The calibrated allocation: probes measure what a masked forward measures, the plan meets the budget,
respects its caps, follows the measured losses, is deterministic, and the cut model equals the masked one."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from prunelight.allocation import Shape, count_params
from prunelight.allocation.budget import build_plan, empty_removed, make_budget
from prunelight.allocation.calibrated import (
    Probes,
    calibrated_scores,
    calibrated_width,
    capped_width,
    measure_probes,
    probe_slices,
    trust_cap,
)
from prunelight.allocation.split_search import masked
from prunelight.calibration import run_calibration
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.importance import build_criterion
from prunelight.pipeline import make_plan
from prunelight.settings import PruneSettings, SettingsError
from prunelight.surgery import apply_plan, mask_units
from prunelight.testing import tiny_model

# Gemma-3: alternating sliding / full layers with local / global rotary embeddings, picked by the layer's index.
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": dict(num_attention_heads=6, num_key_value_heads=2), "gemma3_text": {}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def setup(request):
    model = tiny_model(request.param, num_hidden_layers=4, **FAMILIES[request.param]).eval()
    batches = [torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    scores = run_calibration(model, batches, build_criterion("flap"))
    return model, batches, scores


def test_probe_loss_is_the_masked_models_nll_increase(setup):
    """Rerunning only the layers from the probed one (cached inputs) gives the full masked forward's NLL."""
    model, batches, scores = setup
    budget = make_budget(model, PruneSettings(ratio=0.3))
    probes = measure_probes(model, batches, scores, budget)
    base = evaluate_perplexity(model, batches)["nll"]
    assert probes.base_nll == pytest.approx(base, abs=1e-5)
    for kind in ("attn", "mlp"):
        for i in (0, 2):
            removed = empty_removed(budget)
            removed[kind][i] = set(probes.slices[kind][i])
            with masked(model, build_plan(budget, removed)):
                full = evaluate_perplexity(model, batches)["nll"]
            assert probes.loss[kind][i] == pytest.approx(full - base, abs=1e-5), (kind, i)


def test_probe_slices_are_the_lowest_scores_at_the_operating_point(setup):
    model, _, scores = setup
    budget = make_budget(model, PruneSettings(ratio=0.3))
    slices = probe_slices(scores, budget, fraction=0.25)
    for kind in ("attn", "mlp"):
        for t, s in zip(scores[kind], slices[kind]):
            assert len(s) == max(1, round(0.25 * t.numel()))
            rest = [float(t[j]) for j in range(t.numel()) if j not in s]
            assert max(float(t[j]) for j in s) <= min(rest)


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_plan_meets_budget_respects_caps_and_cuts_as_masked(setup, ratio):
    model, batches, _ = setup
    settings = PruneSettings(ratio=ratio, allocation="calibrated")
    plan = make_plan(model, batches, settings).plan
    again = make_plan(model, batches, settings).plan
    assert plan.to_dict()["layers"] == again.to_dict()["layers"], "same data, same plan"
    budget = make_budget(model, settings)
    cut = copy.deepcopy(model)
    before = count_params(cut)
    apply_plan(cut, plan)
    removed = before - count_params(cut)
    assert budget.target <= removed < budget.target + budget.c_cost
    sizes = plan.meta["probes"]["slice_sizes"]
    reach = plan.meta["calibrated_reach"]
    for i, lp in enumerate(plan.layers):
        # caps (plus the one-channel true-up at most)
        assert budget.n_groups[i] - len(lp.keep_groups) <= trust_cap(budget.n_groups[i], sizes["attn"][i], reach)
        assert budget.n_chans[i] - len(lp.keep_channels) <= trust_cap(budget.n_chans[i], sizes["mlp"][i], reach) + 1
    mask = copy.deepcopy(model)
    mask_units(mask, plan)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(cut(ids).logits, mask(ids).logits, atol=1e-5, rtol=1e-5)


def test_the_trust_region_bounds_removed_and_kept_units():
    """Within a factor reach of the probe on both sides: removed <= reach x probe, kept >= probe's kept / reach."""
    assert trust_cap(3, 1, 1.5) == 1  # a one-group probe never vouches for a second group
    assert trust_cap(1536, 425, 1.5) == 637  # a 28% probe: the removed side binds (1.5 x 425)
    assert trust_cap(1536, 968, 1.5) == 1536 - 379  # a 63% probe: 568 kept, at least 379 stay (not 1.5 x 968)
    assert trust_cap(8, 4, 1.0) == 4 and trust_cap(8, 4, 1e9) == 7  # reach 1: the probe; large: all but one


def test_at_a_high_ratio_no_sub_block_is_emptied_on_an_extrapolation():
    """50%: one MLP's probe is 50x cheaper than the rest; it is cut to its trust region, not emptied."""
    model = tiny_model("llama", num_hidden_layers=4)
    budget = make_budget(model, PruneSettings(ratio=0.5))
    scores = {"attn": [torch.ones(n) for n in budget.n_groups],
              "mlp": [torch.arange(n, dtype=torch.float) + 1 for n in budget.n_chans]}
    slices = probe_slices(scores, budget)
    probes = Probes(0.0, {"attn": [1.0] * 4, "mlp": [0.5, 0.01, 0.5, 0.5]}, slices, tokens=1, stderr=None)
    removed, reach = capped_width(calibrated_scores(scores, probes), budget, probes, 1.5)
    n, p = budget.n_chans[1], len(slices["mlp"][1])
    assert reach == 1.5 and p > n / 2, "the setting this test is about: a probe past half the MLP"
    assert n - len(removed["mlp"][1]) == math.ceil((n - p) / reach), "the cheap MLP goes to its bound, no further"
    assert math.floor(reach * p) >= n - 1, "the removed-side cap alone would have emptied it"


def test_measured_loss_decides_where_units_go():
    """Equal raw scores everywhere: the sub-block whose probe cost most keeps its units, the cheapest loses most."""
    model = tiny_model("llama", num_hidden_layers=4)
    budget = make_budget(model, PruneSettings(ratio=0.15))
    scores = {"attn": [torch.ones(n) for n in budget.n_groups], "mlp": [torch.ones(n) for n in budget.n_chans]}
    slices = probe_slices(scores, budget)
    loss = {"attn": [10.0] * 4, "mlp": [1.0, 5.0, 0.01, 1.0]}
    probes = Probes(0.0, loss, slices, tokens=1)
    removed = calibrated_width(scores, budget, probes, reach=2.0)
    assert all(not r for r in removed["attn"]), "attention probes cost 10x: no group goes"
    assert len(removed["mlp"][2]) == max(len(removed["mlp"][i]) for i in range(4))
    assert len(removed["mlp"][1]) == min(len(removed["mlp"][i]) for i in range(4))
    assert len(removed["mlp"][2]) <= 2 * len(slices["mlp"][2]), "the cheapest sub-block is capped"


def test_a_probe_that_lowers_the_loss_does_not_erase_the_order():
    model = tiny_model("llama", num_hidden_layers=2)
    budget = make_budget(model, PruneSettings(ratio=0.1))
    scores = {"attn": [torch.arange(n, dtype=torch.float) + 1 for n in budget.n_groups],
              "mlp": [torch.arange(n, dtype=torch.float) + 1 for n in budget.n_chans]}
    slices = probe_slices(scores, budget)
    probes = Probes(0.0, {"attn": [1.0, 1.0], "mlp": [-0.5, 0.2]}, slices, tokens=1)
    removed = calibrated_width(scores, budget, probes)
    for i in range(2):
        got = sorted(removed["mlp"][i])
        assert got == list(range(len(got))), "inside a sub-block the lowest scores go first"


def test_bad_calibrated_settings_fail_when_constructed():
    with pytest.raises(SettingsError, match=r"^prune.allocation_args.reach=0.5 is not allowed: must be a number"):
        PruneSettings(allocation="calibrated", allocation_args={"reach": 0.5})
    with pytest.raises(SettingsError, match=r"^prune.allocation_args.reech=2 is not allowed: allocation 'calibrated' "
                                            r"takes reach, split_search$"):
        PruneSettings(allocation="calibrated", allocation_args={"reech": 2})
    assert PruneSettings(allocation="calibrated", allocation_args={"reach": 2}).allocation_options.reach == 2.0


def test_prune_only_run_with_calibrated_allocation(tmp_path, monkeypatch):
    """`prunelight fit` with allocation calibrated: the plan records its probes and meets the ratio."""
    import json

    from prunelight.cli import cli_main
    from prunelight.testing import make_tiny_checkpoint, tiny_fit_args, write_tiny_corpus

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cli_main(tiny_fit_args(ckpt, files, "--model.recovery=none", "--prune.allocation=calibrated",
                           "--prune.ratio=0.3", "--trainer.enable_progress_bar=false", "--export.out_dir=runs/c"))
    report = json.loads((tmp_path / "runs" / "c" / "report.json").read_text())
    assert report["plan"]["removed_fraction_total"] == pytest.approx(0.3, abs=0.02)
    plan_meta = json.dumps(report)
    assert '"allocation": "calibrated"' in plan_meta and '"probes"' in plan_meta


def test_the_registry_row_states_what_calibrated_needs_and_honours():
    """One row: probes measured by the cut's scoring pass, scores rescaled once, every shape, split, KV target."""
    from prunelight.allocation import Shape, allocation_of, check_shape

    row = allocation_of("calibrated")
    assert row.measure is not None and row.rescale is not None and not row.zero3 and row.record_as == "probes"
    assert not row.layer_importance and row.splits and row.kv_target
    assert set(row.by_shape) == {Shape.FREE, Shape.UNIFORM, Shape.SERVED}
    for shape in Shape:
        check_shape(PruneSettings(allocation="calibrated"), shape)  # no refusal
    PruneSettings(allocation="calibrated", target_kv_cache="1KiB@bf16", attn_mlp_split=None)
    PruneSettings(allocation="calibrated", scores="x.pt")  # probes run on the batches a run still reads


def _probes_favouring(budget, scores, costly_attn_layer=None, attn=0.05, mlp=0.05):
    """Probes as if measured: every attention probe costs `attn`, every MLP probe `mlp`, one layer's attention 100x."""
    slices = probe_slices(scores, budget)
    loss = {"attn": [attn] * budget.num_layers, "mlp": [mlp] * budget.num_layers}
    if costly_attn_layer is not None:
        loss["attn"][costly_attn_layer] = 100 * attn
    return Probes(0.0, loss, slices, tokens=1, stderr={k: [0.0] * budget.num_layers for k in loss})


def _flat_scores(budget):
    return {"attn": [torch.arange(n, dtype=torch.float) + 1 for n in budget.n_groups],
            "mlp": [torch.arange(n, dtype=torch.float) + 1 for n in budget.n_chans]}


def test_a_fixed_split_gives_each_kind_its_share_on_the_loss_scale():
    """attn_mlp_split 1:3 with calibrated: attention gives about its quarter, where its probes cost least."""
    from prunelight.allocation import allocate

    model = tiny_model("llama", num_hidden_layers=4)
    settings = PruneSettings(ratio=0.3, allocation="calibrated", attn_mlp_split="1:3")
    budget = make_budget(model, settings)
    scores = _flat_scores(budget)
    plan = allocate(budget, scores, settings, measured=_probes_favouring(budget, scores, costly_attn_layer=1))
    removed = plan.meta["params_removed"]
    assert budget.target <= removed < budget.target + budget.c_cost
    attn = sum(budget.n_groups[i] - len(lp.keep_groups) for i, lp in enumerate(plan.layers)) * budget.g_cost
    assert abs(attn - 0.25 * budget.target) <= budget.g_cost / 2 + 1, "attention's share to the nearest group"
    assert len(plan.layers[1].keep_groups) == budget.n_groups[1], "the layer whose attention probe cost 100x keeps it"
    assert "probes" in plan.meta


def test_under_a_stock_layout_the_uniform_shape_of_least_predicted_loss_is_chosen():
    """export.format stock: global's uniform-shape search on calibrated costs; costly attention -> MLP only."""
    from prunelight.allocation import Shape, allocate

    model = tiny_model("llama", num_hidden_layers=4)
    settings = PruneSettings(ratio=0.2, allocation="calibrated")
    budget = make_budget(model, settings)
    scores = _flat_scores(budget)
    costly = allocate(budget, scores, settings, shape=Shape.UNIFORM,
                      measured=_probes_favouring(budget, scores, attn=5.0, mlp=0.01))
    cheap = allocate(budget, scores, settings, shape=Shape.UNIFORM,
                     measured=_probes_favouring(budget, scores, attn=1e-4, mlp=5.0))
    for plan in (costly, cheap):
        assert len({len(lp.keep_groups) for lp in plan.layers}) == 1
        assert len({len(lp.keep_channels) for lp in plan.layers}) == 1
        assert plan.meta["uniform_shape"] and "probes" in plan.meta
    assert costly.meta["stock_shapes"]["chosen"] == 0, "attention costs 500x the MLP per probe: MLP-only shape"
    assert cheap.meta["stock_shapes"]["chosen"] > 0, "attention nearly free: groups go"


def test_a_kv_cache_target_takes_the_groups_of_lowest_calibrated_cost():
    from prunelight.allocation import allocate

    model = tiny_model("llama", num_hidden_layers=4)
    settings = PruneSettings(allocation="calibrated", target_kv_cache="640B@fp32")
    budget = make_budget(model, settings)
    assert budget.kv_groups > 0
    scores = _flat_scores(budget)
    # raw scores favour layer 0's groups (scaled down 100x); its probe says they are the costliest
    scores["attn"][0] = scores["attn"][0] / 100
    plan = allocate(budget, scores, settings, measured=_probes_favouring(budget, scores, costly_attn_layer=0))
    gone = [budget.n_groups[i] - len(lp.keep_groups) for i, lp in enumerate(plan.layers)]
    assert sum(gone) == budget.kv_groups and gone[0] == 0
    glob = allocate(budget, scores, PruneSettings(allocation="global", target_kv_cache="640B@fp32"))
    assert len(glob.layers[0].keep_groups) < budget.n_groups[0], "global follows the raw scores into layer 0"


def test_the_split_search_and_saved_scores_work_with_calibrated(setup, tmp_path):
    """attn_mlp_split auto tries shares of the calibrated allocation; saved scores are re-allocated with probes."""
    from prunelight.testing import cut_with
    from prunelight.saved import save_scores, scores_key

    model, batches, scores = setup
    auto = PruneSettings(ratio=0.3, allocation="calibrated", attn_mlp_split="auto", reconstruct="none")
    plan = make_plan(model, batches, auto).plan
    assert plan.meta["split_search"]["tried"] and "probes" in plan.meta
    settings = PruneSettings(ratio=0.3, allocation="calibrated", reconstruct="none")
    direct = make_plan(model, batches, settings).plan
    path = tmp_path / "scores.pt"
    save_scores(path, scores, scores_key(model, settings, {}))
    again = cut_with(copy.deepcopy(model), batches, PruneSettings(**{**settings.as_dict(), "scores": str(path)}),
                    surgery=False).plan
    assert again.meta["probes"]["loss"] == direct.meta["probes"]["loss"]
    assert again.to_dict()["layers"] == direct.to_dict()["layers"]


def test_probe_errors_are_pooled_over_ranks():
    """Under DDP every rank must shrink the same numbers: the standard errors are pooled, not left per rank."""
    from prunelight.allocation import MeasureInputs
    from prunelight.allocation.calibrated import measure_calibrated

    model = tiny_model("llama", num_hidden_layers=2).eval()
    batches = [torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))]
    scores = run_calibration(model, batches, build_criterion("flap"))
    budget = make_budget(model, PruneSettings(ratio=0.3))
    settings = PruneSettings(ratio=0.3)

    def measure(reduce_sum):
        return measure_calibrated(MeasureInputs(model, batches, budget, scores, settings, Shape.FREE,
                                                settings.allocation_options, reduce_sum))

    one = measure(None)
    two = measure(lambda t: 2 * t)  # two ranks that measured the same
    for kind in ("attn", "mlp"):
        assert two.loss[kind] == pytest.approx(one.loss[kind])
        assert two.stderr[kind] == pytest.approx([v / 2 ** 0.5 for v in one.stderr[kind]])


def test_calibrated_without_calibration_text_is_refused_before_any_work():
    from prunelight import prune

    with pytest.raises(ValueError, match="measures on calibration text"):
        prune(tiny_model("llama"), PruneSettings(allocation="calibrated", criterion="magnitude", reconstruct="none"))


def test_measured_scores_are_re_allocated_with_probes_on_the_given_batches(setup):
    """A benchmark scores once and re-allocates (cut.measured_scores): calibrated still probes the batches."""
    from prunelight.cut import measured_scores
    from prunelight.testing import cut_with

    model, batches, scores = setup
    settings = PruneSettings(allocation="calibrated", ratio=0.3, reconstruct="none")
    work = copy.deepcopy(model)
    plan = cut_with(work, batches, settings, scores=measured_scores(scores), surgery=False).plan
    direct = make_plan(copy.deepcopy(model), batches, settings).plan
    assert plan.meta["allocation"] == "calibrated" and plan.meta["probes"]["loss"] == direct.meta["probes"]["loss"]
    assert plan.meta["params_removed"] == direct.meta["params_removed"]
