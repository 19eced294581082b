"""Layer tuning (`prune.layer_tuning`): each cut layer trained toward the dense layer's outputs, kept at the epoch of
least held-out error, the same on every rank, off with reconstruct none, and refused with bad settings."""

from __future__ import annotations

import copy
import re
import threading

import pytest
import torch

from prunelight.testing import cut_with
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.layer_tuning import LayerTuner
from prunelight.reconstruct import cut_and_reconstruct
from prunelight.settings import LayerTuning, PruneSettings, SettingsError
from prunelight.testing import ThreadRanks, VARIANTS, allocate_flat, settings_of, tiny_model


def _batches(n: int = 6, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (8, 48), generator=g) for _ in range(n)]


def _plan(model, ratio: float = 0.4):
    return allocate_flat(model, build_criterion("random", seed=1).scores(model), ratio, "global")


def _layer_calls(model, batches) -> list[list[tuple[torch.Tensor, torch.Tensor, dict]]]:
    """Per decoder layer, per batch: the layer's input, its output and the other keyword arguments the model passes
    it (masks, positions), from a forward of `model`."""
    layers = get_family(model).layers(model)
    seen: list[list] = [[] for _ in layers]

    def hook(i: int):
        def record(m, args, kwargs, out):
            x = kwargs.get("hidden_states", args[0] if args else None)
            kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            seen[i].append((x, out[0] if isinstance(out, tuple) else out, kw))

        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for ids in batches:
            model(ids, use_cache=False)
    for h in handles:
        h.remove()
    return seen


def _held_error(cut_model, dense_calls, i: int, held: list[int]) -> float:
    """Σ||layer_i(x) - y||² / Σ||y - x||² over the held-out batches, x and y the dense layer's input and output."""
    layer = get_family(cut_model).layers(cut_model)[i]
    err = own = 0.0
    with torch.no_grad():
        for b in held:
            x, y, kw = dense_calls[i][b]
            out = layer(x, **kw)
            out = out[0] if isinstance(out, tuple) else out
            err += float((out - y).pow(2).sum())
            own += float((y - x).pow(2).sum())
    return err / own


def _cut(model, plan, batches, tuning: LayerTuning | None, reduce_sum=None, all_batches=None):
    settings = settings_of(0.4, reconstruct="least_squares")
    tuner = LayerTuner(model, batches, tuning, reduce_sum, plan.drop_layers) if tuning is not None else None
    figures = cut_and_reconstruct(model, plan, batches, settings, reduce_sum, tune=tuner.tune if tuner else None)
    return figures, tuner


@pytest.mark.parametrize("family, lr", [("llama", 1e-3), ("qwen2", 3e-4)])  # qwen2's tiny cut is nearly repaired
def test_tuning_lowers_each_layers_held_out_error_as_measured_independently(family, lr):
    dense = tiny_model(family)
    plan = _plan(dense)
    batches = _batches()
    repaired, tuned = copy.deepcopy(dense), copy.deepcopy(dense)
    _cut(repaired, plan, batches, None)
    _, tuner = _cut(tuned, plan, batches, LayerTuning(epochs=8, lr=lr, holdout_sequences=12))
    held = [4, 5]  # 12 sequences: the last two batches of 8 (whole batches)
    assert tuner.held_batches == held and tuner.train_batches == [0, 1, 2, 3]
    calls = _layer_calls(dense, batches)
    figures = {f["layer"]: f for f in tuner.summary()["layers"]}
    assert sorted(figures) == [0, 1], "the plan cut both layers: each is tuned"
    improved = False
    for i, f in figures.items():
        before = _held_error(repaired, calls, i, held)
        after = _held_error(tuned, calls, i, held)
        assert f["held_out_error_before"] == pytest.approx(before, rel=1e-4)
        assert f["held_out_error_after"] == pytest.approx(after, rel=1e-4)
        assert after <= before
        improved |= after < 0.9 * before and f["epoch"] > 0
    assert improved, "no layer improved by 10%: the test would not see tuning work"
    # the shapes (and so every layer's query/KV head ratio) are the cut's
    assert {k: v.shape for k, v in tuned.state_dict().items()} == {k: v.shape for k, v in repaired.state_dict().items()}
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), repaired.state_dict().values()))


def test_an_epoch_that_only_hurts_is_not_kept():
    """A learning rate far too large: every epoch raises the held-out error, so each layer keeps the repaired cut."""
    dense = tiny_model("llama")
    plan = _plan(dense)
    batches = _batches()
    repaired, tuned = copy.deepcopy(dense), copy.deepcopy(dense)
    _cut(repaired, plan, batches, None)
    _, tuner = _cut(tuned, plan, batches, LayerTuning(epochs=3, lr=0.5, holdout_sequences=8))
    for f in tuner.summary()["layers"]:
        assert f["epoch"] == 0 and f["epochs_run"] == 1
        assert f["held_out_error_after"] == f["held_out_error_before"]
    for key, v in repaired.state_dict().items():
        assert torch.equal(tuned.state_dict()[key], v), key


