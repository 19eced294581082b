"""Exact resume: a run killed after a checkpoint and resumed with --ckpt_path ends with the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from prunelight.data import EpochShuffle, ResumableLoader
from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_loader_resumes_mid_epoch_and_replays_epochs():
    data = torch.arange(10)
    loader = ResumableLoader(data, batch_size=3, sampler=EpochShuffle(data, seed=0))
    loader.sampler.set_epoch(2)
    full = [b.tolist() for b in loader]
    assert sorted(sum(full, [])) == list(range(10))
    loader.sampler.set_epoch(0)
    assert [b.tolist() for b in loader] != full, "each epoch has its own order"

    it = iter(loader)
    loader.sampler.set_epoch(2)
    first = [next(it).tolist(), next(it).tolist()]
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches": 2} and first == full[:2]

    fresh = ResumableLoader(data, batch_size=3, sampler=EpochShuffle(data, seed=0))
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(2)
    assert [b.tolist() for b in fresh] == full[2:], "the resumed epoch continues where the checkpoint was"
    fresh.sampler.set_epoch(3)
    assert len(list(fresh)) == 4, "the next epoch starts at its beginning"


def _args(tiny: Path, files: dict, out: Path, max_steps: int) -> list[str]:
    return [
        sys.executable, "-m", "prunelight", "fit", "--config", str(ROOT / "configs" / "reference.yaml"),
        f"--model.pretrained={tiny}", "--model.attn_implementation=eager",  # LoRA dropout 0.05 stays on
        f"--data.calibration.path={files['valid']}", f"--data.eval.path={files['test']}",
        f"--data.train.path={files['train']}", "--data.train.max_tokens=320",  # 20 blocks: 5 batches an epoch
        "--data.seq_len=16", "--data.num_samples=8", "--data.batch_size=4", "--prune.reconstruct=none",
        f"--trainer.max_steps={max_steps}", "--trainer.limit_val_batches=2", "--trainer.val_check_interval=2",
        "--trainer.check_val_every_n_epoch=null", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={out / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks.save_top_k=-1", f"--export.out_dir={out}",
    ]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_killed_and_resumed_run_ends_with_the_uninterrupted_weights(tmp_path):
    tiny = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    files = write_tiny_corpus(tmp_path / "data")
    steps = 9  # the resume at step 4 finishes epoch 0 (5 batches) and runs into epoch 1

    killed = subprocess.Popen(_args(tiny, files, tmp_path / "killed", steps), env=_env(), cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = tmp_path / "killed" / "ckpt" / "epoch=0-step=4.ckpt"
    deadline = time.monotonic() + 240
    while not ckpt.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)  # no-op if it already finished: the checkpoint is what matters
    killed.wait()
    assert ckpt.exists(), killed.stderr.read().decode()[-3000:]

    resumed = subprocess.run(_args(tiny, files, tmp_path / "resumed", steps) + [f"--ckpt_path={ckpt}"],
                             env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = subprocess.run(_args(tiny, files, tmp_path / "straight", steps), env=_env(), cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run in {differ[:5]}"
    # the comparison is between trained models: the adapters moved before the checkpoint, and both ran 9 steps
    start = torch.load(ckpt, weights_only=False)
    assert start["global_step"] == 4
    assert any(v.abs().sum() > 0 for k, v in start["state_dict"].items() if "lora_B" in k)
    for run in ("straight", "resumed"):
        report = json.loads((tmp_path / run / "report.json").read_text())
        assert report["recovery"]["steps"] == steps
