"""Perplexity: token-weighted, fp32 loss, non-overlapping windows, on several datasets and lengths.

Each result records what was measured (dataset, split, requested and used window length, windows
and scored tokens), so numbers from different runs can be compared honestly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from prunelight.data import TextSource, pack_blocks, tokenize_source
from prunelight.metrics import TokenPerplexity

# Hub defaults (the usual pruning-paper sets), tokenized as the papers' code does (protocol "paper": rows
# joined by blank lines, the tokenizer's BOS once; C4 rows joined by spaces). Local files are given as
# TextSource(path=...) and keep protocol "lines" unless told otherwise.
HUB_SETS: dict[str, TextSource] = {
    "wikitext2": TextSource(dataset="Salesforce/wikitext", name="wikitext-2-raw-v1", split="test", text_field="text",
                            protocol="paper"),
    "ptb": TextSource(dataset="ptb-text-only/ptb_text_only", name="penn_treebank", split="test", text_field="sentence",
                      protocol="paper"),
    # The first validation shard only (as SparseGPT/Wanda do), not the whole multi-terabyte dataset.
    "c4": TextSource(dataset="allenai/c4", split="validation", text_field="text", max_tokens=256 * 2048,
                     data_files="en/c4-validation.00000-of-00008.json.gz", protocol="paper_c4"),
}


def _batch_parts(batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """input_ids, attention_mask and labels (padding and -100 positions are not scored)."""
    if isinstance(batch, torch.Tensor):
        return batch, None, batch
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    labels = batch.get("labels", ids).clone()
    if mask is not None:
        labels[mask == 0] = -100
    return ids, mask, labels


@torch.no_grad()
def evaluate_perplexity(model: nn.Module, batches: Iterable, max_batches: int | None = None) -> dict:
    """Token-weighted perplexity, NLL and token count over batches of input_ids (or dicts with masks/labels)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    metric = TokenPerplexity(sync_on_compute=False).to(device)  # one process evaluates alone: no collective
    try:
        for b, batch in enumerate(batches):
            if max_batches is not None and b >= max_batches:
                break
            ids, mask, labels = _batch_parts(batch)
            kwargs = {"attention_mask": mask.to(device)} if mask is not None else {}
            logits = model(input_ids=ids.to(device), use_cache=False, **kwargs).logits
            metric.update(logits, labels.to(device))
    finally:
        model.train(was_training)
    n = int(metric.n_tokens.item())
    if n == 0:
        raise ValueError("perplexity needs at least one scored token; the evaluation data is empty")
    return {"ppl": float(metric.compute().item()), "nll": float(metric.nll_sum.item() / n), "tokens": n}


@dataclass
class PerplexityData:
    """Token streams of the evaluation texts, tokenized once and shared by every model evaluated."""

    streams: dict[str, torch.Tensor]
    sources: dict[str, TextSource]
    seq_lens: list[int]
    max_windows: int | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def build(cls, tokenizer, sets: Mapping[str, TextSource], seq_lens: list[int],
              max_windows: int | None = None) -> PerplexityData:
        """Tokenize every set once, each by its source's protocol (see `prunelight.data.STREAM_PROTOCOLS`)."""
        if not sets:
            raise ValueError("perplexity needs at least one dataset")
        bad = [n for n in seq_lens if n < 2]
        if not seq_lens or bad:
            raise ValueError(f"perplexity seq_lens must be integers >= 2, got {seq_lens}")
        streams = {name: tokenize_source(tokenizer, src) for name, src in sets.items()}
        return cls(streams, dict(sets), list(seq_lens), max_windows)


def resolve_sets(datasets: list[str] | Mapping[str, TextSource | dict]) -> dict[str, TextSource]:
    """Names of hub defaults (wikitext2, ptb, c4) or explicit name -> TextSource mappings."""
    if isinstance(datasets, Mapping):
        return {k: v if isinstance(v, TextSource) else TextSource(**v) for k, v in datasets.items()}
    out = {}
    for name in datasets:
        if name not in HUB_SETS:
            raise ValueError(f"unknown perplexity dataset {name!r}; hub defaults: {', '.join(HUB_SETS)} "
                             "(or give name: {path: file.txt} for local text)")
        out[name] = HUB_SETS[name]
    return out


def evaluate_perplexity_suite(model: nn.Module, data: PerplexityData, batch_size: int = 8) -> list[dict]:
    """One record per (dataset, length): ppl, nll, tokens, windows, requested and used length."""
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    records = []
    for name, ids in data.streams.items():
        src = data.sources[name]
        for requested in data.seq_lens:
            used = min(requested, max_pos) if max_pos else requested
            blocks = pack_blocks(ids, used)
            if data.max_windows:
                blocks = blocks[: data.max_windows]
            if len(blocks) == 0:
                raise ValueError(f"{name} has {ids.numel()} tokens, fewer than one window of {used}")
            res = evaluate_perplexity(model, torch.split(blocks, batch_size))
            records.append({
                "dataset": name,
                "source": src.describe(),
                "split": src.split if src.dataset else None,
                "protocol": src.protocol,
                "seq_len_requested": requested,
                "seq_len": used,
                "windows": len(blocks),
                "stream_tokens": int(ids.numel()),
                **res,
            })
    return records
