"""Plans and scores that travel: plan.json / scores.pt written by every run; prune.plan and prune.scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prunelight import pipeline
from prunelight.allocation import allocate, precheck
from prunelight.saved import (
    PLAN_FILE,
    SCORES_FILE,
    calibration_identity,
    check_key,
    check_plan_fits,
    config_facts,
    key_digest,
    load_plan,
    load_scores,
    model_facts,
    plan_document,
    save_scores,
    scores_key,
    write_plan,
)
from prunelight.surgery import apply_plan
from prunelight.testing import make_tiny_checkpoint, settings_of, tiny_fit_args, tiny_model, write_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]


def _batches(n: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (4, 16), generator=g) for _ in range(n)]


def _scored(model, settings, tmp_path: Path):
    planned = pipeline.make_plan(model, _batches(), settings)
    plan, scores = planned.plan, planned.scores
    key = scores_key(model, settings, calibration_identity(settings=settings, source="random", num_samples=8))
    path = save_scores(tmp_path / SCORES_FILE, scores, key, layer_importance=plan.meta.get("layer_importance"),
                       block_importance=plan.meta.get("block_importance"), samples=plan.meta["samples"])
    return plan, scores, key, path


def _no_scoring(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a scoring pass ran")

    monkeypatch.setattr(pipeline, "run_calibration", boom)
    monkeypatch.setattr(pipeline, "layer_importances", boom)
    monkeypatch.setattr(pipeline, "subblock_removal", boom)


def test_scores_file_is_plain_and_loads_with_weights_only(tmp_path):
    model = tiny_model()
    settings = settings_of(0.2, criterion="wanda_sp", reconstruct="none")
    _, scores, key, path = _scored(model, settings, tmp_path)
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "prunelight.scores/1" and raw["key"] == key
    assert raw["provenance"]["prunelight_version"] and raw["provenance"]["samples"] == 8
    for kind in ("attn", "mlp"):
        assert all(torch.equal(a, b.float()) for a, b in zip(raw["unit_scores"][kind], scores[kind]))
    assert set(raw["layer_importance"]) == {"block_influence", "activation_change"}
    assert key["model"]["layers"] == [[4, 2, 96], [4, 2, 96]] and key["model"]["fingerprint"]
    assert key_digest(key) == key_digest(json.loads(json.dumps(key)))


@pytest.mark.parametrize("allocation", ["global", "layerwise", "uniform"])
def test_reallocation_from_saved_scores_runs_no_scoring_and_equals_in_memory(tmp_path, monkeypatch, allocation):
    model = tiny_model()
    _, scores, _, path = _scored(model, settings_of(0.2, allocation=allocation, reconstruct="none"), tmp_path)
    saved = load_scores(path)
    _no_scoring(monkeypatch)
    s3 = settings_of(0.3, allocation=allocation, reconstruct="none", scores=str(path))
    planned = pipeline.make_plan(model, [], s3, saved=saved)
    plan, got = planned.plan, planned.scores
    ref = allocate(precheck(model, s3), scores, s3,
                   layer_scores=saved.layer_importance["block_influence"] if allocation == "layerwise" else None)
    assert plan.to_dict()["layers"] == ref.to_dict()["layers"]
    assert plan.meta["scores_source"] == str(path) and plan.meta["removed_fraction_total"] >= 0.3
    assert got is saved.unit_scores


def test_stale_scores_are_refused_naming_the_field(tmp_path):
    model = tiny_model()
    settings = settings_of(0.2, reconstruct="none")
    _, _, key, path = _scored(model, settings, tmp_path)
    saved = load_scores(path)
    calib = calibration_identity(settings=settings, source="random", num_samples=8)
    check_key(saved.key, scores_key(model, settings, calib), str(path))  # the same run: accepted
    other = tiny_model(seed=1)  # same shapes, other weights
    with pytest.raises(ValueError, match="the weights differ"):
        check_key(saved.key, scores_key(other, settings, calib), str(path))
    with pytest.raises(ValueError, match=r"criterion is 'flap' in the file, 'wanda' here; set prune.criterion='flap'"):
        check_key(saved.key, scores_key(model, settings_of(0.2, criterion="wanda"), calib), str(path))
    with pytest.raises(ValueError, match=r"calibration.num_samples is 8 in the file, 16 here"):
        check_key(saved.key, scores_key(model, settings, {**calib, "num_samples": 16}), str(path))
    wide = tiny_model(intermediate_size=128)
    with pytest.raises(ValueError, match=r"layer 0 is 4 query heads / 2 KV heads / 128 MLP channels here"):
        check_key(saved.key, scores_key(wide, settings, calib), str(path))


def test_scores_without_the_needed_measure_are_refused(tmp_path):
    model = tiny_model()
    _, _, _, path = _scored(model, settings_of(0.2, reconstruct="none", report_layer_importance=[]), tmp_path)
    saved = load_scores(path)
    s = settings_of(0.2, allocation="depth", reconstruct="none")
    with pytest.raises(ValueError, match=r"has no layer importance 'block_influence' \(it has: none\), which "
                                         r"allocation depth needs"):
        pipeline.make_plan(model, [], s, saved=saved)
    s = settings_of(0.2, allocation="blockwise", block_importance="removal", reconstruct="none")
    with pytest.raises(ValueError, match="has no sub-block removal importance"):
        pipeline.make_plan(model, [], s, saved=saved)
    with pytest.raises(ValueError, match="prune.attn_mlp_split='auto' is not allowed: with prune.scores"):
        settings_of(0.2, attn_mlp_split="auto", scores=str(path))


def test_foreign_and_missing_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="prune.scores='nope.pt' does not exist"):
        load_scores("nope.pt")
    torch.save({"a": 1}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="is not a prunelight scores file"):
        load_scores(tmp_path / "x.pt")
    with pytest.raises(FileNotFoundError, match="prune.plan='nope.json' does not exist"):
        load_plan("nope.json")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no prune plan"):
        load_plan(tmp_path / "x.json")


# --- plans -------------------------------------------------------------------------------------
def _plan_of(model, ratio: float = 0.3):
    plan = pipeline.make_plan(model, _batches(), settings_of(ratio, criterion="magnitude", reconstruct="none")).plan
    return plan


def test_plan_from_one_checkpoint_cuts_a_sibling_like_the_in_memory_plan(tmp_path):
    a, b = tiny_model(seed=0), tiny_model(seed=1)  # the sibling: same shapes, other weights
    plan = _plan_of(a)
    before = sum(p.numel() for p in a.parameters())
    write_plan(tmp_path / PLAN_FILE, plan_document(plan, a, before, before - plan.meta["params_removed"]))
    loaded, applies_to = load_plan(tmp_path / PLAN_FILE)
    assert applies_to == model_facts(a)
    check_plan_fits(loaded, applies_to, model_facts(b), "plan.json")
    b_mem = tiny_model(seed=1)
    shapes_file = apply_plan(b, loaded)
    shapes_mem = apply_plan(b_mem, plan)
    assert shapes_file == shapes_mem and shapes_file != [s for s in model_facts(a)["layers"]]
    x = _batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(b(x).logits, b_mem(x).logits)


def test_mismatched_plan_is_refused_naming_the_layer(tmp_path):
    plan = _plan_of(tiny_model(num_attention_heads=8, num_key_value_heads=4, head_dim=8))
    doc = plan_document(plan, tiny_model(num_attention_heads=8, num_key_value_heads=4, head_dim=8), 1, 1)
    write_plan(tmp_path / "p.json", doc)
    loaded, applies_to = load_plan(tmp_path / "p.json")
    with pytest.raises(ValueError, match=r"prune.plan=p.json does not fit the model: its head_dim is 16, the plan "
                                         r"was made for 8"):
        check_plan_fits(loaded, applies_to, model_facts(tiny_model()), "p.json")
    facts = model_facts(tiny_model(num_attention_heads=8, num_key_value_heads=4, head_dim=8))
    facts["layers"][1] = [4, 2, 96]
    with pytest.raises(ValueError, match=r"layer 1 has 4 query heads / 2 KV heads, the plan was made for 8 / 4"):
        check_plan_fits(loaded, applies_to, facts, "p.json")
    with pytest.raises(ValueError, match=r"it has 3 layers, the plan was made for 2"):
        check_plan_fits(loaded, None, config_facts(tiny_model(num_hidden_layers=3).config), "p.json")
    with pytest.raises(ValueError, match="the model is qwen2, the plan was made for llama"):
        check_plan_fits(loaded, applies_to, config_facts(tiny_model("qwen2").config), "p.json")


def test_plan_reads_from_report_and_checkpoint(tmp_path):
    plan = _plan_of(tiny_model())
    report = {"prune_plan": {k: v for k, v in plan.to_dict().items() if k != "meta"}, "plan": plan.meta}
    (tmp_path / "report.json").write_text(json.dumps(report, default=str))
    torch.save({"state_dict": {}, "prunelight": {"plan": json.loads(json.dumps(plan.to_dict()))}},
               tmp_path / "last.ckpt")
    for name in ("report.json", "last.ckpt"):
        loaded, applies_to = load_plan(tmp_path / name)
        assert loaded.to_dict()["layers"] == plan.to_dict()["layers"]
        assert applies_to == model_facts(tiny_model())
    torch.save({"state_dict": {}, "prunelight": {"plan": None}}, tmp_path / "dense.ckpt")
    with pytest.raises(ValueError, match="holds no prune plan"):
        load_plan(tmp_path / "dense.ckpt")


def test_plan_with_scores_or_a_target_is_refused():
    with pytest.raises(ValueError, match="prune.scores='s.pt' is not allowed: prune.plan is set too"):
        settings_of(0.2, plan="p.json", scores="s.pt")
    with pytest.raises(ValueError, match="prune.target_params='1M' is not allowed: prune.plan is set"):
        settings_of(0.2, plan="p.json", target_params="1M")


# --- the command line --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planio")
    ckpt = make_tiny_checkpoint(tmp / "tiny", "llama")
    files = write_tiny_corpus(tmp / "data")
    args = tiny_fit_args(ckpt, files, "--model.recovery=none", "--trainer.enable_progress_bar=false",
                         "--export.figures=false")
    return tmp, args


def test_cli_writes_plan_and_scores_then_reallocates_and_reapplies_without_scoring(tiny_run, tmp_path, monkeypatch,
                                                                                   caplog):
    from prunelight.cli import cli_main

    _, args = tiny_run
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="prunelight")
    cli_main(args + ["--export.out_dir=runs/a"])
    out = tmp_path / "runs" / "a"
    doc = json.loads((out / PLAN_FILE).read_text())
    assert doc["applies_to"]["layers"] == [[4, 2, 96], [4, 2, 96]] and doc["criterion"] == "flap"
    assert doc["params_after"] < doc["params_before"]
    assert load_scores(out / SCORES_FILE).key["calibration"]["num_samples"] == 8

    _no_scoring(monkeypatch)
    caplog.clear()
    cli_main(args + ["--export.out_dir=runs/b", f"--prune.scores={out / SCORES_FILE}", "--prune.ratio=0.3"])
    assert f"no scoring pass: unit scores from {out / SCORES_FILE}" in caplog.text
    report = json.loads((tmp_path / "runs" / "b" / "report.json").read_text())
    assert report["plan"]["removed_fraction_total"] >= 0.3 and report["calibration"]["scores_source"]

    caplog.clear()
    cli_main(args + ["--export.out_dir=runs/c", f"--prune.plan={out / 'report.json'}", "--prune.ratio=0.5"])
    assert f"no scoring pass: plan from {out / 'report.json'}" in caplog.text
    report_c = json.loads((tmp_path / "runs" / "c" / "report.json").read_text())
    report_a = json.loads((out / "report.json").read_text())
    assert report_c["layers"] == report_a["layers"] and report_c["prune_plan"] == report_a["prune_plan"]
    assert report_c["calibration"]["plan_source"] == str(out / "report.json")
    assert not (tmp_path / "runs" / "c" / SCORES_FILE).exists()


def test_cli_plan_from_a_lightning_checkpoint(tiny_run, tmp_path, monkeypatch):
    from prunelight.cli import cli_main

    _, args = tiny_run
    monkeypatch.chdir(tmp_path)
    lora = [a for a in args if a != "--model.recovery=none"] + ["--model.recovery=lora", "--trainer.max_steps=1"]
    cli_main(lora + ["--export.out_dir=runs/l"])
    ckpt = next((tmp_path / "runs" / "l").rglob("*.ckpt"))
    cli_main(args + ["--export.out_dir=runs/lp", f"--prune.plan={ckpt}"])
    a = json.loads((tmp_path / "runs" / "l" / "report.json").read_text())
    b = json.loads((tmp_path / "runs" / "lp" / "report.json").read_text())
    assert a["prune_plan"] == b["prune_plan"] and a["params_after"] == b["params_after"]


def test_cli_refuses_a_mismatched_plan_before_loading_weights(tiny_run, tmp_path, monkeypatch):
    from prunelight.cli import cli_main

    tmp, args = tiny_run
    plan = _plan_of(tiny_model(num_hidden_layers=3))
    write_plan(tmp_path / "p.json", plan_document(plan, tiny_model(num_hidden_layers=3), 1, 1))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"p.json does not fit the model: it has 2 layers, the plan was made for 3"):
        cli_main(args + ["--export.out_dir=runs/x", f"--prune.plan={tmp_path / 'p.json'}"])
    assert not (tmp_path / "runs" / "x" / "report.json").exists()


# --- the reference model (slow; skips without ../shared) ----------------------------------------
@pytest.mark.slow
def test_reference_plan_travels_to_a_sibling_and_scores_reallocate_at_30_percent(ref_model_dir, shared, tmp_path,
                                                                                 monkeypatch, caplog):
    """Prune-only on ref-llama-gqa; its plan cuts a perturbed sibling to the same shapes; scores re-allocate at 30%."""
    import shutil

    from transformers import AutoModelForCausalLM

    from prunelight.cli import cli_main

    sibling = tmp_path / "sibling"  # the same shapes, other weights (as after a few fine-tuning steps)
    model = AutoModelForCausalLM.from_pretrained(ref_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3 * p.std().clamp_min(1e-6))
    model.save_pretrained(sibling)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ref_model_dir / name, sibling / name)
    data = shared / "data" / "wikitext2"
    args = ["fit", "--config", str(ROOT / "configs" / "reference.yaml"), f"--model.pretrained={ref_model_dir}",
            f"--data.calibration.path={data / 'valid.txt'}", f"--data.eval.path={data / 'test.txt'}",
            f"--data.train.path={data / 'valid.txt'}", "--data.num_samples=32", "--data.max_eval_blocks=8",
            "--model.recovery=none", "--trainer.enable_progress_bar=false", "--export.figures=false",
            "--export.model=false", "--evaluation.max_eval_batches=1"]
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="prunelight")
    cli_main(args + ["--export.out_dir=runs/a"])
    a = tmp_path / "runs" / "a"
    report_a = json.loads((a / "report.json").read_text())

    cli_main(args + ["--export.out_dir=runs/b", f"--model.pretrained={sibling}", f"--prune.plan={a / PLAN_FILE}"])
    report_b = json.loads((tmp_path / "runs" / "b" / "report.json").read_text())
    assert report_b["layers"] == report_a["layers"] and report_b["params_after"] == report_a["params_after"]

    _no_scoring(monkeypatch)
    caplog.clear()
    cli_main(args + ["--export.out_dir=runs/c", f"--prune.scores={a / SCORES_FILE}", "--prune.ratio=0.3"])
    assert "no scoring pass: unit scores from" in caplog.text
    report_c = json.loads((tmp_path / "runs" / "c" / "report.json").read_text())
    assert 0.3 <= report_c["plan"]["removed_fraction_total"] < 0.31
    with pytest.raises(ValueError, match="the weights differ"):
        cli_main(args + ["--export.out_dir=runs/d", f"--model.pretrained={sibling}",
                         f"--prune.scores={a / SCORES_FILE}"])
