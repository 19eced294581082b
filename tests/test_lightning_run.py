"""The Lightning run: cut inside fit, LoRA recovery and merge, checkpoints that resume after the cut."""

from __future__ import annotations

import copy
import math
import warnings

import lightning as L
import pytest
import torch

from prunelight.callbacks import PruningCallback, job_callbacks
from prunelight.data import PruneDataModule, TextSource
from prunelight.module import PruneLM
from prunelight.recovery import LoRASettings, add_lora, lr_factor, merge_lora
from prunelight.settings import ExportSettings, PruneSettings
from prunelight.testing import tiny_config, tiny_model, tiny_tokenizer, write_tiny_corpus


def _module(recovery="lora", **kw):
    cfg = tiny_config("llama").to_dict()
    cfg = {k: cfg[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")}
    return PruneLM(config=cfg, recovery=recovery, attn_implementation="eager", lora=LoRASettings(r=4, alpha=8, dropout=0.0),
                   learning_rate=1e-2, **kw)


def _dm(tmp_path):
    files = write_tiny_corpus(tmp_path / "data")
    dm = PruneDataModule(calibration=TextSource(path=str(files["valid"])), eval=TextSource(path=str(files["test"])),
                         train=TextSource(path=str(files["train"])), num_samples=8, seq_len=16, batch_size=4,
                         max_eval_blocks=4)
    dm.set_tokenizer(tiny_tokenizer())
    return dm


def _trainer(tmp_path, max_steps, callbacks, **kw):
    return L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0,
                     num_sanity_val_steps=0, callbacks=callbacks, **kw)


@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_merge_preserves_function(use_dora):
    model = tiny_model("llama")
    peft_model = add_lora(model, LoRASettings(r=4, alpha=8, dropout=0.0, use_dora=use_dora))
    magnitudes = [n for n, _ in peft_model.named_parameters() if "lora_magnitude_vector" in n]
    assert bool(magnitudes) == use_dora  # DoRA adds a trained magnitude per adapted projection
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n or "lora_magnitude_vector" in n:
                p.add_(torch.randn_like(p) * 0.05)  # B starts at zero (and DoRA's magnitude at the norms): move them
        ids = torch.randint(3, 128, (2, 10))
        before = peft_model(ids).logits
        merged = merge_lora(peft_model)
        after = merged(ids).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_fit_prunes_recovers_exports_and_resumes(tmp_path):
    torch.manual_seed(0)
    module, dm = _module(), _dm(tmp_path)
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    prune_cb, export_cb = job_callbacks(PruneSettings(ratio=0.25, criterion="taylor", prune_step=1),
                                        ExportSettings(out_dir=str(tmp_path / "run")))
    trainer = _trainer(tmp_path, 4, [prune_cb, ckpt_cb, export_cb])
    trainer.fit(module, dm)

    report = module.record.to_dict()
    assert module.cut_state.done and report["calibration"]["prune_step"] == 1
    assert report["params_after"] < report["params_before"]
    assert {"dense", "pruned", "recovered"} <= set(report["ppl"])
    assert (tmp_path / "run" / "model" / "model.safetensors").exists() and (tmp_path / "run" / "report.json").exists()
    assert not module.lora_active, "LoRA must be merged at the end"

    # Resume from the checkpoint written after the cut: a fresh dense module must come back pruned + LoRA.
    last = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(last, weights_only=False)
    assert state["prunelight"]["plan"] is not None and state["prunelight"]["lora"] is not None
    resumed, dm2 = _module(), _dm(tmp_path / "b")
    prune_cb2 = PruningCallback(PruneSettings(ratio=0.25, criterion="taylor", prune_step=1))
    trainer2 = _trainer(tmp_path / "b", 6, [prune_cb2])
    trainer2.fit(resumed, dm2, ckpt_path=last)
    assert trainer2.global_step == 6
    assert resumed.plan.to_dict() == module.plan.to_dict(), "the plan must come back from the checkpoint"
    assert resumed.cut_state.done and resumed.record.calibration is not None
    shapes = [layer.mlp.down_proj.in_features for layer in resumed.base_model.model.layers]
    assert shapes == [len(lp.keep_channels) for lp in module.plan.layers]


@pytest.mark.parametrize("schedule, warmup, steps, expected", [
    ("constant", 2, 10, [1 / 3, 2 / 3, 1.0, 1.0, 1.0]),
    ("cosine", 0, 4, [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0]),
    ("linear", 1, 5, [0.5, 1.0, 0.75, 0.5, 0.25]),
    ("cosine", 1, None, [0.5, 1.0, 1.0, 1.0, 1.0]),  # an unbounded run keeps the peak after warmup
])
def test_lr_factor_shapes(schedule, warmup, steps, expected):
    got = [lr_factor(schedule, warmup, s, steps) for s in range(5)]
    assert got == pytest.approx(expected, abs=1e-12)


class _LRs(L.Callback):
    """Records the learning rate each optimizer step runs with, by global step."""

    def __init__(self):
        self.lrs = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def test_cosine_schedule_runs_from_the_cut_to_the_end_and_resumes(tmp_path):
    # Cut at step 2 of 6: the rebuilt schedule is 4 steps long; a run resumed at step 4 continues the same curve.
    lrs, ckpt_cb = _LRs(), L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4,
                                                              save_top_k=-1)
    module = _module(lr_schedule="cosine")
    prune = PruneSettings(ratio=0.25, criterion="taylor", prune_step=2)
    _trainer(tmp_path, 6, [PruningCallback(prune), lrs, ckpt_cb]).fit(module, _dm(tmp_path))
    cosine = [1e-2 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)]
    assert [lrs.lrs[g] for g in range(2, 6)] == pytest.approx(cosine, rel=1e-9)
    trainer = module.trainer
    assert float(trainer.callback_metrics["lr"]) == pytest.approx(cosine[-1], rel=1e-6), "the logger has the lr"

    resumed, lrs2 = _module(lr_schedule="cosine"), _LRs()
    ckpt = next((tmp_path / "ckpt").glob("*step=4*.ckpt"))
    _trainer(tmp_path / "b", 6, [PruningCallback(prune), lrs2]).fit(resumed, _dm(tmp_path / "b"), ckpt_path=ckpt)
    assert [lrs2.lrs[g] for g in (4, 5)] == pytest.approx(cosine[2:], rel=1e-9)


