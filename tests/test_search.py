"""allocation search: levels database, budget window, KL fitness, the search never worse than its seeds, resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import random

import pytest
import torch

from prunelight.allocation.base import Shape
from prunelight.allocation.budget import build_plan, make_budget, plan_params_removed
from prunelight.allocation import search as search_mod
from prunelight.allocation.search import fitness as fitness_mod
from prunelight.allocation.search import run_search
from prunelight.allocation.search.evolve import auto_generations, evolve
from prunelight.allocation.search.fitness import AUTO_FOLDS_MEMORY_SHARE, CrossFitKL, KLFitness, auto_fitness_folds
from prunelight.allocation.search.levels import LevelsDatabase, build_database
from prunelight.allocation.search.options import SearchOptions
from prunelight.allocation.search.space import LevelSpace, counts_of, finish, seed_levels
from prunelight.importance import build_criterion
from prunelight.reconstruct import cut_and_reconstruct
from prunelight.settings import PruneSettings
from prunelight.testing import VARIANTS, settings_of, tiny_model


def _batches(n: int = 4, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (2, 24), generator=g) for _ in range(n)]


def _setup(ratio: float = 0.2, order: str = "criterion"):
    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64, num_key_value_heads=2)
    settings = settings_of(ratio, reconstruct="least_squares")
    budget = make_budget(model, settings)
    scores = build_criterion("random", seed=1).scores(model)
    lim = {k: budget.limits(k) for k in ("attn", "mlp")}
    db = build_database(model, _batches(), scores, lim, order, settings.reconstruct_ridge)
    return model, settings, budget, scores, db


def test_mutations_stay_inside_the_budget_window():
    _, _, budget, _, _ = _setup()
    space = LevelSpace.of(budget, mlp_levels=8)
    rng = random.Random(0)
    lv = space.snap({"attn": [0] * 3, "mlp": [16] * 3})
    assert lv is not None and space.within(lv)
    for _ in range(200):
        kid = space.mutate(lv, rng, 3)
        if kid is not None:
            assert space.within(kid)
            assert all(m % space.step == 0 for m in kid["mlp"])
            lv = kid


@pytest.mark.parametrize("order", ["criterion", "obs", "obs_kfac"])
def test_a_level_is_what_the_cut_with_least_squares_writes(order):
    """The database's weights at a level equal the model cut to that level and repaired by the run's reconstruction."""
    import copy

    model, settings, budget, _, db = _setup(order=order)
    space = LevelSpace.of(budget, mlp_levels=8)
    levels = {"attn": [1, 0, 0], "mlp": [8, 16, 0]}
    removed = space.removed(levels, db)
    plan = build_plan(budget, removed)
    cut = copy.deepcopy(model)
    s = settings_of(0.2, reconstruct="obs" if order == "obs" else "least_squares")
    cut_and_reconstruct(cut, plan, _batches(), s)
    from prunelight.families import get_family
    from prunelight.reconstruct import output_proj

    fam = get_family(cut)
    for i, layer in enumerate(fam.layers(cut)):
        w = db.weight_at("mlp", i, levels["mlp"][i])
        kept = [c for c in range(64) if c not in removed["mlp"][i]]
        assert torch.allclose(output_proj(fam, layer, "mlp").weight, w[:, kept], atol=2e-4, rtol=1e-3)
        assert w[:, sorted(removed["mlp"][i])].abs().sum() == 0 if removed["mlp"][i] else True


def test_kl_fitness_is_zero_for_the_dense_levels_and_grows_with_removal():
    model, _, budget, _, db = _setup()
    rows = torch.cat(_batches())
    fit = KLFitness(model, db, rows)
    zero = {"attn": [0] * 3, "mlp": [0] * 3}
    assert fit(zero, 4) == pytest.approx(0.0, abs=1e-4)
    small = fit({"attn": [0] * 3, "mlp": [8, 0, 0]}, 4)
    big = fit({"attn": [0] * 3, "mlp": [48, 0, 0]}, 4)
    assert 0 < small < big
    ref = model(input_ids=rows[:2]).logits  # the dense weights are back after a call
    assert torch.allclose(ref, model(input_ids=rows[:2]).logits)


def test_cross_fitted_fitness_scores_each_fold_with_refits_fitted_without_it():
    """`CrossFitKL` against an independent computation: for each half of the sequences, a database built from the
    other half alone and the plain KL on that half; the first n sequences weigh the folds they span."""
    model, settings, budget, scores, db = _setup(order="criterion")  # the same order whichever rows are read
    rows = torch.cat(_batches())  # 8 sequences: folds of 4
    lim = {k: budget.limits(k) for k in ("attn", "mlp")}
    lv = LevelSpace.of(budget, mlp_levels=8).snap({"attn": [1, 0, 0], "mlp": [24, 16, 8]})
    before = {key: b.gram.clone() for key, b in db.blocks.items()}
    cross = CrossFitKL(model, db, rows, folds=2, batch=2)
    halves = [rows[:4], rows[4:]]
    alone = [KLFitness(model, build_database(model, list(halves[1 - f].split(2)), scores, lim, "criterion",
                                             settings.reconstruct_ridge), halves[f]) for f in range(2)]
    assert cross(lv, 8) == pytest.approx((alone[0](lv, 4) + alone[1](lv, 4)) / 2, rel=1e-4)
    assert cross(lv, 3) == pytest.approx(alone[0](lv, 3), rel=1e-4)
    assert cross(lv, 6) == pytest.approx((4 * alone[0](lv, 4) + 2 * alone[1](lv, 2)) / 6, rel=1e-4)
    assert cross(lv, 8) > KLFitness(model, db, rows)(lv, 8)  # out of sample the refits fit worse
    assert cross.forwards == 8 + 3 + 6 + 8 and all(torch.equal(before[k], b.gram) for k, b in db.blocks.items())
    dense = {"attn": [0, 0, 0], "mlp": [0, 0, 0]}
    assert cross(dense, 8) == pytest.approx(0.0, abs=1e-6)


def test_top_k_kl_is_a_lower_bound_that_is_exact_at_the_whole_vocabulary():
    """kl_top_k coarsens both distributions to the dense top k plus one bucket: never above the full KL, equal to it
    with k = vocabulary, and checked here against the formula computed by hand for one candidate."""
    import torch.nn.functional as F

    model, _, _, _, db = _setup()
    rows = torch.cat(_batches())
    cands = [{"attn": [0] * 3, "mlp": [m, 0, 0]} for m in (8, 24, 48)] + [{"attn": [1, 0, 0], "mlp": [0] * 3}]
    full = KLFitness(model, db, rows)
    whole = KLFitness(model, db, rows, top_k=model.config.vocab_size)
    top = KLFitness(model, db, rows, top_k=8)
    for lv in cands:
        exact = full(lv, 8)
        # two float32 evaluations of the same KL (from W^T p, and from the stored log-probabilities): on this
        # near-dense tiny model (KL ~6e-6 per token) they agree to ~3e-9, as each does with a float64 forward
        assert whole(lv, 8) == pytest.approx(exact, rel=1e-3, abs=2e-8)  # float32 rounding differs by CPU: 8e-9 seen
        assert 0 < top(lv, 8) <= exact + 1e-9
    lv = cands[2]  # by hand: dense and candidate log-probabilities, top 8 of the dense, one bucket for the rest
    with torch.no_grad():
        p = F.log_softmax(model(input_ids=rows[:4]).logits[:, :-1].float(), -1)
        for key, proj in top.projs.items():
            if lv[key[0]][key[1]]:
                proj.weight.data = db.weight_at(key[0], key[1], lv[key[0]][key[1]])
        q = F.log_softmax(model(input_ids=rows[:4]).logits[:, :-1].float(), -1)
        for key, proj in top.projs.items():
            proj.weight.data = top.dense_w[key]
    tp, idx = p.double().topk(8, -1)
    tq = q.double().gather(-1, idx)
    pr, qr = 1 - tp.exp().sum(-1), 1 - tq.exp().sum(-1)
    by_hand = (tp.exp() * (tp - tq)).sum(-1) + pr * (pr.log() - qr.log())
    assert top(lv, 4) == pytest.approx(float(by_hand.mean()), rel=1e-3)
    with pytest.raises(ValueError, match="kl_top_k=0"):
        SearchOptions(kl_top_k=0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_whole_distribution_kl_equals_the_kl_of_the_log_probabilities(family):
    """With a float32 linear head the dense side keeps W^T p per token (hidden size), not the vocabulary's
    log-probabilities; with a soft-capped head (Gemma-2) it keeps those. Either way the KL is the textbook one,
    computed here from the two models' log-softmax."""
    import torch.nn.functional as F

    from prunelight.allocation.search.fitness import linear_head
    from prunelight.families import get_family
    from prunelight.reconstruct import output_proj

    model = tiny_model(family, seed=0, num_hidden_layers=3, intermediate_size=64)
    budget = make_budget(model, settings_of(0.2, reconstruct="least_squares"))
    scores = build_criterion("random", seed=1).scores(model)
    db = build_database(model, _batches(), scores, {k: budget.limits(k) for k in ("attn", "mlp")}, "criterion", 0.01)
    rows = torch.cat(_batches())
    fit = KLFitness(model, db, rows, batch=3)
    assert fit.linear == linear_head(model) == (family == "llama")
    kept = fit.dense[0][2] if fit.linear else fit.dense[0][0]
    assert kept.shape[-1] == (model.config.hidden_size if fit.linear else model.config.vocab_size)
    fam = get_family(model)
    with torch.no_grad():
        p = F.log_softmax(model(input_ids=rows).logits[:, :-1].float(), -1)
        for lv in ({"attn": [1, 0, 0], "mlp": [16, 32, 0]}, {"attn": [0, 0, 1], "mlp": [0, 8, 48]}):
            layers = fam.layers(model)
            dense = {}
            for kind in ("attn", "mlp"):
                for i, r in enumerate(lv[kind]):
                    proj = output_proj(fam, layers[i], kind)
                    dense[(kind, i)] = proj.weight.data
                    if r:
                        proj.weight.data = db.weight_at(kind, i, r)
            q = F.log_softmax(model(input_ids=rows).logits[:, :-1].float(), -1)
            for (kind, i), w in dense.items():
                output_proj(fam, layers[i], kind).weight.data = w
            textbook = float((p.exp() * (p - q)).sum(-1).mean())
            assert fit(lv, 8) == pytest.approx(textbook, rel=1e-3)  # float32 sums of a KL of ~2e-4
            assert fit(lv, 5) == pytest.approx(float((p.exp() * (p - q)).sum(-1)[:5].mean()), rel=1e-3)
    assert abs(fit({"attn": [0] * 3, "mlp": [0] * 3}, 8)) < 1e-6
    assert not linear_head(tiny_model("llama").to(torch.bfloat16))


