"""LLM-Pruner's element-wise Taylor criteria against a plain-autograd reimplementation, and additive magnitude.

The references below take full `.grad` tensors from `model(x, labels=x).loss` (LLM-Pruner's loss), loop
over samples for acc_grad, apply the element-wise formula, and sum per unit by slicing rows and columns
by hand; they share no code with the criteria.
"""

from __future__ import annotations

import pytest
import torch

from prunelight.allocation import precheck
from prunelight.calibration import run_calibration
from prunelight.families import MODEL_FAMILIES
from prunelight.importance import build_criterion
from prunelight.importance.ownership import owned_tensors
from prunelight.testing import FAMILIES, allocate_flat, settings_of, tiny_model

LLM_PRUNER = ("taylor_element", "taylor_second", "taylor_mix")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(params=[f for f in FAMILIES if not MODEL_FAMILIES[f].fused_qkv])
def family(request) -> str:
    """The reference below reads separate q/k/v and gate/up projections; Phi-3's fused ones are checked against
    an unfused Llama with the same weights (tests/test_families_modern.py)."""
    return request.param


def _ids(n: int, t: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _weights(model) -> dict[tuple[int, str], torch.nn.Parameter]:
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in PROJ:
            block = layer.self_attn if name in PROJ[:4] else layer.mlp
            out[(i, name)] = getattr(block, name).weight
    return out


def _grads(model, ids: torch.Tensor) -> dict:
    """Full weight gradients of LLM-Pruner's loss, the mean token NLL of the batch."""
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    grads = {key: w.grad.detach().clone() for key, w in _weights(model).items()}
    model.zero_grad()
    return grads


def _acc_grad(model, ids: torch.Tensor) -> dict:
    """LLM-Pruner's acc_grad: the mean over samples of each sample's squared gradient."""
    per_sample = [_grads(model, ids[j : j + 1]) for j in range(ids.shape[0])]
    return {key: sum(g[key] ** 2 for g in per_sample) / len(per_sample) for key in per_sample[0]}


def _per_unit(model, salience: dict) -> dict[str, list[torch.Tensor]]:
    """Sum |salience| over each group's q/k/v rows and o_proj columns, each channel's gate/up rows and down column."""
    cfg = model.config
    hd, n_kv = cfg.head_dim, cfg.num_key_value_heads
    rep = cfg.num_attention_heads // n_kv
    out = {"attn": [], "mlp": []}
    for i in range(cfg.num_hidden_layers):
        s = {name: salience[(i, name)].abs() for name in PROJ}
        groups = []
        for u in range(n_kv):
            q = slice(u * rep * hd, (u + 1) * rep * hd)
            kv = slice(u * hd, (u + 1) * hd)
            rows = s["q_proj"][q].sum() + s["k_proj"][kv].sum() + s["v_proj"][kv].sum()
            groups.append(rows + s["o_proj"][:, q].sum())
        out["attn"].append(torch.stack(groups))
        chans = [s["gate_proj"][c].sum() + s["up_proj"][c].sum() + s["down_proj"][:, c].sum()
                 for c in range(cfg.intermediate_size)]
        out["mlp"].append(torch.stack(chans))
    return out


def _reference(model, ids: torch.Tensor, name: str) -> dict[str, list[torch.Tensor]]:
    """LLM-Pruner's param_first / param_second / param_mix on one batch `ids`."""
    w = {key: p.detach() for key, p in _weights(model).items()}
    g = _grads(model, ids)
    h = _acc_grad(model, ids) if name != "taylor_element" else None
    if name == "taylor_element":
        sal = {k: w[k] * g[k] for k in w}
    elif name == "taylor_second":
        sal = {k: w[k] * h[k] * w[k] for k in w}
    else:
        sal = {k: w[k] * g[k] - 0.5 * w[k] * h[k] * w[k] for k in w}
    return _per_unit(model, sal)


def _close(got, want) -> None:
    for kind in ("attn", "mlp"):
        assert len(got[kind]) == len(want[kind])
        for a, b in zip(got[kind], want[kind]):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=1e-9)


def _model(family: str = "llama"):
    """A tiny model with large weights: there w * H * w is not negligible next to w * g (at 0.02 it is 1e-4 of it)."""
    return tiny_model(family, initializer_range=0.5)


@pytest.mark.parametrize("name", LLM_PRUNER)
def test_one_batch_equals_llm_pruner_formula(family, name):
    model, ids = _model(family), _ids(4)
    got = run_calibration(model, [ids], build_criterion(name))
    _close(got, _reference(model, ids, name))


def test_the_reference_tells_the_three_formulas_apart():
    """Guard for the test above: on this model the three formulas, and mix with the other sign, differ well
    beyond the tolerance, so matching the reference checks each formula and not just the dominant term."""
    model, ids = _model(), _ids(4)
    ref = {name: _reference(model, ids, name) for name in LLM_PRUNER}
    first, second = ref["taylor_element"], ref["taylor_second"]
    plus = {k: [e + 0.5 * s for e, s in zip(first[k], second[k])] for k in first}
    for a, b in [("taylor_mix", "taylor_element"), ("taylor_mix", "taylor_second")]:
        assert not torch.allclose(torch.cat(ref[a]["mlp"]), torch.cat(ref[b]["mlp"]), rtol=1e-2)
    # |w g - w^2 H / 2| is not |w g| + |w^2 H| / 2 (the sign inside |.| counts)
    assert not torch.allclose(torch.cat(ref["taylor_mix"]["mlp"]), torch.cat(plus["mlp"]), rtol=1e-2)


