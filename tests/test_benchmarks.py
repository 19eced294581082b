"""The benchmark scripts cut only through the public API and share one harness (read from their source), and the
three that write results run end to end at tiny sizes (no timed asserts)."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# Internals that make a cut (or part of one): a script reaches them only through prunelight.prune / score /
# apply_plan and the `prunelight` command, so what it measures is the cut a run makes.
CUT_MODULES = {"prunelight.cut", "prunelight.pipeline", "prunelight.surgery", "prunelight.reconstruct",
               "prunelight.layer_importance", "prunelight.allocation.calibrated", "prunelight.allocation.split_search",
               "prunelight.allocation.width", "prunelight.allocation.layerwise", "prunelight.allocation.structural",
               "prunelight.allocation.stock", "prunelight.allocation.served", "prunelight.allocation.align"}
CUT_NAMES = {"run_cut", "make_plan", "allocate", "precheck", "measure_probes", "cut_and_reconstruct",
             "measured_scores", "layer_importances", "subblock_removal", "adopt_plan", "prepare_cut", "scoring_pass",
             "mask_units", "apply_plan"}
PUBLIC = {"prune", "score", "apply_plan", "PruneSettings", "PrunePlan", "Scores", "bench", "__version__"}


def _imports(tree: ast.AST) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import in a parsed file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, a.name) for a in node.names]
    return found


def _script_problems(path: Path, scripts: set[str]) -> list[str]:
    """What in one script breaks the rules: another script imported, a cut made outside the public API."""
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = []
    for module, name in _imports(tree):
        if module.split(".")[0] in scripts:
            problems.append(f"imports the script {module}")
        if module in CUT_MODULES or (name and f"{module}.{name}" in CUT_MODULES):
            problems.append(f"imports {module}{'.' + name if name else ''} (cut internals)")
        elif module == "prunelight" and name is not None and name not in PUBLIC:
            problems.append(f"imports prunelight.{name} (not public)")
        elif name in CUT_NAMES and module != "prunelight":
            problems.append(f"imports {name} from {module} (a cut outside the public API)")
    for node in ast.walk(tree):  # prunelight.cut.run_cut(...), surgery.apply_plan(...) reached as attributes
        if isinstance(node, ast.Attribute) and node.attr in CUT_NAMES:
            base = node.value
            if not (isinstance(base, ast.Name) and base.id == "prunelight" and node.attr in PUBLIC):
                problems.append(f"line {node.lineno}: calls .{node.attr} (a cut outside the public API)")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained" \
                and getattr(node.func.value, "id", None) == "AutoModelForCausalLM":
            problems.append(f"line {node.lineno}: loads a model itself (prunelight.bench.load_model is the harness's)")
        loader = getattr(node.func, "attr", getattr(node.func, "id", None)) if isinstance(node, ast.Call) else None
        if loader in ("import_module", "spec_from_file_location", "run_path"):  # a script imported by its name
            named = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            problems += [f"line {node.lineno}: loads the script {n}" for n in named if Path(n).stem in scripts]
    return problems


def test_scripts_cut_only_through_the_public_api_and_import_no_other_script():
    paths = sorted(SCRIPTS.glob("*.py"))
    scripts = {p.stem for p in paths}
    problems = {p.name: _script_problems(p, scripts) for p in paths}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_rule_catches_what_it_forbids(tmp_path):
    """The AST check itself: each forbidden shape in a made-up script is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from benchmark_methods import prepare_data\nfrom prunelight.cut import run_cut\n"
                   "from prunelight.allocation import allocate\nimport prunelight.surgery\n"
                   "from prunelight import pipeline\nimport prunelight\nprunelight.surgery.apply_plan(m, p)\n"
                   "from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained('x')\n"
                   "prunelight.apply_plan(m, p)\nprunelight.prune(m)\nimportlib.import_module('benchmark_methods')\n")
    problems = _script_problems(bad, {"benchmark_methods", "bad"})
    assert len(problems) == 8, problems
    assert not any("prunelight.apply_plan" in p or ".prune" in p for p in problems)


