"""Model tuning (`prune.model_tuning`): the whole cut decoder trained toward the dense model's next-token
distributions, kept at the epoch of least held-out KL (measured here independently), the same on every rank, skipped
where it does not fit in memory, and refused with bad settings."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from prunelight import model_tuning
from prunelight.testing import cut_with
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.model_tuning import ModelTuner, dense_hidden, model_tuning_line
from prunelight.reconstruct import cut_and_reconstruct
from prunelight.settings import ModelTuning, PruneSettings, SettingsError
from prunelight.testing import ThreadRanks, VARIANTS, allocate_flat, settings_of, tiny_model


def _batches(n: int = 6, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (8, 48), generator=g) for _ in range(n)]


def _plan(model, ratio: float = 0.4):
    return allocate_flat(model, build_criterion("random", seed=1).scores(model), ratio, "global")


def _kl(dense, cut, batches) -> float:
    """Mean over positions of KL(dense || cut) of the next-token distributions, from the two models' logits."""
    total = count = 0.0
    with torch.no_grad():
        for b in batches:
            p = F.log_softmax(dense(b).logits.float(), -1)
            q = F.log_softmax(cut(b).logits.float(), -1)
            kl = (p.exp() * (p - q)).sum(-1)
            total += float(kl.sum())
            count += kl.numel()
    return total / count


def _repaired(dense, plan, batches):
    cut = copy.deepcopy(dense)
    cut_and_reconstruct(cut, plan, batches, settings_of(0.4, reconstruct="least_squares"))
    return cut


def test_dense_hidden_is_what_the_head_turns_into_the_models_logits():
    model = tiny_model("llama")
    batches = _batches(2)
    hidden = dense_hidden(model, batches)
    head = get_family(model).logits_head(model)
    with torch.no_grad():
        for b, h in zip(batches, hidden):
            torch.testing.assert_close(head(h), model(b).logits, rtol=1e-5, atol=1e-5)


def test_tuning_lowers_the_held_out_kl_as_measured_independently():
    dense = tiny_model("llama")
    batches = _batches()
    cut = _repaired(dense, _plan(dense), batches)
    held = batches[4:]  # 16 held-out sequences: the last two batches
    before = _kl(dense, cut, held)
    flags = [p.requires_grad for p in cut.parameters()]
    tuner = ModelTuner(cut, batches, dense_hidden(dense, batches), ModelTuning(epochs=5, lr=3e-4,
                                                                                holdout_sequences=16))
    figures = tuner.tune()
    assert tuner.held_batches == [4, 5] and tuner.train_batches == [0, 1, 2, 3]
    after = _kl(dense, cut, held)
    assert figures["held_out_kl_before"] == pytest.approx(before, rel=1e-4)
    assert figures["held_out_kl_after"] == pytest.approx(after, rel=1e-4)
    assert after < 0.9 * before, (before, after)
    assert 0 < figures["epoch"] <= figures["epochs_run"] <= 5 and figures["checks_per_epoch"] == 2
    # the kept weights are those of the least measured held-out KL
    assert figures["held_out_kl_after"] == pytest.approx(min(figures["held_out_kl_per_check"]), rel=1e-6)
    emb = get_family(cut).logits_head(cut).head.weight
    assert torch.equal(emb, get_family(dense).logits_head(dense).head.weight)  # the head is not trained
    assert [p.requires_grad for p in cut.parameters()] == flags  # the trainable flags are restored


def test_an_epoch_that_only_hurts_is_not_kept():
    dense = tiny_model("llama")
    batches = _batches()
    cut = _repaired(dense, _plan(dense), batches)
    start = copy.deepcopy(cut.state_dict())
    figures = ModelTuner(cut, batches, dense_hidden(dense, batches),
                         ModelTuning(epochs=3, lr=0.5, holdout_sequences=16)).tune()  # far too fast
    # the first check, half way through the first epoch, stops it: a tuning that only hurts costs half an epoch
    assert figures["epoch"] == 0 and figures["epochs_run"] == 0.5 and len(figures["held_out_kl_per_check"]) == 1
    assert figures["held_out_kl_after"] == figures["held_out_kl_before"]
    for k, v in cut.state_dict().items():
        assert torch.equal(v, start[k]), k  # the cut exactly as it was


