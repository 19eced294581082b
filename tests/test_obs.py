"""Structured OBS (prunelight.obs) against brute force on a tiny projection, and its criterion / reconstruction."""

from __future__ import annotations

import itertools

import pytest
import torch

from prunelight.obs import damping, greedy_removal, order_scores


def _layer(out: int, units: int, block: int, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    d = units * block
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5  # correlated inputs: OBS differs from |W|
    x = torch.randn(tokens, d, generator=g, dtype=torch.float64) @ (torch.eye(d, dtype=torch.float64) + mix)
    w = torch.randn(out, d, generator=g, dtype=torch.float64)
    cols = torch.arange(d).view(units, block)
    return w, x, cols


def _refit(w, x, keep_cols, lam):
    """Least-squares refit of the kept columns, anchored at the dense weights (reconstruct's objective)."""
    gram, y = x.T @ x, x @ w.T
    gk = gram[keep_cols][:, keep_cols] + lam * torch.eye(len(keep_cols), dtype=torch.float64)
    ck = y.T @ x[:, keep_cols]
    w_k = torch.linalg.solve(gk, (ck + lam * w[:, keep_cols]).T).T
    full = torch.zeros_like(w)
    full[:, keep_cols] = w_k
    return full


def _objective(w_new, w, x, lam):
    d = w_new - w
    return float((x @ d.T).square().sum() + lam * d.square().sum())


@pytest.mark.parametrize("block", [1, 3])
def test_each_greedy_pick_is_the_exhaustive_best_single_removal(block):
    w, x, cols = _layer(out=5, units=6, block=block, tokens=200)
    gram = x.T @ x
    lam = damping(gram, 0.01)
    res = greedy_removal(w, gram, cols, steps=5, lam=lam)
    removed: list[int] = []
    total = 0.0  # the dense weights cost nothing
    for pick, dE in zip(res.order, res.delta):
        costs = {}
        for u in range(6):
            if u in removed:
                continue
            keep = [c for v in range(6) if v not in removed + [u] for c in cols[v].tolist()]
            costs[u] = _objective(_refit(w, x, keep, lam), w, x, lam)
        best = min(costs, key=costs.get)
        assert pick == best
        assert dE == pytest.approx(costs[best] - total, rel=1e-6, abs=1e-8)
        removed.append(pick)
        total = costs[best]


def test_final_update_is_the_least_squares_refit_of_the_kept_columns():
    w, x, cols = _layer(out=7, units=40, block=1, tokens=300, seed=1)
    gram = x.T @ x
    lam = damping(gram, 0.01)
    res = greedy_removal(w, gram, cols, steps=35, lam=lam)  # past the compaction step (16)
    keep = sorted(set(range(40)) - set(res.order))
    ref = _refit(w, x, keep, lam)
    assert torch.allclose(res.weight, ref, atol=1e-8, rtol=1e-6)
    assert res.weight[:, res.order].abs().max() == 0


def test_greedy_beats_every_other_removal_set_of_size_two_or_ties():
    """Greedy is not globally optimal in general, but on a tiny layer its first pick is; the pair is close."""
    w, x, cols = _layer(out=4, units=5, block=2, tokens=100, seed=2)
    gram = x.T @ x
    lam = damping(gram, 0.01)
    res = greedy_removal(w, gram, cols, steps=2, lam=lam)
    best_pair = min(
        _objective(_refit(w, x, [c for v in range(5) if v not in pair for c in cols[v].tolist()], lam), w, x, lam)
        for pair in itertools.combinations(range(5), 2))
    got = _objective(res.weight, w, x, lam)
    assert got == pytest.approx(sum(res.delta), rel=1e-6)
    assert got >= best_pair - 1e-9


def test_order_scores_make_the_greedy_prefix_the_lowest():
    scores = order_scores([3, 0, 2], [0.5, 0.1, 2.0], 5).float()
    ranked = sorted(range(5), key=lambda j: (float(scores[j]), j))
    assert ranked[:3] == [3, 0, 2]


def test_steps_beyond_the_units_are_refused():
    w, x, cols = _layer(out=2, units=3, block=1, tokens=20)
    with pytest.raises(ValueError, match="steps=4"):
        greedy_removal(w, x.T @ x, cols, steps=4, lam=0.1)


# --- the criterion and the reconstruction on a tiny model ----------------------------------------------------------
def _tiny_batches(n: int = 3, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (2, 24), generator=g) for _ in range(n)]