def test_scripts_share_one_harness():
    """Scripts that measure models use prunelight.bench (data, perplexity, cuts, results, workers)."""
    users = {p.stem for p in SCRIPTS.glob("*.py") if ("prunelight", "bench") in _imports(ast.parse(p.read_text()))}
    assert {"benchmark_calibrated", "benchmark_methods", "benchmark_quality_vs_size", "benchmark_scoring_cost",
            "benchmark_speed", "benchmark_vllm_speed", "compare_methods", "serve_check"} <= users


def test_scorer_cuts_equal_the_run_cut_for_every_allocation():
    """bench.Scorer scores once for many cuts, and each cut is the one prunelight.prune makes from scratch."""
    import prunelight
    from prunelight import bench
    from prunelight.allocation import ALLOCATIONS
    from prunelight.testing import tiny_model

    calibration = list(torch.split(torch.randint(3, 128, (16, 16), generator=torch.Generator().manual_seed(0)), 8))
    model = tiny_model(seed=0)
    scorer = bench.Scorer(model, calibration)
    cells = [bench.cell_settings(a, "taylor", 0.3, importance_batches=1) for a in ALLOCATIONS]
    cells.append(bench.cell_settings("blockwise", "taylor", 0.3, importance_batches=1, block_importance="removal"))
    for settings in cells:
        allocation = settings.allocation
        pruned, plan, _ = bench.cut_copy(model, settings, calibration, scores=scorer(settings))
        _, direct = prunelight.prune(tiny_model(seed=0), settings, calibration)
        assert plan.to_dict()["layers"] == direct.to_dict()["layers"], allocation
        assert plan.drop_layers == direct.drop_layers, allocation
    assert set(scorer.seconds) == {"taylor"}  # one scoring pass of the criterion for every allocation


def test_memory_table_counts_parameters_with_the_run_budget(tmp_path):
    """memory_table's counts are the run's Budget on a weightless copy: any family, tied embeddings once."""
    from prunelight.allocation import make_budget
    from prunelight.settings import PruneSettings
    from prunelight.testing import make_tiny_checkpoint, tiny_model

    table = _script("memory_table")
    for family in ("phi3", "gemma2"):  # fused projections; tied embeddings and extra norms
        folder = make_tiny_checkpoint(tmp_path / family, family)
        arch = table.arch(str(folder), 0.3)
        budget = make_budget(tiny_model(family), PruneSettings(ratio=0.3))
        assert arch.params() == budget.total == sum(p.numel() for p in tiny_model(family).parameters())
        assert arch.params(pruned=True) == budget.total - budget.target
        assert 0 < arch.keep() < 1 and arch.lora_params(8) > arch.lora_params(8, arch.keep()) > 0
    text = table.render(table.arch("llama3-8b", 0.2), 2048, 1, 0.2, 16, 8)
    assert "8.03B parameters, 6.42B after removing 20%" in text


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in a script look their module up by name
    spec.loader.exec_module(module)
    return module


def test_quality_vs_size_tiny_writes_table_json_and_figure(tmp_path):
    bench = _script("benchmark_quality_vs_size")
    bench.main(["--tiny-family", "llama", "--ratios", "0.3", "--methods", "default,magnitude", "--peer-setups", "",
                "--samples", "8", "--eval-tokens", "1024", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "quality_tiny_llama.json").read_text())
    assert {"dense_ppl", "params_total", "ratios", "eval_tokens"} <= set(data["meta"])
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {bench.METHOD_KEYS["default"], "magnitude"}
    for row in rows.values():
        assert "error" not in row, row
        assert math.isfinite(row["ppl"]) and abs(row["removed"] - 0.3) < 0.05
    assert (tmp_path / "quality_tiny_llama.png").stat().st_size > 0
    assert "| magnitude |" in (tmp_path / "quality_tiny_llama.md").read_text()


