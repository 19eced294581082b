"""Layer importance: each measure means what it says, checked against models where the answer is known."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from prunelight.evaluation.figures import plot_layer_importance
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.layer_importance import layer_importance, layer_importances, subblock_removal
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.surgery import apply_plan
from prunelight.testing import tiny_model


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (2, 16), generator=g) for _ in range(2)]


def _identity_layer(model, i):
    """Zero the outputs of layer i's attention and MLP: the layer then passes its input through."""
    with torch.no_grad():
        model.model.layers[i].self_attn.o_proj.weight.zero_()
        model.model.layers[i].mlp.down_proj.weight.zero_()


def _plan(model, drop=(), empty_attn=()):
    n = len(model.model.layers)
    layers = [LayerPlan([] if i in empty_attn or i in drop else [0, 1], [] if i in drop else list(range(96)))
              for i in range(n)]
    return PrunePlan(layers, [2] * n, [96] * n, drop_layers=list(drop))


def test_identity_layer_has_no_influence():
    model = tiny_model("llama", num_hidden_layers=3)
    _identity_layer(model, 1)
    vals = layer_importances(model, _batches(), ["block_influence", "activation_change", "removal"])
    for name, v in vals.items():
        assert len(v) == 3
        assert abs(v[1]) < 1e-5, (name, v)
        assert abs(v[0]) > 1e-4 and abs(v[2]) > 1e-4, (name, v)  # random layers do change the output


def test_removal_is_the_perplexity_rise_of_dropping_the_layer():
    model = tiny_model("qwen2", num_hidden_layers=3)
    batches = _batches()
    removal = layer_importance(model, batches, "removal")
    base = evaluate_perplexity(model, batches)["ppl"]
    for i in range(3):
        cut = copy.deepcopy(model)
        apply_plan(cut, _plan(cut, drop=[i]))
        assert math.isclose(removal[i], evaluate_perplexity(cut, batches)["ppl"] - base, rel_tol=1e-4, abs_tol=1e-4)


def test_subblock_removal_matches_removing_attention():
    model = tiny_model("llama", num_hidden_layers=2)
    batches = _batches()
    sub = subblock_removal(model, batches)
    base = evaluate_perplexity(model, batches)["ppl"]
    cut = copy.deepcopy(model)
    apply_plan(cut, _plan(cut, empty_attn=[1]))
    assert math.isclose(sub["attn"][1], evaluate_perplexity(cut, batches)["ppl"] - base, rel_tol=1e-4, abs_tol=1e-4)
    # Already-removed sub-blocks have no score.
    assert subblock_removal(cut, batches)["attn"][1] is None


def test_unknown_measure_rejected():
    with pytest.raises(ValueError, match="unknown layer importance 'cosine'.*block_influence"):
        layer_importance(tiny_model("llama"), _batches(), "cosine")


def test_plot_is_a_png(tmp_path):
    path = plot_layer_importance({"removal": [0.3, 1.2, 0.1], "block_influence": [0.1, 0.2, 0.05]}, tmp_path / "li.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["li.png"]  # no temporary file left behind
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_layer_importance({}, tmp_path / "x.png")
