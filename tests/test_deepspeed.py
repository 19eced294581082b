"""The DeepSpeed path as far as a CPU allows: config, ZeRO-aware gathering, plan, hand-off, LoRA checkpoints.

Lightning's DeepSpeedStrategy refuses to `fit` without CUDA ("only supported on CUDA GPUs"); the
hand-off to a fresh engine is exercised here with the ordinary strategy standing in for it, and
the real ZeRO-2/3 runs are marked to skip without a GPU.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from prunelight import distributed, zero3
from prunelight.allocation.budget import count_params
from prunelight.families import get_family
from prunelight.deepspeed_config import deepspeed_config
from prunelight.zero3 import gathered_merged_copy, gathered_pruned_copy, gathered_scores, gathered_state_dict
from prunelight.importance import build_criterion
from prunelight.pipeline import make_plan
from prunelight.surgery import apply_plan
from prunelight.settings import PruneSettings
from prunelight.testing import make_tiny_checkpoint, settings_of, tiny_model, write_tiny_corpus

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = "DeepSpeed strategy needs CUDA GPUs; no GPU on this machine"
deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed")


# --- configuration ----------------------------------------------------------------------------
def test_deepspeed_config_stage3_offload():
    cfg = deepspeed_config(stage=3, precision="bf16", offload_optimizer=True, offload_parameters=True)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    assert zero["offload_optimizer"]["device"] == "cpu" and cfg["bf16"] == {"enabled": True}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stage=4), "ZeRO stage"),
        (dict(precision="fp8"), "precision"),
        (dict(stage=2, offload_parameters=True), "offload_parameters needs ZeRO stage 3"),
        (dict(stage=0, offload_optimizer=True), "offload_optimizer"),
    ],
)
def test_deepspeed_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        deepspeed_config(**kwargs)


def test_strategy_accepts_config_and_skips_checkpoint_io():
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    strategy = DeepSpeedStrategy(config=deepspeed_config(stage=3), exclude_frozen_parameters=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    assert distributed.zero_stage(trainer.strategy) == 3
    assert distributed.needs_fresh_engine(trainer.strategy)
    assert not distributed.uses_checkpoint_io(trainer.strategy)
    assert distributed.zero_stage(DDPStrategy()) is None and not distributed.needs_fresh_engine(DDPStrategy())


def test_zero3_tells_transformers_to_load_partitioned():
    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert zero3.hf_zero3_loading(L.Trainer(accelerator="cpu", devices=1, logger=False)) is None
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, strategy=DeepSpeedStrategy(stage=3))
    handle = zero3.hf_zero3_loading(trainer)
    assert handle is not None and is_deepspeed_zero3_enabled()
    del handle
    assert not is_deepspeed_zero3_enabled()


def test_skeletons_are_built_while_transformers_sees_zero3():
    """Under ZeRO-3 the run keeps an `HfDeepSpeedConfig` alive; the meta-device skeletons (the shape twin, the
    gathered cut and merged copies) must still build. On an H200 they failed inside transformers' zero.Init
    ("Cannot copy out of meta tensor"); on CPU the same path stops inside `deepspeed.zero.Init`."""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from prunelight.recovery import LoRASettings, add_lora

    model = tiny_model("llama")
    plan = make_plan(model, [], PruneSettings(ratio=0.3, criterion="magnitude", allocation="global")).plan
    ref = copy.deepcopy(model)
    apply_plan(ref, plan)
    handle = HfDeepSpeedConfig(deepspeed_config(stage=3))
    assert is_deepspeed_zero3_enabled()
    twin = zero3.shape_twin(model)
    assert all(p.is_meta for p in twin.parameters())
    assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in model.parameters())
    assert is_deepspeed_zero3_enabled()  # the pause ends with the skeleton
    cut = gathered_pruned_copy(model, plan)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(cut(ids).logits, ref(ids).logits, rtol=0, atol=0)
    lora = LoRASettings(r=4, dropout=0.0)
    merged = gathered_merged_copy(add_lora(copy.deepcopy(model), lora), lora)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(ids).logits)
    assert is_deepspeed_zero3_enabled()
    del handle


@pytest.mark.parametrize("config", ["llama3-70b-zero3.yaml", "llama3-8b-ddp.yaml"])
def test_scaling_configs_parse(config, monkeypatch, tmp_path):
    """The shipped YAMLs build their Trainer and strategy (on CPU here: accelerator/devices overridden)."""
    from prunelight.checkpoint_io import AtomicCheckpointIO
    from prunelight.cli import cli_main

    monkeypatch.chdir(tmp_path)
    cli = cli_main(["--config", str(REPO / "configs" / config), "--trainer.accelerator", "cpu",
                    "--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.precision", "32-true"],
                   run=False)
    ds = distributed.is_deepspeed(cli.trainer.strategy)
    assert ds == ("zero3" in config)
    # AtomicCheckpointIO only where the strategy writes through a CheckpointIO.
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO) != ds
    if ds:
        assert distributed.zero_stage(cli.trainer.strategy) == 3
        assert cli.trainer.strategy.exclude_frozen_parameters  # LoRA: frozen weights stay out of checkpoints


# --- ZeRO-aware gathering (GatheredParameters is a no-op on ordinary parameters) ----------------
def test_gathered_scores_equal_direct_magnitude(tiny):
    crit = build_criterion("magnitude")
    direct = crit.scores(tiny)
    layerwise = gathered_scores(tiny, build_criterion("magnitude"))
    for kind in direct:
        for a, b in zip(direct[kind], layerwise[kind]):
            torch.testing.assert_close(a, b)
    # The one-layer view is undone.
    assert len(get_family(tiny).layers(tiny)) == tiny.config.num_hidden_layers


@pytest.mark.parametrize("criterion", ["taylor", "magnitude"])
def test_plan_under_sharding_equals_plain_plan(criterion):
    model = tiny_model("llama")
    batches = [torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    plain = make_plan(model, batches, PruneSettings(ratio=0.3, criterion=criterion, allocation="global")).plan
    sharded = make_plan(model, batches, PruneSettings(ratio=0.3, criterion=criterion, allocation="global"), sharded=True).plan
    assert not plain.is_identity()
    assert sharded.to_dict()["layers"] == plain.to_dict()["layers"]
    assert sharded.meta["params_removed"] == plain.meta["params_removed"]


def test_the_run_plan_refuses_options_that_write_partitioned_weights():
    """ZeRO-3: masked forwards (the default's probes, the split search) are refused from the config alone."""
    from prunelight.run_plan import RunFacts, prepare_run

    config = tiny_model("llama").config
    zero3_run = RunFacts(deepspeed=True, zero_stage=3)
    with pytest.raises(ValueError, match="ZeRO-3.*attn_mlp_split=auto"):
        prepare_run(settings_of(0.3, criterion="magnitude", attn_mlp_split="auto", reconstruct="none"),
                    config=config, run=zero3_run)
    with pytest.raises(ValueError, match="ZeRO-3.*allocation=search.*prune.allocation: global needs no masked"):
        prepare_run(PruneSettings(ratio=0.3, criterion="magnitude", reconstruct="none"), run=zero3_run)  # default
    with pytest.raises(ValueError, match=r"ZeRO-3 partitioned weights: prune.allocation_args.block_importance=removal;"):
        prepare_run(settings_of(0.3, criterion="magnitude", allocation="blockwise", reconstruct="none"), run=zero3_run)
    # block_importance (default removal) is read by blockwise only: global under ZeRO-3 runs
    prepare_run(settings_of(0.3, criterion="magnitude", reconstruct="none"), config=config, run=zero3_run)
    prepare_run(settings_of(0.3, criterion="magnitude", attn_mlp_split="1:3", reconstruct="none"), config=config,
                run=zero3_run)
    model = tiny_model("llama")
    plain = make_plan(model, [], settings_of(0.3, criterion="magnitude", attn_mlp_split="1:3")).plan
    fixed = make_plan(model, [], settings_of(0.3, criterion="magnitude", attn_mlp_split="1:3"), sharded=True).plan
    assert fixed.to_dict()["layers"] == plain.to_dict()["layers"]


@pytest.mark.parametrize("tie", [False, True])
def test_gathered_pruned_copy_equals_cut_model(family, tie):
    model = tiny_model(family, tie_word_embeddings=tie)
    plan = make_plan(model, [], PruneSettings(ratio=0.3, criterion="magnitude", allocation="global")).plan
    assert set(gathered_state_dict(model)) == set(model.state_dict())
    cut = gathered_pruned_copy(model, plan)
    ref = copy.deepcopy(model)
    apply_plan(ref, plan)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(cut(ids).logits, ref(ids).logits, rtol=0, atol=0)
    assert cut.config.layer_shapes == ref.config.layer_shapes
    assert gathered_pruned_copy(model, plan, keep=False) is None  # non-zero ranks keep nothing


def test_gathered_merged_copy_equals_in_place_merge():
    from prunelight.recovery import LoRASettings, add_lora, merge_lora

    torch.manual_seed(0)
    settings = LoRASettings(r=4, dropout=0.0)
    model = add_lora(tiny_model("llama"), settings)
    with torch.no_grad():  # trained-looking adapters (B starts at zero, which would make the check vacuous)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    copy_ = gathered_merged_copy(model, settings)
    ref = merge_lora(model)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(copy_(ids).logits, ref(ids).logits)
        assert not any("lora" in k for k in copy_.state_dict())
    assert gathered_merged_copy(model, settings, keep=False) is None


# --- the hand-off to a fresh engine, run end to end with the ordinary strategy --------------------
def _job(tmp: Path, max_steps: int, callbacks_extra: list | None = None, checkpointing: bool = False) -> Path:
    model = tmp / "model"
    if not model.exists():
        make_tiny_checkpoint(model)
        write_tiny_corpus(tmp / "text")
    text = tmp / "text"
    cfg = {
        "seed_everything": 0,
        "model": {"pretrained": str(model), "dtype": "float32", "recovery": "lora", "learning_rate": 1e-2},
        "data": {"calibration": {"path": str(text / "valid.txt")}, "eval": {"path": str(text / "test.txt")},
                 "train": {"path": str(text / "train.txt")}, "num_samples": 8, "seq_len": 32, "batch_size": 2,
                 "max_eval_blocks": 4},
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": max_steps, "logger": False,
            "enable_checkpointing": checkpointing,
            "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "callbacks": callbacks_extra or [],
        },
        "prune": {"ratio": 0.3, "reconstruct": "none"},  # a repair is refused under DeepSpeed (tested below)
        "export": {"out_dir": str(tmp / "out")},
    }
    path = tmp / f"job{max_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_reconstruction_is_refused_under_the_fresh_engine_handoff(tmp_path, monkeypatch):
    from prunelight.callbacks import pruning
    from prunelight.cli import cli_main

    monkeypatch.setattr(pruning, "needs_fresh_engine", lambda strategy: True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="prune.reconstruct=least_squares is not allowed under DeepSpeed"):
        cli_main(["fit", "--config", str(_job(tmp_path, max_steps=2)), "--prune.reconstruct", "least_squares"])
    assert not (tmp_path / "out" / "pruned").exists()