def test_quality_vs_size_grid_rows_both_protocols_and_resume(tmp_path):
    bench = _script("benchmark_quality_vs_size")
    args = ["--tiny-family", "llama", "--ratios", "0.3", "--grid", "flap:global,uniform:0.3", "--grid",
            "random:global:0.3", "--protocols", "own,paper", "--paper-seq-len", "64", "--paper-windows", "4",
            "--peer-setups", "", "--samples", "8", "--eval-tokens", "1024", "--out-dir", str(tmp_path)]
    bench.main(args)
    path = tmp_path / "quality_tiny_llama.json"
    data = json.loads(path.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["flap / global", "flap / uniform", "random / global"]  # the default first
    for row in rows.values():
        assert "error" not in row, row
        assert math.isfinite(row["ppl"]) and math.isfinite(row["ppl_paper"]) and row["eval_tokens_paper"] == 252
        assert abs(row["removed"] - 0.3) < 0.05 and row["cut"]["mlp_kept_min"] <= row["cut"]["mlp_kept_max"]
    assert data["meta"]["dense_ppl_paper"] > 0
    bench.main([*args, "--grid", "magnitude:global:0.3", "--resume"])  # only the new cell runs
    again = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    assert again["flap / global"]["seconds"] == rows["flap / global"]["seconds"] and "magnitude / global" in again
    text = (tmp_path / "quality_tiny_llama.md").read_text()
    assert "| flap / uniform |" in text and "paper protocol" in text


def test_quality_vs_size_peer_rows_are_recorded(tmp_path):
    pytest.importorskip("torch_pruning", reason="Torch-Pruning not installed: the peer part is skipped")
    bench = _script("benchmark_quality_vs_size")
    bench.main(["--tiny-family", "llama", "--ratios", "0.2", "--methods", "default", "--peer-setups", "tp_l2_heads",
                "--peer-steps", "2", "--samples", "8", "--eval-tokens", "1024", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "quality_tiny_llama.json").read_text())["rows"]
    peer = [r for r in rows if r["kind"] == "peer"]
    assert len(peer) == 1 and ("ppl" in peer[0] or "error" in peer[0])  # a failure is a recorded fact too


def test_scoring_cost_tiny_reports_floors_and_ratios(tmp_path):
    bench = _script("benchmark_scoring_cost")
    bench.main(["--tiny", "--criteria", "taylor,flap,magnitude", "--batches", "1", "--repeats", "1",
                "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "scoring_cost.json").read_text())
    assert data["meta"]["floors"] == {"taylor": "floor:frozen", "flap": "floor:forward", "magnitude": None}
    for name in ("floor:frozen", "floor:forward", "taylor", "naive:taylor", "flap", "magnitude"):
        row = data["rows"][name]
        assert "error" not in row, row
        assert row["median_s"] > 0 and len(row["times_s"]) == 1
    assert "| taylor |" in (tmp_path / "scoring_cost.md").read_text()


def test_gpu_phases_tiny_runs_every_phase_on_cpu(tmp_path):
    """The GPU phase script's code path at a tiny shape: every phase ok, the cut at its ratio, speed per model."""
    phases = _script("gpu_phases")
    phases.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--speed-ratios", "0.3", "--batch-sizes", "1",
                 "--out", str(tmp_path / "p"), "--work", str(tmp_path / "w")])
    data = json.loads((tmp_path / "p.json").read_text())
    status = {r["phase"]: r["status"] for r in data["phases"]}
    assert set(status.values()) == {"ok"}, status
    assert {"build", "score taylor", "score taylor_element", "export (safetensors)", "lora recovery"} <= set(status)
    cut = next(r for r in data["phases"] if r["phase"].startswith("cut"))
    assert abs(cut["removed"] - 0.2) < 0.01
    lora = next(r for r in data["phases"] if r["phase"] == "lora recovery")
    assert lora["trainable_params"] > 0 and lora["tokens_per_s"] > 0
    assert {r["model"] for r in data["speed"]} == {"dense", "30% align 1", "30% align 32"}
    assert "| lora recovery | ok |" in (tmp_path / "p.md").read_text()


@pytest.mark.parametrize("option, names", [("--models", "dense,20% align 7"), ("--compile", "dens")])
def test_gpu_phases_refuses_an_unknown_model_name_before_any_work(tmp_path, capsys, option, names):
    phases = _script("gpu_phases")
    with pytest.raises(SystemExit):
        phases.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--speed-ratios", "0.3", option, names,
                     "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert f"{option} [" in err and "not among this run's models" in err and "'30% align 32'" in err
    assert not (tmp_path / "p.json").exists()


def test_gpu_phases_regional_compile_keeps_the_logits_and_can_be_undone(monkeypatch):
    """Each decoder layer compiled in place gives the eager model's logits; `uncompile` makes the layers eager
    again (so copies made for the next cut stay plain)."""
    from prunelight.testing import tiny_model

    phases = _script("gpu_phases")
    for name in ("allow_unspec_int_on_nn_module", "recompile_limit"):  # compile_model sets them; restored after
        monkeypatch.setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name))
    model = tiny_model("llama").eval()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        run = phases.compile_model(model, "regional")
        assert run is model and all(layer._compiled_call_impl is not None for layer in model.model.layers)
        torch.testing.assert_close(run(input_ids=ids).logits, eager, rtol=1e-4, atol=1e-4)
    phases.uncompile(model)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    torch._dynamo.reset()


