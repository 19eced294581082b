"""Report and figures: one fit evaluates dense / pruned / recovered the same way; `prunelight evaluate` re-measures."""

from __future__ import annotations

import json

import pytest
import yaml

from prunelight.cli import cli_main
from prunelight.evaluation.figures import kept_removed_scores, write_figures
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.report import render_markdown
from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

PNG = b"\x89PNG\r\n\x1a\n"
ZS_ROWS = [
    {"query": "Question: which fox is quick", "choices": ["the brown fox", "a lazy dog"], "gold": 0},
    {"query": "Question: what do we remove", "choices": ["whole groups", "the dog"], "gold": 0},
    {"query": "Question: a model must", "choices": ["still speak", "jumps"], "gold": 0},
]


def _config(tmp_path, allow_overlap=False, eval_text=None) -> dict:
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    files = write_tiny_corpus(tmp_path / "text", lines=120)
    zs = tmp_path / "zs"
    zs.mkdir()
    (zs / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ZS_ROWS))
    evaluation = {
        "ppl_datasets": {"tiny_test": {"path": str(eval_text or files["test"])}},
        "seq_lens": [16, 4096], "ppl_batch_size": 4, "tasks": ["arc_easy"], "zeroshot_data_dir": str(zs),
        "speed_prompt_len": 8, "speed_new_tokens": 2, "speed_repeats": 1, "similarity_batches": 1,
    }
    return {
        "seed_everything": 0,
        "model": {"pretrained": str(ckpt), "recovery": "lora", "attn_implementation": "eager"},
        "data": {"calibration": {"path": str(files["valid"])}, "eval": {"path": str(files["test"])},
                 "train": {"path": str(files["train"])}, "num_samples": 8, "seq_len": 16, "batch_size": 4,
                 "allow_overlap": allow_overlap},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False, "enable_checkpointing": False,
                    "num_sanity_val_steps": 0, "limit_val_batches": 0, "enable_progress_bar": False},
        "prune": {"ratio": 0.3, "criterion": "taylor"},
        "evaluation": {"max_eval_batches": 1, "suite": evaluation},
        "export": {"out_dir": str(tmp_path / "run")},
    }


def _fit(tmp_path, cfg):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli_main(["fit", "--config", str(path)])


def test_fit_reports_dense_pruned_recovered_with_figures(tmp_path):
    _fit(tmp_path, _config(tmp_path))
    run = tmp_path / "run"
    rep = json.loads((run / "report.json").read_text())
    ev = rep["evaluation"]
    assert set(ev) >= {"dense", "pruned", "recovered", "hidden_similarity"}
    for name in ("dense", "pruned", "recovered"):
        recs = ev[name]["perplexity"]
        assert [(r["seq_len_requested"], r["seq_len"]) for r in recs] == [(16, 16), (4096, 256)]
        assert ev[name]["zeroshot"]["tasks"]["arc_easy"]["samples"] == len(ZS_ROWS)
        assert ev[name]["efficiency"]["speed"]["prompt_len"] == 8
    # same data measured for every model; the cut removed parameters
    assert ev["dense"]["perplexity"][0]["tokens"] == ev["pruned"]["perplexity"][0]["tokens"]
    assert ev["pruned"]["efficiency"]["params"]["total"] < ev["dense"]["efficiency"]["params"]["total"]
    assert ev["recovered"]["efficiency"]["disk_bytes"] > 0
    sim = ev["hidden_similarity"]
    assert sim["pruned"][0] == pytest.approx(1.0, abs=1e-5)  # embeddings are never cut
    assert min(sim["pruned"]) < 0.9999
    for fname in rep["figures"].values():
        assert (run / fname).read_bytes()[:8] == PNG
    assert set(rep["figures"]) >= {"kept_units", "importance_distribution", "hidden_similarity"}
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temp files left behind
    md = (run / "report.md").read_text()
    assert "## Zero-shot accuracy" in md and "4096 -> 256" in md and "![kept_units](kept_units.png)" in md
    dense_zs = ev["dense"]["zeroshot"]["tasks"]["arc_easy"]
    assert f"{dense_zs['acc']:.4f} ± {dense_zs['acc_stderr']:.4f}" in md  # accuracies carry their standard error
    assert "OVERLAP" not in md and rep["overlap"]["flagged"] is False

    # `prunelight evaluate --run` re-measures the finished run's model (and the dense one it came from).
    out = tmp_path / "re"
    cli_main(["evaluate", "--run", str(run), "--out_dir", str(out), "--evaluation.zeroshot", "false",
              "--evaluation.efficiency", "false", "--evaluation.ppl_datasets",
              json.dumps(rep["evaluation_settings"]["ppl_datasets"]), "--evaluation.seq_lens", "[16]"])
    again = json.loads((out / "report.json").read_text())["evaluation"]
    assert again["recovered"]["perplexity"][0]["ppl"] == pytest.approx(ev["recovered"]["perplexity"][0]["ppl"], rel=1e-4)
    assert again["dense"]["perplexity"][0]["ppl"] == pytest.approx(ev["dense"]["perplexity"][0]["ppl"], rel=1e-4)

    # Without naming any data, `--run` re-measures the run's own perplexity sets (not the hub defaults).
    out2 = tmp_path / "re2"
    cli_main(["evaluate", "--run", str(run), "--out_dir", str(out2), "--evaluation.zeroshot", "false",
              "--evaluation.efficiency", "false", "--evaluation.seq_lens", "[16]"])
    inherited = json.loads((out2 / "report.json").read_text())
    assert inherited["evaluation_settings"]["ppl_datasets"] == rep["evaluation_settings"]["ppl_datasets"]
    assert inherited["evaluation"]["recovered"]["perplexity"][0]["ppl"] == pytest.approx(
        ev["recovered"]["perplexity"][0]["ppl"], rel=1e-4)


