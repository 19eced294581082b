"""Benchmarks and scripts reach prunelight only through an allow-list of its modules (read from their source), one
entry point lists and runs the benchmarks, and those that write results run end to end at tiny sizes (no timed
asserts)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS, BENCHMARKS = ROOT / "scripts", ROOT / "benchmarks"
# What a benchmark or script may import of prunelight: the public API (prunelight/__init__.py), the benchmark
# harness that wraps whatever else they need (prunelight.bench), and two modules that exist for tests, scripts and
# benchmarks: tiny models and the shared-data lookup (prunelight.testing), the engine runners (prunelight.llama_cpp,
# prunelight.vllm). Every other module is an internal that moves: reached through prunelight.bench, a move changes
# one file.
ALLOWED = {"prunelight", "prunelight.bench", "prunelight.testing", "prunelight.llama_cpp", "prunelight.vllm"}


def _public() -> set[str]:
    """Names `from prunelight import ...` may bind: the public API and the allowed modules."""
    import prunelight

    return set(prunelight.__all__) | {m.split(".", 1)[1] for m in ALLOWED if "." in m}


def _own_names() -> set[str]:
    """Module names of the scripts and benchmarks (none may import another)."""
    return {p.stem for folder in (SCRIPTS, BENCHMARKS) for p in folder.glob("*.py")} | {"benchmarks", "scripts"}


def _problems(path: Path, own: set[str], public: set[str]) -> list[str]:
    """What in one file breaks the rules: a prunelight module off the allow-list, a private name, a non-public
    `prunelight.X`, another script or benchmark imported, a model loaded around the harness."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    problems, bound = [], {}  # bound: local name -> the prunelight module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "prunelight":
                    if a.name not in ALLOWED:
                        problems.append(f"line {node.lineno}: imports {a.name} (not on the allow-list)")
                    bound[a.asname or "prunelight"] = a.name if a.asname else "prunelight"
                elif a.name.split(".")[0] in own:
                    problems.append(f"line {node.lineno}: imports {a.name} (another script or benchmark)")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.split(".")[0] in own:
                problems.append(f"line {node.lineno}: imports from {'.' * node.level}{module} "
                                "(another script or benchmark)")
            elif module.split(".")[0] == "prunelight":
                if module not in ALLOWED:
                    problems.append(f"line {node.lineno}: imports from {module} (not on the allow-list)")
                for a in node.names:
                    if a.name.startswith("_"):
                        problems.append(f"line {node.lineno}: imports the private name {a.name} from {module}")
                    elif module == "prunelight" and a.name not in public:
                        problems.append(f"line {node.lineno}: imports prunelight.{a.name} (not public)")
                    elif module == "prunelight" and f"prunelight.{a.name}" in ALLOWED:
                        bound[a.asname or a.name] = f"prunelight.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            module = bound[node.value.id]
            if node.attr.startswith("_"):
                problems.append(f"line {node.lineno}: uses the private {module}.{node.attr}")
            elif module == "prunelight" and node.attr not in public:
                problems.append(f"line {node.lineno}: uses prunelight.{node.attr} (not public)")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained" \
                and getattr(node.func.value, "id", None) == "AutoModelForCausalLM":
            problems.append(f"line {node.lineno}: loads a model itself (prunelight.bench.load_model is the harness's)")
        loader = getattr(node.func, "attr", getattr(node.func, "id", None)) if isinstance(node, ast.Call) else None
        if loader in ("import_module", "spec_from_file_location", "run_path"):  # a script loaded by its name
            named = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            problems += [f"line {node.lineno}: loads {n} (another script or benchmark)" for n in named
                         if Path(n).stem.split(".")[-1] in own]
    return problems


