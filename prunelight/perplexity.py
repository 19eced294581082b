"""Perplexity of a model over a dataloader of fixed-length token blocks."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from prunelight.metrics import TokenPerplexity


@torch.no_grad()
def evaluate_perplexity(model: nn.Module, batches: Iterable[torch.Tensor], max_batches: int | None = None) -> dict:
    """Token-weighted perplexity, NLL and token count over non-overlapping blocks (input_ids tensors)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    metric = TokenPerplexity().to(device)
    try:
        for b, input_ids in enumerate(batches):
            if max_batches is not None and b >= max_batches:
                break
            input_ids = input_ids.to(device)
            metric.update(model(input_ids=input_ids, use_cache=False).logits, input_ids)
    finally:
        model.train(was_training)
    n = int(metric.n_tokens.item())
    if n == 0:
        raise ValueError("perplexity needs at least one scored token; the evaluation data is empty")
    return {"ppl": float(metric.compute().item()), "nll": float(metric.nll_sum.item() / n), "tokens": n}
