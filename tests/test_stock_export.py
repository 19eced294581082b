"""export.format: stock — uniform-shape allocation and a folder plain transformers (and serving engines) load."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from prunelight.allocation import Shape, allocate, check_shape, precheck
from prunelight.export import StockExportError, export_config, export_pretrained
from prunelight.importance import build_criterion
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.settings import ExportSettings, SettingsError
from prunelight.surgery import apply_plan
from prunelight.testing import settings_of, tiny_model

IDS = [[5, 9, 17, 33, 2, 64, 100, 7]]
SITE = str(Path(transformers.__file__).resolve().parents[1])  # site-packages holding transformers and torch
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# 8 query heads over 4 KV groups (head_dim 8, hidden 64): candidates remove 0, 1 or 2 groups per layer.
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)
# One KV head per group: keeping 7 of 8 heads of hidden 64 is a shape LlamaConfig refuses (64 % 7 != 0).
REFUSED = dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8, rope_parameters=LLAMA3_ROPE)
CASES = {  # name: (family, overrides, groups removed per layer or None for the allocation's choice, align)
    "llama": ("llama", SHAPE, None, 8),
    "mistral": ("mistral", SHAPE, None, 1),
    "qwen2": ("qwen2", SHAPE, 1, 8),
    "llama-7-heads": ("llama", REFUSED, 1, 1),
}


def _stock_plan(model, ratio=0.2, groups_removed=None, **options):
    settings = settings_of(ratio, **options)
    scores = build_criterion("random", seed=1).scores(model)
    return allocate(precheck(model, settings, shape=Shape.UNIFORM), scores, settings, shape=Shape.UNIFORM,
                    groups_removed=groups_removed)


def test_candidates_meet_the_budget_with_one_shape_per_layer():
    model = tiny_model("llama", num_hidden_layers=3, **SHAPE)
    for align in (1, 8):
        plan = _stock_plan(model, align_channels=align)
        meta = plan.meta
        cands = meta["stock_shapes"]["candidates"]
        assert [c["groups_removed_per_layer"] for c in cands][0] == 0, "MLP-only pruning is a candidate"
        assert len(cands) >= 2
        for c in cands:
            assert 0 <= c["budget_error_params"] < 3 * align * 192, c  # layers x align x one channel's cost
            assert c["intermediate_size"] % align == 0
        chosen = min(cands, key=lambda c: c["removed_score"])
        assert meta["stock_shapes"]["chosen"] == chosen["groups_removed_per_layer"]
        shapes = {(len(lp.keep_groups), len(lp.keep_channels)) for lp in plan.layers}
        assert shapes == {(4 - chosen["groups_removed_per_layer"], chosen["intermediate_size"])}
        assert 0 <= meta["budget_error_params"] < 3 * align * 192


def test_fixed_split_picks_the_nearest_shape_and_layers_keep_their_own_best_units():
    model = tiny_model("llama", **SHAPE)
    plan = _stock_plan(model, attn_mlp_split="0:1")
    assert plan.meta["stock_shapes"]["chosen"] == 0 and plan.meta["groups_removed"] == 0, "0:1 is MLP-only"
    scores = build_criterion("random", seed=1).scores(model)
    plan = _stock_plan(model, groups_removed=1)
    for i, lp in enumerate(plan.layers):  # per layer: the lowest-scored group of that layer goes
        assert set(range(4)) - set(lp.keep_groups) == {int(scores["attn"][i].argmin())}


def test_depth_drops_layers_then_fills_one_width():
    model = tiny_model("llama", num_hidden_layers=4, **SHAPE)
    settings = settings_of(0.35, allocation="depth")
    scores = build_criterion("random", seed=1).scores(model)
    plan = allocate(precheck(model, settings, shape=Shape.UNIFORM), scores, settings, layer_scores=[0.9, 0.1, 0.8, 0.7],
                    shape=Shape.UNIFORM)
    assert plan.drop_layers == [1]
    kept = {(len(lp.keep_groups), len(lp.keep_channels)) for i, lp in enumerate(plan.layers) if i != 1}
    assert len(kept) == 1 and 0 <= plan.meta["budget_error_params"] < 3 * 192


@pytest.mark.parametrize("options, match", [
    (dict(allocation="layerwise"), "prune.allocation='layerwise' is not allowed with export.format=stock"),
    (dict(reconstruct="bias"), "prune.reconstruct='bias' is not allowed with export.format=stock.*least_squares"),
    (dict(min_groups=0), "min_groups=0"),
])
def test_settings_no_stock_config_can_state_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        check_shape(settings_of(0.2, **options), Shape.UNIFORM)


def test_export_format_setting_is_checked():
    assert ExportSettings(format="stock").shape is Shape.UNIFORM and ExportSettings().shape is Shape.FREE
    with pytest.raises(SettingsError, match="export.format='gguf' is not allowed: use one of auto, stock"):
        ExportSettings(format="gguf")


def test_stock_refuses_what_no_stock_config_states():
    model = tiny_model("llama")
    plan = PrunePlan(layers=[LayerPlan([0, 1], list(range(96))), LayerPlan([0], list(range(96)))],
                     num_groups=[2, 2], num_channels=[96, 96], drop_layers=[])
    apply_plan(model, plan)
    with pytest.raises(StockExportError, match="same heads, KV heads and MLP width in every layer"):
        export_config(model, "stock")
    model = tiny_model("llama")
    model.config.output_bias = True
    with pytest.raises(StockExportError, match="output_bias.*least_squares or none"):
        export_config(model, "stock")
    # A Llama with biases in a shape LlamaConfig refuses: Mistral (the fallback) cannot state them.
    model = tiny_model("llama", attention_bias=True, **REFUSED)
    apply_plan(model, _stock_plan(model, groups_removed=1))
    with pytest.raises(StockExportError, match="MistralConfig cannot state q/k/v biases"):
        export_config(model, "stock")


@pytest.fixture(scope="module")
def stock_exports(tmp_path_factory):
    """Each case cut with the uniform-shape allocation and exported as stock; with in-memory logits."""
    root = tmp_path_factory.mktemp("stock")
    out = {}
    for name, (family, overrides, groups, align) in CASES.items():
        model = tiny_model(family, **overrides)
        plan = _stock_plan(model, groups_removed=groups, align_channels=align)
        apply_plan(model, plan)
        folder = export_pretrained(model, root / name, format="stock")
        with torch.no_grad():
            out[name] = (folder, model(torch.tensor(IDS)).logits, model.config)
    return out


def test_refused_llama_shape_is_written_as_mistral_with_the_rope_kept(stock_exports):
    folder, _, config = stock_exports["llama-7-heads"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "mistral" and cfg["architectures"] == ["MistralForCausalLM"]
    assert cfg["num_attention_heads"] == 7 and cfg["head_dim"] == 8 and cfg["hidden_size"] == 64
    assert cfg["sliding_window"] is None
    assert cfg["rope_parameters"] == LLAMA3_ROPE == config.rope_parameters
    assert "attention_bias" not in cfg and "mlp_bias" not in cfg
    assert json.loads((stock_exports["llama"][0] / "config.json").read_text())["model_type"] == "llama"


def test_engine_fields_present_and_consistent_with_the_tensors(stock_exports):
    for name, (folder, _, _) in stock_exports.items():
        cfg = json.loads((folder / "config.json").read_text())
        assert "auto_map" not in cfg and "layer_shapes" not in cfg and "output_bias" not in cfg, name
        assert not list(folder.glob("*.py")), "no custom code"
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "hidden_size",
                    "num_hidden_layers", "rope_parameters", "tie_word_embeddings", "architectures", "vocab_size"):
            assert key in cfg, (name, key)
        h, hd, n, kv, inter = (cfg[k] for k in ("hidden_size", "head_dim", "num_attention_heads",
                                                 "num_key_value_heads", "intermediate_size"))
        assert n % kv == 0
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.")}
        assert layers == set(range(cfg["num_hidden_layers"]))
        for i in layers:
            p = f"model.layers.{i}."
            assert shapes[p + "self_attn.q_proj.weight"] == (n * hd, h)
            assert shapes[p + "self_attn.k_proj.weight"] == shapes[p + "self_attn.v_proj.weight"] == (kv * hd, h)
            assert shapes[p + "self_attn.o_proj.weight"] == (h, n * hd)
            assert shapes[p + "mlp.gate_proj.weight"] == shapes[p + "mlp.up_proj.weight"] == (inter, h)
            assert shapes[p + "mlp.down_proj.weight"] == (h, inter)
            assert p + "self_attn.o_proj.bias" not in shapes and p + "mlp.down_proj.bias" not in shapes


def _load_clean(folders: dict[str, str]) -> dict:
    """Load each folder in a fresh interpreter without site processing (no editable prunelight), no remote code."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.append({SITE!r})
        try:
            import prunelight
            found = True
        except ImportError:
            found = False
        import torch
        from transformers import AutoModelForCausalLM
        out = {{"_prunelight_importable": found}}
        for name, folder in {folders!r}.items():
            m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
            out[name] = [type(m).__name__, m(torch.tensor({IDS})).logits.tolist()]
        print(json.dumps(out))
        """)
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=300,
                         env=env, cwd="/")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["_prunelight_importable"] is False
    return got


def test_loads_with_plain_transformers_without_prunelight(stock_exports):
    got = _load_clean({name: str(v[0]) for name, v in stock_exports.items()})
    expected = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "llama-7-heads": "MistralForCausalLM"}
    for name, (_, logits, _) in stock_exports.items():
        cls, got_logits = got[name]
        assert cls == expected[name]
        torch.testing.assert_close(torch.tensor(got_logits), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_reference_model_stock_export_loads_clean(ref_model_dir, tmp_path):
    """The reference model cut to 20% with one shape (weight-only scores) loads as stock with the same logits."""
    from transformers import AutoModelForCausalLM

    from prunelight.pipeline import make_plan
    from prunelight.settings import PruneSettings

    model = AutoModelForCausalLM.from_pretrained(ref_model_dir, dtype=torch.float32).eval()
    settings = PruneSettings(ratio=0.2, criterion="magnitude", allocation="global", reconstruct="none",
                             align_channels=64)
    plan = make_plan(model, [], settings, shape=Shape.UNIFORM).plan
    assert 0 <= plan.meta["budget_error_params"] < 8 * 64 * 3 * 256
    apply_plan(model, plan)
    folder = export_pretrained(model, tmp_path / "ref", format="stock")
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    cls, got = _load_clean({"ref": str(folder)})["ref"]
    assert cls in ("LlamaForCausalLM", "MistralForCausalLM")
    torch.testing.assert_close(torch.tensor(got), logits, atol=1e-4, rtol=1e-4)


def test_deploy_config_parses_with_the_cli(tmp_path, capsys):
    """configs/deploy.yaml: Llama-3-8B, 20%, stock export, distillation recovery (needs PruneLM's distillation)."""
    import inspect

    import yaml

    from prunelight.cli import cli_main
    from prunelight.module import PruneLM

    path = Path(__file__).resolve().parents[1] / "configs" / "deploy.yaml"
    config = yaml.safe_load(path.read_text())
    assert config["model"]["distillation"]["loss"] == "kl" and config["export"]["format"] == "stock"
    if "distillation" not in inspect.signature(PruneLM).parameters:  # before the distillation branch is merged
        del config["model"]["distillation"]
        path = tmp_path / "deploy.yaml"
        path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(path), "--print_config"])
    assert exc.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["pretrained"] == "meta-llama/Meta-Llama-3-8B"
    assert printed["prune"]["ratio"] == 0.2 and printed["export"]["format"] == "stock"
    assert printed["prune"]["align_channels"] == 128 and printed["prune"]["reconstruct"] == "least_squares"
