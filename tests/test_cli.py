"""The command line: the `prune:` section, shipped YAML, a fast_dev_run smoke test, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from prunelight.cli import cli_main
from prunelight.testing import make_tiny_checkpoint, tiny_fit_args, write_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml"))
METHODS = sorted((ROOT / "configs" / "methods").glob("*.yaml"))
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
        assert printed["prune"]["ratio"] == 0.2 and printed["export"]["out_dir"].startswith("runs/")
        # The output folder is named once: Lightning's own files go there too.
        assert printed["trainer"].get("default_root_dir") in (None, printed["export"]["out_dir"])


def test_help_lists_the_prune_section_with_allowed_values(capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--prune.ratio" in out
    from prunelight.importance import CRITERIA
    from prunelight.settings import ALLOCATIONS

    assert "--prune.criterion {" + ",".join(CRITERIA) + "}" in out
    assert "--prune.allocation {" + ",".join(ALLOCATIONS) + "}" in out
    assert "--prune.attn_mlp_split" in out and "--export.out_dir" in out and "--evaluation.suite" in out


def test_prune_options_on_the_command_line(capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(ROOT / "configs" / "reference.yaml"), "--prune.ratio", "0.3",
                  "--prune.criterion", "fisher", "--prune.layerwise.alpha", "2", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["prune"]["ratio"] == 0.3 and printed["prune"]["criterion"] == "fisher"
    assert printed["prune"]["layerwise"]["alpha"] == 2.0
    assert "callbacks" not in printed["trainer"] or not any(
        "Pruning" in str(c) for c in printed["trainer"]["callbacks"] or [])


def test_presets_compose_over_a_base_config(capsys):
    args = ["fit", "--config", str(ROOT / "configs" / "reference.yaml")]
    for preset in PRESETS:
        args += ["--config", str(preset)]
    with pytest.raises(SystemExit):
        cli_main(args + ["--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    names = [c["class_path"].rsplit(".", 1)[-1] for c in printed["trainer"]["callbacks"]]
    assert names == ["ModelCheckpoint"]  # the pruning job's callbacks are not list entries any more
    assert printed["export"]["out_dir"] == "runs/prunelight"  # callbacks/export.yaml overrides reference.yaml
    stems = [p.stem for p in PRESETS]
    assert stems.index("lora") > stems.index("full")
    assert printed["model"]["recovery"] == "lora", "lora.yaml comes after full.yaml, so its value wins"


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """A tiny checkpoint and corpus, and reference.yaml's command pointed at them."""
    tmp = tmp_path_factory.mktemp("job")
    ckpt = make_tiny_checkpoint(tmp / "tiny", "llama")
    files = write_tiny_corpus(tmp / "data")
    return tmp, ckpt, files, tiny_fit_args(ckpt, files)


def test_fast_dev_run_smoke_cuts_the_model_and_spares_the_real_output(tiny_job, tmp_path, monkeypatch):
    _, _, _, args = tiny_job
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "reference"  # reference.yaml's out_dir, relative to the working directory
    (out / "model").mkdir(parents=True)
    (out / "report.json").write_text('{"real": true}')
    cli = cli_main(args + ["--trainer.fast_dev_run=true", "--trainer.enable_progress_bar=false"])
    assert cli.model.plan is not None, "surgery must run under fast_dev_run"
    smoke = out / "fast_dev_run"
    report = json.loads((smoke / "report.json").read_text())
    assert report["params_after"] < report["params_before"]
    assert report["plan"]["removed_fraction_total"] >= 0.2
    assert (smoke / "model" / "config.json").exists()
    assert json.loads((out / "report.json").read_text()) == {"real": True}, "a smoke test overwrote a real run"


def test_prune_only_run_prints_the_summary_and_logs_metrics(tiny_job, tmp_path, monkeypatch, caplog):
    _, _, _, args = tiny_job
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="prunelight")
    cli_main(args + ["--model.recovery=none", "--prune.ratio=0.3", "--prune.criterion=fisher",
                     "--trainer.enable_progress_bar=false", "--export.out_dir=runs/p"])
    text = caplog.text
    assert "cut with fisher / global: parameters" in text and "budget error" in text
    assert "KV groups per layer" in text and "MLP channels per layer" in text
    assert "perplexity: dense" in text and "-> pruned" in text
    assert "report written to runs/p/report.md" in text
    report = json.loads((tmp_path / "runs" / "p" / "report.json").read_text())
    assert report["plan"]["removed_fraction_total"] == pytest.approx(0.3, abs=0.02)
    assert report["calibration"]["settings"]["criterion"] == "fisher"
    metrics = next((tmp_path / "runs" / "p" / "lightning_logs").rglob("metrics.csv")).read_text()
    for key in ("prune/params_after", "prune/removed_fraction", "ppl/dense", "ppl/pruned", "ppl/recovered"):
        assert key in metrics, key