def test_the_defaults_are_the_search_on_obs_levels_and_measured_block_removal():
    """The allocation that was never worse than the uniform cut (docs/benchmarks.md) is the default, with the budget
    it was measured with; blockwise ranks sub-blocks by measured removal (380x dense with unit scores on SmolLM2)."""
    s = PruneSettings()
    assert s.allocation == "search" and s.reconstruct == "least_squares"
    assert PruneSettings(allocation="blockwise").allocation_options.block_importance == "removal"
    opts = s.allocation_options
    assert (opts.order, opts.generations, opts.offspring, opts.stages, opts.survivors) == ("obs", "auto", 8,
                                                                                        (2, 8, 32), (8, 2, 1))


@pytest.mark.parametrize("ratio, generations", [(0.1, 6), (0.2, 6), (0.3, 9), (0.5, 15)])
def test_generations_auto_grows_with_the_share_of_parameters_removed(tmp_path, ratio, generations):
    """6 generations up to a 20% cut, then 6 per 20%; run_search resolves the count before the search, runs that
    many generations and records the count."""
    model, settings, budget, scores, _ = _setup(ratio)
    assert auto_generations(budget) == generations
    assert budget.target / budget.total == pytest.approx(ratio, abs=0.01)
    opts = SearchOptions(offspring=1, stages=(2,), survivors=(1,), mlp_levels=8, fitness_folds=1, cut_ridge="fixed")
    _, res, _, _ = run_search(model, _batches(), budget, scores, settings, opts, state_dir=tmp_path)
    assert res.generations == generations == res.as_dict()["generations"]
    assert [t["generation"] for t in res.trajectory] == list(range(generations + 1))


def test_kl_top_k_auto_keeps_the_whole_distribution_while_it_fits_in_a_gibibyte():
    auto = SearchOptions()
    assert auto.kl_top_k == "auto"
    assert auto.top_k_for(32, 128, 49152) is None  # SmolLM2: 0.8 GB of dense log-probabilities
    assert auto.top_k_for(32, 2048, 128256) == 256  # Llama-3 at 2048 tokens: 34 GB in full
    assert auto.top_k_for(32, 2048, 128256, linear=True) is None  # a float32 linear head: W^T p per token
    assert auto.top_k_for(10**6, 128, 100) == 100  # never more than the vocabulary
    assert SearchOptions(kl_top_k=None).top_k_for(32, 2048, 128256) is None
    assert SearchOptions(kl_top_k=64).top_k_for(2, 8, 256) == 64
    with pytest.raises(ValueError, match="kl_top_k='all'"):
        SearchOptions(kl_top_k="all")


