"""The notebook API: `prunelight.prune` and `prunelight.apply_plan` (the README's "Python API" snippet)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import prunelight
from prunelight.surgery import mask_units
from prunelight.testing import tiny_model


def _calibration(samples: int = 16, seq_len: int = 16) -> torch.Tensor:
    return torch.randint(3, 128, (samples, seq_len), generator=torch.Generator().manual_seed(0))


def test_readme_snippet_prunes_and_applies_the_plan_to_a_sibling(tmp_path):
    # The README's snippet, with tiny models standing in for the hub ones.
    model, sibling = tiny_model(seed=0), tiny_model(seed=1)
    calibration = _calibration()  # [samples, seq_len] token ids
    model, plan = prunelight.prune(model, {"ratio": 0.3, "criterion": "flap"}, calibration)
    sibling = prunelight.apply_plan(sibling, plan)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    again = prunelight.apply_plan(tiny_model(seed=1), tmp_path / "plan.json")

    before = sum(p.numel() for p in tiny_model().parameters())
    after = sum(p.numel() for p in model.parameters())
    assert after == before - plan.meta["params_removed"] and plan.meta["removed_fraction_total"] >= 0.3
    shapes = [(m.self_attn.k_proj.out_features, m.mlp.up_proj.out_features) for m in model.model.layers]
    assert shapes == [(m.self_attn.k_proj.out_features, m.mlp.up_proj.out_features) for m in sibling.model.layers]
    x = calibration[:2]
    with torch.no_grad():
        assert torch.equal(sibling(x).logits, again(x).logits)


def test_prune_without_repair_equals_masking(tmp_path):
    model, ref = tiny_model(), tiny_model()
    model, plan = prunelight.prune(model, prunelight.PruneSettings(ratio=0.25, criterion="magnitude",
                                                                   allocation="global", reconstruct="none"), None)
    mask_units(ref, plan)
    x = _calibration(2)
    with torch.no_grad():
        assert torch.allclose(model(x).logits, ref(x).logits, atol=1e-5)


def test_prune_from_saved_scores_equals_scoring_and_refuses_other_weights(tmp_path):
    from prunelight.saved import calibration_identity, save_scores, scores_key
    from prunelight.pipeline import make_plan

    model = tiny_model()
    batches = prunelight.api.as_batches(_calibration())
    s = prunelight.PruneSettings(ratio=0.2, reconstruct="none", allocation="global")
    planned = make_plan(model, batches, s)
    plan0, scores = planned.plan, planned.scores
    options = {"ratio": 0.2, "reconstruct": "none", "allocation": "global", "scores": str(tmp_path / "scores.pt")}
    save_scores(tmp_path / "scores.pt", scores, scores_key(model, s, calibration_identity(settings=s)))
    _, plan = prunelight.prune(tiny_model(), options)  # global: no calibration text needed at all
    assert plan.to_dict()["layers"] == plan0.to_dict()["layers"]
    with pytest.raises(ValueError, match="the weights differ"):
        prunelight.prune(tiny_model(seed=2), options)
    # the default (calibrated) re-allocates the same saved scores with its probes on the calibration text given
    calibrated = {**options, "allocation": "calibrated"}
    direct = make_plan(tiny_model(), batches, prunelight.PruneSettings(**{**calibrated, "scores": None})).plan
    _, plan = prunelight.prune(tiny_model(), calibrated, _calibration())
    assert plan.to_dict()["layers"] == direct.to_dict()["layers"] and "probes" in plan.meta
    with pytest.raises(ValueError, match="measures on calibration text"):
        prunelight.prune(tiny_model(), calibrated)


def test_bad_calls_say_what_is_missing():
    with pytest.raises(ValueError, match="prune.reconstruct='least_squares' needs calibration batches"):
        prunelight.prune(tiny_model(), {"ratio": 0.2})
    with pytest.raises(ValueError, match="prune.criterion='flap' scores units on calibration text"):
        prunelight.prune(tiny_model(), {"ratio": 0.2, "reconstruct": "none"})
    with pytest.raises(ValueError, match="prune.ratio=2 is not allowed"):
        prunelight.prune(tiny_model(), {"ratio": 2})
    with pytest.raises(TypeError, match="settings must be a PruneSettings or a dict"):
        prunelight.prune(tiny_model(), 0.2)


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("options", [
    {"ratio": 0.3},  # the default: flap, calibrated (probes on the calibration text), least-squares repair
    {"ratio": 0.3, "criterion": "taylor", "allocation": "layerwise", "layer_importance": "removal"},
    {"ratio": 0.3, "allocation": "blockwise", "block_importance": "removal"},
])
def test_score_then_cut_is_the_run_cut(options):
    """score + prune(scores=...) makes the plan and the weights `prune` (the run's cut) makes, repair included."""
    calibration = _calibration()
    _, plan = prunelight.prune(ref := tiny_model(), options, calibration)
    scores = prunelight.score(tiny_model(), options, calibration)
    assert isinstance(scores, prunelight.Scores) and scores.samples == 16
    model, again = prunelight.prune(tiny_model(), options, calibration, scores=scores)
    assert again.to_dict()["layers"] == plan.to_dict()["layers"] and again.drop_layers == plan.drop_layers
    assert again.meta["params_removed"] == plan.meta["params_removed"]
    expected = _weights(ref)
    assert all(torch.equal(v, expected[k]) for k, v in _weights(model).items())


def test_scored_once_cut_many_ways():
    """One scoring pass serves several ratios and allocations; each cut is the one `prune` makes from scratch."""
    calibration = _calibration()
    scores = prunelight.score(tiny_model(), {"criterion": "taylor", "allocation": "global",
                                             "report_layer_importance": ["block_influence"]}, calibration)
    assert set(scores.layer_importance) == {"block_influence"}
    for options in ({"criterion": "taylor", "allocation": "global", "ratio": 0.2, "reconstruct": "none"},
                    {"criterion": "taylor", "allocation": "uniform", "ratio": 0.35},
                    {"criterion": "taylor", "allocation": "depth", "ratio": 0.4}):
        _, plan = prunelight.prune(tiny_model(), options, calibration, scores=scores)
        _, direct = prunelight.prune(tiny_model(), options, calibration)
        assert plan.to_dict()["layers"] == direct.to_dict()["layers"], options
        assert plan.drop_layers == direct.drop_layers


def test_prune_from_scores_refuses_what_the_scores_lack_and_bad_formats():
    calibration = _calibration()
    scores = prunelight.score(tiny_model(), {"allocation": "global", "report_layer_importance": []}, calibration)
    with pytest.raises(ValueError, match="no layer importance 'removal'"):
        prunelight.prune(tiny_model(), {"allocation": "layerwise", "layer_importance": "removal"}, calibration,
                       scores=scores)
    # scores handed in: a data criterion needs no text, but the default repair still does
    _, plan = prunelight.prune(tiny_model(), {"allocation": "global", "reconstruct": "none"}, scores=scores)
    assert plan.meta["removed_fraction_total"] >= 0.2
    with pytest.raises(ValueError, match="prune.reconstruct='least_squares' needs calibration batches"):
        prunelight.prune(tiny_model(), {"allocation": "global"}, scores=scores)
    with pytest.raises(ValueError, match="export_format='gguf' is not allowed: use one of auto"):
        prunelight.prune(tiny_model(), {"allocation": "global"}, calibration, scores=scores, export_format="gguf")


def test_prune_for_an_export_format_keeps_its_shapes():
    calibration = _calibration()
    model, plan = prunelight.prune(tiny_model(), {"ratio": 0.3, "allocation": "global"}, calibration,
                                 export_format="stock")
    widths = {(m.self_attn.k_proj.out_features, m.mlp.up_proj.out_features) for m in model.model.layers}
    assert len(widths) == 1 and plan.meta["removed_fraction_total"] > 0.2  # stock: one shape in every layer


def test_import_stays_cheap():
    code = ("import sys, prunelight; mods = [m for m in sys.modules if m.startswith('prunelight.')]; "
            "print(','.join(sorted(mods)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "prunelight.modeling", out  # the API and the pipeline load on first use only