def _prune(criterion: str, reconstruct: str, seed: int = 0, intermediate: int = 24):
    import prunelight
    from prunelight.testing import tiny_model

    model = tiny_model("llama", seed=seed, intermediate_size=intermediate)
    settings = {"criterion": criterion, "allocation": "uniform", "ratio": 0.15, "reconstruct": reconstruct}
    if criterion == "random":
        settings["criterion_args"] = {"seed": 1}
    return prunelight.prune(model, settings, _tiny_batches())


def test_obs_reconstruction_keeps_the_plans_counts_and_picks_the_obs_criterions_units():
    """With uniform counts, any criterion + `reconstruct: obs` keeps exactly the units the `obs` criterion ranks
    lowest (both are greedy OBS on the same dense Gram), and plan.json states the units actually kept."""
    from prunelight.families import get_family

    m_obs, p_obs = _prune("obs", "least_squares")
    m_rand, p_rand = _prune("random", "obs")
    for a, b in zip(p_obs.layers, p_rand.layers):
        assert a.keep_channels == b.keep_channels
        assert a.keep_groups == b.keep_groups
    shapes = get_family(m_rand).layer_shapes(m_rand)
    for lp, s in zip(p_rand.layers, shapes):
        assert s.intermediate_size == len(lp.keep_channels) < 24
    # the random criterion alone would have kept other channels
    _, p_plain = _prune("random", "least_squares")
    assert any(a.keep_channels != b.keep_channels for a, b in zip(p_plain.layers, p_rand.layers))


def test_obs_reconstruction_output_error_is_at_most_the_planned_cut():
    import prunelight
    from prunelight.testing import tiny_model

    model = tiny_model("llama", seed=0, intermediate_size=24)
    settings = {"criterion": "random", "criterion_args": {"seed": 1}, "allocation": "uniform", "ratio": 0.15,
                "reconstruct": "obs"}
    from prunelight.testing import cut_with
    from prunelight.settings import PruneSettings

    res = cut_with(model, _tiny_batches(), PruneSettings(**settings))
    figs = res.reconstruction["sub_blocks"]
    assert figs and all(f["rel_err_after"] <= f["rel_err_before"] + 1e-9 for f in figs)
    assert res.reconstruction["method"] == "obs"
    del prunelight


def test_obs_criterion_refuses_a_bad_ridge():
    from prunelight.importance import build_criterion

    with pytest.raises(ValueError, match="ridge=0"):
        build_criterion("obs", ridge=0)


def test_the_one_column_path_takes_the_general_paths_steps():
    """MLP channels (every input column a unit) take a faster path; it removes the same units in the same order with
    the same costs and final weights as the general path, past several compactions and with units out of order."""
    from prunelight.obs import _greedy_blocks, _greedy_columns, _inverse

    w, x, _ = _layer(out=7, units=60, block=1, tokens=400, seed=3)
    cols = torch.randperm(60, generator=torch.Generator().manual_seed(0)).view(60, 1)
    h = x.T @ x
    h.diagonal().add_(damping(h, 0.01))
    hinv = _inverse(h)
    w_fast, w_ref = w.clone(), w.clone()
    fast = _greedy_columns(w_fast, hinv.clone(), cols[:, 0], 50)
    ref = _greedy_blocks(w_ref, hinv.clone(), cols, 50)
    assert fast[0] == ref[0]
    assert fast[1] == pytest.approx(ref[1], rel=1e-9)
    assert torch.allclose(w_fast, w_ref, atol=1e-12, rtol=1e-9)
    assert greedy_removal(w, x.T @ x, cols, 50, damping(x.T @ x, 0.01)).order == ref[0]
