"""Text data: calibration samples, recovery training blocks and evaluation blocks from local files or the hub."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from prunelight.errors import PrunelightError

log = logging.getLogger(__name__)


# How rows become one token stream: (separator between rows, add the tokenizer's special tokens once).
STREAM_PROTOCOLS: dict[str, tuple[str, bool]] = {
    # rows joined by newlines, no special tokens: local files, calibration and training text
    "lines": ("\n", False),
    # WikiText-2 / PTB as LLM-Pruner, Wanda and GPTQ measure them: tokenizer("\n\n".join(rows)), i.e. the
    # tokenizer's BOS (when it adds one by default) once at the start of the whole stream
    "paper": ("\n\n", True),
    # C4 validation as Wanda and SparseGPT/GPTQ measure it: tokenizer(" ".join(rows))
    "paper_c4": (" ", True),
}
StreamProtocol = Literal["lines", "paper", "paper_c4"]

# Whether every calibration / training / evaluation window starts with BOS. auto: where the tokenizer adds BOS to
# a text by default (its `add_bos_token`: Llama-3, Gemma), i.e. where the family expects every input to start with
# it; models trained without one (SmolLM2, Qwen2, the reference models) see plain windows.
BOS_PER_WINDOW = ("auto", "always", "never")
BosPerWindow = Literal["auto", "always", "never"]


@dataclass
class TextSource:
    """Where text comes from: local `path` (file, folder or glob of .txt/.jsonl; `pkg://<package>/<path>` names
    text shipped inside an installed package, e.g. pkg://prunelight/texts/alice_calibration.txt) or a hub
    `dataset`."""

    path: str | None = None
    dataset: str | None = None
    name: str | None = None
    split: str = "train"
    text_field: str = "text"
    max_tokens: int | None = None  # stop reading once this many tokens are available
    data_files: str | None = None  # hub dataset file(s) to read instead of the whole dataset (e.g. one C4 shard)
    protocol: StreamProtocol = "lines"  # how rows become one token stream (STREAM_PROTOCOLS)

    def __post_init__(self) -> None:
        if self.protocol not in STREAM_PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r} is not allowed: use one of {', '.join(STREAM_PROTOCOLS)}")

    def describe(self) -> str:
        """Short human-readable identity for reports."""
        if self.path:
            return self.path
        return f"{self.dataset}{'/' + self.name if self.name else ''}:{self.split}"

    def files(self) -> list[Path]:
        """Resolved local files (sorted); a clear error when nothing matches."""
        if not self.path:
            return []
        from prunelight.sources import is_package_resource, resource_path

        packaged = is_package_resource(self.path)
        p = resource_path(self.path, "path") if packaged else Path(self.path).expanduser()
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix in (".txt", ".jsonl"))
        elif not packaged and any(c in self.path for c in "*?["):
            files = sorted(Path(f) for f in glob.glob(str(p)))
        else:
            files = [p] if p.exists() else []
        if not files:
            raise FileNotFoundError(f"{self.path!r} does not exist or holds no .txt/.jsonl files "
                                    "(a file, folder or glob was expected)")
        return files

    def lines(self) -> list[str]:
        """The text as a list of documents/lines."""
        if self.path:
            out: list[str] = []
            for f in self.files():
                if f.suffix == ".jsonl":
                    with open(f, encoding="utf-8") as fh:
                        out.extend(json.loads(line)[self.text_field] for line in fh if line.strip())
                else:
                    out.extend(f.read_text(encoding="utf-8").splitlines())
            return out
        if self.dataset:
            from datasets import load_dataset

            from prunelight.errors import hub_download

            kwargs = {"data_files": {self.split: self.data_files}} if self.data_files else {}
            with hub_download("dataset", self.dataset):
                ds = load_dataset(self.dataset, self.name, split=self.split, **kwargs)
            return list(ds[self.text_field])
        raise ValueError("a text source needs either `path` (local files) or `dataset` (hub id)")


def _special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds by default before and after a text (e.g. Llama's BOS; none for Qwen2)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


def window_prefix(tokenizer, bos_per_window: str = "auto") -> list[int]:
    """The ids every window starts with: the tokenizer's default BOS (auto), its BOS token (always), or none."""
    if bos_per_window not in BOS_PER_WINDOW:
        raise ValueError(f"data.bos_per_window={bos_per_window!r} is not allowed: "
                         f"use one of {', '.join(BOS_PER_WINDOW)}")
    if bos_per_window == "never":
        return []
    if bos_per_window == "always":
        if tokenizer.bos_token_id is None:
            raise ValueError("data.bos_per_window='always' is not allowed: the tokenizer has no BOS token")
        return [int(tokenizer.bos_token_id)]
    before, _ = _special_tokens(tokenizer)
    bos = tokenizer.bos_token_id
    return [int(bos)] if bos is not None and int(bos) in before else []


def tokenize_source(tokenizer, source: TextSource, chunk_lines: int = 2000) -> torch.Tensor:
    """One long stream of token ids, rows joined as `source.protocol` says (tokenized in chunks of rows)."""
    sep, special = STREAM_PROTOCOLS[source.protocol]
    before, after = _special_tokens(tokenizer) if special else ([], [])
    lines = source.lines()
    ids: list[int] = list(before)
    for start in range(0, len(lines), chunk_lines):
        text = sep.join(lines[start : start + chunk_lines])
        if start:
            text = sep + text
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if source.max_tokens and len(ids) >= source.max_tokens:
            break
    ids.extend(after)
    if source.max_tokens:
        ids = ids[: source.max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def overlap_fraction(a: list[str], b: list[str], min_chars: int = 40) -> tuple[float, int]:
    """Fraction (and count) of b's substantial lines that also occur in a; exact-match on stripped text."""
    def keys(lines):
        return {hashlib.sha1(s.encode()).hexdigest() for s in (x.strip() for x in lines) if len(s) >= min_chars}

    kb = keys(b)
    if not kb:
        return 0.0, 0
    shared = len(keys(a) & kb)
    return shared / len(kb), shared


class BlockDataset(Dataset):
    """Fixed-length blocks of a token stream."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.blocks[i]


class EpochShuffle(RandomSampler):
    """A fresh permutation each epoch, drawn from `seed` and the epoch number alone, so a resumed run replays it.

    A RandomSampler, so that under DDP Lightning swaps it for a DistributedSampler (itself seeded by epoch).
    """

    def __init__(self, data_source: Dataset, seed: int) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch (also after a resume, with the restored epoch)."""
        self.epoch = epoch

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=gen).tolist()


class ResumableLoader(DataLoader):
    """A DataLoader whose position in the epoch survives a checkpoint.

    Lightning's fit loop saves `state_dict()` of stateful training loaders in the checkpoint and calls
    `load_state_dict()` on resume; the next epoch's iterator then skips the batches already trained on.
    """

    _resume: dict | None = None
    _epoch = 0
    _yielded = 0

    def __iter__(self):
        # A generator: runs at the first batch, after Lightning's set_epoch on the sampler.
        epoch = int(getattr(self.sampler, "epoch", 0))
        skip = 0
        if self._resume is not None:
            skip = int(self._resume["batches"]) if int(self._resume["epoch"]) == epoch else 0
            self._resume = None
        self._epoch, self._yielded = epoch, skip
        it = super().__iter__()
        for _ in range(skip):  # blocks are in memory: skipping by loading is cheap and works with workers
            next(it)
        for batch in it:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict:
        """The epoch and how many of its batches were handed out."""
        return {"epoch": self._epoch, "batches": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position (applied by the next iterator)."""
        self._resume = dict(state)


def _with_prefix(blocks: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    if not prefix:
        return blocks
    head = torch.tensor(prefix, dtype=blocks.dtype).expand(blocks.shape[0], len(prefix))
    return torch.cat([head, blocks], dim=1)


def pack_blocks(ids: torch.Tensor, seq_len: int, prefix: list[int] | None = None) -> torch.Tensor:
    """Non-overlapping [n, seq_len] blocks, each starting with `prefix` (e.g. BOS); a short tail is dropped."""
    prefix = list(prefix or [])
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"a window of {seq_len} tokens has no room for text after its {len(prefix)} prefix token(s)")
    n = ids.numel() // body
    return _with_prefix(ids[: n * body].view(n, body), prefix)


def sample_windows(ids: torch.Tensor, num_samples: int, seq_len: int, seed: int,
                   prefix: list[int] | None = None) -> torch.Tensor:
    """`num_samples` random windows of `seq_len` tokens (each starting with `prefix`), reproducible under `seed`."""
    if ids.numel() < seq_len + 1:
        raise ValueError(f"the calibration text has {ids.numel()} tokens, fewer than data.seq_len={seq_len} + 1")
    prefix = list(prefix or [])
    body = seq_len - len(prefix)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (num_samples,), generator=gen)
    return _with_prefix(torch.stack([ids[s : s + body] for s in starts.tolist()]), prefix)


def effective_calibration_batch_size(calibration_batch_size: int | None, batch_size: int) -> int:
    """The calibration batch size a run scores with: data.calibration_batch_size, or data.batch_size when null."""
    return calibration_batch_size or batch_size


class PruneDataModule(L.LightningDataModule):
    """Calibration, recovery-training and evaluation data for one prune-and-recover run."""

    def __init__(
        self,
        calibration: TextSource,
        eval: TextSource,
        train: TextSource | None = None,
        tokenizer: str | None = None,
        num_samples: int = 128,
        seq_len: int = 128,
        eval_seq_len: int | None = None,
        batch_size: int = 8,
        calibration_batch_size: int | None = None,
        eval_batch_size: int | None = None,
        max_eval_blocks: int | None = None,
        seed: int = 0,
        allow_overlap: bool = False,
        num_workers: int = 0,
        bos_per_window: BosPerWindow = "auto",
    ) -> None:
        super().__init__()
        if bos_per_window not in BOS_PER_WINDOW:
            raise ValueError(f"data.bos_per_window={bos_per_window!r} is not allowed: use one of "
                             f"{', '.join(BOS_PER_WINDOW)}")
        self.bos_per_window = bos_per_window
        self.prefix: list[int] = []  # the ids every window starts with, known once the tokenizer is loaded
        if num_samples <= 0:
            raise ValueError(f"data.num_samples={num_samples} is not allowed: must be an integer >= 1")
        if seq_len <= 1:
            raise ValueError(f"data.seq_len={seq_len} is not allowed: must be an integer >= 2")
        self.calibration, self.eval, self.train = calibration, eval, train
        self.tokenizer_path = tokenizer
        self.tokenizer = None
        self.num_samples, self.seq_len = num_samples, seq_len
        self.eval_seq_len = eval_seq_len or seq_len
        self.batch_size = batch_size
        self.calibration_batch_size = effective_calibration_batch_size(calibration_batch_size, batch_size)
        self.eval_batch_size = eval_batch_size or batch_size
        self.max_eval_blocks = max_eval_blocks
        self.seed, self.allow_overlap, self.num_workers = seed, allow_overlap, num_workers
        self.calib_blocks = self.train_blocks = self.eval_blocks = None
        self.overlap: dict = {}

    # --- preparation ------------------------------------------------------------------------
    def set_tokenizer(self, tokenizer) -> None:
        """Use an already-loaded tokenizer (tests, or the module's own)."""
        self.tokenizer = tokenizer

    def _load_tokenizer(self):
        if self.tokenizer is None:
            if not self.tokenizer_path:
                raise ValueError("PruneDataModule needs `tokenizer` (a hub id or local folder)")
            from prunelight import sources

            # A folder, hub id, GGUF file or pkg:// value, resolved as model.pretrained is.
            self.tokenizer = sources.load_tokenizer(sources.resolve_pretrained(self.tokenizer_path,
                                                                               option="data.tokenizer"),
                                                    "data.tokenizer")
        return self.tokenizer

    def check_context(self, max_positions: int | None) -> None:
        """Refuse sequence lengths beyond the model's context window."""
        for name, n in (("seq_len", self.seq_len), ("eval_seq_len", self.eval_seq_len)):
            if max_positions and n > max_positions:
                raise ValueError(f"data.{name}={n} exceeds the model's context (max_position_embeddings="
                                 f"{max_positions}); use at most {max_positions}")

    def sources(self) -> dict[str, TextSource]:
        """The text sources by option name (train may be absent)."""
        return {k: v for k, v in (("calibration", self.calibration), ("eval", self.eval), ("train", self.train))
                if v is not None}

    def check_sources(self) -> None:
        """Local files must exist and hold text, checked before any tokenizing."""
        for name, src in self.sources().items():
            if not src.path:
                continue
            try:
                files = src.files()
            except FileNotFoundError as err:
                raise FileNotFoundError(f"data.{name}.path={err}") from None
            except PrunelightError as err:  # a pkg:// path: the message already starts with "path=..."
                raise PrunelightError(f"data.{name}.{err}") from None
            if not any(f.stat().st_size for f in files):
                raise ValueError(f"data.{name}.path={src.path!r} is empty: it needs text")

    def _check_overlap(self) -> None:
        same = {s.describe() for s in (self.calibration, self.train) if s is not None} & {self.eval.describe()}
        frac_c, n_c = overlap_fraction(self.calibration.lines(), self.eval.lines())
        frac_t, n_t = overlap_fraction(self.train.lines(), self.eval.lines()) if self.train else (0.0, 0)
        self.overlap = {
            "calibration_eval_shared_lines": n_c,
            "calibration_eval_fraction": frac_c,
            "train_eval_shared_lines": n_t,
            "train_eval_fraction": frac_t,
            "same_source": sorted(same),
        }
        bad = bool(same) or frac_c > 0.01 or frac_t > 0.01
        self.overlap.update(flagged=bad, allowed=self.allow_overlap)  # the report shows a banner when flagged
        if bad and not self.allow_overlap:
            raise ValueError(
                "calibration/training text overlaps the evaluation text "
                f"(same source: {sorted(same) or 'no'}; {n_c} calibration and {n_t} training lines also in eval): "
                "perplexity would be optimistic. Use a different split, or set data.allow_overlap=true to proceed anyway"
            )
        if bad:
            log.warning("OVERLAP between calibration/training and evaluation text: %s", self.overlap)

    def setup(self, stage: str | None = None) -> None:
        """Tokenize and block all splits (once)."""
        if self.eval_blocks is not None:
            return
        tok = self._load_tokenizer()
        self._check_overlap()
        self.prefix = window_prefix(tok, self.bos_per_window)
        calib_ids = tokenize_source(tok, self.calibration)
        if calib_ids.numel() <= self.seq_len:
            raise ValueError(f"data.calibration ({self.calibration.describe()}) has {calib_ids.numel()} tokens, "
                             f"fewer than data.seq_len={self.seq_len} + 1; give more text or a shorter seq_len")
        self.calib_blocks = sample_windows(calib_ids, self.num_samples, self.seq_len, self.seed, self.prefix)
        self.eval_blocks = pack_blocks(tokenize_source(tok, self.eval), self.eval_seq_len, self.prefix)
        if self.max_eval_blocks:
            self.eval_blocks = self.eval_blocks[: self.max_eval_blocks]
        if len(self.eval_blocks) == 0:
            raise ValueError(f"evaluation text {self.eval.describe()} is shorter than eval_seq_len={self.eval_seq_len}")
        train_ids = tokenize_source(tok, self.train) if self.train else calib_ids
        self.train_blocks = pack_blocks(train_ids, self.seq_len, self.prefix)

    def window_protocol(self) -> dict:
        """How windows were made, for the report: BOS per window or not, and the token each starts with."""
        return {"bos_per_window": self.bos_per_window, "window_prefix": list(self.prefix)}

    # --- loaders ----------------------------------------------------------------------------
    def calibration_batches(self, rank: int = 0, world_size: int = 1) -> list[torch.Tensor]:
        """This rank's share of the calibration samples (every world_size-th), in fixed-size batches.

        Statistics are sums over samples, so the shares of all ranks add up to the one-process result.
        """
        mine = self.calib_blocks[rank::world_size]
        return list(torch.split(mine, self.calibration_batch_size))

    def train_dataloader(self) -> DataLoader:
        """Shuffled training blocks; the order and the position in it are restored on resume."""
        data = BlockDataset(self.train_blocks)
        # The generator only seeds DataLoader workers, so creating iterators never draws from the global RNG.
        return ResumableLoader(data, batch_size=self.batch_size, sampler=EpochShuffle(data, self.seed),
                               generator=torch.Generator().manual_seed(self.seed), num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.eval_blocks, self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def eval_dataloader(self) -> DataLoader:
        """All evaluation blocks on this process (evaluation outside Lightning's loops)."""
        return DataLoader(BlockDataset(self.eval_blocks), batch_size=self.eval_batch_size, shuffle=False)

    def _loader(self, blocks: torch.Tensor, batch_size: int, shuffle: bool) -> DataLoader:
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            BlockDataset(blocks), batch_size=batch_size, shuffle=shuffle, generator=gen, num_workers=self.num_workers
        )