def test_benchmarks_and_scripts_import_only_the_allowed_prunelight_modules_and_no_other_script():
    paths = sorted([*SCRIPTS.glob("*.py"), *BENCHMARKS.glob("*.py")])
    own, public = _own_names(), _public()
    problems = {str(p.relative_to(ROOT)): _problems(p, own, public) for p in paths}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_rule_catches_what_it_forbids(tmp_path):
    """The AST check itself: each forbidden shape in a made-up file is reported, the allowed ones are not."""
    bad = tmp_path / "bad.py"
    bad.write_text("from criteria import prepare_data\nfrom prunelight.cut import run_cut\n"
                   "import prunelight.allocation.search\nfrom prunelight import pipeline\n"
                   "from prunelight.bench import _private\nimport prunelight\nprunelight.levels.build(m)\n"
                   "from prunelight import bench\nbench._helper()\nfrom . import speed\n"
                   "from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained('x')\n"
                   "importlib.import_module('benchmarks.speed')\n"
                   # allowed: the public API, the harness, the test helpers, an outside library
                   "prunelight.apply_plan(m, p)\nprunelight.prune(m)\nprunelight.PruneSettings()\nbench.cut_copy(m)\n"
                   "from prunelight.testing import tiny_model\nfrom prunelight import Scores, bench\nimport torch.nn\n")
    problems = _problems(bad, {"criteria", "speed", "bad", "benchmarks"}, _public())
    assert len(problems) == 10, problems
    for shown in ("criteria", "prunelight.cut", "prunelight.allocation.search", "prunelight.pipeline", "_private",
                  "prunelight.levels", "bench._helper", "from .", "loads a model", "benchmarks.speed"):
        assert any(shown in p for p in problems), (shown, problems)


def _benchmark(name: str):
    """benchmarks/<name>.py, imported as the entry point imports it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # `python -m benchmarks` runs from the repository root
    return importlib.import_module(f"benchmarks.{name}")


def test_the_entry_point_lists_every_benchmark_with_what_it_writes(capsys):
    """`python -m benchmarks --help` names each module of benchmarks/ with its first docstring line and WRITES;
    each benchmark module has `main`, imports the harness, and answers --help; an unknown name is refused."""
    entry = _benchmark("__main__")
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    assert set(names) >= {"allocations", "criteria", "distillation", "llama_cpp", "quality_vs_size", "scoring_cost",
                          "speed", "vllm_speed"}
    assert entry.main(["--help"]) == 0
    listing = capsys.readouterr().out
    for name in names:
        module = _benchmark(name)
        assert callable(module.main) and module.WRITES and module.__doc__, name
        assert f"  {name} " in listing, name
        assert module.WRITES in listing and module.__doc__.split("\n", 1)[0] in listing, name
        with pytest.raises(SystemExit) as stop:
            module.main(["--help"])
        assert stop.value.code == 0
        assert f"usage: python -m benchmarks {name}" in capsys.readouterr().out, name
    assert entry.main(["no_such_benchmark"]) == 2 and "not a benchmark" in capsys.readouterr().err


def test_add_speedups_compares_each_row_with_its_own_base():
    from prunelight import bench

    rows = [{"m": "dense", "bs": 1, "params": 100, "tps": 10.0}, {"m": "cut", "bs": 1, "params": 80, "tps": 15.0},
            {"m": "dense", "bs": 8, "params": 100, "tps": 40.0}, {"m": "cut", "bs": 8, "params": 80, "tps": 40.0},
            {"m": "cut", "bs": 32, "params": 80, "tps": 50.0}]
    bench.add_speedups(rows, {"decode": "tps"}, lambda r: r["m"] == "dense", ("bs",))
    assert [r.get("decode_speedup") for r in rows] == [1.0, 1.5, 1.0, 1.0, None]  # no dense at batch 32
    assert rows[1]["ideal_speedup"] == 1.25 and rows[1]["decode_vs_ideal"] == pytest.approx(1.2)


def test_the_harness_export_and_shapes_are_the_cuts(tmp_path):
    """bench.shape_settings cuts to the export format's shapes; bench.export writes that format, which
    bench.export_format reads back; bench.layer_shapes reads the cut widths from the modules."""
    import prunelight
    from prunelight import bench
    from prunelight.testing import tiny_model

    for fmt in ("stock", "nemotron_nas"):
        model = prunelight.prune(tiny_model(seed=0), bench.shape_settings(0.3), export_format=fmt)[0]
        shapes = bench.layer_shapes(model)
        assert shapes[0]["intermediate_size"] < 96 and len(shapes) == 2
        assert (len({tuple(s.values()) for s in shapes}) == 1) == (fmt == "stock")  # stock: one shape everywhere
        assert bench.export_format(bench.export(model, tmp_path / fmt, format=fmt)) == fmt


def test_scorer_cuts_equal_the_run_cut_for_every_allocation():
    """bench.Scorer scores once for many cuts, and each cut is the one prunelight.prune makes from scratch."""
    import prunelight
    from prunelight import bench
    from prunelight.testing import tiny_model

    calibration = list(torch.split(torch.randint(3, 128, (16, 16), generator=torch.Generator().manual_seed(0)), 8))
    model = tiny_model(seed=0)
    scorer = bench.Scorer(model, calibration)
    cells = [bench.cell_settings(a, "taylor", 0.3, importance_batches=1) for a in bench.allocations()]
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

    table = _script("memory_table")  # its Arch reads bench.architecture: the counts of a run
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
    """scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in a script look their module up by name
    spec.loader.exec_module(module)
    return module