@pytest.mark.parametrize("folds", [1, 2])
def test_search_is_never_worse_than_its_seeds_and_meets_the_budget(tmp_path, folds):
    model, settings, budget, scores, _ = _setup()
    opts = SearchOptions(generations=4, offspring=4, stages=(2, 4), survivors=(4, 1), mlp_levels=8,
                         fitness_folds=folds)
    removed, res, db, _ = run_search(model, _batches(), budget, scores, settings, opts, state_dir=tmp_path)
    assert res.fitness_folds == folds and res.as_dict()["fitness_folds"] == folds
    if folds == 2:  # the seeds' figures are the cross-fitted KL: each half of the 4 sequences without its refits
        searched = dataclasses.replace(db, ridge=settings.reconstruct_ridge)  # the search's ridge, not the cut's
        uniform = seed_levels(LevelSpace.of(budget, mlp_levels=8), scores)["uniform"]
        cross = CrossFitKL(model, searched, torch.cat(_batches())[:4], 2, 2)(uniform, 4)
        assert res.seeds["uniform"] == pytest.approx(cross, rel=1e-6)
        assert cross > KLFitness(model, searched, torch.cat(_batches())[:4])(uniform, 4)
    assert res.kl <= min(res.seeds.values()) + 1e-12
    assert {"uniform", "global"} <= set(res.seeds)
    total = plan_params_removed(budget, build_plan(budget, removed))
    assert budget.target <= total < budget.target + budget.c_cost
    assert [t["kl"] for t in res.trajectory] == sorted((t["kl"] for t in res.trajectory), reverse=True)
    assert opts.order == "obs" and db.repair == "least_squares" == settings.reconstruct  # the defaults
    assert (tmp_path / "levels_obs.pt").is_file()
    assert (tmp_path / f"search_state_obs-least_squares_{budget.target}.pt").is_file()


def test_a_saved_database_is_reused_only_for_the_same_model_ridge_and_calibration_text(tmp_path, monkeypatch):
    """The database's key holds what its Grams and orders depend on: the same run reads it back; other calibration
    text of the same size, another ridge (OBS's order is chosen with it) or a changed weight deep in the model
    rebuild it instead of silently reusing stale Grams."""
    model, settings, budget, scores, _ = _setup()
    opts = SearchOptions(generations=0, stages=(4,), survivors=(1,), mlp_levels=8, fitness_folds=1,
                         cut_ridge="fixed")
    built = []
    real = search_mod.build_database
    monkeypatch.setattr(search_mod, "build_database", lambda *a, **k: built.append(1) or real(*a, **k))
    other_ridge = settings_of(0.2, reconstruct="least_squares", reconstruct_ridge=0.1)

    def run(batches, s=settings):
        n = len(built)
        _, _, db, _ = run_search(model, batches, budget, scores, s, opts, state_dir=tmp_path)
        return len(built) > n, db

    assert run(_batches())[0]
    assert not run(_batches())[0]  # the same model, ridge and tokens: read back
    assert not run(list(reversed(_batches())))[0]  # the Grams are sums: the sequences' order does not matter
    assert run(_batches(seed=4))[0]  # other text of the same size
    rebuilt, db = run(_batches(seed=4), other_ridge)
    assert rebuilt and db.ridge == 0.1 and db.key["ridge"] == 0.1
    assert not run(_batches(seed=4), other_ridge)[0]
    with torch.no_grad():
        model.model.layers[-1].mlp.up_proj.weight[0, 0] += 1.0  # the last layer's inputs to down_proj change
    assert run(_batches(seed=4), other_ridge)[0]


def test_fitness_folds_auto_cross_fits_when_the_fold_copies_fit_in_memory(monkeypatch):
    """auto: 2 folds while two copies of the Grams take at most the share of free memory, where every rank scores
    two sequences or more, and only when every rank agrees; else the in-sample fitness."""
    _, _, _, _, db = _setup()
    assert SearchOptions().fitness_folds == "auto"
    need = 2 * sum(b.gram.numel() * b.gram.element_size() for b in db.blocks.values())
    assert auto_fitness_folds(db, 32) == 2  # the tiny Grams fit in this host's memory
    monkeypatch.setattr(fitness_mod, "free_memory", lambda device: int(need / AUTO_FOLDS_MEMORY_SHARE))
    assert auto_fitness_folds(db, 32) == 2  # exactly at the share
    monkeypatch.setattr(fitness_mod, "free_memory", lambda device: int(need / AUTO_FOLDS_MEMORY_SHARE) - 1)
    assert auto_fitness_folds(db, 32) == 1
    monkeypatch.setattr(fitness_mod, "free_memory", lambda device: None)  # a device whose memory cannot be read
    assert auto_fitness_folds(db, 32) == 1
    monkeypatch.setattr(fitness_mod, "free_memory", lambda device: 1 << 50)
    assert auto_fitness_folds(db, 1) == 1  # one sequence cannot be split
    assert auto_fitness_folds(db, 32, reduce_sum=lambda t: t) == 2  # one rank that fits
    assert auto_fitness_folds(db, 32, reduce_sum=lambda t: t + 1) == 1  # another rank does not fit


def test_the_default_search_resolves_auto_folds_and_records_the_count(tmp_path, monkeypatch):
    model, settings, budget, scores, _ = _setup()
    opts = SearchOptions(generations=1, offspring=2, stages=(4,), survivors=(2,), mlp_levels=8)
    _, res, _, _ = run_search(model, _batches(), budget, scores, settings, opts, state_dir=tmp_path)
    assert res.fitness_folds == 2 and res.as_dict()["fitness_folds"] == 2
    state = tmp_path / f"search_state_obs-least_squares_{budget.target}.pt"
    assert torch.load(state, weights_only=False)["options"]["fitness_folds"] == 2  # the count, not "auto"
    monkeypatch.setattr(fitness_mod, "free_memory", lambda device: 0)
    _, res, _, _ = run_search(model, _batches(), budget, scores, settings, opts, state_dir=tmp_path / "low")
    assert res.fitness_folds == 1
    assert "fitness_folds" not in torch.load(tmp_path / "low" / state.name, weights_only=False)["options"]


def test_search_resumes_from_its_state(tmp_path):
    model, settings, budget, scores, db = _setup()
    space = LevelSpace.of(budget, mlp_levels=8)
    fit = KLFitness(model, db, torch.cat(_batches()))
    seeds = {"uniform": space.snap({"attn": [0] * 3, "mlp": [16] * 3})}
    opts = SearchOptions(generations=3, offspring=3, stages=(4,), survivors=(3,), mlp_levels=8)
    whole = evolve(space, fit, seeds, opts)
    part = evolve(space, fit, seeds, SearchOptions(**{**opts.__dict__, "generations": 1}), tmp_path / "s.pt")
    assert len(part.trajectory) == 2
    resumed = evolve(space, fit, seeds, opts, tmp_path / "s.pt")
    assert resumed.levels == whole.levels and resumed.kl == pytest.approx(whole.kl)
    assert len(resumed.trajectory) == 4
    # a shorter search is not read from a longer one's state, nor a search from another first generation
    shorter = evolve(space, fit, seeds, SearchOptions(**{**opts.__dict__, "generations": 2}), tmp_path / "s.pt")
    assert len(shorter.trajectory) == 3
    more = {**seeds, "other": space.snap({"attn": [1, 0, 0], "mlp": [8, 8, 8]})}
    other = evolve(space, fit, more, opts, tmp_path / "s.pt")
    assert set(other.seeds) == {"uniform", "other"} and len(other.trajectory) == 4


