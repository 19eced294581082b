"""One evaluation, run the same way on every model of a run: perplexity, zero-shot, efficiency, similarity."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from prunelight.console import progress
from prunelight.data import TextSource
from prunelight.evaluation.efficiency import efficiency_report
from prunelight.evaluation.perplexity import PerplexityData, evaluate_perplexity_suite, resolve_sets
from prunelight.evaluation.zeroshot import TASKS, evaluate_zeroshot

log = logging.getLogger(__name__)


@dataclass
class EvaluationSettings:
    """What to measure. `ppl_datasets` None = WikiText-2, PTB and C4 test/validation from the hub;
    `zeroshot_data_dir` None = lm-eval's official hub tasks, a folder = local jsonl task files."""

    perplexity: bool = True
    ppl_datasets: dict[str, TextSource] | None = None
    seq_lens: list[int] = field(default_factory=lambda: [128, 2048])
    ppl_batch_size: int = 8
    max_windows: int | None = None
    zeroshot: bool = True
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    zeroshot_data_dir: str | None = None
    limit: float | None = None
    zeroshot_batch_size: int = 32
    log_samples: bool = False
    efficiency: bool = True
    speed_batch_size: int = 1
    speed_prompt_len: int = 128
    speed_new_tokens: int = 32
    speed_repeats: int = 3
    similarity_batches: int = 2

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ValueError(f"unknown zero-shot task(s) {bad}; available: {', '.join(TASKS)}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"limit must be > 0 (a row count, or a fraction < 1), got {self.limit}")
        if self.limit is not None and self.limit >= 1:
            self.limit = int(self.limit)

    def as_dict(self) -> dict:
        """JSON-able form for the report."""
        d = asdict(self)
        if self.ppl_datasets is not None:
            d["ppl_datasets"] = {k: asdict(v) for k, v in self.ppl_datasets.items()}
        return d


class Evaluator:
    """Tokenizes the evaluation text once, then measures any number of models identically."""

    def __init__(self, settings: EvaluationSettings, tokenizer) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self._ppl_data: PerplexityData | None = None

    def ppl_data(self) -> PerplexityData:
        """The tokenized perplexity sets (built on first use)."""
        if self._ppl_data is None:
            s = self.settings
            sets = resolve_sets(s.ppl_datasets if s.ppl_datasets is not None else ["wikitext2", "ptb", "c4"])
            self._ppl_data = PerplexityData.build(self.tokenizer, sets, s.seq_lens, s.max_windows)
        return self._ppl_data

    def evaluate(self, model: nn.Module, name: str, folder: str | Path | None = None) -> dict:
        """All configured measurements of `model`; `folder` (when it exists) gives its size on disk."""
        s, out, times = self.settings, {}, {}
        parts = int(s.perplexity) + int(s.zeroshot) + int(s.efficiency)
        with progress(None, f"evaluating the {name} model", total=parts, unit="part") as bar:
            self._evaluate(model, name, folder, out, times, bar)
        out["times_s"] = times
        return out

    def _evaluate(self, model: nn.Module, name: str, folder, out: dict, times: dict, bar) -> None:
        s = self.settings
        if s.perplexity:
            t0 = time.perf_counter()
            out["perplexity"] = evaluate_perplexity_suite(model, self.ppl_data(), s.ppl_batch_size)
            times["perplexity"] = time.perf_counter() - t0
            for r in out["perplexity"]:
                log.info("%s ppl %s@%d = %.3f (%d tokens)", name, r["dataset"], r["seq_len"], r["ppl"], r["tokens"])
            bar.update(1)
        if s.zeroshot:
            t0 = time.perf_counter()
            out["zeroshot"] = evaluate_zeroshot(
                model, self.tokenizer, s.tasks, data_dir=s.zeroshot_data_dir, limit=s.limit,
                batch_size=s.zeroshot_batch_size, log_samples=s.log_samples)
            times["zeroshot"] = time.perf_counter() - t0
            log.info("%s zero-shot average acc %.4f", name, out["zeroshot"]["average"]["acc"])
            bar.update(1)
        if s.efficiency:
            t0 = time.perf_counter()
            out["efficiency"] = efficiency_report(
                model, folder, batch_size=s.speed_batch_size, prompt_len=s.speed_prompt_len,
                new_tokens=s.speed_new_tokens, repeats=s.speed_repeats)
            times["efficiency"] = time.perf_counter() - t0
            bar.update(1)


@torch.no_grad()
def capture_hidden_states(model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Hidden states (embeddings, then after every layer) for a few batches, kept on CPU in fp32."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    per_batch = []
    try:
        for ids in batches:
            hs = model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False).hidden_states
            per_batch.append([h.float().cpu() for h in hs])
    finally:
        model.train(was_training)
    return [torch.cat([b[i] for b in per_batch]) for i in range(len(per_batch[0]))] if per_batch else []


def hidden_similarity(reference: list[torch.Tensor], other: list[torch.Tensor]) -> list[float]:
    """Mean per-token cosine similarity of each hidden state to the reference's."""
    if len(reference) != len(other):
        raise ValueError(f"hidden states differ in depth: {len(reference)} vs {len(other)}")
    return [float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()) for a, b in zip(reference, other)]
