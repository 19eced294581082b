"""Data-parallel scoring: two CPU processes (DDP over gloo) give the one-process statistics, plan and weights.

The workers run the real command line under torchrun (`python -m torch.distributed.run ... -m
prunelight fit --config X.yaml --trainer.devices 2 --trainer.strategy ddp`), which is what a user's
multi-GPU or multi-node job does; each rank writes what it holds through `dist_probe.RankProbe`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from dist_probe import free_port

from prunelight.pipeline import make_plan
from prunelight.settings import PruneSettings
from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

# One group under `pytest -n`: the module-scoped torchrun jobs then run once, on one worker.
pytestmark = pytest.mark.xdist_group("distributed")

REPO = Path(__file__).resolve().parents[1]
RATIO, SAMPLES, CAL_BATCH = 0.3, 12, 4


def _job(tmp: Path) -> Path:
    model = make_tiny_checkpoint(tmp / "model")
    text = write_tiny_corpus(tmp / "text")
    cfg = {
        "seed_everything": 0,
        "model": {"pretrained": str(model), "dtype": "float32", "recovery": "lora", "learning_rate": 1e-2},
        "data": {
            "calibration": {"path": str(text["valid"])},
            "eval": {"path": str(text["test"])},
            "train": {"path": str(text["train"])},
            "num_samples": SAMPLES,
            "seq_len": 32,
            "batch_size": 2,
            "calibration_batch_size": CAL_BATCH,
        },
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 2,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [{"class_path": "dist_probe.RankProbe", "init_args": {"out_dir": str(tmp)}}],
        },
        # The plain cut, so rank weights compare bit for bit with make_plan + apply_plan in one process; the
        # least-squares statistics summed over ranks are tested in test_reconstruct.py.
        # No generations: the search's early stages score each rank's own first sequences, so under DDP they see
        # other sequences than one process does and may step elsewhere (ranks still agree: test_search.py sums
        # over ranks); the seeds are ranked on every sequence either way.
        "prune": {"ratio": RATIO, "reconstruct": "none", "allocation_args": {"generations": 0}},
        # evaluation runs on rank 0 only while rank 1 waits at a barrier: this must not hang
        "evaluation": {"data_eval": False, "suite": {
            "ppl_datasets": {"test": {"path": str(text["test"])}}, "seq_lens": [16],
            "max_windows": 4, "zeroshot": False, "efficiency": False, "similarity_batches": 1}},
        "export": {"out_dir": str(tmp / "run"), "figures": False},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Run the 2-process job once; return (folder, per-rank results)."""
    tmp = tmp_path_factory.mktemp("ddp")
    cfg = _job(tmp)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "prunelight", "fit", "--config", str(cfg), "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def one_process(ddp_run):
    """The same samples scored, allocated and cut in this one process."""
    from prunelight.data import PruneDataModule, TextSource
    from prunelight.module import PruneLM

    tmp, _ = ddp_run
    cfg = yaml.safe_load((tmp / "job.yaml").read_text())
    d = cfg["data"]
    dm = PruneDataModule(TextSource(**d["calibration"]), TextSource(**d["eval"]), TextSource(**d["train"]),
                         tokenizer=str(tmp / "model"), num_samples=SAMPLES, seq_len=d["seq_len"],
                         calibration_batch_size=CAL_BATCH)
    dm.setup("fit")
    lm = PruneLM(pretrained=str(tmp / "model"), dtype="float32")
    lm.configure_model()
    planned = make_plan(lm.base_model, dm.calibration_batches(0, 1), PruneSettings(
        ratio=RATIO, allocation_args=cfg["prune"]["allocation_args"]))
    plan, scores = planned.plan, planned.scores
    lm.apply_plan(plan)
    return plan, scores, lm.base_model.state_dict()


def test_both_ranks_ran_ddp(ddp_run):
    _, ranks = ddp_run
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["strategy"] == "DDPStrategy" for r in ranks)