def test_a_state_saved_with_other_fitness_folds_is_not_resumed(tmp_path):
    """The fold count changes every KL the state holds: a search with other folds starts afresh, one with the same
    folds resumes (and a state of the in-sample fitness keeps resuming as it did before the option)."""
    model, settings, budget, scores, db = _setup()
    space = LevelSpace.of(budget, mlp_levels=8)
    base = KLFitness(model, db, torch.cat(_batches()))
    calls = []

    def fit(levels, n):
        calls.append(n)
        return base(levels, n)

    seeds = {"uniform": space.snap({"attn": [0] * 3, "mlp": [16] * 3})}
    opts = SearchOptions(generations=1, offspring=2, stages=(4,), survivors=(2,), mlp_levels=8, fitness_folds=1)
    evolve(space, fit, seeds, opts, tmp_path / "s.pt")
    assert "fitness_folds" not in torch.load(tmp_path / "s.pt", weights_only=False)["options"]
    calls.clear()
    evolve(space, fit, seeds, opts, tmp_path / "s.pt")  # the same options: nothing left to do
    assert calls == []
    evolve(space, fit, seeds, dataclasses.replace(opts, fitness_folds=2), tmp_path / "s.pt")
    assert len(calls) == 1 + 2  # the seed scored again, then one generation of two offspring
    assert torch.load(tmp_path / "s.pt", weights_only=False)["options"]["fitness_folds"] == 2


def test_finish_lands_within_one_channel():
    _, _, budget, _, db = _setup(ratio=0.23)
    space = LevelSpace.of(budget, mlp_levels=8)
    lv = space.snap({"attn": [0] * 3, "mlp": [24] * 3})
    removed = finish(space, lv, db)
    total = plan_params_removed(budget, build_plan(budget, removed))
    assert budget.target <= total < budget.target + budget.c_cost
    assert counts_of(removed)["attn"] == lv["attn"]


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="generations=-1"):
        SearchOptions(generations=-1)
    for bad in ("many", True, 2.5):
        with pytest.raises(ValueError, match="an integer >= 0 or auto"):
            SearchOptions(generations=bad)
    with pytest.raises(ValueError, match="stages"):
        SearchOptions(stages=(8, 2), survivors=(4, 1))
    with pytest.raises(ValueError, match="order='x'"):
        SearchOptions(order="x")
    with pytest.raises(ValueError, match="cut_ridge='auto' is not allowed: use cv or fixed"):
        SearchOptions(cut_ridge="auto")
    with pytest.raises(ValueError, match=r"cv_ridges=\[-1\] is not allowed"):
        SearchOptions(cv_ridges=[-1])
    with pytest.raises(ValueError, match="cv_sequences=0"):
        SearchOptions(cv_sequences=0)
    with pytest.raises(ValueError, match="restarts=0 is not allowed: an integer >= 1"):
        SearchOptions(restarts=0)
    for bad in (0, "two", True):
        with pytest.raises(ValueError, match=f"fitness_folds={bad!r} is not allowed: an integer >= 1 or auto"):
            SearchOptions(fitness_folds=bad)
    for name in ("cv_seed", "seed_calibrated"):  # a string such as "no" would otherwise read as true
        with pytest.raises(ValueError, match=f"{name}='no' is not allowed: true or false"):
            SearchOptions(**{name: "no"})
    with pytest.raises(ValueError, match="allocation_args.cv_seed='no' is not allowed"):
        PruneSettings(allocation_args={"cv_seed": "no"})


def test_cut_ridge_cv_picks_the_ridge_of_least_kl_on_held_out_sequences():
    """`cross_validate_ridge` against an independent computation: a database built from all but the last quarter
    of the sequences, each ridge's KL of the levels on that quarter; the winner is scaled to all the tokens."""
    from prunelight.allocation.search.ridge import cross_validate_ridge

    model, settings, budget, scores, db = _setup(order="criterion")  # the same order whichever rows are read
    rows = torch.cat(_batches())  # 8 sequences: 2 held out
    space = LevelSpace.of(budget, mlp_levels=8)
    lv = space.snap({"attn": [1, 0, 0], "mlp": [24, 16, 8]})
    opts = SearchOptions(cv_ridges=(0.001, 0.1, 10.0, 1000.0))
    before = {key: b.gram.clone() for key, b in db.blocks.items()}
    out, report = cross_validate_ridge(model, db, _batches(), lv, opts)
    fit = build_database(model, list(rows[:6].split(2)), scores, {k: budget.limits(k) for k in ("attn", "mlp")},
                         "criterion", settings.reconstruct_ridge)
    expected = {}
    for r in opts.cv_ridges:
        fit.set_ridge(r)
        expected[r] = KLFitness(model, fit, rows[6:])(lv, 2)
    assert report["sequences"] == 2 and report["chosen_by"] == "cv"
    assert [report["kl"][str(r)] for r in opts.cv_ridges] == pytest.approx([expected[r] for r in opts.cv_ridges],
                                                                            rel=1e-4)
    best = min(expected, key=expected.get)
    assert len({round(v, 6) for v in expected.values()}) > 1  # the ridges differ, so the choice means something
    assert report["chosen"] == best and out.ridge == pytest.approx(best * 6 / 8) and out.ridge_validated
    assert out.blocks is db.blocks and db.ridge == settings.reconstruct_ridge
    assert all(torch.equal(before[key], b.gram) for key, b in db.blocks.items())  # the Grams are untouched
    too_few = cross_validate_ridge(model, db, _batches(1), lv, opts)
    assert too_few[0] is db and too_few[1]["chosen_by"].startswith("fixed")


def test_the_next_ridge_past_a_winning_end_of_the_grid_takes_the_grid_step_there():
    from prunelight.allocation.search.ridge import beyond_edge

    assert beyond_edge({0.01: 1.0, 0.03: 1.1, 0.1: 1.2}) == 0.00333  # 0.01 / 3, to 3 digits
    assert beyond_edge({0.1: 1.2, 0.3: 1.1, 1.0: 1.0}) == 3.33
    assert beyond_edge({0.01: 1.1, 0.03: 1.0, 0.1: 1.2}) is None  # the least is inside the grid
    assert beyond_edge({0.0: 1.0, 0.1: 1.2}) is None and beyond_edge({0.0: 1.2, 0.1: 1.0}) is None  # no ratio from 0
    assert beyond_edge({0.1: 1.0}) is None


