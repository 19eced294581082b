"""Scoring memory: gradient checkpointing stays on, no weight gradients, fp32 statistics from bf16 weights."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from prunelight.calibration import run_calibration
from prunelight.importance import build_criterion
from prunelight.testing import tiny_model


def _batches():
    return [torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def test_checkpointed_scoring_recomputes_and_gives_the_same_statistics():
    plain = tiny_model("llama")
    ref = run_calibration(plain, _batches(), build_criterion("taylor"))
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mlp = ckpt.model.layers[0].mlp
    calls, forward = [], mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    got = run_calibration(ckpt, _batches(), build_criterion("taylor"))
    assert len(calls) == 2 * len(_batches()), "layer not recomputed in backward: checkpointing was off while scoring"
    for kind in ref:
        for a, b in zip(ref[kind], got[kind]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert not ckpt.training  # eval/train state restored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scoring_allocates_no_weight_gradients_and_fp32_statistics(dtype):
    model = tiny_model("llama").to(dtype)
    crit = build_criterion("taylor")
    scores = run_calibration(model, _batches(), crit)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the freeze is undone afterwards
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for v in scores.values() for t in v)


@pytest.mark.parametrize("criterion", ["taylor", "fisher", "entropy"])
def test_no_batch_activations_outlive_the_calibration_pass(criterion):
    """Activation-gradient hooks must not keep a batch's activations alive after its backward.

    With Python's cyclic GC off, anything kept only by a reference cycle stays; before the fix every
    batch's o_proj / down_proj inputs were (hook closure -> input -> its graph node -> hook), so memory
    grew by one batch of activations per calibration batch (1.4 GiB after 16 batches on the 8M model).
    """
    model = tiny_model("llama")
    inter = model.config.intermediate_size
    batches = [torch.randint(3, 128, (5, 24), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def live_activations() -> int:
        return sum(1 for o in gc.get_objects()
                   if isinstance(o, torch.Tensor) and o.dim() == 3 and tuple(o.shape[:2]) == (5, 24)
                   and o.shape[2] in (inter, model.config.hidden_size))

    gc.collect()
    gc.disable()
    try:
        run_calibration(model, batches, build_criterion(criterion))
        assert live_activations() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("criterion", ["taylor", "fisher", "entropy"])
def test_down_proj_input_rebuilt_from_saved_factors_gives_identical_scores(family, criterion, monkeypatch):
    """The hook rebuilds SwiGLU's product from the Mul node's saved factors (no activation held): same bits."""
    from prunelight.importance.base import ActGradCriterion

    model = tiny_model(family)
    used, factors = [], ActGradCriterion._factors

    def spy(self, x):
        out = factors(self, x)
        used.append(out is not None)
        return out

    monkeypatch.setattr(ActGradCriterion, "_factors", spy)
    got = run_calibration(model, _batches(), build_criterion(criterion))
    assert sum(used) == model.config.num_hidden_layers * len(_batches())  # every down_proj input, no o_proj input
    monkeypatch.setattr(ActGradCriterion, "_factors", lambda self, x: None)
    ref = run_calibration(model, _batches(), build_criterion(criterion))
    for kind in ref:
        for a, b in zip(ref[kind], got[kind]):
            assert torch.equal(a, b)
