"""Running a decoder from a cached layer input (`prunelight.allocation.prefix`) and the search fitness that relies on it."""

from __future__ import annotations

import random

import pytest
import torch

from prunelight.allocation.search.fitness import KLFitness
from prunelight.allocation.search.space import LevelSpace
from prunelight.families import get_family
from prunelight.allocation.prefix import recorded_inputs, started_at
from prunelight.testing import FAMILIES, tiny_model
from tests.test_search import _batches, _setup


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("start", [1, 2, 3])
def test_a_forward_started_at_a_layer_equals_the_full_forward(family, start):
    """Every family, every start: the layers keep their index, so sliding / full masks and Gemma-3's local / global
    rotary embeddings (picked by the layer's position) are those of the full forward."""
    model = tiny_model(family, seed=0, num_hidden_layers=4, max_position_embeddings=64)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), recorded_inputs(model) as inputs:
        full = model(input_ids=ids, use_cache=False).logits
    with torch.no_grad(), started_at(model, start) as stand:
        stand.state = inputs[start][0]
        part = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(part, full, atol=1e-5, rtol=1e-5)
    layers = get_family(model).layers(model)
    assert len(inputs[0]) == 1 and len(layers) == 4 and all(type(m).__name__ != "_StandIn" for m in layers)


def test_the_layers_before_the_start_are_not_run():
    model = tiny_model("llama", seed=0, num_hidden_layers=4)
    ids = torch.randint(3, 128, (1, 8))
    ran = []
    for i, layer in enumerate(get_family(model).layers(model)):
        layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
    with torch.no_grad(), started_at(model, 3) as stand:
        stand.state = torch.zeros(1, 8, model.config.hidden_size)
        model(input_ids=ids, use_cache=False)
    assert ran == [3]
    with pytest.raises(ValueError, match="layer=4 is not a decoder layer index"):
        with started_at(model, 4):
            pass


def test_the_fitness_reuses_kept_prefixes_and_scores_as_without_them():
    """A random walk of offspring as the search makes them: every KL equals the fitness that runs every layer, and
    the kept prefixes skip layers; the candidate of least KL stays kept."""
    model, _, budget, _, db = _setup()
    rows = torch.cat(_batches())
    plain = KLFitness(model, db, rows, batch=2, prefix_entries=0)
    kept = KLFitness(model, db, rows, batch=2, prefix_entries=2)
    space = LevelSpace.of(budget, mlp_levels=8)
    rng = random.Random(0)
    parent = space.snap({"attn": [0] * 3, "mlp": [16] * 3})
    best = kept(parent, 8)
    assert best == pytest.approx(plain(parent, 8), rel=1e-6, abs=1e-9)
    for _ in range(12):
        kid = space.mutate(parent, rng, 2)
        if kid is None or kid == parent:
            continue
        for n in (2, 8):
            kl = kept(kid, n)
            assert kl == pytest.approx(plain(kid, n), rel=1e-6, abs=1e-9)
        if kl < best:
            parent, best = kid, kl
        assert ((db.ridge, db.repair), tuple(zip(parent["attn"], parent["mlp"]))) in kept.kept and len(kept.kept) <= 2
    assert kept.forwards == plain.forwards
    assert kept.layers_run < plain.layers_run == plain.forwards * 3


def test_a_kept_prefix_is_not_reused_after_the_refits_change():
    """Cross-validating the cut's ridge scores one assignment at several ridges: each is a new model."""
    model, _, budget, _, db = _setup()
    rows = torch.cat(_batches())
    fit = KLFitness(model, db, rows, batch=2, prefix_entries=2)
    lv = LevelSpace.of(budget, mlp_levels=8).snap({"attn": [1, 0, 0], "mlp": [16, 16, 16]})
    first = fit(lv, 8)
    db.set_ridge(10.0)
    other = fit(lv, 8)
    assert other == pytest.approx(KLFitness(model, db, rows, batch=2, prefix_entries=0)(lv, 8), rel=1e-6)
    assert other != pytest.approx(first, rel=1e-3)