def test_cut_ridge_cv_goes_past_the_end_of_the_grid_while_the_held_out_kl_falls(caplog):
    """When an end of cv_ridges wins, more ridges one grid step further are measured (as an independent database
    fitted on the other sequences measures them) until one is worse or CV_EDGE_STEPS are spent."""
    from prunelight.allocation.search.ridge import CV_EDGE_STEPS, cross_validate_ridge

    model, settings, budget, scores, db = _setup(order="criterion")
    rows = torch.cat(_batches())
    space = LevelSpace.of(budget, mlp_levels=8)
    lv = space.snap({"attn": [1, 0, 0], "mlp": [24, 16, 8]})
    fit = build_database(model, list(rows[:6].split(2)), scores, {k: budget.limits(k) for k in ("attn", "mlp")},
                         "criterion", settings.reconstruct_ridge)

    def held_out_kl(r: float) -> float:
        fit.set_ridge(r)
        return KLFitness(model, fit, rows[6:])(lv, 2)

    caplog.set_level(logging.INFO, logger="prunelight.allocation.search.ridge")
    for grid, extended in (((10.0, 100.0), [1.0, 0.1]),  # 1 beats 10, then 0.1 is worse than 1: stop
                           ((0.0001, 0.001), [0.01, 0.1, 1.0])):  # upward, each better, until the steps are spent
        _, report = cross_validate_ridge(model, db, _batches(), lv, SearchOptions(cv_ridges=grid))
        assert report["extended"] == pytest.approx(extended) and len(extended) <= CV_EDGE_STEPS
        kls = {float(r): v for r, v in report["kl"].items()}
        assert sorted(kls) == sorted([*grid, *extended])
        for r in extended:
            assert kls[r] == pytest.approx(held_out_kl(r), rel=1e-4)
        assert report["chosen"] == 1.0 == min(kls, key=kls.get)
    assert "past the end of cv_ridges: 0.01, 0.1, 1" in caplog.text  # the run's log line names them
    caplog.clear()
    _, inside = cross_validate_ridge(model, db, _batches(), lv, SearchOptions(cv_ridges=(0.001, 1.0, 1000.0)))
    assert inside["chosen"] == 1.0 and "extended" not in inside  # an inner winner: the grid is kept as it is
    assert "cut ridge" in caplog.text and "past the end" not in caplog.text


def test_cut_ridge_cv_measures_the_alternatives_on_the_held_out_sequences_at_the_chosen_ridge():
    """With alternatives (cv_seed's best seed), each is measured on the held-out sequences at the chosen ridge, as
    an independent database fitted on the other sequences measures it; the plan of least held-out KL is named."""
    from prunelight.allocation.search.ridge import cross_validate_ridge

    model, settings, budget, scores, db = _setup(order="criterion")
    rows = torch.cat(_batches())
    space = LevelSpace.of(budget, mlp_levels=8)
    lv = space.snap({"attn": [1, 0, 0], "mlp": [24, 16, 8]})
    others = {"a": space.snap({"attn": [0, 1, 0], "mlp": [8, 24, 16]}),
              "b": space.snap({"attn": [0, 0, 1], "mlp": [16, 8, 24]})}
    opts = SearchOptions(cv_ridges=(0.001, 10.0))
    _, report = cross_validate_ridge(model, db, _batches(), lv, opts, alternatives=others)
    fit = build_database(model, list(rows[:6].split(2)), scores, {k: budget.limits(k) for k in ("attn", "mlp")},
                         "criterion", settings.reconstruct_ridge)
    fit.set_ridge(report["chosen"])
    fitness = KLFitness(model, fit, rows[6:])
    expected = {"search": fitness(lv, 2), **{k: fitness(v, 2) for k, v in others.items()}}
    assert report["candidates"] == pytest.approx(expected, rel=1e-4)
    assert len({round(v, 6) for v in expected.values()}) == 3  # they differ, so the choice means something
    assert report["plan"] == min(expected, key=expected.get)
    _, plain = cross_validate_ridge(model, db, _batches(), lv, opts)
    assert "plan" not in plain and "candidates" not in plain  # nothing else measured without alternatives


@pytest.mark.parametrize("winner", ["search", "seed"])
def test_the_cut_takes_the_seed_that_generalizes_better_than_the_search_result(tmp_path, monkeypatch, winner):
    """cv_seed: the best seed goes to the cross-validation as an alternative, and the cut (the final removal, the
    reported levels and KL) is that seed's when its held-out KL is lower, else the search's result."""
    import prunelight.allocation.search as search

    model, settings, budget, scores, _ = _setup()
    real = search.cross_validate_ridge
    seen = {}

    def cv(*args, **kwargs):
        db, report = real(*args, **kwargs)
        alternatives = args[7]
        seen.update(alternatives)
        # as if the held-out sequences preferred `winner`
        return db, {**report, "plan": next(iter(alternatives)) if winner == "seed" else "search"}

    monkeypatch.setattr(search, "cross_validate_ridge", cv)
    opts = SearchOptions(generations=6, offspring=4, stages=(2, 4), survivors=(4, 1), mlp_levels=8, cv_seed=True)
    removed, res, db, _ = run_search(model, _batches(), budget, scores, settings, opts, state_dir=tmp_path)
    monkeypatch.setattr(search, "cross_validate_ridge", real)
    # the same search resumed from its state, without the seed's check: the search's own result
    _, off, _, _ = run_search(model, _batches(), budget, scores, settings, dataclasses.replace(opts, cv_seed=False),
                              state_dir=tmp_path)
    assert "plan" not in off.ridge_cv
    best_seed = min(off.seeds, key=lambda k: (off.seeds[k], k))
    assert off.kl < off.seeds[best_seed]  # the search improved on its best seed, which is then the alternative
    assert list(seen) == [best_seed] and seen[best_seed] != off.levels
    if winner == "seed":
        assert res.levels == seen[best_seed] and res.kl == off.seeds[best_seed]
    else:
        assert res.levels == off.levels and res.kl == off.kl
    space = LevelSpace.of(budget, mlp_levels=8)
    assert removed == finish(space, res.levels, db)
    total = plan_params_removed(budget, build_plan(budget, removed))
    assert budget.target <= total < budget.target + budget.c_cost


def test_measure_and_allocate_meet_the_budget_through_the_row_functions(tmp_path):
    """The row's measurement and allocation functions, with the contract's inputs (MeasureInputs / AllocationInputs)."""
    from types import SimpleNamespace

    from prunelight.allocation.search import allocate_search, measure_search

    model, settings, budget, scores, _ = _setup()
    opts = SearchOptions(generations=2, offspring=3, stages=(2, 4), survivors=(3, 1), mlp_levels=8)
    mi = SimpleNamespace(model=model, batches=_batches(), budget=budget, scores=scores, settings=settings,
                         shape=Shape.FREE, options=opts, reduce_sum=None, state_dir=tmp_path,
                         calibration=_batches(), collected=None)
    measured = measure_search(mi)
    removal = allocate_search(SimpleNamespace(measured=measured))
    total = plan_params_removed(budget, build_plan(budget, removal.removed))
    assert removal.exact and budget.target <= total < budget.target + budget.c_cost
    assert measured.as_dict()["trajectory"]
    # Two ranks that hold the same sequences: Grams, tokens and KL sums double, the search takes the same steps.
    twice = measure_search(SimpleNamespace(**{**vars(mi), "reduce_sum": lambda t: 2 * t,
                                              "state_dir": tmp_path / "ddp"}))
    assert twice.removed == measured.removed
    assert twice.result.kl == pytest.approx(measured.result.kl, rel=1e-9)
    assert torch.load(tmp_path / "ddp" / "levels_obs.pt", weights_only=False)["tokens"] == 2 * sum(
        b.numel() for b in mi.calibration)


