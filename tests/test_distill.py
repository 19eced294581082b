"""Recovery by distillation: the loss against independent formulas, chunking, the frozen teacher, and a CLI run."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prunelight.callbacks import PruningCallback
from prunelight.cli import cli_main
from prunelight.distill import DistillationSettings, chunked_losses, logit_distillation, next_token_targets
from prunelight.module import PruneLM
from prunelight.recovery import LoRASettings
from prunelight.settings import PruneSettings, SettingsError
from prunelight.testing import (make_tiny_checkpoint, tiny_config, tiny_fit_args, tiny_model, tiny_tokenizer,
                                write_tiny_corpus)



def _reference(s: torch.Tensor, t: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """The distillation term from torch.nn.functional on the full logits."""
    if kind == "mse_logits":
        return F.mse_loss(s, t)
    log_s, log_t = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
    if kind == "kl":  # KL(teacher || student)
        return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * temperature**2
    return F.kl_div(log_t, log_s, log_target=True, reduction="batchmean") * temperature**2  # KL(student || teacher)


@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "mse_logits"])
@pytest.mark.parametrize("chunk", [None, 4, 5, 100])
def test_loss_equals_an_independent_computation_chunked_or_not(kind, chunk):
    torch.manual_seed(0)
    student = torch.randn(13, 50, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(13, 50, dtype=torch.float64) * 2
    ours = logit_distillation(student, teacher, nn.Identity(), kind, temperature=2.0, chunk_tokens=chunk)
    (grad,) = torch.autograd.grad(ours, student)
    ref = _reference(student, teacher, kind, 2.0)
    (ref_grad,) = torch.autograd.grad(ref, student)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_chunked_teacher_head_equals_the_full_logits():
    """The teacher's LM head applied chunk by chunk gives the loss of its full logits."""
    torch.manual_seed(1)
    head = nn.Linear(16, 40, bias=False)
    hidden = torch.randn(23, 16)
    student = torch.randn(23, 40, requires_grad=True)
    full = logit_distillation(student, head(hidden).detach(), nn.Identity(), "kl", 1.5, None)
    chunked = logit_distillation(student, hidden, head, "kl", 1.5, chunk_tokens=6)
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-6)
    assert head.weight.grad is None, "the teacher head must not receive gradients"


@pytest.mark.parametrize("field,value,match", [
    ("alpha", 1.5, "model.distillation.alpha=1.5 is not allowed: must be a number in [0.0, 1.0]"),
    ("temperature", 0.0, "model.distillation.temperature=0.0 is not allowed"),
    ("loss", "js", "model.distillation.loss='js' is not allowed: use one of kl, reverse_kl, mse_logits"),
    ("chunk_tokens", 0, "model.distillation.chunk_tokens=0 is not allowed"),
    ("teacher", "", "model.distillation.teacher='' is not allowed"),
    ("dtype", "int8",
     "model.distillation.dtype='int8' is not allowed: use one of auto, bfloat16, float16, float32, model"),
])
def test_bad_settings_fail_with_one_line(field, value, match):
    with pytest.raises(SettingsError, match=match.replace("[", r"\[").replace("]", r"\]")):
        DistillationSettings(**{field: value})


def _module(tmp_path, recovery="lora", **distill) -> PruneLM:
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    return PruneLM(pretrained=str(ckpt), recovery=recovery, attn_implementation="eager",
                   lora=LoRASettings(r=4, alpha=8, dropout=0.0), learning_rate=1e-2,
                   distillation=DistillationSettings(**distill))


def _dm(tmp_path):
    from prunelight.data import PruneDataModule, TextSource

    files = write_tiny_corpus(tmp_path / "data")
    dm = PruneDataModule(calibration=TextSource(path=str(files["valid"])), eval=TextSource(path=str(files["test"])),
                         train=TextSource(path=str(files["train"])), num_samples=8, seq_len=16, batch_size=4,
                         max_eval_blocks=4)
    dm.set_tokenizer(tiny_tokenizer())
    return dm


def test_alpha_zero_is_plain_ce_and_never_runs_the_teacher(tmp_path, monkeypatch):
    module = _module(tmp_path, recovery="full", alpha=0.0)
    module.configure_model()
    module.snapshot_teacher()
    assert module.frozen_teacher.model is None, "alpha 0 keeps no copy of the dense model"
    monkeypatch.setattr(PruneLM, "teacher", lambda self: pytest.fail("alpha 0 ran the teacher"))
    batch = torch.randint(3, 128, (2, 12))
    ce = module.model(input_ids=batch, labels=batch, use_cache=False).loss
    torch.testing.assert_close(module._distillation_loss(batch), ce, rtol=0, atol=1e-6)


def test_a_twin_teacher_gives_zero_kl_and_hidden_mse():
    module = _twin("llama", alpha=1.0, loss="kl", temperature=2.0, hidden=True)
    assert module._distillation_loss(torch.randint(3, 128, (2, 12))).abs().item() < 1e-6