def test_statistics_equal_one_process(ddp_run, one_process):
    _, ranks = ddp_run
    _, scores, _ = one_process
    for r in ranks:
        for kind in ("attn", "mlp"):
            for got, want in zip(r["unit_scores"][kind], scores[kind]):
                torch.testing.assert_close(torch.tensor(got), want.cpu(), rtol=1e-5, atol=1e-7)
    # The shares were really different: one rank alone would not give the sum.
    assert ranks[0]["plan"]["meta"]["samples"] == SAMPLES


def test_plan_equals_one_process(ddp_run, one_process):
    _, ranks = ddp_run
    plan, _, _ = one_process
    assert not plan.is_identity()
    for r in ranks:
        assert r["plan"]["layers"] == plan.to_dict()["layers"]
        assert r["plan"]["meta"]["params_removed"] == plan.meta["params_removed"]


def test_ranks_hold_identical_pruned_weights(ddp_run, one_process):
    _, ranks = ddp_run
    _, _, weights = one_process
    a, b = ranks[0]["after_cut"], ranks[1]["after_cut"]
    assert a.keys() == b.keys() == weights.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert torch.equal(a[k], weights[k]), k


def test_recovery_stays_in_sync_after_rewrap(ddp_run):
    # Each rank trains on different batches; equal weights after the steps mean the cut (LoRA-wrapped)
    # model was re-wrapped for DDP and its gradients were averaged across ranks.
    _, ranks = ddp_run
    a, b = ranks[0]["final"], ranks[1]["final"]
    lora_b = [k for k in a if "lora_B" in k]
    assert lora_b and ranks[0]["steps"] == 2
    assert any(a[k].abs().sum() > 0 for k in lora_b), "LoRA did not train: the sync check would be vacuous"
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_rank_zero_evaluates_and_exports_once(ddp_run):
    import json

    from transformers import AutoModelForCausalLM

    tmp, results = ddp_run
    report = json.loads((tmp / "run" / "report.json").read_text())
    assert set(report["evaluation"]) >= {"dense", "pruned", "recovered"}
    assert report["params_after"] < report["params_before"]
    exported = AutoModelForCausalLM.from_pretrained(tmp / "run" / "model").state_dict()
    # The export is rank 0's trained model with LoRA merged by hand: W + (alpha / r) * B @ A.
    final = {k.removeprefix("base_model.model."): v for k, v in results[0]["final"].items()}
    lora = report["recovery"]["lora"]
    scale = lora["alpha"] / lora["r"]
    merged = 0
    for name, value in exported.items():
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_A.default.weight" in final:
            expect = final[f"{stem}.base_layer.weight"] + scale * (
                final[f"{stem}.lora_B.default.weight"] @ final[f"{stem}.lora_A.default.weight"])
            merged += 1
        else:
            expect = final[name.replace(".weight", ".base_layer.weight")] if name not in final else final[name]
        torch.testing.assert_close(value, expect, rtol=1e-5, atol=1e-6)
    assert merged > 0


def test_search_allocation_under_ddp_gives_every_rank_the_same_plan(tmp_path):
    """`allocation: search` under DDP: each rank scores its own sequences, the Grams and KL are summed over ranks,
    so both ranks build the same database (of every rank's tokens), take the same steps and cut the same units."""
    cfg = _job(tmp_path)
    args = '{"generations": 2, "offspring": 3, "stages": [2, 4], "survivors": [3, 1], "mlp_levels": 8}'
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "prunelight", "fit", "--config", str(cfg), "--trainer.devices", "2", "--trainer.strategy", "ddp",
           "--prune.allocation", "search", "--prune.allocation_args", args, "--trainer.max_steps", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    plans = [r["plan"] for r in ranks]
    assert plans[0]["layers"] == plans[1]["layers"]
    assert plans[0]["meta"]["search"]["kl"] == plans[1]["meta"]["search"]["kl"]
    assert plans[0]["meta"]["allocation"] == "search" and plans[0]["meta"]["budget_error_params"] >= 0
    db = torch.load(tmp_path / "run" / "levels_obs.pt", weights_only=False)
    assert db["tokens"] == SAMPLES * 32  # both ranks' calibration windows, not one rank's half