def test_full_finetune_recovery_trains_all_weights(tmp_path):
    module, dm = _module(recovery="full"), _dm(tmp_path)
    trainer = _trainer(tmp_path, 3, [PruningCallback(PruneSettings(ratio=0.2, criterion="magnitude"))])
    trainer.fit(module, dm)
    # all parameters are trainable and the optimizer holds the pruned ones
    params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert params == {id(p) for p in module.model.parameters()}


def test_prune_only_run_stops_after_the_cut(tmp_path):
    module, dm = _module(recovery="none"), _dm(tmp_path)
    callbacks = job_callbacks(PruneSettings(ratio=0.2, criterion="taylor"), ExportSettings(out_dir=str(tmp_path / "run")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(tmp_path, 100, callbacks)
        trainer.fit(module, dm)
    assert module.plan is not None and trainer.global_step == 0, "the loop must stop right after the cut"
    # the final model is the pruned one: measured once, its figures stand for "recovered" too
    assert module.record.ppl["recovered"] == module.record.ppl["pruned"]
    assert any("measured once" in n for n in module.record.notes)
    assert not [w for w in caught if "training_step" in str(w.message)], "a prune-only run never enters training"
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()


def test_nan_weights_give_clear_error(tmp_path):
    module, dm = _module(), _dm(tmp_path)
    module.configure_model()
    with torch.no_grad():
        module.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    trainer = _trainer(tmp_path, 2, [PruningCallback(PruneSettings(ratio=0.2, criterion="taylor"))])
    with pytest.raises(FloatingPointError, match="NaN|nan|non-finite"):
        trainer.fit(module, dm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ratio": 1.2}, r"prune.ratio=1.2 is not allowed: must be a number in \(0.0, 1.0\)"),
        ({"criterion": "taylorr"}, "prune.criterion='taylorr' is not allowed: use one of taylor"),
        ({"allocation": "everywhere"}, "prune.allocation='everywhere'"),
        ({"prune_step": -1}, "prune.prune_step=-1 is not allowed: must be an integer >= 0"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PruneSettings(**kwargs)


@pytest.mark.parametrize("recovery, step, max_steps, match", [
    ("lora", 5, 3, r"prune.prune_step=5 is not allowed: the run stops at trainer.max_steps=3"),
    ("none", 2, 10, r"prune.prune_step=2 is not allowed with model.recovery=none"),
])
def test_prune_step_checked_against_the_run(tmp_path, recovery, step, max_steps, match):
    module, dm = _module(recovery=recovery), _dm(tmp_path)
    trainer = _trainer(tmp_path, max_steps, [PruningCallback(PruneSettings(prune_step=step))])
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, dm)
    assert module.plan is None


def test_unknown_architecture_and_bad_module_settings():
    with pytest.raises(ValueError, match=r"unsupported architecture model_type='gpt2'; prunelight supports: gemma2, gemma3_text, "
                       r"llama, mistral, nemotron-nas, phi3, .*qwen3"):
        PruneLM(config={"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}).configure_model()
    with pytest.raises(ValueError, match="unknown recovery mode 'qlora'"):
        PruneLM(recovery="qlora")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        PruneLM(dtype="fp8")
    with pytest.raises(ValueError, match="unknown lr_schedule 'step'; use one of constant, cosine, linear"):
        PruneLM(lr_schedule="step")


def test_module_deepcopy_free_of_trainer_state():
    # A module built from a config holds no trainer/global state and can be copied before fit.
    m = _module()
    m.configure_model()
    assert copy.deepcopy(m).model is not m.model