def _twin(family: str, **distill) -> PruneLM:
    """A config-built module whose teacher is a snapshot of itself, its logits sharpened past Gemma 2's cap (3.0)."""
    distill.setdefault("dtype", "float32")  # the student's dtype: the twin's logits are the student's exactly
    module = PruneLM(config=tiny_config(family).to_dict(), recovery="full", attn_implementation="eager",
                     distillation=DistillationSettings(**distill))
    torch.manual_seed(0)
    module.configure_model()
    with torch.no_grad():
        module.base_model.get_output_embeddings().weight.mul_(8)
    module.snapshot_teacher()
    return module


@pytest.mark.parametrize("family", ["gemma2", "llama"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_a_model_distilled_against_itself_gives_zero_kl(family, chunk):
    """The teacher's logits get the family's transform (Gemma 2's final soft-cap), as the student's forward does."""
    module = _twin(family, alpha=1.0, loss="kl", chunk_tokens=chunk)
    batch = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    assert module._distillation_loss(batch).abs().item() < 1e-6


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("chunk", [None, 5, 7])
def test_chunked_ce_equals_the_models_own_loss(family, chunk):
    """The CE term, in chunks (checkpointed when they train), is transformers' labels= loss, gradients included."""
    model = tiny_model(family)
    ids = torch.randint(3, 128, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(input_ids=ids, labels=ids).loss
        logits = model(input_ids=ids).logits
    leaf = logits.reshape(-1, logits.shape[-1]).clone().requires_grad_(True)
    distill, ce = chunked_losses(leaf, next_token_targets(ids), None, None, chunk_tokens=chunk)
    assert distill is None
    torch.testing.assert_close(ce, own, rtol=0, atol=1e-5)
    ref = F.cross_entropy(leaf.view(3, 11, -1)[:, :-1].reshape(-1, leaf.shape[-1]), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(torch.autograd.grad(ce, leaf)[0], torch.autograd.grad(ref, leaf)[0],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [None, 5])
def test_mixed_loss_equals_an_independent_computation(chunk):
    """alpha * KL(teacher forward's logits || student's) + (1 - alpha) * the model's own CE, on Gemma 2."""
    module = _twin("gemma2", alpha=0.3, loss="kl", temperature=2.0, chunk_tokens=chunk)
    with torch.no_grad():  # the student drifts from its teacher, so the KL is not 0
        module.base_model.get_output_embeddings().weight.add_(torch.randn(128, 64) * 0.5)
    module.model.eval()
    batch = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = module.model(input_ids=batch, labels=batch)
        t_logits = module.teacher()(input_ids=batch).logits
        kl = _reference(out.logits.reshape(-1, 128), t_logits.reshape(-1, 128), "kl", 2.0)
        ours = module._distillation_loss(batch)
    assert kl > 1e-3
    torch.testing.assert_close(ours, 0.3 * kl + 0.7 * out.loss, rtol=0, atol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_the_student_forward_gets_no_labels_and_alpha_one_computes_no_ce(alpha, monkeypatch):
    module = _twin("llama", alpha=alpha)
    calls = []
    module.model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs), with_kwargs=True)
    ce_calls = []
    real_ce = F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda *a, **k: ce_calls.append(1) or real_ce(*a, **k))
    module._distillation_loss(torch.randint(3, 128, (2, 12)))
    assert len(calls) == 1 and calls[0].get("labels") is None, "transformers would compute a whole-batch CE"
    assert bool(ce_calls) == (alpha < 1), "alpha 1 is distillation only: no CE is computed"


@pytest.mark.parametrize("dtype,want", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                        ("float32", torch.float32), ("model", torch.float32),
                                        ("auto", torch.float32)])  # auto on a CPU: the student's dtype
def test_the_teacher_is_held_in_the_configured_dtype(tmp_path, dtype, want):
    """Snapshotted before the cut or reloaded from its folder (a resume), the teacher is in distillation.dtype."""
    module = _module(tmp_path, recovery="full", alpha=0.5, dtype=dtype)  # the student: model.dtype float32
    module.configure_model()
    module.snapshot_teacher()
    assert {p.dtype for p in module.frozen_teacher.model.parameters()} == {want}
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}, "the student keeps its dtype"
    reloaded = _module(tmp_path, recovery="full", alpha=0.5, dtype=dtype)
    reloaded.configure_model()
    assert {p.dtype for p in reloaded.teacher().parameters()} == {want}
    assert torch.isfinite(reloaded._distillation_loss(torch.randint(3, 128, (2, 12))))


def test_a_bad_teacher_dtype_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"model\.distillation\.dtype='fp8' is not allowed: use one of auto, bfloat16, "
                                         r"float16, float32, model"):
        DistillationSettings(dtype="fp8")