def test_quality_vs_size_tiny_writes_table_json_and_figure(tmp_path):
    import prunelight

    bench = _benchmark("quality_vs_size")
    bench.main(["--tiny-family", "llama", "--ratios", "0.3", "--methods", "default,flap_ls,magnitude",
                "--peer-setups", "", "--samples", "8", "--eval-tokens", "1024", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "quality_tiny_llama.json").read_text())
    assert {"dense_ppl", "params_total", "ratios", "eval_tokens"} <= set(data["meta"])
    rows = {r["method"]: r for r in data["rows"]}
    # "default" is the library's default (search), never the global flap + least_squares row
    defaults = prunelight.PruneSettings()
    assert bench.METHOD_KEYS["default"] == f"prunelight default ({defaults.criterion} / {defaults.allocation})"
    assert set(rows) == {bench.METHOD_KEYS["default"], "flap+least_squares (global)", "magnitude"}
    assert not any("default" in label for key, label in bench.METHOD_KEYS.items() if key != "default")
    for row in rows.values():
        assert "error" not in row, row
        assert math.isfinite(row["ppl"]) and abs(row["removed"] - 0.3) < 0.05
    assert (tmp_path / "quality_tiny_llama.png").stat().st_size > 0
    text = (tmp_path / "quality_tiny_llama.md").read_text()
    assert "| magnitude |" in text and f"| {bench.METHOD_KEYS['default']} |" in text


def test_quality_vs_size_grid_rows_both_protocols_and_resume(tmp_path):
    bench = _benchmark("quality_vs_size")
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
    bench = _benchmark("quality_vs_size")
    bench.main(["--tiny-family", "llama", "--ratios", "0.2", "--methods", "flap_ls", "--peer-setups", "tp_l2_heads",
                "--peer-steps", "2", "--samples", "8", "--eval-tokens", "1024", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "quality_tiny_llama.json").read_text())["rows"]
    peer = [r for r in rows if r["kind"] == "peer"]
    assert len(peer) == 1 and ("ppl" in peer[0] or "error" in peer[0])  # a failure is a recorded fact too


def test_scoring_cost_tiny_reports_floors_and_ratios(tmp_path):
    bench = _benchmark("scoring_cost")
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
    bench = _benchmark("speed")
    bench.main(["--tiny", "--ratios", "0.3", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "speed.json").read_text())
    models = {r["model"] for r in data["rows"]}
    assert models == {"dense", "30% align 1", "30% align 64"}
    aligned = next(r for r in data["rows"] if r["model"] == "30% align 64")
    assert all(w % 64 == 0 for w in aligned["widths"]["mlp"])
    for r in data["rows"]:
        assert r["ideal_speedup"] >= 1 and r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
    assert {m["width"] for m in data["mlp"]} == {128, 100}


def _tiny_checkpoint_and_corpus(tmp_path):
    """A tiny 3-layer checkpoint and a tiny corpus for the allocations benchmark."""
    from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=3, intermediate_size=64)
    return ckpt, write_tiny_corpus(tmp_path / "data", lines=60)


