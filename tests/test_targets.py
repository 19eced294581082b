"""Budgets in deployment units: prune.target_params, target_memory and target_kv_cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from prunelight.allocation import allocate, count_params, precheck
from prunelight.allocation.targets import kv_bytes_per_token, parse_count, parse_target
from prunelight.settings import SettingsError
from prunelight.surgery import apply_plan
from prunelight.testing import make_tiny_checkpoint, settings_of, tiny_model, write_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]


def _scores(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layers = model.config.num_hidden_layers
    return {"attn": [torch.rand(model.config.num_key_value_heads, generator=g) for _ in range(layers)],
            "mlp": [torch.rand(model.config.intermediate_size, generator=g) for _ in range(layers)]}


def _cut(model, **target):
    settings = settings_of(0.2, reconstruct="none", **target)
    budget = precheck(model, settings)
    plan = allocate(budget, _scores(model), settings)
    apply_plan(model, plan)
    return budget, plan


@pytest.mark.parametrize("allocation", ["global", "layerwise", "blockwise"])
def test_target_params_is_met_within_one_channel(allocation):
    model = tiny_model(num_hidden_layers=4)
    c_cost = 3 * model.config.hidden_size
    kw = {"layer_scores": [0.1, 0.5, 0.3, 0.9]} if allocation == "layerwise" else {}
    settings = settings_of(0.2, reconstruct="none", allocation=allocation, target_params="100K")
    budget = precheck(model, settings)
    plan = allocate(budget, _scores(model), settings, **kw)
    apply_plan(model, plan)
    after = count_params(model)
    assert 100_000 - c_cost < after <= 100_000
    met = plan.meta["target"]
    assert met["option"] == "prune.target_params" and met["unit"] == "parameters"
    assert met["met"]["params_after"] == after and met["within_target"]


@pytest.mark.parametrize("text, bpp", [("300KB@fp32", 4), ("150KiB@bf16", 2), ("0.1MB@int8", 1)])
def test_target_memory_counts_all_weights_once_and_is_met_within_one_channel(text, bpp):
    model = tiny_model(num_hidden_layers=4, tie_word_embeddings=True)
    c_cost = 3 * model.config.hidden_size
    limit = parse_target("memory", text).value
    _, plan = _cut(model, target_memory=text)
    weight_bytes = sum(p.numel() for p in model.parameters()) * bpp  # tied embedding counted once
    assert limit - c_cost * bpp < weight_bytes <= limit
    assert plan.meta["target"]["met"]["weight_bytes_after"] == weight_bytes


@pytest.mark.parametrize("allocation", ["global", "uniform"])
def test_target_kv_cache_removes_groups_only_and_lands_at_or_below(allocation):
    model = tiny_model(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    hd = 16
    before_mlp = [layer.mlp.up_proj.out_features for layer in model.model.layers]
    now = kv_bytes_per_token([4] * 4, hd, 2)  # 1024 B per token at bf16
    settings = settings_of(0.2, reconstruct="none", allocation=allocation, target_kv_cache="700B@bf16")
    budget = precheck(model, settings)
    plan = allocate(budget, _scores(model), settings)
    apply_plan(model, plan)
    kv = [layer.self_attn.k_proj.out_features // hd for layer in model.model.layers]
    after = kv_bytes_per_token(kv, hd, 2)
    per_group = 2 * hd * 2
    assert after <= 700 and (allocation == "uniform" or after > 700 - per_group), (now, after)
    assert [layer.mlp.up_proj.out_features for layer in model.model.layers] == before_mlp
    assert plan.meta["target"]["met"]["kv_bytes_per_token_after"] == after
    if allocation == "uniform":
        assert len(set(kv)) == 1


@pytest.mark.parametrize("option, value, message", [
    ("target_params", "6.5X", "prune.target_params='6.5X' is not allowed: use a parameter count"),
    ("target_params", "-3M", "prune.target_params='-3M' is not allowed"),
    ("target_memory", "16GiB", "prune.target_memory='16GiB' is not allowed: use <size><unit>@<dtype>"),
    ("target_memory", "16GiB@fp64", "prune.target_memory='16GiB@fp64' is not allowed"),
    ("target_memory", "16XB@bf16", "prune.target_memory='16XB@bf16' is not allowed"),
    ("target_kv_cache", "lots", "prune.target_kv_cache='lots' is not allowed: use <size><unit>@<dtype>"),
])
def test_bad_target_strings_are_refused(option, value, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_of(0.2, **{option: value})


@pytest.mark.parametrize("text, count", [
    ("8.03B", 8_030_000_000), ("1.1M", 1_100_000), ("0.3K", 300), ("7e9", 7_000_000_000), ("1.2e9", 1_200_000_000),
    ("0.29K", 290), ("2.3M", 2_300_000), ("350M", 350_000_000), (".5k", 500), (8_000_000, 8_000_000),
    ("78144", 78_144), (8.03e9, 8_030_000_000),
])
def test_parameter_counts_round_to_the_nearest_whole_count(text, count):
    # float arithmetic makes 8.03 x 1e9 = 8029999999.999999: a count is rounded, never truncated
    assert parse_count(text) == count
    assert parse_target("params", text).value == count


@pytest.mark.parametrize("text", ["6.5X", "-3M", "lots", "", "0.3", 0, float("nan"), True])
def test_a_bad_parameter_count_is_refused_naming_the_value(text):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(text))} is not a (positive )?parameter count"):
        parse_count(text)


def test_targets_are_exclusive_and_kv_needs_an_allocation_that_takes_it():
    with pytest.raises(SettingsError, match="prune.target_memory='1GB@bf16' is not allowed: prune.target_params is"):
        settings_of(0.2, target_params="1M", target_memory="1GB@bf16")
    with pytest.raises(SettingsError, match="with allocation global or uniform or calibrated, not 'depth'"):
        settings_of(0.2, target_kv_cache="1KiB@bf16", allocation="depth")
    assert parse_target("params", "6.5B").value == 6_500_000_000
    assert parse_target("params", "1.2e9").value == 1_200_000_000 and parse_target("params", 350).value == 350
    assert parse_target("memory", "16GiB@bf16").value == 16 * 2**30


def test_targets_above_the_model_or_unreachable_are_refused_with_the_numbers():
    model = tiny_model()  # 78,144 parameters; KV 2 x 4 heads x 16 x 2 B = 256 B per token at bf16
    with pytest.raises(ValueError, match="prune.target_params='1M' is not allowed: the model has 78,144 parameters"):
        precheck(model, settings_of(0.2, target_params="1M"))
    with pytest.raises(ValueError, match=r"takes 256 B per token at bf16 already"):
        precheck(model, settings_of(0.2, target_kv_cache="1KiB@bf16"))
    with pytest.raises(ValueError, match=r"keeping prune.min_groups=1 KV group\(s\) per layer leaves at least 128 B"):
        precheck(model, settings_of(0.2, target_kv_cache="100B@bf16"))
    with pytest.raises(ValueError, match=r"prune.target_params='1K' asks to remove 77,144 parameters but at most"):
        precheck(model, settings_of(0.2, target_params="1K"))


def test_cli_run_with_a_memory_target_reports_what_was_met(tmp_path, monkeypatch):
    from prunelight.cli import cli_main

    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cli_main(["fit", "--config", str(ROOT / "configs" / "reference.yaml"), f"--model.pretrained={ckpt}",
              "--model.attn_implementation=eager", f"--data.calibration.path={files['valid']}",
              f"--data.eval.path={files['test']}", f"--data.train.path={files['train']}", "--data.seq_len=16",
              "--data.num_samples=8", "--trainer.limit_val_batches=0", "--model.recovery=none",
              "--trainer.enable_progress_bar=false", "--export.figures=false", "--export.out_dir=runs/m",
              "--prune.target_memory=250KB@fp32"])
    report = json.loads((tmp_path / "runs" / "m" / "report.json").read_text())
    target = report["calibration"]["target"]
    assert target["option"] == "prune.target_memory" and target["unit"] == "weight bytes at fp32"
    assert report["params_after"] * 4 == target["met"]["weight_bytes_after"] <= 250_000
    assert report["params_after"] * 4 > 250_000 - 3 * 64 * 4
    assert report["plan"]["target"]["within_target"]
    md = (tmp_path / "runs" / "m" / "report.md").read_text()
    assert "Target `prune.target_memory=250KB@fp32` (weight bytes at fp32)" in md


def test_cli_bad_target_is_one_line(tmp_path, capsys):
    from prunelight.cli import main

    rc = main(["fit", "--config", str(ROOT / "configs" / "reference.yaml"), "--prune.target_memory=16GiB",
               f"--export.out_dir={tmp_path / 'x'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prunelight: error:")]
    assert rc == 2 and len(err) == 1
    assert "prune.target_memory='16GiB' is not allowed: use <size><unit>@<dtype>" in err[0]