def test_gpu_check_refuses_an_unknown_check(tmp_path):
    import subprocess

    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "CHECKS": "deepspeed kd2"}, timeout=60)
    assert proc.returncode == 2 and "CHECKS: 'kd2' is not a check (deepspeed, phases, kd)" in proc.stdout
    assert not (tmp_path / "out" / "deepspeed.log").exists()


def test_speed_tiny_times_dense_and_pruned_models(tmp_path):
    bench = _script("benchmark_speed")
    bench.main(["--tiny", "--ratios", "0.3", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "speed.json").read_text())
    models = {r["model"] for r in data["rows"]}
    assert models == {"dense", "30% align 1", "30% align 64"}
    aligned = next(r for r in data["rows"] if r["model"] == "30% align 64")
    assert all(w % 64 == 0 for w in aligned["widths"]["mlp"])
    for r in data["rows"]:
        assert r["ideal_speedup"] >= 1 and r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
    assert {m["width"] for m in data["mlp"]} == {128, 100}


def test_search_curve_scales_the_8b_estimate_by_the_decoder_layers_the_fitness_ran():
    curve = _script("search_curve")
    row = {"row": "search", "ratio": 0.2, "seq_len": 128, "times_s": {"search": 100.0},
           "search": {"forwards": 1000, "layers": 30, "layers_run": 30000, "trajectory": [{}, {}], "seeds_kl": {}}}
    whole = curve.estimate(row, 350.0, 30.0)
    half = curve.estimate({**row, "search": {**row["search"], "layers_run": 15000}}, 350.0, 30.0)
    old = curve.estimate({**row, "search": {k: v for k, v in row["search"].items() if k != "layers_run"}}, 350.0, 30.0)
    assert whole["layer_share"] == old["layer_share"] == 1.0 and half["layer_share"] == 0.5
    m = curve.LLAMA3_8B
    head = m["vocab"] * m["hidden"]
    assert whole["search_s"] == pytest.approx(128_000 * 2 * (m["params"] - head) / 350e12)
    assert half["search_s"] == pytest.approx(128_000 * 2 * ((m["params"] - 2 * head) / 2 + head) / 350e12)
