"""The three benchmark scripts run end to end at tiny sizes and write their JSON (no timed asserts)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
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