def test_two_ranks_write_the_same_weights():
    dense = tiny_model("llama")
    plan = _plan(dense)
    batches = _batches(8)
    cut = _repaired(dense, plan, batches)
    models = [copy.deepcopy(cut) for _ in range(2)]
    hidden = dense_hidden(dense, batches)
    tuning = ModelTuning(epochs=2, lr=3e-4, holdout_sequences=16)
    figures = ThreadRanks(2).run(
        lambda r, reduce_sum: ModelTuner(models[r], batches[r::2], hidden[r::2], tuning, reduce_sum).tune())
    s0, s1 = models[0].state_dict(), models[1].state_dict()
    for key, v in s0.items():
        assert torch.equal(v, s1[key]), key
    assert any(not torch.equal(v, cut.state_dict()[k]) for k, v in s0.items()), "nothing was tuned"
    assert figures[0]["held_out_kl_per_check"] == figures[1]["held_out_kl_per_check"]
    assert figures[0]["train_sequences"] == 48 and figures[0]["held_out_sequences"] == 16  # summed over ranks
    # the held-out KL both ranks agree on is the KL over all ranks' held-out batches
    held = [batches[6], batches[7]]
    assert figures[0]["held_out_kl_after"] == pytest.approx(_kl(dense, models[0], held), rel=1e-4)


def test_a_non_finite_loss_stops_with_a_line_naming_the_setting(monkeypatch):
    dense = tiny_model("llama")
    batches = _batches()
    cut = _repaired(dense, _plan(dense), batches)
    broken = copy.deepcopy(cut)
    with torch.no_grad():
        get_family(broken).layers(broken)[1].mlp.up_proj.weight[:, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"held-out KL .* is nan before any step.*model_tuning.epochs: 0"):
        ModelTuner(broken, batches, dense_hidden(dense, batches), ModelTuning(epochs=2, lr=1e-3)).tune()

    class Diverging(torch.optim.Adam):
        def step(self, closure=None):
            super().step(closure)
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.fill_(float("inf"))

    monkeypatch.setattr(model_tuning.torch.optim, "Adam", Diverging)
    with pytest.raises(FloatingPointError, match=r"KL loss is nan at epoch 1; lower prune.model_tuning.lr \(0.001\)"):
        ModelTuner(copy.deepcopy(cut), batches, dense_hidden(dense, batches), ModelTuning(epochs=2, lr=1e-3)).tune()


def test_the_cut_tunes_the_model_after_a_repair_and_says_so(caplog):
    dense = tiny_model("llama")
    batches = _batches()
    tuned, untuned = copy.deepcopy(dense), copy.deepcopy(dense)
    base = dict(ratio=0.4, allocation="global", criterion="magnitude", reconstruct="least_squares")
    result = cut_with(tuned, batches, PruneSettings(**base, model_tuning={"epochs": 2, "lr": 3e-4}))
    cut_with(untuned, batches, PruneSettings(**base, model_tuning={"epochs": 0}))
    figures = result.reconstruction["model_tuning"]
    assert figures["held_out_kl_after"] < figures["held_out_kl_before"]
    assert _kl(dense, tuned, batches[4:]) == pytest.approx(figures["held_out_kl_after"], rel=1e-4)
    assert _kl(dense, untuned, batches[4:]) == pytest.approx(figures["held_out_kl_before"], rel=1e-4)
    none = cut_with(copy.deepcopy(dense), batches, PruneSettings(**{**base, "reconstruct": "none"}))
    assert none.reconstruction is None  # the masked model is what reconstruct none asks for
    line = model_tuning_line(figures)
    assert re.match(r"model tuning \(2 epochs, lr 0.0003, 32 training sequences\): held-out KL from the dense model "
                    r"\d\.\d{4} -> \d\.\d{4} \(16 held-out sequences\); weights kept after [0-9.]+ of [0-9.]+ "
                    r"epochs run", line), line


