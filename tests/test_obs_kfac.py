"""The levels order `obs_kfac`: structured OBS with the output error weighted by the output Fisher, against an
independent autograd computation of that Fisher and a brute-force greedy of the weighted error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from prunelight.allocation.budget import make_budget
from prunelight.allocation.search.options import SearchOptions
from prunelight.importance import build_criterion
from prunelight.allocation.search.levels import KFAC_SHRINK, build_database, metric_weight, output_fishers, sampled_labels
from prunelight.obs import damping, greedy_removal
from prunelight.testing import settings_of, tiny_model


def _batches(n: int = 3, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (2, 16), generator=g) for _ in range(n)]


def test_output_fishers_sum_the_outer_products_of_the_output_gradients_under_sampled_labels():
    """Reference: plain autograd on a copy whose weights do get gradients, the outputs' .grad read after backward,
    labels drawn by the same `sampled_labels`."""
    model = tiny_model("llama", seed=0, num_hidden_layers=2, intermediate_size=32, num_key_value_heads=2)
    model.train()
    got = output_fishers(model, _batches())
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())

    ref_model = copy.deepcopy(model).eval()
    outs: dict[tuple[str, int], torch.Tensor] = {}
    for i, layer in enumerate(ref_model.model.layers):
        for kind, proj in (("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            def keep(m, a, out, key=(kind, i)):
                out.retain_grad()
                outs[key] = out
            proj.register_forward_hook(keep)
    h, vocab = model.config.hidden_size, model.config.vocab_size
    ref = {key: torch.zeros(h, h, dtype=torch.float64) for key in [(k, i) for i in range(2) for k in ("attn", "mlp")]}
    for ids in _batches():
        logits = ref_model(input_ids=ids).logits[:, :-1].float()
        labels = sampled_labels(ids, logits.detach())
        F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum").backward()
        for key, out in outs.items():
            g = out.grad.reshape(-1, h).double()
            ref[key] += g.T @ g
    for i in range(2):
        for kind in ("attn", "mlp"):
            assert got[i][kind].shape == (h, h)
            torch.testing.assert_close(got[i][kind].double(), ref[(kind, i)], rtol=1e-4,
                                       atol=1e-5 * float(ref[(kind, i)].abs().max()))  # fp32 sums
    assert float(ref[("mlp", 0)].abs().sum()) > 0


@pytest.mark.parametrize("block", [1, 2])
def test_each_pick_is_the_brute_force_best_under_the_fisher_weighted_error(block):
    """greedy_removal on metric_weight(W, F) removes, at each step, the unit whose removal after the least-squares
    refit of the rest adds the least tr(M D H Dᵀ), M = F / mean diag F + shrink I, D the change of the weights."""
    g = torch.Generator().manual_seed(1)
    units, out = 6, 5
    d = units * block
    x = torch.randn(120, d, generator=g, dtype=torch.float64)
    x = x @ (torch.eye(d, dtype=torch.float64) + torch.randn(d, d, generator=g, dtype=torch.float64) / d)  # correlated
    w = torch.randn(out, d, generator=g, dtype=torch.float64)
    a = torch.randn(out, out, generator=g, dtype=torch.float64)
    fisher = a @ a.T * 7.0  # strongly anisotropic, any scale
    gram = x.T @ x
    lam = damping(gram, 0.01)
    h = gram + lam * torch.eye(d, dtype=torch.float64)
    m = fisher / fisher.diagonal().mean() + KFAC_SHRINK * torch.eye(out, dtype=torch.float64)
    cols = torch.arange(d).view(units, block)
    res = greedy_removal(metric_weight(w, fisher), gram, cols, units - 1, lam)
    got = res.order
    plain = greedy_removal(w, gram, cols, units - 1, lam).order

    def weighted_error(removed: list[int]) -> float:
        gone = cols[removed].reshape(-1)
        kept = cols[[u for u in range(units) if u not in removed]].reshape(-1)
        delta = torch.zeros_like(w)
        delta[:, gone] = -w[:, gone]
        # the least-squares refit's change of the kept columns: D_K = W_R H_RK H_KK⁻¹ (it does not depend on M)
        delta[:, kept] = w[:, gone] @ h[gone][:, kept] @ torch.linalg.inv(h[kept][:, kept])
        return float(torch.trace(m @ delta @ h @ delta.T))

    removed: list[int] = []
    total = 0.0
    for pick, added in zip(got, res.delta):
        costs = {u: weighted_error(removed + [u]) for u in range(units) if u not in removed}
        assert pick == min(costs, key=costs.get)
        assert added == pytest.approx(costs[pick] - total, rel=1e-6, abs=1e-9)  # the weighted error it adds
        removed.append(pick)
        total = costs[pick]
    assert got != plain or block == 2  # the weighting changes the order (checked on the one-column case)


def test_a_database_of_order_obs_kfac_differs_from_obs_in_its_orders_not_its_grams():
    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64, num_key_value_heads=2)
    settings = settings_of(0.3, reconstruct="least_squares")
    budget = make_budget(model, settings)
    scores = build_criterion("random", seed=1).scores(model)
    lim = {k: budget.limits(k) for k in ("attn", "mlp")}
    obs = build_database(model, _batches(), scores, lim, "obs", settings.reconstruct_ridge)
    kfac = build_database(model, _batches(), scores, lim, "obs_kfac", settings.reconstruct_ridge)
    assert kfac.order == "obs_kfac" and kfac.key["order"] == "obs_kfac" and kfac.repair == "least_squares"
    assert any(kfac.blocks[k].order != obs.blocks[k].order for k in obs.blocks)
    for k, b in obs.blocks.items():
        torch.testing.assert_close(kfac.blocks[k].gram, b.gram)
        assert sorted(kfac.blocks[k].order) == sorted(set(kfac.blocks[k].order))
        assert len(kfac.blocks[k].order) == len(b.order)


def test_an_unknown_order_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="order='kfac' is not allowed: use one of criterion, obs, obs_kfac"):
        SearchOptions(order="kfac")


def test_sampled_labels_depend_on_the_sequence_not_its_batch():
    """A sequence draws the same labels alone, first or second in a batch (so DDP's shares draw what one process
    draws), another seed draws others, and the draws follow the softmax."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    logits = torch.randn(3, 8, 40, generator=g)
    both = sampled_labels(ids, logits)
    torch.testing.assert_close(sampled_labels(ids[1:2], logits[1:2])[0], both[1])
    torch.testing.assert_close(sampled_labels(ids[[2, 0]], logits[[2, 0]]), both[[2, 0]])
    assert not torch.equal(sampled_labels(ids, logits, seed=1), both)
    peaked = torch.full((1, 2000, 4), -30.0)
    peaked[0, :1000, 2] = 0.0  # the first half: always token 2, the second: always token 1
    peaked[0, 1000:, 1] = 0.0
    drawn = sampled_labels(torch.arange(9).view(1, 9), peaked)[0]
    assert (drawn[:1000] == 2).all() and (drawn[1000:] == 1).all()
    fair = sampled_labels(torch.arange(9).view(1, 9), torch.zeros(1, 4000, 2))[0].float().mean()
    assert 0.45 < float(fair) < 0.55


def test_output_fishers_of_two_shares_sum_to_one_process_on_all_batches():
    """What DDP does: each rank sums its own share and the shares are added (reduce_sum). With labels drawn per
    sequence the shares add up to one process's Fisher however the sequences are batched."""
    model = tiny_model("llama", seed=0, num_hidden_layers=2, intermediate_size=32, num_key_value_heads=2)
    batches = _batches(4)
    whole = output_fishers(model, batches)
    rows = torch.cat(batches)
    share_a = output_fishers(model, [rows[[0, 5, 2]], rows[[7]]])  # other batch sizes and orders
    share_b = output_fishers(model, [rows[[6, 1]], rows[[3, 4]]])
    for i in range(2):
        for kind in ("attn", "mlp"):
            scale = float(whole[i][kind].abs().max())
            torch.testing.assert_close(share_a[i][kind] + share_b[i][kind], whole[i][kind], rtol=1e-4,
                                       atol=1e-5 * scale)