def _console_script() -> Path:
    script = Path(sys.executable).parent / "prunelight"
    if not script.exists():
        pytest.skip(f"the `prunelight` console script is not installed beside {sys.executable} (pip install -e .)")
    return script


def _run(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    full_env.pop("PRUNELIGHT_DEBUG", None)
    return subprocess.run([str(_console_script()), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=300)


def test_console_script_exits_zero_after_a_run(tiny_job, tmp_path):
    """`prunelight fit ... && next-step` must work: success is exit status 0."""
    _, _, _, args = tiny_job
    ok = _run(args + ["--trainer.fast_dev_run=true", "--trainer.enable_progress_bar=false"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "runs" / "reference" / "fast_dev_run" / "report.json").exists()


def _bad_inputs(tmp: Path, ckpt: Path, files: dict) -> dict[str, tuple[list[str], str, dict]]:
    """name -> (extra arguments, expected text of the one error line, extra environment)."""
    empty = tmp / "empty.txt"
    empty.write_text("")
    gpt2 = tmp / "gpt2"
    gpt2.mkdir(exist_ok=True)
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                                  "vocab_size": 64}))
    return {
        "ratio above 1": (["--prune.ratio=1.5"], "prune.ratio=1.5 is not allowed: must be a number in (0.0, 1.0)", {}),
        "negative ratio": (["--prune.ratio=-0.2"], "prune.ratio=-0.2 is not allowed", {}),
        "NaN ratio": (["--prune.ratio=nan"], "prune.ratio='nan' is not allowed", {}),
        "unknown criterion": (["--prune.criterion=taylorr"], "prune.criterion='taylorr' is not allowed: use one of "
                              "taylor,", {}),
        "unknown allocation": (["--prune.allocation=everywhere"], "prune.allocation='everywhere' is not allowed", {}),
        "split 3:": (["--prune.attn_mlp_split=3:"], "prune.attn_mlp_split='3:' is not allowed: use 'x:y'", {}),
        "split with depth": (["--prune.allocation=depth", "--prune.attn_mlp_split=1:1"],
                             "prune.attn_mlp_split='1:1' is not allowed: a split applies to allocation global or "
                             "layerwise", {}),
        "negative min_groups": (["--prune.min_groups=-1"], "prune.min_groups=-1 is not allowed", {}),
        "min_channels above the width": (["--prune.min_channels=1000"], "prune.min_channels=1000 is not allowed: the "
                                         "model's layers have 96 MLP channels", {}),
        "zero alignment": (["--prune.align_channels=0"], "prune.align_channels=0 is not allowed", {}),
        "bad rate range": (["--prune.allocation=layerwise", '--prune.allocation_args={"rate_range": [0.5, 0.2]}'],
                           "prune.allocation_args.rate_range=[0.5, 0.2] is not allowed", {}),
        "bad criterion_args": (["--prune.criterion_args={p: 3}"], "prune.criterion_args={'p': 3} is not allowed", {}),
        "more units than exist": (["--prune.ratio=0.95"], "prune.ratio=0.95 asks to remove", {}),
        "prune_step past max_steps": (["--prune.prune_step=500"], "prune.prune_step=500 is not allowed: the run stops "
                                      "at trainer.max_steps=200", {}),
        "seq_len beyond the context": (["--data.seq_len=100000"], "data.seq_len=100000 exceeds the model's context "
                                       "(max_position_embeddings=256)", {}),
        "empty calibration file": ([f"--data.calibration.path={empty}"], f"data.calibration.path='{empty}' is empty",
                                   {}),
        "missing calibration file": ([f"--data.calibration.path={tmp / 'nope.txt'}"],
                                     f"data.calibration.path='{tmp / 'nope.txt'}' does not exist", {}),
        "unknown recovery": (["--model.recovery=qlora"], "model.recovery='qlora' is not allowed: use one of lora, "
                             "full, none", {}),
        "unsupported architecture": ([f"--model.pretrained={gpt2}"], "unsupported architecture model_type='gpt2'", {}),
        "missing local model": (["--model.pretrained=./models/nope"], "model.pretrained='./models/nope' does not "
                                "exist", {}),
        "unreachable hub": (["--model.pretrained=no-such-org/no-such-model"], "model.pretrained='no-such-org/"
                            "no-such-model' could not be downloaded from the Hugging Face hub", {"HF_HUB_OFFLINE": "1"}),
        "unknown option": (["--prune.ratoi=0.3"], "prune.ratoi", {}),
    }


