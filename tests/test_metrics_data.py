"""Perplexity metric, data preparation and the calibration/evaluation overlap guard."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from prunelight.data import PruneDataModule, TextSource, pack_blocks, sample_windows
from prunelight.metrics import TokenPerplexity
from prunelight.testing import tiny_tokenizer, write_tiny_corpus


def test_perplexity_matches_manual_sum_with_ignored_and_underflowing_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 50, generator=gen) * 3
    logits[0, 2, 7] = -120.0  # softmax underflows to exactly 0 in fp32 for this token
    labels = torch.randint(0, 50, (3, 6), generator=gen)
    labels[0, 3] = 7
    labels[1, 4:] = -100  # padding
    metric = TokenPerplexity()
    metric.update(logits[:2], labels[:2])
    metric.update(logits[2:], labels[2:])
    nll, n = 0.0, 0
    for b in range(3):
        for t in range(5):
            y = int(labels[b, t + 1])
            if y == -100:
                continue
            nll += -float(F.log_softmax(logits[b, t].double(), -1)[y])
            n += 1
    assert int(metric.n_tokens) == n == 13
    assert float(torch.softmax(logits[0, 2], -1)[7]) == 0.0, "the underflow case must really underflow"
    assert math.isfinite(float(metric.compute()))
    assert float(metric.compute()) == pytest.approx(math.exp(nll / n), rel=1e-5)


def test_pack_and_sample_are_reproducible():
    ids = torch.arange(1000)
    blocks = pack_blocks(ids, 64)
    assert blocks.shape == (15, 64) and int(blocks[1, 0]) == 64
    a, b = sample_windows(ids, 8, 32, seed=3), sample_windows(ids, 8, 32, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, sample_windows(ids, 8, 32, seed=4))
    assert all(int(w[-1] - w[0]) == 31 for w in a)


def _dm(tmp_path, **kw):
    files = write_tiny_corpus(tmp_path)
    dm = PruneDataModule(
        calibration=TextSource(path=str(files["valid"])),
        eval=TextSource(path=str(files["test"])),
        train=TextSource(path=str(files["train"])),
        num_samples=6,
        seq_len=16,
        batch_size=4,
        calibration_batch_size=4,
        **kw,
    )
    dm.set_tokenizer(tiny_tokenizer())
    return dm, files


def test_datamodule_splits(tmp_path):
    dm, _ = _dm(tmp_path)
    dm.setup("fit")
    assert dm.calib_blocks.shape == (6, 16)
    assert sum(b.shape[0] for b in dm.calibration_batches()) == 6
    shares = [dm.calibration_batches(r, 2) for r in range(2)]
    assert sorted(torch.cat([torch.cat(s) for s in shares]).tolist()) == sorted(dm.calib_blocks.tolist())
    assert sum(b.shape[0] for s in shares for b in s) == 6
    assert next(iter(dm.train_dataloader())).shape == (4, 16)


def test_overlap_refused_unless_allowed(tmp_path):
    dm, files = _dm(tmp_path)
    dm.eval = TextSource(path=str(files["valid"]))  # evaluating on the calibration text
    with pytest.raises(ValueError, match="overlaps the evaluation text"):
        dm.setup("fit")
    dm2, files2 = _dm(tmp_path / "b", allow_overlap=True)
    dm2.eval = TextSource(path=str(files2["valid"]))
    dm2.setup("fit")
    assert dm2.overlap["calibration_eval_fraction"] == 1.0


def test_missing_files_and_long_seq(tmp_path):
    dm, _ = _dm(tmp_path)
    dm.calibration = TextSource(path=str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        dm.setup("fit")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        _dm(tmp_path / "c", eval_seq_len=4096)[0].check_context(256)