def test_allocations_tiny_writes_rows_with_phase_times(tmp_path):
    bench = _benchmark("allocations")
    ckpt, files = _tiny_checkpoint_and_corpus(tmp_path)
    bench.main(["--model", str(ckpt), "--calibration", str(files["valid"]), "--eval", str(files["test"]),
                "--eval-chars", "3000", "--samples", "8", "--seq-len", "16", "--generations", "2", "--offspring", "2",
                "--stages", "2", "4", "--survivors", "2", "1", "--mlp-levels", "8", "--rows", "stock,search",
                "--state-dir", str(tmp_path / "state"), "--out-dir", str(tmp_path), "--name", "s"])
    data = json.loads((tmp_path / "s.json").read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"stock", "search"} and all("error" not in r for r in rows.values())
    assert math.isfinite(rows["search"]["ppl"]) and {"database", "search", "cut", "eval"} <= set(
        rows["search"]["times_s"])
    assert "stock" in rows["search"]["search"]["seeds_kl"]  # the stock plan seeds the search
    assert "| search | 0.2 |" in (tmp_path / "s.md").read_text()
    s = rows["search"]["search"]  # the fitness's work: kept prefixes are not run again
    assert s["layers"] == 3 and 0 < s["layers_run"] <= s["forwards"] * s["layers"]
    assert data["meta"]["commands"][-1].startswith("python -m benchmarks allocations --model ")


def test_allocations_settings_make_a_labelled_variant_of_the_defaults(tmp_path):
    """--settings changes the library defaults of the default row, labelled by --variant (required)."""
    bench = _benchmark("allocations")
    ckpt, files = _tiny_checkpoint_and_corpus(tmp_path)
    quick = {"importance_batches": 1, "allocation_args": {"generations": 1, "offspring": 2, "stages": [4],
                                                          "survivors": [1], "mlp_levels": 8, "fitness_folds": 1}}
    argv = ["--model", str(ckpt), "--calibration", str(files["valid"]), "--eval", str(files["test"]),
            "--eval-chars", "3000", "--samples", "8", "--seq-len", "16", "--rows", "default",
            "--state-dir", str(tmp_path / "state"), "--out-dir", str(tmp_path), "--name", "s",
            "--settings", json.dumps(quick)]
    with pytest.raises(SystemExit):  # a changed default without a label would pass for the defaults' row
        bench.main(argv)
    bench.main([*argv, "--variant", "quick"])
    data = json.loads((tmp_path / "s.json").read_text())
    (row,) = data["rows"]
    assert row["row"] == "default" and row["variant"] == "quick" and "error" not in row
    assert [t["generation"] for t in row["search"]["trajectory"]] == [0, 1]  # the changed generations ran
    assert data["meta"]["settings_variants"] == {"quick": quick}
    assert "| default (quick) | 0.2 |" in (tmp_path / "s.md").read_text()


def test_vllm_speed_table_compares_each_folder_with_the_dense_one(tmp_path):
    """The vLLM speed table from measured rows (no vLLM needed): speed-ups and the ideal against the dense folder."""
    import argparse

    speed = _benchmark("vllm_speed")
    rows = [{"name": "dense", "format": "-", "ratio": 0.0, "align_channels": 1, "params": 100, "engine": "vllm x",
             "architecture": "LlamaForCausalLM", "prefill_tok_s": 1000.0, "decode_tok_s": 100.0},
            {"name": "stock_20", "format": "stock", "ratio": 0.2, "align_channels": 1, "params": 80,
             "engine": "vllm x", "architecture": "LlamaForCausalLM", "prefill_tok_s": 1100.0, "decode_tok_s": 120.0}]
    args = argparse.Namespace(batch=4, prompt_len=256, decode_tokens=64, repeats=5, tag="t", out=str(tmp_path))
    speed.write(rows, args)
    data = json.loads((tmp_path / "vllm_speed_t.json").read_text())
    assert [r["decode_speedup"] for r in data["rows"]] == [1.0, 1.2] and data["rows"][1]["ideal_speedup"] == 1.25
    assert "| stock_20 | stock (LlamaForCausalLM) | 1 | 80 | 1100 | 120.0 | 1.10 | 1.20 | 1.25 |" in (
        tmp_path / "vllm_speed_t.md").read_text()