def test_taylor_element_sums_the_per_batch_scores(family):
    model, ids = _model(family), _ids(5)
    a, b = ids[:3], ids[3:]  # unequal batch sizes: each batch's gradient is its own mean
    got = run_calibration(model, [a, b], build_criterion("taylor_element"))
    ref_a, ref_b = _reference(model, a, "taylor_element"), _reference(model, b, "taylor_element")
    _close(got, {k: [x + y for x, y in zip(ref_a[k], ref_b[k])] for k in ref_a})
    whole = _reference(model, ids, "taylor_element")
    assert not torch.allclose(got["mlp"][0], whole["mlp"][0])  # |.| per batch: grouping matters, as documented


@pytest.mark.parametrize("name", ["taylor_second", "taylor_mix"])
def test_second_and_mix_treat_all_samples_as_one_batch(name):
    model, ids = _model(), _ids(5)
    got = run_calibration(model, [ids[:2], ids[2:]], build_criterion(name))
    _close(got, _reference(model, ids, name))


def test_taylor_element_ranks_add_up_over_the_same_batches():
    model, ids = tiny_model("llama"), _ids(6)
    batches = [ids[:2], ids[2:4], ids[4:]]
    single = run_calibration(model, batches, build_criterion("taylor_element"))
    sent: list[torch.Tensor] = []
    run_calibration(model, batches[1:], build_criterion("taylor_element"),
                    reduce_sum=lambda t: sent.append(t.clone()) or t)
    summed = run_calibration(model, batches[:1], build_criterion("taylor_element"),
                             reduce_sum=lambda t: t + sent.pop(0))
    assert not sent
    _close(summed, single)


@pytest.mark.parametrize("name", LLM_PRUNER)
def test_no_per_sample_weight_gradient_is_kept(name):
    """At most the gradient being reduced exists; none survives; biases are neither scored nor given grads."""
    model = tiny_model("qwen2")
    weights = [o.param for o in owned_tensors(model) if not o.is_bias]
    biases = [o.param for o in owned_tensors(model) if o.is_bias]
    assert biases  # qwen2 has q/k/v biases
    crit = build_criterion(name)
    seen = {"live": 0, "bias_grad": False}
    accumulate = crit.accumulate

    def counting(owned, w, g):
        seen["live"] = max(seen["live"], sum(p.grad is not None for p in weights))
        seen["bias_grad"] |= any(p.requires_grad for p in biases)
        assert not owned.is_bias
        accumulate(owned, w, g)

    crit.accumulate = counting
    run_calibration(model, [_ids(3)], crit)
    assert seen["live"] == 1 and not seen["bias_grad"]
    assert all(p.grad is None for p in model.parameters())


def test_taylor_mix_buffers_are_two_fp32_per_scored_weight_and_freed():
    model = tiny_model("qwen2")
    crit = build_criterion("taylor_mix")
    crit.attach(model)
    scored = sum(o.param.numel() for o in owned_tensors(model) if not o.is_bias)
    held = sum(t.numel() * t.element_size() for pair in crit._sums for t in pair)
    crit.detach()
    assert held == 2 * 4 * scored
    crit = build_criterion("taylor_mix")
    first = run_calibration(model, [_ids(2)], crit)
    assert crit._sums == []  # consumed by scores()
    _close(crit.scores(model), first)  # a second call returns the same scores


# --- magnitude: additive per parameter -----------------------------------------------------------

def test_magnitude_is_sum_of_squares_and_l1_sum_of_abs(family):
    model = tiny_model(family)
    w = {key: p.detach() for key, p in _weights(model).items()}
    _close(build_criterion("magnitude").scores(model), _per_unit(model, {k: v**2 for k, v in w.items()}))
    _close(build_criterion("magnitude_l1").scores(model), _per_unit(model, w))


def _iid_attention_share(scores_of, p_name: str, seed: int) -> tuple[float, float]:
    """(attention share of the removed parameters, attention share of the removable ones) under `global`."""
    # 8 groups of 1536 parameters and 256 channels of 192 per layer: a group is 8x a channel.
    model = tiny_model("llama", seed=seed, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=4, intermediate_size=256)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for o in owned_tensors(model):  # the same scale everywhere: size is the only difference
            o.param.copy_(torch.randn(o.param.shape, generator=gen) * 0.02)
    budget = precheck(model, settings_of(0.1, allocation="global"))
    removable = budget.removable("attn") + budget.removable("mlp")
    ratio = 0.5 * removable / budget.total  # half of what may go: the threshold sits mid-distribution
    plan = allocate_flat(model, scores_of(build_criterion(p_name).scores(model)), ratio, "global")
    groups, chans = plan.removed_counts()
    attn, mlp = groups * budget.g_cost, chans * budget.c_cost
    return attn / (attn + mlp), budget.removable("attn") / removable


@pytest.mark.parametrize("name", ["magnitude", "magnitude_l1"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_global_magnitude_does_not_favour_removing_large_units(name, seed):
    share, fair = _iid_attention_share(lambda s: s, name, seed)
    assert abs(share - fair) < 0.08, (share, fair)


def test_old_l2_norm_removed_attention_first():
    """The same check fails for the former L2 norm (sqrt of the sum of squares): all removable attention goes."""
    share, fair = _iid_attention_share(lambda s: {k: [t.sqrt() for t in v] for k, v in s.items()}, "magnitude", 0)
    assert share > fair + 0.15, (share, fair)
