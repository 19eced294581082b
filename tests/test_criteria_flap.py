"""FLAP's Wanda-sp and fluctuation (WIFV) metric, and HFPrune's entropy criterion, against literal formulas.

Each reference collects the o_proj / down_proj inputs with plain hooks into full tensors, computes the
paper's formula with torch ops in fp64 and slices the columns of each unit by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prunelight.allocation import precheck
from prunelight.allocation.budget import units
from prunelight.calibration import run_calibration
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.testing import FAMILIES, settings_of, tiny_model


def _ids(n: int = 4, t: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _batches(ids: torch.Tensor, n_batches: int) -> list[torch.Tensor]:
    return list(torch.chunk(ids, n_batches))


def _inputs(model, ids: torch.Tensor, n_batches: int = 1) -> list[dict[str, torch.Tensor]]:
    """Per layer, every calibration token's o_proj and down_proj input as [tokens, width] fp64 (same batching)."""
    seen: list[dict[str, list[torch.Tensor]]] = [{"attn": [], "mlp": []} for _ in model.model.layers]
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for kind, proj in (("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            hooks.append(proj.register_forward_pre_hook(
                lambda m, a, i=i, kind=kind: seen[i][kind].append(a[0].detach().reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        for batch in _batches(ids, n_batches):
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    return [{k: torch.cat(v).double() for k, v in d.items()} for d in seen]


def _weights(model, i: int) -> dict[str, torch.Tensor]:
    layer = model.model.layers[i]
    return {"attn": layer.self_attn.o_proj.weight.detach().double(),
            "mlp": layer.mlp.down_proj.weight.detach().double()}


def _group_width(model) -> int:
    """o_proj input columns one GQA group owns: its query heads times head_dim."""
    c = model.config
    return (c.num_attention_heads // c.num_key_value_heads) * (c.hidden_size // c.num_attention_heads)


def _per_unit(cols: torch.Tensor, width: int, n_units: int, reduce) -> torch.Tensor:
    return torch.stack([reduce(cols[u * width:(u + 1) * width]) for u in range(n_units)])


def _assert_close(got, expect) -> None:
    for kind in ("attn", "mlp"):
        assert len(got[kind]) == len(expect[kind])
        for g, e in zip(got[kind], expect[kind]):
            assert g.dtype == torch.float32
            # Scores are fp32 (values up to ~1e3 here): an absolute error of a few ulps of the largest is rounding.
            torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-6 * max(1.0, float(e.abs().max())))


@pytest.mark.parametrize("n_batches", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_wanda_sp_is_mean_over_rows_of_abs_w_times_input_norm(family, n_batches):
    model, ids = tiny_model(family), _ids()
    scores = run_calibration(model, _batches(ids, n_batches), build_criterion("wanda_sp"))
    gw, n_kv = _group_width(model), model.config.num_key_value_heads
    expect = {"attn": [], "mlp": []}
    for i, x in enumerate(_inputs(model, ids)):
        w = _weights(model, i)
        for kind in ("attn", "mlp"):
            norm = x[kind].pow(2).sum(0).sqrt()  # ||X_j||_2 over every calibration token
            cols = (w[kind].abs() * norm[None, :]).mean(0)  # FLAP: W_metric.mean(axis=0)
            if kind == "attn":  # a head sums its channels; a group sums its heads' channels
                expect[kind].append(_per_unit(cols, gw, n_kv, torch.sum))
            else:
                expect[kind].append(cols)
    _assert_close(scores, expect)


def _unit_costs(model) -> dict[str, int]:
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    q = (c.num_attention_heads // c.num_key_value_heads) * hd
    group = (q + 2 * hd) * c.hidden_size + c.hidden_size * q  # q, k, v rows and o_proj columns
    if family_has_qkv_bias(model):
        group += q + 2 * hd
    return {"attn": group, "mlp": 3 * c.hidden_size}


def family_has_qkv_bias(model) -> bool:
    return get_family(model).has_attn_bias(model.config)[0]


def _wifv(model, ids) -> list[dict[str, torch.Tensor]]:
    """FLAP's WIFV per input column (squared for o_proj, as FLAP's prune_flap does)."""
    out = []
    for i, x in enumerate(_inputs(model, ids)):
        w = _weights(model, i)
        metric = {kind: x[kind].var(dim=0, unbiased=True) * w[kind].pow(2).sum(0) for kind in ("attn", "mlp")}
        metric["attn"] = metric["attn"] ** 2
        out.append(metric)
    return out


@pytest.mark.parametrize("n_batches", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_flap_is_standardised_wifv_times_unit_cost(family, n_batches):
    model, ids = tiny_model(family), _ids()
    scores = run_calibration(model, _batches(ids, n_batches), build_criterion("flap"))
    gw, n_kv, cost = _group_width(model), model.config.num_key_value_heads, _unit_costs(model)
    expect = {"attn": [], "mlp": []}
    for metric in _wifv(model, ids):
        z = {kind: (m - m.mean()) / m.std(unbiased=True) for kind, m in metric.items()}  # per layer and kind
        expect["attn"].append(_per_unit(z["attn"], gw, n_kv, torch.mean) * cost["attn"])  # head: mean of channels
        expect["mlp"].append(z["mlp"] * cost["mlp"])
    _assert_close(scores, expect)


@pytest.mark.parametrize("n_batches", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_flap_unstandardised_sums_squared_wifv_per_head(family, n_batches):
    model, ids = tiny_model(family), _ids()
    scores = run_calibration(model, _batches(ids, n_batches), build_criterion("flap", standardize=False))
    gw, n_kv = _group_width(model), model.config.num_key_value_heads
    expect = {"attn": [], "mlp": []}
    for metric in _wifv(model, ids):
        expect["attn"].append(_per_unit(metric["attn"], gw, n_kv, torch.sum))
        expect["mlp"].append(metric["mlp"])
    _assert_close(scores, expect)


@pytest.mark.parametrize("n_batches", [1, 2])
def test_input_means_are_the_mean_o_proj_and_down_proj_inputs(n_batches):
    model, ids = tiny_model("qwen2"), _ids()
    crit = build_criterion("flap")
    run_calibration(model, _batches(ids, n_batches), crit)
    means = crit.input_means()
    for i, x in enumerate(_inputs(model, ids)):
        for kind in ("attn", "mlp"):
            assert means[kind][i].dtype == torch.float32
            torch.testing.assert_close(means[kind][i].double(), x[kind].mean(0), rtol=1e-5, atol=1e-7)


def test_variance_survives_a_large_mean_offset():
    """E[x^2] - E[x]^2 in fp32 would lose the variance entirely for inputs ~300 with a spread of ~1e-2."""
    model, ids = tiny_model("llama"), _ids(n=6)
    proj = model.model.layers[1].mlp.down_proj
    shift = proj.register_forward_pre_hook(lambda m, a: (a[0] + 300.0,))
    crit = build_criterion("flap")
    run_calibration(model, _batches(ids, 3), crit)
    x = _inputs(model, ids, 3)[1]["mlp"]  # the hook is still on: the same shifted fp32 inputs, in fp64
    shift.remove()
    torch.testing.assert_close(crit.input_variances(1, "mlp"), x.var(0, unbiased=True), rtol=1e-5, atol=0)
    torch.testing.assert_close(crit.input_means()["mlp"][1].double(), x.mean(0), rtol=1e-6, atol=0)


def test_global_allocation_sees_flap_order():
    """`global` ranks by score / parameters; `flap` scores make that FLAP's AL-AM order by standardised score."""
    model, ids = tiny_model("llama"), _ids()
    scores = run_calibration(model, [ids], build_criterion("flap"))
    budget = precheck(model, settings_of(0.2))
    gw, n_kv = _group_width(model), model.config.num_key_value_heads
    z = []
    for i, metric in enumerate(_wifv(model, ids)):
        s = {kind: (m - m.mean()) / m.std() for kind, m in metric.items()}
        z += [(float(v), "attn", i, j) for j, v in enumerate(_per_unit(s["attn"], gw, n_kv, torch.mean))]
        z += [(float(v), "mlp", i, j) for j, v in enumerate(s["mlp"])]
    order = [u[1:4] for u in units(scores, budget)]
    assert order == [u[1:] for u in sorted(z)]


def _entropy_reference(model, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """HFPrune: one sample at a time, H = mean over tokens of the output entropy, score += sum_t |a * dH/da|."""
    acts: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for kind, proj in (("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            hooks.append(proj.register_forward_pre_hook(lambda m, a, key=(i, kind): acts.__setitem__(key, a[0])))
    cols = {key: 0.0 for key in [(i, k) for i in range(len(model.model.layers)) for k in ("attn", "mlp")]}
    for s in range(ids.shape[0]):
        logits = model(input_ids=ids[s:s + 1]).logits.double()
        p, logp = F.softmax(logits, -1), F.log_softmax(logits, -1)
        entropy = -(p * logp).sum(-1).mean()
        keys = list(acts)
        grads = torch.autograd.grad(entropy, [acts[k] for k in keys])
        for k, g in zip(keys, grads):
            cols[k] = cols[k] + (acts[k].double() * g.double()).abs().sum(dim=(0, 1))  # abs per token and channel
    for h in hooks:
        h.remove()
    gw, n_kv = _group_width(model), model.config.num_key_value_heads
    return {
        "attn": [_per_unit(cols[(i, "attn")], gw, n_kv, torch.sum) for i in range(len(model.model.layers))],
        "mlp": [cols[(i, "mlp")] for i in range(len(model.model.layers))],
    }


@pytest.mark.parametrize("n_batches", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_entropy_is_hfprune_sum_of_abs_products(family, n_batches):
    model, ids = tiny_model(family), _ids()
    scores = run_calibration(model, _batches(ids, n_batches), build_criterion("entropy"))
    _assert_close(scores, _entropy_reference(model, ids))


def test_entropy_differs_from_taylor_on_the_entropy_objective():
    """|a*g| summed element-wise is at least |sum a*g| per sample, and strictly more where signs cancel."""
    model, ids = tiny_model("llama"), _ids()
    hf = run_calibration(model, [ids], build_criterion("entropy"))
    signed = run_calibration(model, [ids], build_criterion("taylor", objective="entropy"))
    for kind in ("attn", "mlp"):
        for a, b in zip(hf[kind], signed[kind]):
            assert (a >= b * (1 - 1e-5)).all() and (a > b * 1.01).any()