@pytest.mark.parametrize("device,bf16,model_dtype,want", [
    ("cuda", True, torch.float32, torch.bfloat16),   # a GPU that computes in bf16: half the teacher's memory
    ("cuda", False, torch.float16, torch.float16),   # e.g. a V100: the student's dtype
    ("cpu", True, torch.float32, torch.float32),     # a CPU: the student's dtype, whatever CUDA says
    ("cpu", True, torch.bfloat16, torch.bfloat16),
])
def test_auto_teacher_dtype_is_bf16_on_a_bf16_gpu_else_the_students(monkeypatch, device, bf16, model_dtype, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert DistillationSettings().dtype == "auto"
    assert DistillationSettings().teacher_dtype(model_dtype, torch.device(device)) == want
    assert DistillationSettings(dtype="bfloat16").teacher_dtype(model_dtype, torch.device(device)) == torch.bfloat16


def test_the_record_names_the_dtype_the_teacher_was_held_in(tmp_path):
    """`auto` is resolved where the teacher runs; the report says what it became, not "auto"."""
    module = _module(tmp_path, recovery="full", alpha=0.5)
    module.configure_model()
    assert module.distillation_record()["dtype"] == "auto", "before the teacher exists: the setting"
    module.snapshot_teacher()
    assert module.distillation_record()["dtype"] == "float32"


@pytest.mark.parametrize("recovery", ["lora", "full"])
def test_teacher_is_frozen_outside_the_optimizer_and_the_checkpoint(tmp_path, recovery):
    torch.manual_seed(0)
    module, dm = _module(tmp_path, recovery=recovery, alpha=0.5, temperature=2.0), _dm(tmp_path)
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[PruningCallback(PruneSettings(ratio=0.25)), ckpt_cb])
    module.configure_model()
    dense = {k: v.clone() for k, v in module.base_model.state_dict().items()}
    trainer.fit(module, dm)

    teacher = module.frozen_teacher.model
    assert teacher is not None and not teacher.training
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert {k: v for k, v in teacher.state_dict().items()}.keys() == dense.keys()
    for k, v in teacher.state_dict().items():
        assert v.dtype == torch.float32, "distillation.dtype's default (auto) on a CPU: the student's float32"
        assert torch.equal(v, dense[k].to(v.dtype)), f"the teacher must stay the dense model ({k} changed)"
    in_opt = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not in_opt & {id(p) for p in teacher.parameters()}
    assert not any("teacher" in n for n, _ in module.named_parameters())
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert not any("teacher" in k for k in saved["state_dict"])
    if recovery == "full":  # every saved weight is the student's: the cut shapes, not the dense ones
        assert saved["state_dict"]["model.model.layers.0.mlp.down_proj.weight"].shape[1] < 96
    assert len(saved["optimizer_states"]) == 1
    n_opt = sum(len(g["params"]) for g in saved["optimizer_states"][0]["param_groups"])
    assert n_opt == sum(1 for p in module.model.parameters() if p.requires_grad)


def test_distillation_is_refused_under_zero3_by_the_run_plan(tmp_path, monkeypatch):
    """The run plan refuses distillation under ZeRO-3 before any weights load (and allows it under ZeRO-2)."""
    from prunelight import sources
    from prunelight.distill import DistillationSettings
    from prunelight.run_plan import RunFacts, prepare_run

    monkeypatch.setattr(sources, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    config = tiny_model().config
    facts = dict(deepspeed=True, zero_stage=3, distillation=DistillationSettings(alpha=0.5))
    settings = PruneSettings(ratio=0.2, criterion="magnitude", allocation="global", reconstruct="none")
    with pytest.raises(ValueError, match="model.distillation is not allowed under DeepSpeed ZeRO-3"):
        prepare_run(settings, config=config, run=RunFacts(**facts))
    assert prepare_run(settings, config=config, run=RunFacts(**{**facts, "zero_stage": 2})).budget is not None


def test_lora_distillation_run_via_the_cli_names_teacher_and_loss(tmp_path, monkeypatch):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cli_main(tiny_fit_args(
        ckpt, files, "--trainer.max_steps=3", "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1",
        "--model.distillation.alpha=0.7", "--model.distillation.loss=reverse_kl",
        "--model.distillation.temperature=2.0", "--model.distillation.chunk_tokens=5",
        "--export.out_dir=runs/d",
    ))
    report = json.loads((tmp_path / "runs" / "d" / "report.json").read_text())
    rec = report["recovery"]
    assert rec["mode"] == "lora" and rec["steps"] == 3
    assert rec["distillation"]["loss"] == "reverse_kl" and rec["distillation"]["alpha"] == 0.7
    assert rec["distillation"]["teacher"] == f"dense model before the cut ({ckpt})"
    metrics = next((tmp_path / "runs" / "d" / "lightning_logs").rglob("metrics.csv")).read_text()
    assert "train_distill" in metrics and "train_ce" in metrics
    assert "distillation" in (tmp_path / "runs" / "d" / "report.md").read_text().lower()
