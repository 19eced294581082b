"""Importance criteria on tiny models: shapes, determinism, a zeroed unit ranked last, rank sums, exact formulas."""

from __future__ import annotations

import pytest
import torch

from prunelight.families import get_family
from prunelight.calibration import calibration_loss, run_calibration
from prunelight.importance import CRITERIA, WeightGradCriterion, build_criterion
from prunelight.importance.ownership import owned_tensors
from prunelight.testing import tiny_model

DATA_FREE = {"magnitude", "magnitude_l1", "random"}
RANKED = sorted(n for n in CRITERIA if n != "random")


def _ids(n: int = 4, t: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _score(model, name: str, ids: torch.Tensor, batch: int = 2, **kwargs):
    return run_calibration(model, list(torch.split(ids, batch)), build_criterion(name, **kwargs))


def _zero_unit(model, layer: int, group: int, channel: int) -> None:
    """Zero every weight and bias that one GQA group (in `layer`) and one MLP channel (in layer+1) own."""
    with torch.no_grad():
        for owned in owned_tensors(model):
            if (owned.kind, owned.layer) == ("attn", layer):
                unit = group
            elif (owned.kind, owned.layer) == ("mlp", layer + 1):
                unit = channel
            else:
                continue
            p = owned.spec.owned_part(owned.param)  # a fused projection's slice (Phi-3), else the whole tensor
            if owned.axis == 0:
                p.view(owned.units, -1)[unit] = 0
            else:
                p.view(p.shape[0], owned.units, -1)[:, unit] = 0


@pytest.mark.parametrize("name", sorted(CRITERIA))
def test_scores_match_layer_shapes_and_repeat_exactly(family, name):
    ids = _ids()
    first = _score(tiny_model(family), name, ids)
    again = _score(tiny_model(family), name, ids)
    shapes = get_family(tiny_model(family)).layer_shapes(tiny_model(family))
    assert [t.numel() for t in first["attn"]] == [s.num_key_value_heads for s in shapes]
    assert [t.numel() for t in first["mlp"]] == [s.intermediate_size for s in shapes]
    for kind in ("attn", "mlp"):
        for a, b in zip(first[kind], again[kind]):
            assert a.dtype == torch.float32 and torch.isfinite(a).all()
            assert torch.equal(a, b)
        assert any(t.abs().sum() > 0 for t in first[kind])


@pytest.mark.parametrize("name", RANKED)
def test_zeroed_unit_is_ranked_last_in_its_layer(family, name):
    model = tiny_model(family)
    _zero_unit(model, layer=0, group=1, channel=5)
    scores = _score(model, name, _ids())
    attn, mlp = scores["attn"][0], scores["mlp"][1]
    assert int(attn.argmin()) == 1 and attn[1] < attn[0], attn
    assert int(mlp.argmin()) == 5 and (mlp[5] < torch.cat([mlp[:5], mlp[6:]])).all()


def test_random_is_seeded():
    model = tiny_model("llama")
    a, b, c = (_score(model, "random", _ids(), seed=s)["mlp"][0] for s in (3, 3, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)


# taylor_element takes |w·ḡ| per batch (LLM-Pruner's param_first), so by definition it depends on how samples are
# batched; that ranks splitting the same batches add up is tested in test_criteria_llmpruner.py.
@pytest.mark.parametrize("name", sorted(set(CRITERIA) - DATA_FREE - {"taylor_element"}))
def test_two_rank_sums_equal_one_process(name):
    """Samples split over two 'ranks' with another batch size give the one-process statistics after all_reduce."""
    model, ids = tiny_model("llama"), _ids(n=8)
    single = _score(model, name, ids, batch=4)
    sent: list[torch.Tensor] = []

    def record(t):  # rank 1 contributes its tensors in call order
        sent.append(t.clone())
        return t

    def add_rank1(t):  # rank 0 receives rank 1's tensor in the same order
        return t + sent.pop(0)

    rank1 = build_criterion(name)
    run_calibration(model, list(torch.split(ids[1::2], 2)), rank1, reduce_sum=record)
    summed = run_calibration(model, list(torch.split(ids[0::2], 2)), build_criterion(name), reduce_sum=add_rank1)
    assert not sent
    for kind in ("attn", "mlp"):
        for a, b in zip(single[kind], summed[kind]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def _per_sample_grads(model, ids):
    """Reference: explicit per-sample gradients of every unit-owned tensor (a full gradient copy per sample)."""
    owned = owned_tensors(model)
    out = []
    for s in range(ids.shape[0]):
        params = [o.param for o in owned]
        loss = calibration_loss(model(input_ids=ids[s : s + 1]).logits, ids[s : s + 1])
        out.append(torch.autograd.grad(loss, params))
    return owned, out


def test_weight_taylor_and_second_order_match_explicit_formulas():
    model, ids = tiny_model("qwen2"), _ids(n=3)
    owned, grads = _per_sample_grads(model, ids)
    taylor = _score(model, "taylor_weight", ids)
    second = _score(model, "second_order", ids)
    ref_t = {k: [torch.zeros_like(t) for t in taylor[k]] for k in taylor}
    ref_c = {k: [torch.zeros_like(t) for t in taylor[k]] for k in taylor}
    for j, o in enumerate(owned):
        w = o.param.detach()
        ref_t[o.kind][o.layer] += sum(o.to_units((w * g[j]).abs()) for g in grads)
        h_diag = sum(g[j] ** 2 for g in grads) / len(grads)
        ref_c[o.kind][o.layer] += o.to_units(w**2 * h_diag)
    for kind in ("attn", "mlp"):
        for i in range(len(taylor[kind])):
            torch.testing.assert_close(taylor[kind][i], ref_t[kind][i], rtol=1e-4, atol=1e-7)
            expect = ref_t[kind][i] / len(grads) + 0.5 * ref_c[kind][i]
            torch.testing.assert_close(second[kind][i], expect, rtol=1e-4, atol=1e-7)


def test_wanda_matches_explicit_formula():
    model, ids = tiny_model("llama"), _ids()
    seen = {}
    layer = get_family(model).layers(model)[1]
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("o", []).append(a[0])),
        layer.mlp.gate_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("mlp", []).append(a[0])),
    ]
    scores = _score(model, "wanda", ids)
    for h in hooks:
        h.remove()
    o_norm = torch.cat(seen["o"]).reshape(-1, 64).norm(dim=0)
    o_cols = (layer.self_attn.o_proj.weight.abs() * o_norm).view(64, 2, 32).sum((0, 2))
    mlp_norm = torch.cat(seen["mlp"]).reshape(-1, 64).norm(dim=0)
    gate_rows = (layer.mlp.gate_proj.weight.abs() * mlp_norm).sum(1)
    up_rows = (layer.mlp.up_proj.weight.abs() * mlp_norm).sum(1)
    assert (scores["attn"][1] > o_cols).all()  # plus the q/k/v rows
    assert (scores["mlp"][1] > gate_rows + up_rows).all()  # plus the down column
    down_in = layer.mlp.act_fn(torch.cat(seen["mlp"]) @ layer.mlp.gate_proj.weight.T) * (
        torch.cat(seen["mlp"]) @ layer.mlp.up_proj.weight.T
    )
    down_cols = layer.mlp.down_proj.weight.abs().sum(0) * down_in.reshape(-1, 96).norm(dim=0)
    torch.testing.assert_close(scores["mlp"][1], gate_rows + up_rows + down_cols, rtol=1e-4, atol=1e-4)