def test_the_database_reads_every_calibration_batch_and_the_probes_only_the_importance_ones(tmp_path):
    """prune.importance_batches bounds what the calibrated seed's probes read; the levels database (its Grams, the
    refits every level writes) is built from all the calibration batches the run scored on."""
    import prunelight

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)
    batches = _batches(4)
    args = {"generations": 1, "offspring": 2, "stages": [2], "survivors": [2], "mlp_levels": 8,
            "state_dir": str(tmp_path)}
    _, plan = prunelight.prune(model, {"criterion": "flap", "allocation": "search", "ratio": 0.2,
                                       "importance_batches": 1, "allocation_args": {**args, "seed_calibrated": True}},
                               batches)
    db = torch.load(tmp_path / "levels_obs.pt", weights_only=False)
    assert db["tokens"] == sum(b.numel() for b in batches)  # 4 batches, not the 1 the probes read
    assert "calibrated" in plan.meta["search"]["seeds_kl"]


def test_allocation_search_end_to_end_through_prune():
    """`prune.allocation: search` with its options from `allocation_args`: the plan meets the budget and records the
    search; an unknown option is refused naming the allowed ones."""
    import prunelight

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)
    args = {"generations": 2, "offspring": 3, "stages": [2, 4], "survivors": [3, 1], "mlp_levels": 8}
    _, plan = prunelight.prune(model, {"criterion": "flap", "allocation": "search", "ratio": 0.2,
                                       "allocation_args": args}, _batches())
    assert plan.meta["allocation"] == "search"
    assert 0 <= plan.meta["budget_error_params"] < 3 * 64 and "search" in plan.meta  # one MLP channel: 3 x hidden
    seeds_kl = plan.meta["search"]["seeds_kl"]
    assert set(seeds_kl) == {"uniform", "global"}  # no probes by default: the calibrated plan is opt-in
    assert plan.meta["search"]["trajectory"][-1]["kl"] <= min(seeds_kl.values())
    fresh = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)  # prune cuts in place
    _, plan = prunelight.prune(fresh, {"criterion": "flap", "allocation": "search", "ratio": 0.2,
                                       "allocation_args": {**args, "seed_calibrated": True}}, _batches())
    assert {"uniform", "global", "calibrated"} <= set(plan.meta["search"]["seeds_kl"])
    assert plan.meta["search"]["trajectory"][-1]["kl"] <= min(plan.meta["search"]["seeds_kl"].values())
    with pytest.raises(ValueError, match="generationz"):
        prunelight.prune(tiny_model("llama"), {"allocation": "search", "allocation_args": {"generationz": 1}},
                         _batches())


def test_search_under_export_format_stock_measures_every_uniform_shape(tmp_path):
    """export.format stock: every layer keeps one shape, the one of least KL among the uniform shapes meeting the
    budget (each refitted as the cut repairs it), within the stock budget window; the shape's report is kept."""
    import prunelight
    from prunelight.allocation import make_budget as budget_of

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64, num_key_value_heads=2)
    budget = budget_of(model, prunelight.PruneSettings(ratio=0.25))
    args = {"generations": 3, "offspring": 2, "stages": [4], "survivors": [2], "mlp_levels": 8,
            "state_dir": str(tmp_path)}
    _, plan = prunelight.prune(model, {"criterion": "flap", "allocation": "search", "ratio": 0.25,
                                       "allocation_args": args}, _batches(), export_format="stock")
    assert len({len(lp.keep_groups) for lp in plan.layers}) == 1
    assert len({len(lp.keep_channels) for lp in plan.layers}) == 1
    shapes = plan.meta["stock_shapes"]
    assert shapes["chosen_by"] == "search_kl" and len(shapes["candidates"]) >= 2
    best = min(shapes["candidates"], key=lambda c: c["kl"])
    assert shapes["chosen"] == best["groups_removed_per_layer"]
    assert 2 - len(plan.layers[0].keep_groups) == best["groups_removed_per_layer"]
    assert 0 <= plan.meta["budget_error_params"] < 3 * budget.c_cost  # a stock cut's window: one channel per layer
    assert "calibrated" not in plan.meta["search"]["seeds_kl"]  # no per-layer plan can seed one shape
    from transformers import AutoModelForCausalLM

    from prunelight.export import export_pretrained

    out = export_pretrained(model, tmp_path / "stock", format="stock")  # a stock config states the cut
    ids = torch.cat(_batches(1))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits, model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_search_under_export_format_nemotron_nas_keeps_one_group_count(tmp_path):
    """export.format nemotron_nas: one kept GQA group count in every layer keeping attention (from the served
    layouts the search starts from), per-layer MLP widths, within one channel of the target; never worse on KL than
    its seeds."""
    import prunelight

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64, num_key_value_heads=2)
    args = {"generations": 3, "offspring": 3, "stages": [2, 4], "survivors": [3, 1], "mlp_levels": 8,
            "state_dir": str(tmp_path), "seed_calibrated": True}  # the served layouts paired with calibrated's widths
    _, plan = prunelight.prune(model, {"criterion": "flap", "allocation": "search", "ratio": 0.3,
                                       "allocation_args": args}, _batches(), export_format="nemotron_nas")
    kept = {len(lp.keep_groups) for lp in plan.layers if lp.keep_groups}
    assert len(kept) == 1
    served = plan.meta["served_shapes"]
    assert served["chosen_by"] == "search_kl" and served["chosen"]["groups_kept"] == kept.pop()
    seeds = plan.meta["search"]["seeds_kl"]
    assert any(n.startswith("served g") for n in seeds) and any(n.startswith("calibrated g") for n in seeds)
    assert plan.meta["search"]["kl"] <= min(seeds.values()) + 1e-12
    assert 0 <= plan.meta["budget_error_params"] < 3 * 64  # one MLP channel: 3 x hidden
    assert list(tmp_path.glob("search_state_obs-least_squares_served_*.pt"))  # its own state: never a FREE search's
    # the layout vLLM serves states the cut: the folder reloads equal to the cut model
    from transformers import AutoModelForCausalLM

    from prunelight.export import export_pretrained

    out = export_pretrained(model, tmp_path / "served", format="nemotron_nas")
    ids = torch.cat(_batches(1))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits, model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order,method,cut_ridge", [("criterion", "least_squares", "fixed"), ("obs", "obs", "fixed"),
                                                    ("obs", "least_squares", "fixed"), ("obs", "least_squares", "cv"),
                                                    ("obs_kfac", "least_squares", "cv")])
