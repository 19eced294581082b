"""Depth pruning: dropped layers behave exactly like layers that pass their input through, generate included."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from prunelight.families import get_family
from prunelight.export import export_pretrained
from prunelight.pipeline import make_plan
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.surgery import apply_plan, mask_units
from prunelight.testing import settings_of, tiny_model

PROMPT = torch.tensor([[5, 6, 7, 9, 11]])


def _plan(n, drop, keep_groups=None, keep_channels=None):
    keep_groups = keep_groups or {}
    keep_channels = keep_channels or {}
    layers = [
        LayerPlan([] if i in drop else keep_groups.get(i, [0, 1]),
                  [] if i in drop else keep_channels.get(i, list(range(96))))
        for i in range(n)
    ]
    return PrunePlan(layers, [2] * n, [96] * n, drop_layers=sorted(drop))


def _check_against_masked(model, plan):
    ref = copy.deepcopy(model)
    mask_units(ref, plan)  # zeroed o_proj / down_proj: the dropped layers add nothing to the residual
    want = ref.generate(PROMPT, max_new_tokens=8, do_sample=False)
    apply_plan(model, plan)
    got = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    with torch.no_grad():
        torch.testing.assert_close(model(want).logits, ref(want).logits, atol=1e-5, rtol=1e-5)
    return model


def test_generate_after_dropping_layers(family):
    model = tiny_model(family, num_hidden_layers=4)
    model = _check_against_masked(model, _plan(4, {1, 2}, keep_groups={3: [1]}, keep_channels={0: list(range(40))}))
    assert len(model.model.layers) == 2 and model.config.num_hidden_layers == 2
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1]
    if getattr(model.config, "layer_types", None) is not None:
        assert len(model.config.layer_types) == 2
    assert len(model.config.layer_shapes) == 2


def test_generate_with_first_attention_removed():
    # The cache length is read from layer 0; a removed attention there must still advance it.
    model = tiny_model("llama", num_hidden_layers=3)
    _check_against_masked(model, _plan(3, {2}, keep_groups={0: []}))


def test_export_with_first_attention_removed_generates(tmp_path):
    model = tiny_model("qwen2", num_hidden_layers=3)
    apply_plan(model, _plan(3, {1}, keep_groups={0: []}))
    export_pretrained(model, tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert loaded.model.layers[0].self_attn.layer_idx == 0
    assert torch.equal(loaded.generate(PROMPT, max_new_tokens=6, do_sample=False),
                       model.generate(PROMPT, max_new_tokens=6, do_sample=False))


def test_export_round_trip_of_depth_pruned_model(tmp_path, family):
    model = tiny_model(family, num_hidden_layers=4)
    apply_plan(model, _plan(4, {0}, keep_groups={2: [0]}, keep_channels={3: list(range(50))}))
    export_pretrained(model, tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert loaded.config.num_hidden_layers == 3
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert torch.equal(loaded.generate(PROMPT, max_new_tokens=5, do_sample=False),
                       model.generate(PROMPT, max_new_tokens=5, do_sample=False))


def test_uniform_depth_pruned_model_exports_a_stock_config(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    apply_plan(model, _plan(4, {1, 3}))
    export_pretrained(model, tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert loaded.config.model_type == "llama" and loaded.config.num_hidden_layers == 2
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_plan_without_drop_layers_still_loads():
    plan = _plan(2, {1})
    data = plan.to_dict()
    assert PrunePlan.from_dict(data).drop_layers == [1]
    data.pop("drop_layers")  # a plan saved before depth pruning existed
    assert PrunePlan.from_dict(data).drop_layers == []


def test_depth_allocation_drops_the_least_influential_layer():
    model = tiny_model("llama", num_hidden_layers=4)
    with torch.no_grad():  # layer 2 passes its input through: it has the lowest block influence
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    batches = [torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))]
    plan = make_plan(model, batches, settings_of(0.22, allocation="depth", fill_width=False)).plan
    assert plan.drop_layers == [2]
    assert plan.meta["layer_importance"]["block_influence"][2] < 1e-6
    before = sum(p.numel() for p in model.parameters())
    apply_plan(model, plan)
    assert before - sum(p.numel() for p in model.parameters()) == plan.meta["params_removed"]
    assert get_family(model).layer_shapes(model)[0].num_key_value_heads == 2
    assert model.generate(PROMPT, max_new_tokens=3, do_sample=False).shape == (1, 8)


def test_depth_preset_runs_end_to_end(tmp_path, monkeypatch):
    """The depth preset, pointed at a tiny checkpoint: layers dropped, report + plot written, export and resume work."""
    import json

    import yaml

    from prunelight.cli import cli_main
    from prunelight.module import PruneLM
    from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

    ckpt = make_tiny_checkpoint(tmp_path / "tiny", num_hidden_layers=4)
    text = write_tiny_corpus(tmp_path / "text")
    cfg = {
        "model": {"pretrained": str(ckpt), "recovery": "lora"},
        "data": {"calibration": {"path": str(text["valid"])}, "eval": {"path": str(text["test"])},
                 "train": {"path": str(text["train"])}, "num_samples": 8, "seq_len": 32, "batch_size": 4,
                 "calibration_batch_size": 4, "eval_batch_size": 8, "max_eval_blocks": 8},
        "trainer": {"accelerator": "cpu", "max_steps": 2, "val_check_interval": None, "limit_val_batches": 0,
                    "log_every_n_steps": 1, "logger": False},
        "prune": {"ratio": 0.3},
        "export": {"out_dir": str(tmp_path / "out")},
    }
    base, preset = Path(__file__).resolve().parents[1] / "configs/reference.yaml", "configs/methods/depth.yaml"
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr("sys.argv", ["prunelight"])
    repo = Path(__file__).resolve().parents[1]
    cli = cli_main(["fit", "--config", str(base), "--config", str(repo / preset), "--config", str(tmp_path / "cfg.yaml")])

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["plan"]["layers_dropped"], "depth preset dropped no layer"
    assert len(report["layer_importance"]["block_influence"]) == 4
    assert (tmp_path / "out" / "layer_importance.png").read_bytes()[:4] == b"\x89PNG"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert loaded.config.num_hidden_layers == 4 - len(report["plan"]["layers_dropped"])

    saved = next((tmp_path / "out").rglob("*.ckpt"))
    state = torch.load(saved, map_location="cpu", weights_only=False)
    fresh = PruneLM(pretrained=str(ckpt), recovery="lora")
    fresh.on_load_checkpoint(state)
    fresh.load_state_dict(state["state_dict"])
    assert fresh.base_model.config.num_hidden_layers == loaded.config.num_hidden_layers
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    fresh.merge_lora()
    with torch.no_grad():
        torch.testing.assert_close(fresh.base_model.eval()(ids).logits, cli.model.base_model.eval()(ids).logits)