@pytest.mark.parametrize("recovery", ["lora", "none"])
def test_fresh_engine_handoff_end_to_end(tmp_path, monkeypatch, recovery):
    """Score -> plan -> gather+cut -> write from rank 0 -> stop -> recover in a new Trainer, one command."""
    from prunelight.callbacks import export, pruning
    from prunelight.cli import cli_main

    monkeypatch.setattr(pruning, "needs_fresh_engine", lambda strategy: True)
    exported_shapes = []  # the first engine (uncut, stopped after writing the cut) exports nothing
    real_export = export.export_pretrained

    def counting_export(model, *args, **kwargs):
        exported_shapes.append(count_params(model))
        return real_export(model, *args, **kwargs)

    monkeypatch.setattr(export, "export_pretrained", counting_export)
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", str(_job(tmp_path, max_steps=2)), "--model.recovery", recovery])
    pruned_dir = tmp_path / "out" / "pruned"
    assert (pruned_dir / "config.json").exists()
    # The second Trainer trained the model loaded from the written pruned folder (prune-only: no steps).
    assert cli.trainer.global_step == (2 if recovery == "lora" else 0)
    assert cli.model.pretrained == str(pruned_dir) and cli.model.pretrained_is_pruned
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ppl"]["dense"] > 0 and report["ppl"]["recovered"] > 0
    assert report["params_after"] < report["params_before"]
    assert report["params_after"] == report["params_before"] - report["plan"]["params_removed"]
    assert exported_shapes == [report["params_after"]]
    # The exported model is the cut shape of the plan.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    plan_layers = cli.model.plan.layers
    for layer, lp in zip(exported.model.layers, plan_layers):
        if lp.keep_channels:
            assert layer.mlp.gate_proj.out_features == len(lp.keep_channels)