@pytest.mark.parametrize("n_batches", [8, 7])  # 7: the ranks hold 4 and 3 batches, and still step together
def test_two_ranks_write_the_same_weights(n_batches):
    model = tiny_model("qwen2")
    plan = _plan(model)
    batches = _batches(n_batches)
    tuning = LayerTuning(epochs=3, lr=1e-3, holdout_sequences=8)
    models = [copy.deepcopy(model) for _ in range(2)]
    tuners = ThreadRanks(2).run(lambda r, reduce_sum: _cut(models[r], plan, batches[r::2], tuning, reduce_sum)[1])
    untuned = copy.deepcopy(model)
    _cut(untuned, plan, batches, None)
    s0, s1 = models[0].state_dict(), models[1].state_dict()
    for key, v in s0.items():
        assert torch.equal(v, s1[key]), key  # every rank took the same steps
    assert any(not torch.equal(v, untuned.state_dict()[k]) for k, v in s0.items()), "nothing was tuned"
    assert [t.held_batches for t in tuners] == [[3], [n_batches // 2 - 1]]  # 4 of the 8 held-out sequences each
    assert [len(t.train_batches) for t in tuners] == [n_batches // 2 - 1] * 2
    assert tuners[0].figures == tuners[1].figures


def test_non_finite_outputs_or_loss_stop_with_the_layer(monkeypatch):
    dense = tiny_model("llama")
    plan = _plan(dense)
    batches = _batches()
    broken = copy.deepcopy(dense)
    with torch.no_grad():
        get_family(broken).layers(broken)[1].mlp.up_proj.weight[:, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"dense decoder layer 1 gives non-finite outputs"):
        _cut(broken, plan, batches, LayerTuning(epochs=2, lr=1e-3, holdout_sequences=8))

    class Diverging(torch.optim.Adam):
        def step(self, closure=None):  # a step that blows the weights up, as too large a rate can
            super().step(closure)
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.fill_(float("inf"))

    monkeypatch.setattr("prunelight.layer_tuning.torch.optim.Adam", Diverging)
    with pytest.raises(FloatingPointError, match=r"loss of decoder layer 0 is nan at epoch 1; lower "
                                                 r"prune\.layer_tuning\.lr \(0\.001\)"):
        _cut(copy.deepcopy(dense), plan, batches, LayerTuning(epochs=2, lr=1e-3, holdout_sequences=8))


def test_a_loss_that_diverges_on_one_rank_stops_every_rank(monkeypatch):
    """Only rank 1's weights blow up: both ranks still meet at the gradient sum and raise the same error (raising
    on rank 1 alone would leave rank 0 waiting at that sum: here the barrier's time-out, then BrokenBarrierError)."""
    model = tiny_model("qwen2")
    plan = _plan(model)
    batches = _batches(8)
    models = [copy.deepcopy(model) for _ in range(2)]
    here = threading.local()  # which rank the calling thread stands for

    class DivergingOnRank1(torch.optim.Adam):
        def step(self, closure=None):
            super().step(closure)
            if getattr(here, "rank", None) == 1:
                with torch.no_grad():
                    for group in self.param_groups:
                        for p in group["params"]:
                            p.fill_(float("inf"))

    monkeypatch.setattr("prunelight.layer_tuning.torch.optim.Adam", DivergingOnRank1)
    tuning = LayerTuning(epochs=2, lr=1e-3, holdout_sequences=8)

    def one(r, reduce_sum):
        here.rank = r
        try:
            _cut(models[r], plan, batches[r::2], tuning, reduce_sum)
        except FloatingPointError as err:  # returned, so the other rank is not released by an abort
            return err
        return None

    errors = ThreadRanks(2).run(one)
    assert all(isinstance(e, FloatingPointError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    assert re.search(r"loss of decoder layer 0 is (nan|inf) \(summed over the ranks\) at epoch 1", str(errors[0]))


def test_the_cut_tunes_after_a_repair_and_not_without_one():
    """`cut.run_cut` (the run's and `prunelight.prune`'s cut): tuned and recorded after least squares; epochs 0 is
    the repair alone; reconstruct none is not tuned (the cut stays the masked model)."""
    dense = tiny_model("llama")
    batches = _batches()
    common = dict(ratio=0.3, criterion="random", allocation="global",
                  layer_tuning={"epochs": 4, "lr": 1e-3, "holdout_sequences": 8})
    tuned, repaired, bare = copy.deepcopy(dense), copy.deepcopy(dense), copy.deepcopy(dense)
    tuning = cut_with(tuned, batches, PruneSettings(reconstruct="least_squares", **common)).reconstruction["tuning"]
    assert tuning["epochs"] == 4 and tuning["held_out_sequences"] == 8 and tuning["train_sequences"] == 40
    assert [f["layer"] for f in tuning["layers"]] == [0, 1]
    assert tuning["mean_held_out_error_after"] <= tuning["mean_held_out_error_before"]
    figures = cut_with(repaired, batches, PruneSettings(reconstruct="least_squares",
                                                       **{**common, "layer_tuning": {"epochs": 0}})).reconstruction
    assert "tuning" not in figures
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), repaired.state_dict().values()))
    assert cut_with(bare, batches, PruneSettings(reconstruct="none", **common)).reconstruction is None


@pytest.mark.parametrize("tuning, option", [
    ({"epochs": -1}, "prune.layer_tuning.epochs"),
    ({"lr": 0.0}, "prune.layer_tuning.lr"),
    ({"lr": 2.0}, "prune.layer_tuning.lr"),
    ({"holdout_sequences": 0}, "prune.layer_tuning.holdout_sequences"),
])
def test_settings_refuse_bad_values(tuning, option):
    with pytest.raises(SettingsError, match=rf"^{option}="):
        PruneSettings(layer_tuning=tuning)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_family_is_tuned_and_never_worse_on_held_out_sequences(variant):
    """Each family's layer (its norms, biases, sliding windows, fused projections) takes the tuning's forward and
    backward, and no layer leaves it with a larger held-out error than the repair gave it."""
    family, overrides = VARIANTS[variant]
    model = tiny_model(family, **overrides)
    batches = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    settings = PruneSettings(ratio=0.3, criterion="random", allocation="global",
                             layer_tuning={"epochs": 3, "holdout_sequences": 4})
    tuning = cut_with(model, batches, settings).reconstruction["tuning"]
    assert [f["layer"] for f in tuning["layers"]] == [0, 1]
    for f in tuning["layers"]:
        assert f["held_out_error_after"] <= f["held_out_error_before"]
    with torch.no_grad():
        assert torch.isfinite(model(batches[0]).logits).all()


def test_both_cuts_tune_to_the_same_model_and_the_fitted_one_reuses_its_dense_pass(monkeypatch):
    """A search plan cut from its levels database (`cut_with_levels`: the tuner runs each dense layer itself) and the
    same plan fitted again (`cut_and_reconstruct`: the tuner gets the fit's dense inputs and outputs, and runs no
    forward of its own) tune to the same model with the same figures."""
    import prunelight.layer_tuning as layer_tuning
    from prunelight.allocation.search.repair import cut_with_levels
    from prunelight.pipeline import make_plan

    counts = {"layer_calls": 0, "run_layer": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(layer_tuning, "layer_calls", counted("layer_calls", layer_tuning.layer_calls))
    monkeypatch.setattr(layer_tuning, "run_layer", counted("run_layer", layer_tuning.run_layer))
    model = tiny_model("llama", seed=0, num_hidden_layers=3, intermediate_size=64, num_key_value_heads=2)
    batches = _batches()
    settings = settings_of(0.4, criterion="flap", allocation="search", reconstruct="least_squares", allocation_args={
        "generations": 2, "offspring": 2, "stages": [4], "survivors": [2], "mlp_levels": 8, "cut_ridge": "fixed"})
    planned = make_plan(model, batches, settings)
    plan, db = planned.plan, planned.measured.levels
    tuning = LayerTuning(epochs=6, lr=3e-4, holdout_sequences=8)
    fast, slow = copy.deepcopy(model), copy.deepcopy(model)
    fast_tuner = LayerTuner(fast, batches, tuning, None, plan.drop_layers)
    assert cut_with_levels(fast, plan, db, settings, batches, wrap=fast_tuner.wrap)["from"] == "levels_database"
    assert counts == {"layer_calls": 1, "run_layer": 3}  # one embedding pass, one dense forward per layer
    slow_tuner = LayerTuner(slow, batches, tuning, None, plan.drop_layers)
    cut_and_reconstruct(slow, copy.deepcopy(plan), batches, settings_of(0.4, reconstruct="least_squares"),
                        tune=slow_tuner.tune)
    assert counts == {"layer_calls": 1, "run_layer": 3}, "the fitted cut's tuner ran a forward of its own"
    cut_layers = [i for i, lp in enumerate(plan.layers) if lp.keep_channels is not None or lp.keep_groups is not None]
    assert [f["layer"] for f in fast_tuner.figures] == [f["layer"] for f in slow_tuner.figures] == cut_layers
    assert any(f["epoch"] > 0 for f in slow_tuner.figures), "no epoch was kept: the test would not see tuning"
    for a, b in zip(fast_tuner.figures, slow_tuner.figures):
        assert a["epoch"] == b["epoch"]
        assert a["held_out_error_after"] == pytest.approx(b["held_out_error_after"], rel=1e-3, abs=1e-7)
    ids = torch.cat(batches[:1])
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, slow(ids).logits, rtol=1e-3, atol=1e-3)