BAD_NAMES = [  # the keys of _bad_inputs, listed here for test ids
    "ratio above 1", "negative ratio", "NaN ratio", "unknown criterion", "unknown allocation", "split 3:",
    "split with depth", "negative min_groups", "min_channels above the width", "zero alignment", "bad rate range",
    "bad criterion_args", "more units than exist", "prune_step past max_steps", "seq_len beyond the context",
    "empty calibration file", "missing calibration file", "unknown recovery", "unsupported architecture",
    "missing local model", "unreachable hub", "unknown option",
]


def _check_refusal(name: str, status: int, stderr: str, out_dir: Path, tmp, ckpt, files) -> None:
    """The refusal of bad input `name`: status 2, one `prunelight: error:` line naming it, nothing written."""
    expected = _bad_inputs(tmp, ckpt, files)[name][1]
    errors = [line for line in stderr.splitlines() if line.startswith("prunelight: error:")]
    assert status == 2, stderr[-3000:]
    assert len(errors) == 1 and expected in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr and "Does not validate against any of the Union" not in stderr
    assert not (out_dir / "runs" / "reference" / "model").exists(), "nothing may be written on bad input"


# The console script is `prunelight.cli:main`; each case runs it in this process (a subprocess costs ~8 s of imports
# per case). The cases that set environment variables read at import time, and one plain case, run the real console
# script in a fresh process, so its exit status is checked too.
IN_A_SUBPROCESS = {"unreachable hub", "ratio above 1"}


def test_bad_inputs_are_all_listed(tiny_job):
    tmp, ckpt, files, _ = tiny_job
    assert set(_bad_inputs(tmp, ckpt, files)) == set(BAD_NAMES)


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n not in IN_A_SUBPROCESS])
def test_bad_input_exits_with_one_line(tiny_job, tmp_path, monkeypatch, capsys, name):
    """Each refused input: status 2 and one `prunelight: error:` line naming option and value."""
    from prunelight.cli import main

    tmp, ckpt, files, args = tiny_job
    extra, _, env = _bad_inputs(tmp, ckpt, files)[name]
    assert not env, "a case with its own environment runs in a subprocess (IN_A_SUBPROCESS)"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PRUNELIGHT_DEBUG", raising=False)
    status = main(args + extra)
    _check_refusal(name, status, capsys.readouterr().err, tmp_path, tmp, ckpt, files)


@pytest.mark.parametrize("name", sorted(IN_A_SUBPROCESS))
def test_bad_input_exits_the_console_script_with_one_line(tiny_job, tmp_path, name):
    """The installed `prunelight` command: non-zero exit within seconds, the same one line."""
    tmp, ckpt, files, args = tiny_job
    extra, _, env = _bad_inputs(tmp, ckpt, files)[name]
    t0 = time.perf_counter()
    proc = _run(args + extra, tmp_path, **env)
    elapsed = time.perf_counter() - t0
    _check_refusal(name, proc.returncode, proc.stderr, tmp_path, tmp, ckpt, files)
    assert elapsed < 120, f"took {elapsed:.0f} s to refuse"


def test_help_shows_each_option_docstring(capsys):
    """`fit --help` carries the settings fields' docstrings, not only their types and defaults."""
    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text at the terminal width
    assert "Fraction of all the model's parameters to remove, in (0, 1)." in out  # PruneSettings.ratio
    assert "GQA groups every layer keeps" in out  # PruneSettings.min_groups


def test_sweep_help_shows_each_option_docstring(capsys):
    """`sweep --help` carries SweepSettings' docstrings too (the docstring parsing is set before the dispatch)."""
    with pytest.raises(SystemExit):
        cli_main(["sweep", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Optuna storage: null = a journal file" in out  # SweepSettings.storage


def test_run_output_has_no_lightning_tips_and_one_layout_note(tiny_job, tmp_path):
    """A run prints no "Tip: ... litlogger / litmodels" advert, and the export's layout choice once."""
    _, _, _, args = tiny_job
    # reconstruct: bias adds o_proj/down_proj biases, which the Nemotron-NAS layout cannot state: the export says so
    ran = _run(args + ["--model.recovery=none", "--prune.reconstruct=bias", "--trainer.enable_progress_bar=false",
                       "--export.out_dir=runs/b"], tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    text = ran.stdout + ran.stderr
    assert "litlogger" not in text and "litmodels" not in text and "Tip:" not in text
    assert "LeafSpec" not in text  # Lightning's warning about its own use of a deprecated torch API
    assert text.count("the Nemotron-NAS layout cannot state these shapes") == 1, text[-3000:]
    assert (tmp_path / "runs" / "b" / "model" / "README.md").exists()