def test_a_tuning_that_does_not_fit_in_memory_is_skipped_and_said(monkeypatch, caplog):
    dense = tiny_model("llama")
    batches = _batches()
    monkeypatch.setattr(model_tuning, "free_memory", lambda device: 1000)
    settings = PruneSettings(ratio=0.4, allocation="global", criterion="magnitude", model_tuning={"epochs": 2})
    with caplog.at_level("WARNING"):
        result = cut_with(copy.deepcopy(dense), batches, settings)
    assert result.reconstruction["model_tuning"]["skipped"].startswith("the decoder's float32 weights")
    assert "model tuning skipped" in caplog.text
    assert model_tuning_line(result.reconstruction["model_tuning"]).startswith("model tuning skipped: ")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_family_is_tuned_and_never_worse_on_held_out_sequences(variant):
    """Each family (its norms, biases, soft-capping, tied embeddings) takes the tuning's forward and backward, and the
    model never leaves it with a larger held-out KL than the repair gave it."""
    family, overrides = VARIANTS[variant]
    dense = tiny_model(family, **overrides)
    batches = _batches()
    cut = _repaired(dense, _plan(dense), batches)
    before = _kl(dense, cut, batches[4:])
    figures = ModelTuner(cut, batches, dense_hidden(dense, batches), ModelTuning(epochs=2, lr=1e-3)).tune()
    assert _kl(dense, cut, batches[4:]) <= before * (1 + 1e-5)
    assert figures["held_out_kl_after"] <= figures["held_out_kl_before"]
    assert all(p.dtype == torch.float32 for p in cut.parameters())
    if overrides.get("tie_word_embeddings"):  # the tied head stays the embedding, untouched
        assert cut.lm_head.weight is cut.get_input_embeddings().weight
        assert torch.equal(cut.lm_head.weight, dense.lm_head.weight)


@pytest.mark.parametrize("tuning, option", [({"epochs": -1}, "prune.model_tuning.epochs"),
                                            ({"lr": 0}, "prune.model_tuning.lr"),
                                            ({"lr": 2.0}, "prune.model_tuning.lr"),
                                            ({"holdout_sequences": 0}, "prune.model_tuning.holdout_sequences")])
def test_settings_refuse_bad_values(tuning, option):
    with pytest.raises(SettingsError, match=re.escape(option)):
        PruneSettings(model_tuning=tuning)


def test_a_bf16_model_trains_in_float32_and_gets_its_dtypes_back():
    dense = tiny_model("llama")
    batches = _batches()
    cut = _repaired(dense, _plan(dense), batches).to(torch.bfloat16)
    before = _kl(dense, cut.float(), batches[4:])
    cut.to(torch.bfloat16)
    figures = ModelTuner(cut, batches, dense_hidden(dense, batches), ModelTuning(epochs=5, lr=3e-4)).tune()
    assert all(p.dtype == torch.bfloat16 for p in cut.parameters())
    assert figures["epoch"] > 0  # float32 steps: in bf16 most of Adam's steps would round away
    assert _kl(dense, cut.float(), batches[4:]) < before


def test_the_learning_rate_rule_scales_with_the_width():
    """lr auto: 3e-5 at SmolLM2's hidden size, and as 1 / width elsewhere; a number is taken as it is."""
    from types import SimpleNamespace

    from prunelight.model_tuning import learning_rate

    assert learning_rate(ModelTuning(), SimpleNamespace(hidden_size=576)) == pytest.approx(3e-5)
    assert learning_rate(ModelTuning(), SimpleNamespace(hidden_size=4096)) == pytest.approx(3e-5 * 576 / 4096)
    assert learning_rate(ModelTuning(lr=1e-4), SimpleNamespace(hidden_size=4096)) == 1e-4
    assert ModelTuning().lr == "auto"


def test_the_held_out_kl_is_checked_within_the_epoch():
    """With four training batches and two checks per epoch the held-out KL is read after steps 2 and 4 of each epoch;
    with one check, at its end only."""
    dense = tiny_model("llama")
    batches = _batches()
    hidden = dense_hidden(dense, batches)
    two = ModelTuner(copy.deepcopy(dense), batches, hidden, ModelTuning(epochs=1, lr=3e-4))
    one = ModelTuner(copy.deepcopy(dense), batches, hidden, ModelTuning(epochs=1, lr=3e-4, checks_per_epoch=1))
    assert two.check_after == {2, 4} and one.check_after == {4}