def test_overlap_refused_then_reported_loudly(tmp_path):
    cfg = _config(tmp_path)
    calib = cfg["data"]["calibration"]["path"]
    cfg["evaluation"]["suite"]["ppl_datasets"] = {"leak": {"path": calib}}
    with pytest.raises(ValueError, match="overlaps the perplexity set 'leak'"):
        _fit(tmp_path, cfg)
    cfg["data"]["allow_overlap"] = True
    cfg["evaluation"]["suite"].update(zeroshot=False, efficiency=False)
    _fit(tmp_path, cfg)
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["overlap"]["flagged"] is True and "calibration/leak" in rep["overlap"]["evaluation_sets"]
    assert "WARNING: calibration/training text OVERLAPS" in (tmp_path / "run" / "report.md").read_text()


def test_kept_removed_split_and_figures_without_a_run(tmp_path):
    plan = PrunePlan([LayerPlan([1], [0, 2]), LayerPlan([0, 1], [1])], [2, 2], [3, 3])
    scores = {"attn": [[0.1, 5.0], [1.0, 2.0]], "mlp": [[3.0, 0.0, 4.0], [0.5, 6.0, 0.2]]}
    split = kept_removed_scores(scores, plan)
    assert split["attn"] == ([5.0, 1.0, 2.0], [0.1])
    assert split["mlp"] == ([3.0, 4.0, 6.0], [0.0, 0.5, 0.2])
    figs = write_figures({"unit_scores": scores, "layer_importance": {"cosine": [0.2, 0.4]}}, plan, tmp_path)
    assert set(figs) == {"kept_units", "importance_distribution", "layer_importance"}
    assert all((tmp_path / f).read_bytes()[:8] == PNG for f in figs.values())
    assert "# prunelight report" in render_markdown({"model": "m", "figures": figs})


def test_markdown_lists_layer_importance_beside_layer_shapes_and_notes():
    layers = [{"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64},
              {"num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 32}]
    md = render_markdown({"model": "m", "layers": layers, "notes": ["look here"],
                          "layer_importance": {"block_influence": [0.125, 0.5], "removal": [1.0]}})
    assert "| layer | attention heads | KV heads | MLP channels | block_influence |" in md
    assert "| 1 | 4 | 1 | 32 | 0.5000 |" in md
    assert "removal" not in md  # a measure that does not match the layer count (depth-pruned) is left out
    assert "Note: look here" in md


def test_summary_uses_the_suite_perplexity_when_the_callbacks_did_not_measure_it():
    rec = {"dataset": "wikitext2", "source": "test.txt", "split": None, "seq_len_requested": 128, "seq_len": 128,
           "tokens": 1000}
    ev = {m: {"perplexity": [{**rec, "ppl": p}]} for m, p in (("dense", 10.0), ("pruned", 12.5), ("recovered", 11.0))}
    md = render_markdown({"model": "m", "params_before": 100, "params_after": 80, "ppl": {}, "evaluation": ev,
                          "plan": {"params_removed": 20}})
    assert "| dense | 100 | 10.00 |" in md and "| pruned | 80 | 12.50 |" in md and "| recovered | 80 | 11.00 |" in md
    assert "Evaluation: wikitext2 `test.txt`, 128 tokens per window" in md
    # the callbacks' own numbers win when present
    md = render_markdown({"model": "m", "params_before": 100, "params_after": 80, "ppl": {"dense": 9.0},
                          "evaluation": ev, "plan": {"params_removed": 20}})
    assert "| dense | 100 | 9.00 |" in md
