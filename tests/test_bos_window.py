"""Every calibration, training and evaluation window starts with BOS where the tokenizer adds one by default."""

from __future__ import annotations

import pytest
import torch

from prunelight.data import PruneDataModule, TextSource, pack_blocks, sample_windows, window_prefix
from prunelight.testing import tiny_tokenizer, write_tiny_corpus


class _BosTokenizer:
    """A tokenizer that adds BOS by default (as Llama-3 and Gemma tokenizers do), wrapping the tiny one."""

    def __init__(self) -> None:
        self.inner = tiny_tokenizer()
        self.bos_token_id = self.inner.bos_token_id

    def __call__(self, text, add_special_tokens=True):
        ids = self.inner(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


def test_window_prefix_follows_the_tokenizer():
    plain, bos = tiny_tokenizer(), _BosTokenizer()
    assert window_prefix(plain, "auto") == []  # adds no BOS by default (as SmolLM2, Qwen2)
    assert window_prefix(bos, "auto") == [bos.bos_token_id]
    assert window_prefix(bos, "never") == []
    assert window_prefix(plain, "always") == [plain.bos_token_id]
    with pytest.raises(ValueError, match="bos_per_window"):
        window_prefix(plain, "sometimes")


def test_prefixed_windows_keep_their_length_and_cover_the_text_once():
    ids = torch.arange(10, 1010)
    blocks = pack_blocks(ids, 64, [1])
    assert blocks.shape == (1000 // 63, 64) and (blocks[:, 0] == 1).all()
    assert torch.equal(blocks[:, 1:].reshape(-1), ids[: blocks.shape[0] * 63])
    wins = sample_windows(ids, 8, 32, seed=3, prefix=[1])
    assert wins.shape == (8, 32) and (wins[:, 0] == 1).all()
    assert torch.equal(sample_windows(ids, 8, 32, seed=3), sample_windows(ids, 8, 32, seed=3, prefix=[]))


@pytest.mark.parametrize("tokenizer, first", [("plain", None), ("bos", "bos")])
def test_datamodule_windows(tmp_path, tokenizer, first):
    files = write_tiny_corpus(tmp_path)
    dm = PruneDataModule(calibration=TextSource(path=str(files["valid"])), eval=TextSource(path=str(files["test"])),
                         train=TextSource(path=str(files["train"])), num_samples=6, seq_len=16, batch_size=4)
    tok = tiny_tokenizer() if tokenizer == "plain" else _BosTokenizer()
    dm.set_tokenizer(tok)
    dm.setup("fit")
    bos = tok.bos_token_id
    for blocks in (dm.calib_blocks, dm.eval_blocks, dm.train_blocks):
        assert blocks.shape[1] == 16
        starts = set(blocks[:, 0].tolist())
        assert starts == {bos} if first else len(starts) > 1
    assert dm.window_protocol() == {"bos_per_window": "auto", "window_prefix": [bos] if first else []}


def test_bad_bos_setting_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bos_per_window"):
        PruneDataModule(calibration=TextSource(path="x"), eval=TextSource(path="y"), bos_per_window="yes")