def test_the_cut_after_a_search_writes_the_database_refits_equal_to_fitting_again(order, method, cut_ridge):
    """The cut of a search plan takes its repair from the levels database: the same model as fitting it again
    (`reconstruct.cut_and_reconstruct`), the same figures; another repair than the database's is fitted as usual.
    OBS's order with least_squares (the default) refits OBS's units as least_squares does. With `cut_ridge: cv`
    the database holds the cross-validated ridge: fitting again with that ridge gives the same model."""
    import copy

    from prunelight.allocation.search.repair import cut_with_levels
    from prunelight.pipeline import make_plan

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64, num_key_value_heads=2)
    settings = settings_of(0.25, criterion="flap", allocation="search", reconstruct=method, allocation_args={
        "generations": 2, "offspring": 2, "stages": [4], "survivors": [2], "mlp_levels": 8, "order": order,
        "cut_ridge": cut_ridge, "cv_ridges": [0.01, 1.0, 30.0]})
    planned = make_plan(model, _batches(), settings)
    plan, db = planned.plan, planned.measured.levels
    assert db is not None and db.order == order and db.repair == method
    cv = plan.meta["search"]["ridge_cv"]
    assert cv["chosen_by"] == cut_ridge and cv["ridge"] == db.ridge
    assert (db.ridge == settings.reconstruct_ridge) == (cut_ridge == "fixed")
    # a cross-validated ridge travels with the plan as its repair; a fixed one is the settings'
    assert plan.meta.get("repair") == ({"reconstruct_ridge": db.ridge, "chosen_by": "cv"} if cut_ridge == "cv" else None)
    fast, slow = copy.deepcopy(model), copy.deepcopy(model)
    other = copy.deepcopy(plan)
    figures = cut_with_levels(fast, plan, db, settings, _batches())
    fitted = cut_and_reconstruct(slow, other, _batches(), settings_of(
        0.25, criterion="flap", reconstruct=method, reconstruct_ridge=db.ridge))
    assert figures is not None and figures["ridge"] == pytest.approx(db.ridge)
    assert figures is not None and figures["from"] == "levels_database"
    assert [lp.keep_channels for lp in plan.layers] == [lp.keep_channels for lp in other.layers]
    ids = torch.cat(_batches(1))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, slow(ids).logits, rtol=1e-4, atol=1e-4)
    assert figures["rel_err_after_mean"] == pytest.approx(fitted["rel_err_after_mean"], rel=1e-3, abs=1e-6)
    assert figures["rel_err_before_mean"] == pytest.approx(fitted["rel_err_before_mean"], rel=1e-3, abs=1e-6)
    # the database holds one repair: another method or fewer calibration tokens are fitted as usual
    untouched = copy.deepcopy(model)
    assert cut_with_levels(untouched, plan, db, settings_of(0.25, reconstruct="bias"), _batches()) is None
    assert cut_with_levels(untouched, plan, db, settings, _batches(2)) is None
    assert untouched.config.intermediate_size == 64 and untouched.model.layers[0].mlp.down_proj.in_features == 64


def test_prune_with_search_cuts_from_the_database_and_forgets_it():
    import prunelight

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)
    args = {"generations": 1, "offspring": 2, "stages": [4], "survivors": [2], "mlp_levels": 8}
    from prunelight.testing import cut_with

    result = cut_with(model, _batches(), prunelight.PruneSettings(criterion="flap", allocation="search", ratio=0.2,
                                                                allocation_args=args))
    assert result.reconstruction["from"] == "levels_database"
    # the database (Grams of every layer) is not kept through recovery: nothing the cut returns holds it
    assert not any(isinstance(v, LevelsDatabase) for v in vars(result).values())


def test_a_saved_search_plan_reapplied_repairs_with_its_cross_validated_ridge(tmp_path, caplog):
    """The cross-validated ridge is part of the plan: `prune.plan` re-applies it with that ridge (the model the
    run wrote), and so does a cut on fewer calibration batches than the database's, each saying so in one line."""
    import copy
    import logging

    import prunelight
    from prunelight.testing import cut_with
    from prunelight.saved import plan_document, write_plan

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)
    args = {"generations": 1, "offspring": 2, "stages": [4], "survivors": [2], "mlp_levels": 8,
            "cv_ridges": [1.0, 30.0]}
    settings = prunelight.PruneSettings(criterion="flap", allocation="search", ratio=0.2, allocation_args=args)
    dense = copy.deepcopy(model)
    first = cut_with(model, _batches(), settings)
    ridge = first.plan.meta["search"]["ridge_cv"]["ridge"]
    assert first.reconstruction["from"] == "levels_database" and ridge > 0.5 > settings.reconstruct_ridge
    path = write_plan(tmp_path / "plan.json", plan_document(first.plan, model, 0, 0, settings))

    again = copy.deepcopy(dense)
    with caplog.at_level(logging.INFO, logger="prunelight.cut"):
        second = cut_with(again, _batches(), prunelight.PruneSettings(plan=str(path)))
    assert second.reconstruction["ridge"] == pytest.approx(ridge)
    assert second.plan.meta["repair"] == {"reconstruct_ridge": ridge, "chosen_by": "cv"}
    assert "the cut repairs with the plan's reconstruct_ridge" in caplog.text

    # a plan.json written before the plan carried its repair (the ridge under search.ridge_cv) re-applies the same
    legacy = json.loads(path.read_text())
    del legacy["plan"]["meta"]["repair"]
    old = tmp_path / "legacy_plan.json"
    old.write_text(json.dumps(legacy))
    third = cut_with(copy.deepcopy(dense), _batches(), prunelight.PruneSettings(plan=str(old)))
    assert third.reconstruction["ridge"] == pytest.approx(ridge)
    ids = torch.cat(_batches(1))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)

    # fewer calibration batches at the cut than in the database: fitted again, with the same ridge
    fewer = cut_with(copy.deepcopy(dense), _batches(), dataclasses.replace(settings, max_calibration_batches=2))
    assert "from" not in fewer.reconstruction and fewer.reconstruction["ridge"] == pytest.approx(
        fewer.plan.meta["search"]["ridge_cv"]["ridge"])
    # a plan of the fixed ridge has none: prune.reconstruct_ridge repairs it
    fixed = dataclasses.replace(settings, allocation_args={**args, "cut_ridge": "fixed"})
    assert cut_with(copy.deepcopy(dense), _batches(), fixed).reconstruction["ridge"] == settings.reconstruct_ridge



def test_restarts_are_independent_searches_and_the_least_kl_is_kept(tmp_path):
    """restarts=3 with the fixed ridge: each restart is the search a single run with its seed makes (same levels,
    same KL), the result is the one of least calibration KL, and every restart resumes from its own state file."""
    model, settings, budget, scores, _ = _setup()
    opts = SearchOptions(generations=2, offspring=4, stages=(2, 4), survivors=(4, 1), mlp_levels=16,
                         cut_ridge="fixed", seed_calibrated=False, restarts=3)
    removed, res, _, _ = run_search(model, _batches(), budget, scores, settings, opts, state_dir=tmp_path / "r")
    single = {}
    for s in (0, 1, 2):
        one = dataclasses.replace(opts, restarts=1, seed=s)
        single[s] = run_search(model, _batches(), budget, scores, settings, one, state_dir=tmp_path / f"s{s}")[1]
    assert res.restarts == pytest.approx({f"seed={s}": single[s].kl for s in single}, rel=1e-9)
    assert len({tuple(map(tuple, r.levels.values())) for r in single.values()}) > 1  # the seeds search apart
    best = min(single, key=lambda s: (single[s].kl, s))
    assert res.levels == single[best].levels and res.kl == single[best].kl
    assert res.as_dict()["restarts_kl"] == res.restarts
    assert sorted(p.name for p in (tmp_path / "r").glob("search_state_*")) == sorted(
        [f"search_state_obs-least_squares_{budget.target}.pt"]
        + [f"search_state_obs-least_squares_{budget.target}_seed{s}.pt" for s in (1, 2)])
    again = run_search(model, _batches(), budget, scores, settings, opts, state_dir=tmp_path / "r")
    assert again[0] == removed and again[1].restarts == res.restarts  # each restart read back from its state


