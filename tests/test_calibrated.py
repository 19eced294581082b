"""The calibrated allocation: probes measure what a masked forward measures, the plan meets the budget,
respects its caps, follows the measured losses, is deterministic, and the cut model equals the masked one."""

from __future__ import annotations

import copy

import pytest
import torch

from prunelight.allocation import count_params
from prunelight.allocation.budget import build_plan, empty_removed, make_budget
from prunelight.allocation.calibrated import Probes, calibrated_width, measure_probes, probe_slices
from prunelight.allocation.split_search import masked
from prunelight.calibration import run_calibration
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.importance import build_criterion
from prunelight.pipeline import make_plan
from prunelight.settings import PruneSettings, SettingsError
from prunelight.surgery import apply_plan, mask_units
from prunelight.testing import tiny_model

FAMILIES = {"llama": {}, "mistral": {}, "qwen2": dict(num_attention_heads=6, num_key_value_heads=2)}


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
    plan, _ = make_plan(model, batches, settings)
    again, _ = make_plan(model, batches, settings)
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
        assert budget.n_groups[i] - len(lp.keep_groups) <= round(reach * sizes["attn"][i])
        assert budget.n_chans[i] - len(lp.keep_channels) <= round(reach * sizes["mlp"][i]) + 1
    mask = copy.deepcopy(model)
    mask_units(mask, plan)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(cut(ids).logits, mask(ids).logits, atol=1e-5, rtol=1e-5)


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


@pytest.mark.parametrize("kwargs, match", [
    (dict(allocation="calibrated", calibrated_reach=0.5), "calibrated_reach"),
    (dict(allocation="calibrated", scores="x.pt"), "no calibration pass"),
    (dict(allocation="calibrated", attn_mlp_split="1:3"), "attn_mlp_split"),
])
def test_bad_calibrated_settings_fail_when_constructed(kwargs, match):
    with pytest.raises(SettingsError, match=match):
        PruneSettings(**kwargs)


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
    """One row: probes measured by the cut's scoring pass, Shape.FREE only, no split, no KV target."""
    from prunelight.allocation import Shape, allocation_of, check_shape

    row = allocation_of("calibrated")
    assert row.probes and not row.layer_importance and not row.splits and not row.kv_target
    assert set(row.by_shape) == {Shape.FREE}
    for shape, fmt in ((Shape.UNIFORM, "stock"), (Shape.SERVED, "nemotron_nas")):
        with pytest.raises(ValueError, match=f"prune.allocation='calibrated' is not allowed with export.format={fmt}"):
            check_shape(PruneSettings(allocation="calibrated"), shape)
    with pytest.raises(SettingsError, match="KV-cache target"):
        PruneSettings(allocation="calibrated", target_kv_cache="1KiB@bf16")


def test_calibrated_without_calibration_text_is_refused_before_any_work():
    from prunelight import prune

    with pytest.raises(ValueError, match="measures probe removals on calibration text"):
        prune(tiny_model("llama"), PruneSettings(allocation="calibrated", criterion="magnitude", reconstruct="none"))


def test_measured_scores_are_re_allocated_with_probes_on_the_given_batches(setup):
    """A benchmark scores once and re-allocates (cut.measured_scores): calibrated still probes the batches."""
    from prunelight.cut import measured_scores, run_cut

    model, batches, scores = setup
    settings = PruneSettings(allocation="calibrated", ratio=0.3, reconstruct="none")
    work = copy.deepcopy(model)
    plan = run_cut(work, batches, settings, scores=measured_scores(scores), surgery=False).plan
    direct, _ = make_plan(copy.deepcopy(model), batches, settings)
    assert plan.meta["allocation"] == "calibrated" and plan.meta["probes"]["loss"] == direct.meta["probes"]["loss"]
    assert plan.meta["params_removed"] == direct.meta["params_removed"]
