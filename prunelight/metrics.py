"""Token-weighted perplexity as a torchmetrics Metric (fp32 cross-entropy, ignored labels excluded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric


class TokenPerplexity(Metric):
    """exp(sum of token NLL / number of scored tokens), reduced across processes by summing both states.

    Unlike `torchmetrics.text.Perplexity` it takes log-softmax directly in fp32 (no softmax-then-log,
    so one very unlikely token cannot make the result infinite), and positions labelled
    `ignore_index` are excluded from both sums instead of being wrapped into the vocabulary.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, ignore_index: int = -100, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n_tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """logits [batch, T, vocab] and labels [batch, T] aligned as in transformers (shifted inside)."""
        logits = logits[:, :-1].float()
        target = labels[:, 1:]
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=self.ignore_index, reduction="sum"
        )
        self.nll_sum += nll.double()
        self.n_tokens += (target != self.ignore_index).sum()

    def compute(self) -> torch.Tensor:
        """Perplexity over everything seen since the last reset."""
        return torch.exp(self.nll_sum / self.n_tokens.clamp(min=1))