@pytest.mark.parametrize("winner", ["search", "restart"])
def test_with_cut_ridge_cv_the_cut_takes_the_restart_that_generalizes_best(monkeypatch, winner):
    """The restarts other than the one of least calibration KL go to the cross-validation as alternatives; the cut
    takes the one the held-out sequences prefer, with its own levels and calibration KL."""
    import prunelight.allocation.search as search

    model, settings, budget, scores, _ = _setup()
    real = search.cross_validate_ridge
    seen = {}

    def cv(*args, **kwargs):
        db, report = real(*args, **kwargs)
        seen.update(args[7])
        restart = next(k for k in args[7] if k.startswith("restart "))
        return db, {**report, "plan": restart if winner == "restart" else "search"}

    monkeypatch.setattr(search, "cross_validate_ridge", cv)
    opts = SearchOptions(generations=2, offspring=4, stages=(2, 4), survivors=(4, 1), mlp_levels=16,
                         seed_calibrated=False, cv_seed=False, restarts=3)
    removed, res, db, _ = run_search(model, _batches(), budget, scores, settings, opts)
    singles = {s: run_search(model, _batches(), budget, scores, settings,
                             dataclasses.replace(opts, restarts=1, seed=s, cut_ridge="fixed"))[1] for s in (0, 1, 2)}
    first = min(singles, key=lambda s: (singles[s].kl, s))
    others = {f"restart seed={s}": r.levels for s, r in singles.items()
              if s != first and r.levels != singles[first].levels}
    assert others and seen == others  # the restarts that ended elsewhere, in seed order
    taken = singles[int(next(iter(others))[-1])] if winner == "restart" else singles[first]
    assert res.levels == taken.levels and res.kl == taken.kl
    space = LevelSpace.of(budget, mlp_levels=16)
    assert removed == finish(space, res.levels, db)


def test_the_model_tuning_takes_its_targets_from_the_databases_dense_pass(monkeypatch, tmp_path):
    """The levels database's one dense pass also records the final hidden states the model tuning trains toward: they
    are exactly `dense_hidden`'s, the cut runs no second dense pass for them, and a database read back from disk
    (nothing recorded) makes the tuning measure its own."""
    import prunelight
    from prunelight import cut as cut_mod
    from prunelight.model_tuning import dense_hidden

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)
    batches = _batches(4)
    settings = PruneSettings(criterion="flap", allocation="search", ratio=0.2)
    crit = build_criterion("magnitude")
    lim = {k: make_budget(model, settings).limits(k) for k in ("attn", "mlp")}
    db = build_database(model, batches, crit.scores(model), lim, "obs", settings.reconstruct_ridge)
    for got, want in zip(db.dense_hidden, dense_hidden(model, batches), strict=True):
        assert torch.equal(got, want)

    calls = []
    monkeypatch.setattr(cut_mod, "dense_hidden", lambda m, b: calls.append(len(b)) or dense_hidden(m, b))
    args = {"generations": 1, "offspring": 2, "stages": [2], "survivors": [2], "mlp_levels": 8,
            "state_dir": str(tmp_path)}
    run = {"criterion": "flap", "allocation": "search", "ratio": 0.2, "allocation_args": args,
           "model_tuning": {"epochs": 1, "holdout_sequences": 8}}
    _, plan = prunelight.prune(tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64), run, batches)
    assert calls == []  # the database was built here: its recorded states were the targets
    _, again = prunelight.prune(tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64), run, batches)
    assert calls == [len(batches)]  # read back from state_dir: the tuning ran its own dense pass
    assert again.layers == plan.layers


def test_the_scoring_pass_collects_the_databases_grams_so_the_search_runs_no_dense_pass_of_its_own(monkeypatch):
    """`collect_search`: the scoring forwards also gather the levels database's Grams and hidden states, exactly what
    the database's own pass gives, so a first run makes one dense pass fewer; a criterion that reads no data (or
    another set of batches) leaves the database its own pass."""
    import prunelight
    from prunelight.allocation.search import levels as levels_mod
    from prunelight.allocation.search.levels import DensePass, input_grams
    from prunelight.calibration import run_calibration

    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)
    batches = _batches(4)
    dense = DensePass()
    run_calibration(model, batches, build_criterion("flap"), also=[dense])
    grams, tokens, hidden = dense.result(batches)
    alone_hidden: list[torch.Tensor] = []
    alone, alone_tokens = input_grams(model, batches, hidden=alone_hidden)
    assert tokens == alone_tokens == sum(b.numel() for b in batches)
    for got, want in zip(grams, alone, strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert all(torch.equal(a, b) for a, b in zip(hidden, alone_hidden, strict=True))
    assert dense.result(batches[:3]) is None  # other batches: not used

    passes = []
    real = levels_mod.input_grams
    monkeypatch.setattr(levels_mod, "input_grams", lambda *a, **k: passes.append(1) or real(*a, **k))
    args = {"generations": 1, "offspring": 2, "stages": [2], "survivors": [2], "mlp_levels": 8}
    for criterion, own_pass in (("flap", 0), ("magnitude", 1)):
        passes.clear()
        fresh = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64)
        prunelight.prune(fresh, {"criterion": criterion, "allocation": "search", "ratio": 0.2,
                                 "allocation_args": {**args, "cut_ridge": "fixed", "fitness_folds": 1}}, batches)
        assert len(passes) == own_pass, criterion


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_fitness_runs_narrowed_mlps_with_the_kl_of_the_masked_model(variant):
    """A candidate's MLPs run with only their kept channels (what the zero columns of the masked model would cancel;
    a fused gate_up_proj keeps equal halves), attention masked: in every family its KL equals the KL, computed here
    independently, of the dense model with the database's weights at those levels swapped in, and every weight is
    back after the call."""
    import copy

    import torch.nn.functional as F

    from prunelight.families import get_family
    from prunelight.reconstruct import output_proj

    family, overrides = VARIANTS[variant]
    model = tiny_model(family, seed=0, intermediate_size=64, **overrides)
    settings = settings_of(0.2, reconstruct="least_squares")
    budget = make_budget(model, settings)
    lim = {k: budget.limits(k) for k in ("attn", "mlp")}
    db = build_database(model, _batches(), build_criterion("random", seed=1).scores(model), lim, "criterion",
                        settings.reconstruct_ridge)
    rows = torch.cat(_batches())
    levels = {"attn": [1, 0], "mlp": [8, 40]}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = KLFitness(model, db, rows)(levels, 8)
    masked = copy.deepcopy(model)
    fam = get_family(masked)
    for i, layer in enumerate(fam.layers(masked)):
        for kind in ("attn", "mlp"):
            if levels[kind][i]:
                output_proj(fam, layer, kind).weight.data = db.weight_at(kind, i, levels[kind][i]).clone()
    with torch.no_grad():
        p = F.log_softmax(model(input_ids=rows).logits[:, :-1].float(), -1)
        q = F.log_softmax(masked(input_ids=rows).logits[:, :-1].float(), -1)
    want = float((p.exp() * (p - q)).sum(-1).mean())
    assert got == pytest.approx(want, rel=1e-4, abs=1e-7) and want > 1e-6
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].shape == after[k].shape for k in before)
