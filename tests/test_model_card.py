"""The exported folder's model card (README.md) and license files, and a stock-format run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prunelight.cli import cli_main
from prunelight.export import engines_verified
from prunelight.families import MODEL_FAMILIES
from prunelight.model_card import model_card
from prunelight.testing import make_tiny_checkpoint, tiny_fit_args, write_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_card_reads_the_record_defensively():
    card = model_card({}, config=None)
    assert "base_model: null" in card
    assert "## What was removed" in card and "none recorded" in card and "prunelight" in card
    record = {
        "model": "meta-llama/Meta-Llama-3-8B", "params_before": 1000, "params_after": 800,
        "calibration": {"criterion": "flap", "allocation": "global", "ratio": 0.2, "samples": 128, "seq_len": 128,
                        "settings": {"ratio": 0.2}},
        "plan": {"groups_removed": 3, "channels_removed": 40, "layers_dropped": [],
                 "stock_shapes": {"chosen": 1, "chosen_by": "calibration_nll", "candidates": [{}, {}]}},
        "layers": [{"num_attention_heads": 28, "num_key_value_heads": 7, "intermediate_size": 11264}] * 2,
        "recovery": {"mode": "lora", "steps": 200, "lora": {"r": 8},
                     "distillation": {"alpha": 0.5, "temperature": 2.0, "loss": "kl"}},
        "ppl": {"dense": 10.0, "pruned": 20.0, "recovered": 12.5}, "eval": {"source": "wikitext2 test", "seq_len": 128},
        "a_field_from_the_future": {"x": 1},
    }
    card = model_card(record, config={"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
                      command="prunelight fit --config configs/deploy.yaml")
    assert "base_model: meta-llama/Meta-Llama-3-8B" in card
    assert "1,000 -> 800 (20.00% removed)" in card
    assert "Query heads: 28 in each of 2 layers" in card and "MLP width: 11264 in each of 2 layers" in card
    assert '"loss": "kl"' in card and "| recovered | 12.50 |" in card
    assert "Stock `mistral` config (`MistralForCausalLM`)" in card
    # Engines nothing here ran are named only as not run (an earlier card claimed all four read the folder).
    for engine in ("llama.cpp", "TGI", "TensorRT-LLM"):
        line = next(ln for ln in card.splitlines() if engine in ln)
        assert "Not run by prunelight: llama.cpp (convert_hf_to_gguf.py), TGI and TensorRT-LLM" in line
    assert "vLLM" not in card  # no serving check recorded for this run: the card claims none
    served = model_card({**record, "engines_verified": ["vLLM 0.32.0 (MistralForCausalLM: greedy ...)"]},
                        config={"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    assert "verified in by prunelight's serving check" in served and "vLLM 0.32.0 (MistralForCausalLM" in served
    assert "prunelight fit --config configs/deploy.yaml" in card
    pruned = model_card(record, config={"model_type": "prunelight_llama", "layer_shapes": [{}], "auto_map": {}})
    assert "trust_remote_code=True" in pruned and "Stock" not in pruned


@pytest.mark.parametrize("family", sorted(MODEL_FAMILIES))
def test_engines_verified_states_what_the_serving_check_ran(family):
    fam = MODEL_FAMILIES[family]
    stock = fam.config_class(architectures=[fam.model_class.__name__])
    engines = engines_verified(stock)
    # Every family's stock export was served by vLLM (scripts/serve_check.py --tiny-families): named with its class.
    assert engines[0].startswith(f"vLLM 0.32.0 ({fam.model_class.__name__}: greedy output equal to transformers'")
    assert engines[-1] == "transformers (plain, no trust_remote_code)"
    assert ("attention_bias" in engines[0]) == (family == "qwen3")  # the one difference found: vLLM's Qwen3 o_proj
    # The prunelight type: vLLM's Transformers backend (per_layer_config), unless a layer lost its attention
    shapes = [{"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}] * 2
    pruned = fam.pruned_config_class(layer_shapes=shapes, architectures=[fam.pruned_model_class.__name__])
    served = engines_verified(pruned)
    assert served[0].startswith(f"vLLM 0.32.0 ({fam.pruned_model_class.__name__}; its Transformers backend")
    assert served[-1] == "transformers (prunelight imported, or trust_remote_code)"
    pruned.layer_shapes = [shapes[0], {**shapes[0], "num_attention_heads": 0, "num_key_value_heads": 0}]
    assert engines_verified(pruned) == ["transformers (prunelight imported, or trust_remote_code)"]
    assert not any(e in " ".join(engines) for e in ("llama.cpp", "TGI", "TensorRT"))


def test_readme_serving_table_has_a_row_for_every_family():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Serving"):]
    rows = [line for line in section[:section.index("\n## ", 5)].splitlines() if line.startswith("| ")]
    for fam in MODEL_FAMILIES.values():
        assert any(f"(`{fam.model_class.__name__}`)" in row for row in rows), fam.name


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("card")
    ckpt = make_tiny_checkpoint(tmp / "tiny", "llama", num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    (ckpt / "LICENSE").write_text("tiny license\n")
    (ckpt / "USE_POLICY.md").write_text("be nice\n")
    files = write_tiny_corpus(tmp / "data")
    args = tiny_fit_args(ckpt, files, "--trainer.enable_progress_bar=false", "--model.recovery=none")
    return tmp, args


def test_stock_run_writes_a_stock_folder_with_card_and_licenses(tiny_job, tmp_path, monkeypatch):
    _, args = tiny_job
    monkeypatch.chdir(tmp_path)
    cli_main(args + ["--export.format=stock", "--prune.attn_mlp_split=auto", "--export.out_dir=runs/s"])
    out = tmp_path / "runs" / "s"
    report = json.loads((out / "report.json").read_text())
    search = report["plan"]["split_search"]
    assert search["by"] == "calibration_nll" and len(search["tried"]) >= 2
    assert report["plan"]["stock_shapes"]["chosen"] == search["best_groups_removed_per_layer"]
    assert len({tuple(layer.values()) for layer in report["layers"]}) == 1, "one shape in every layer"
    model = out / "model"
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg and "layer_shapes" not in cfg
    assert (model / "LICENSE").read_text() == "tiny license\n" and (model / "USE_POLICY.md").exists()
    card = (model / "README.md").read_text()
    assert "| recovered |" in card and "| dense |" in card and "| pruned |" in card, "card rewritten after eval"
    assert "Stock `llama` config" in card and "calibration_nll" in card
    assert not list(model.parent.glob(".model.*")), "no temporary folders left"


def test_stock_with_bias_reconstruction_is_refused_before_work(tiny_job, tmp_path, monkeypatch):
    _, args = tiny_job
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="prune.reconstruct='bias' is not allowed with export.format=stock"):
        cli_main(args + ["--export.format=stock", "--prune.reconstruct=bias", "--export.out_dir=runs/b"])
    assert not (tmp_path / "runs" / "b" / "model").exists()
