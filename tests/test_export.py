"""Export round trip: pruned folders reload with from_pretrained at their pruned shapes, atomically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from prunelight.export import export_pretrained
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.surgery import apply_plan
from prunelight.testing import FAMILIES, allocate_flat, tiny_model

IDS = [[5, 9, 17, 33, 2, 64, 100, 7]]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
       # a checkout run with PYTHONPATH (beside another editable install) imports its own prunelight
       **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {})}


def _load_in_fresh_python(folders: dict, prelude: str, trust_remote_code: bool) -> dict:
    """Load each folder in one fresh interpreter; return {name: [class name, logits]}."""
    code = textwrap.dedent(
        f"""
        import json, sys, torch
        {prelude}
        from transformers import AutoModelForCausalLM
        out = {{}}
        for name, folder in {dict((k, str(v)) for k, v in folders.items())!r}.items():
            m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code={trust_remote_code})
            out[name] = [type(m).__name__, m(torch.tensor({IDS})).logits.tolist()]
        out["_prunelight_imported"] = sys.modules.get("prunelight") is not None
        print(json.dumps(out))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV, cwd="/")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Globally pruned tiny models of every family, exported; with their in-memory logits."""
    root = tmp_path_factory.mktemp("exports")
    folders, refs = {}, {}
    for fam in FAMILIES:
        model = tiny_model(fam)
        # seed 2: per-layer widths in every family (Gemma's tied embeddings make the 25% target smaller)
        plan = allocate_flat(model, build_criterion("random", seed=2).scores(model), 0.25, "global")
        shapes = apply_plan(model, plan)
        assert len(set(shapes)) > 1, "global plan should give per-layer widths for this test"
        folders[fam] = export_pretrained(model, root / fam)
        with torch.no_grad():
            refs[fam] = model(torch.tensor(IDS)).logits
    return folders, refs


def test_export_files(exported):
    folders, _ = exported
    for fam, folder in folders.items():
        cfg = json.loads((folder / "config.json").read_text())
        if cfg["model_type"] == "nemotron-nas":  # auto: the served layout states these shapes (Llama-like families)
            assert get_family(tiny_model(fam)).nemotron_nas and len(cfg["block_configs"]) == 2
        else:
            assert cfg["model_type"] == f"prunelight_{fam}" and len(cfg["layer_shapes"]) == 2
        assert (folder / "model.safetensors").exists() and not list(folder.glob("*.bin")), "safetensors only"
        assert (folder / "modeling_prunelight.py").exists()


@pytest.mark.parametrize("mode", ["import-prunelight", "remote-code-without-prunelight"])
def test_roundtrip_same_logits(exported, mode):
    folders, refs = exported
    if mode == "import-prunelight":
        got = _load_in_fresh_python(folders, "import prunelight", trust_remote_code=False)
        assert got["_prunelight_imported"]
    else:
        got = _load_in_fresh_python(folders, "sys.modules['prunelight'] = None", trust_remote_code=True)
        assert not got["_prunelight_imported"]
    for fam in FAMILIES:
        name, logits = got[fam]
        assert name.startswith(("Pruned", "NemotronNas"))
        torch.testing.assert_close(torch.tensor(logits), refs[fam], atol=1e-5, rtol=1e-5)


def _uniform_plan(model, keep_groups) -> PrunePlan:
    n = model.config.num_hidden_layers
    return PrunePlan([LayerPlan(list(keep_groups), list(range(48))) for _ in range(n)],
                     [model.config.num_key_value_heads] * n, [model.config.intermediate_size] * n)


def test_uniform_export_loads_with_stock_transformers(tmp_path):
    folders, refs = {}, {}
    for fam in FAMILIES:
        model = tiny_model(fam, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
        apply_plan(model, _uniform_plan(model, [0, 2]))  # 4 heads: divides hidden 64, as stock Llama requires
        folders[fam] = export_pretrained(model, tmp_path / fam)
        cfg = json.loads((folders[fam] / "config.json").read_text())
        assert cfg["model_type"] == fam and "layer_shapes" not in cfg and "auto_map" not in cfg
        assert not (folders[fam] / "modeling_prunelight.py").exists()
        with torch.no_grad():
            refs[fam] = model(torch.tensor(IDS)).logits
    got = _load_in_fresh_python(folders, "sys.modules['prunelight'] = None", trust_remote_code=False)
    for fam in FAMILIES:
        assert not got[fam][0].startswith("Pruned")
        torch.testing.assert_close(torch.tensor(got[fam][1]), refs[fam], atol=1e-5, rtol=1e-5)


def test_uniform_llama_that_stock_rejects_falls_back(tmp_path):
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    apply_plan(model, _uniform_plan(model, [0, 1, 3]))  # 6 heads: stock LlamaConfig rejects 64 % 6 != 0
    export_pretrained(model, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    # auto: the served Nemotron-NAS layout states one head count per layer (no divisibility rule) before the
    # prunelight type
    assert cfg["model_type"] == "nemotron-nas" and cfg["num_attention_heads"] == 6


def test_failed_export_keeps_previous_folder(tmp_path, monkeypatch):
    model = tiny_model("llama")
    export_pretrained(model, tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        export_pretrained(model, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "no temporary folder may be left behind"