def test_fisher_is_squared_taylor_for_one_sample():
    model, ids = tiny_model("mistral"), _ids(n=1)
    taylor, fisher = _score(model, "taylor", ids), _score(model, "fisher", ids)
    for kind in ("attn", "mlp"):
        torch.testing.assert_close(fisher[kind][0], taylor[kind][0] ** 2)


def test_weight_gradients_are_freed_one_at_a_time():
    model = tiny_model("llama")
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e3)  # stale training gradients must not leak into the scores
    flags = {id(p): p.requires_grad for p in model.parameters()}
    targets = [o.param for o in owned_tensors(model)]

    class Counting(type(build_criterion("taylor_weight"))):
        max_live = 0

        def accumulate(self, owned, w, g):
            live = sum(p.grad is not None for p in targets)
            Counting.max_live = max(Counting.max_live, live)
            super().accumulate(owned, w, g)

    scores = run_calibration(model, [_ids()], Counting())
    assert Counting.max_live == 1  # only the gradient being reduced exists
    assert all(p.grad is None for p in targets)
    assert {id(p): p.requires_grad for p in model.parameters()} == flags
    reference = _score(tiny_model("llama"), "taylor_weight", _ids())
    torch.testing.assert_close(scores["mlp"][0], reference["mlp"][0])
    assert isinstance(build_criterion("second_order"), WeightGradCriterion)


def test_entropy_objective_reads_no_labels():
    model, ids = tiny_model("llama"), _ids()
    logits = model(input_ids=ids).logits
    other = _ids(seed=1)
    assert torch.equal(calibration_loss(logits, ids, "entropy"), calibration_loss(logits, other, "entropy"))
    taylor = _score(model, "taylor", ids)
    on_entropy = _score(model, "taylor", ids, objective="entropy")
    assert not torch.allclose(on_entropy["mlp"][0], taylor["mlp"][0])
    assert build_criterion("entropy").loss == "entropy"  # HFPrune's criterion (formula: tests/test_criteria_flap.py)


def test_bad_names_and_arguments_are_explained():
    with pytest.raises(ValueError, match="available: .*fisher.*wanda"):
        build_criterion("obd")
    with pytest.raises(ValueError, match="accepts: objective, micro_batch_size"):
        build_criterion("taylor_weight", objectve="lm")
    with pytest.raises(ValueError, match="objective 'ce'"):
        build_criterion("fisher", objective="ce")
    with pytest.raises(ValueError, match="micro_batch_size"):
        build_criterion("second_order", micro_batch_size=0)


@pytest.mark.parametrize("name", sorted(CRITERIA))
def test_every_criterion_drives_a_plan_that_meets_the_budget(name):
    from prunelight.pipeline import make_plan
    from prunelight.settings import PruneSettings

    model = tiny_model("qwen2")
    plan = make_plan(model, list(torch.split(_ids(), 2)), PruneSettings(ratio=0.2, criterion=name)).plan
    assert plan.meta["criterion"] == name
    assert plan.meta["params_removed"] >= plan.meta["params_target_removed"]
    assert plan.meta["removed_fraction_total"] < 0.3
    assert all(p.grad is None for p in model.parameters())


def test_forward_only_criteria_build_no_graph_and_skip_the_lm_head():
    model = tiny_model("llama")
    grad_modes, head_calls = [], []
    handle = model.model.norm.register_forward_hook(
        lambda m, i, out: grad_modes.append((torch.is_grad_enabled(), out.requires_grad))
    )
    head = model.lm_head.register_forward_hook(lambda m, i, out: head_calls.append(1))
    run_calibration(model, [_ids()], build_criterion("wanda"))
    handle.remove()
    head.remove()
    assert grad_modes == [(False, False)]
    assert head_calls == []  # a forward-only criterion reads the layers: no logits are computed