# --- LoRA checkpoints keep only what trains -------------------------------------------------------
def test_lora_checkpoint_omits_frozen_weights_and_resumes(tmp_path, monkeypatch):
    from prunelight.cli import cli_main

    monkeypatch.chdir(tmp_path)
    ckpt_cb = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
               "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "every_n_train_steps": 2}}
    cli = cli_main(["fit", "--config", str(_job(tmp_path, 2, [ckpt_cb], checkpointing=True))])
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert keys and all("lora_" in k for k in keys), keys[:5]
    assert ckpt["prunelight"]["weights"] == "trainable"
    saved = {k: v.clone() for k, v in ckpt["state_dict"].items()}

    # Restore: the frozen base comes back from `pretrained` + plan, the adapters from the file.
    from prunelight.module import PruneLM

    lm = PruneLM(pretrained=cli.model.pretrained, dtype="float32", recovery="lora")
    lm.on_load_checkpoint(ckpt)
    lm.load_state_dict(ckpt["state_dict"], strict=True)
    own = lm.state_dict()
    for k, v in saved.items():
        assert torch.equal(own[k], v), k
    ref = PruneLM(pretrained=cli.model.pretrained, dtype="float32")
    ref.configure_model()
    apply_plan(ref.base_model, cli.model.plan)
    base = lm.base_model.state_dict()
    for k, v in ref.base_model.state_dict().items():
        key = k if k in base else k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(base[key], v), k

    # And through Lightning: the run resumes at step 2 and trains one more step.
    job = _job(tmp_path, 3, [ckpt_cb], checkpointing=True)
    resumed = cli_main(["fit", "--config", str(job), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    assert resumed.trainer.global_step == 3
    assert resumed.model.plan.to_dict()["layers"] == cli.model.plan.to_dict()["layers"]


def test_full_recovery_checkpoint_keeps_all_weights(tmp_path, monkeypatch):
    from prunelight.module import PruneLM

    lm = PruneLM(pretrained=str(make_tiny_checkpoint(tmp_path / "m")), recovery="full")
    lm.configure_model()
    plan = make_plan(lm.base_model, [], PruneSettings(ratio=0.3, criterion="magnitude", allocation="global")).plan
    lm.apply_plan(plan)
    lm.start_recovery()
    ckpt = {"state_dict": lm.state_dict()}
    lm.on_save_checkpoint(ckpt)
    assert ckpt["prunelight"]["weights"] == "all" and len(ckpt["state_dict"]) == len(lm.state_dict())


# --- what needs CUDA ------------------------------------------------------------------------------
def _gpu_job(tmp_path: Path, stage: int, accelerator: str = "gpu") -> Path:
    """The ZeRO-`stage` prune-and-recover job of the CUDA test (allocation global: search, the default, runs masked
    forwards that ZeRO-3 partitions refuse, as configs/llama3-70b-zero3.yaml says)."""
    cfg = yaml.safe_load(_job(tmp_path, 2).read_text())
    cfg["trainer"].update(accelerator=accelerator, devices=1, precision="bf16-mixed" if accelerator == "gpu" else "32")
    cfg["trainer"]["strategy"] = {"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy",
                                  "init_args": {"stage": stage, "exclude_frozen_parameters": True}}
    cfg["prune"]["allocation"] = "global"
    path = tmp_path / f"gpu{stage}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stand-in of the CUDA test below")
@pytest.mark.parametrize("stage", [2, 3])
def test_the_cuda_job_passes_every_check_before_lightnings_cuda_refusal(tmp_path, monkeypatch, stage):
    """The CUDA test's job on CPU gets as far as Lightning's own "CUDA only" stop: no prunelight refusal comes
    first (on an H100 the ZeRO-3 case once stopped at the run plan's refusal of the default allocation)."""
    from prunelight.cli import cli_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="CUDA") as err:
        cli_main(["fit", "--config", str(_gpu_job(tmp_path, stage, accelerator="cpu"))])
    assert "not available with ZeRO-3" not in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_fit_on_gpu(tmp_path, monkeypatch, stage):
    """The real thing: ZeRO-2/3 prune-and-recover on the tiny model (runs only where CUDA exists)."""
    from prunelight.cli import cli_main

    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", str(_gpu_job(tmp_path, stage))])
    assert cli.trainer.global_step == 2 and cli.model.pretrained_is_pruned
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    if stage == 2:
        assert report["ppl"]["recovered"] > 0
        return
    # ZeRO-3 holds the merged model on rank 0's CPU only: the run says so, and the export is measured afterwards,
    # in a new process as its warning tells the user (this one's transformers still sees the run's ZeRO-3 config)
    assert "recovered" not in report["ppl"] and any("ZeRO-3" in note for note in report["notes"])
    subprocess.run([sys.executable, "-m", "prunelight", "evaluate", "--run", str(tmp_path / "out"), "--out_dir",
                    str(tmp_path / "re"), "--device", "cuda", "--evaluation.zeroshot", "false",
                    "--evaluation.efficiency", "false"], check=True, timeout=300)
    again = json.loads((tmp_path / "re" / "report.json").read_text())["evaluation"]
    assert again["recovered"]["perplexity"][0]["ppl"] > 0
