"""The command line: every shipped YAML parses, and a fast_dev_run smoke test really cuts the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prunelight.cli import cli_main
from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml"))
PRESETS = sorted((ROOT / "callbacks").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_parse(config, capsys):
    subcommand = "evaluate" if config.stem == "evaluate" else "fit"
    with pytest.raises(SystemExit) as exc:
        cli_main([subcommand, "--config", str(config), "--print_config"])
    assert exc.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    if subcommand == "evaluate":
        assert printed["models"] and printed["evaluation"]["tasks"]
    else:
        assert printed["model"]["pretrained"] and printed["trainer"]


def test_callback_presets_compose(capsys):
    base = ROOT / "configs" / "reference.yaml"
    args = ["fit", "--config", str(base)]
    for preset in PRESETS:
        args += ["--config", str(preset)]
    with pytest.raises(SystemExit):
        cli_main(args + ["--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    names = [c["class_path"].rsplit(".", 1)[-1] for c in printed["trainer"]["callbacks"]]
    # reference.yaml has Pruning + Export; the presets append Pruning, Export and ModelCheckpoint
    assert names.count("PruningCallback") == 2 and "ModelCheckpoint" in names
    stems = [p.stem for p in PRESETS]
    assert stems.index("lora") > stems.index("full")
    assert printed["model"]["recovery"] == "lora", "lora.yaml comes after full.yaml, so its value wins"


@pytest.mark.parametrize("config", [c for c in CONFIGS if "PruningCallback" in c.read_text()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pruning_options_can_be_set_on_the_command_line(config, capsys):
    """`--trainer.callbacks.X` sets X on the last callback, so every shipped config lists PruningCallback last."""
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(config), "--trainer.callbacks.ratio=0.35",
                  "--trainer.callbacks.criterion=wanda", "--print_config"])
    callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    pruning = [c for c in callbacks if c["class_path"].endswith("PruningCallback")]
    assert len(pruning) == 1 and callbacks[-1] is pruning[0]
    assert pruning[0]["init_args"]["ratio"] == 0.35 and pruning[0]["init_args"]["criterion"] == "wanda"


def test_fast_dev_run_smoke_cuts_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    files = write_tiny_corpus(tmp_path / "data")
    out = tmp_path / "runs" / "reference"  # reference.yaml's out_dir, relative to the working directory
    cli = cli_main([
        "fit", "--config", str(ROOT / "configs" / "reference.yaml"),
        f"--model.pretrained={ckpt}", "--model.attn_implementation=eager",
        f"--data.calibration.path={files['valid']}", f"--data.eval.path={files['test']}",
        f"--data.train.path={files['train']}", "--data.seq_len=16", "--data.num_samples=8",
        "--trainer.fast_dev_run=true", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
    ])
    module = cli.model
    assert module.plan is not None, "surgery must run under fast_dev_run"
    report = json.loads((out / "report.json").read_text())
    assert report["params_after"] < report["params_before"]
    assert report["plan"]["removed_fraction_total"] >= 0.2
    assert (out / "model" / "config.json").exists()


def test_seq_len_beyond_context_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "llama", max_position_embeddings=64)
    files = write_tiny_corpus(tmp_path / "data")
    with pytest.raises(ValueError, match=r"seq_len=128 exceeds the model's context \(max_position_embeddings=64\)"):
        cli_main([
            "fit", "--config", str(ROOT / "configs" / "reference.yaml"), f"--model.pretrained={ckpt}",
            f"--data.calibration.path={files['valid']}", f"--data.eval.path={files['test']}",
            f"--data.train.path={files['train']}", "--trainer.fast_dev_run=true", "--trainer.logger=false",
        ])


def _console_script() -> Path:
    script = Path(sys.executable).parent / "prunelight"
    if not script.exists():
        pytest.skip(f"the `prunelight` console script is not installed beside {sys.executable} (pip install -e .)")
    return script


def test_console_script_exits_zero_after_a_run_and_nonzero_on_bad_input(tmp_path):
    """`prunelight fit ... && next-step` must work: success is exit status 0, a refused input is not."""
    script = _console_script()
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    files = write_tiny_corpus(tmp_path / "data")
    args = [
        str(script), "fit", "--config", str(ROOT / "configs" / "reference.yaml"),
        f"--model.pretrained={ckpt}", "--model.attn_implementation=eager",
        f"--data.calibration.path={files['valid']}", f"--data.eval.path={files['test']}",
        f"--data.train.path={files['train']}", "--data.seq_len=16", "--data.num_samples=8",
        "--trainer.fast_dev_run=true", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "runs" / "reference" / "report.json").exists()
    bad = subprocess.run(args + ["--trainer.callbacks.ratio=1.5"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode != 0 and "prune ratio must be a fraction of parameters in (0, 1), got 1.5" in bad.stderr
