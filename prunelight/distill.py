"""Recovery by distillation: the cut model (student) learns the dense model's (teacher's) next-token distributions.

The loss of one batch is `alpha * distill + (1 - alpha) * CE`, where CE is the usual next-token loss and
`distill` compares the student's and the teacher's logits at every position:

- `kl`: KL(teacher || student) of the temperature-T softmaxes, times T^2 (Hinton et al., 2015), mean over tokens;
- `reverse_kl`: KL(student || teacher), same scaling;
- `mse_logits`: mean squared difference of the raw logits (temperature unused), mean over tokens and vocabulary.

With `hidden: true` the distill term also adds the MSE between the final hidden states (the decoder's output
after its last norm, i.e. what the LM head reads), mean over tokens and hidden units.

The teacher's logits are never held for the whole batch: the teacher runs its decoder once, and its LM head is
applied `chunk_tokens` positions at a time; each chunk's fp32 softmaxes are recomputed in the backward pass
(activation checkpointing) instead of being kept, so only one chunk's (tokens x vocab) fp32 tensors live at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from prunelight.settings import _bad, _choice, _integer, _number

DISTILL_LOSSES = ("kl", "reverse_kl", "mse_logits")
DistillLoss = Literal[DISTILL_LOSSES]  # type: ignore[valid-type]


@dataclass
class DistillationSettings:
    """`model.distillation`: recover the cut model from a teacher's logits instead of (or mixed with) plain CE."""

    alpha: float = 0.5
    """Weight of the distillation term: loss = alpha * distill + (1 - alpha) * CE (0: plain CE, 1: distillation only)."""
    temperature: float = 1.0
    """Softmax temperature T of kl / reverse_kl (the term is scaled by T^2); unused by mse_logits."""
    loss: DistillLoss = "kl"
    """kl: KL(teacher || student); reverse_kl: KL(student || teacher); mse_logits: MSE of the raw logits."""
    hidden: bool = False
    """Also match the final hidden states (decoder output after the last norm) by MSE, added to the distill term."""
    teacher: str | None = None
    """null: the dense model as it was before the cut; else a folder or hub id of a model with the same vocabulary."""
    chunk_tokens: int | None = 1024
    """Token positions per chunk of the teacher's LM head and the loss (null: the whole batch at once)."""

    def __post_init__(self) -> None:
        _number("model.distillation.alpha", self.alpha, 0.0, 1.0, False, False)
        _number("model.distillation.temperature", self.temperature, 0.0, float("inf"), True, True)
        _choice("model.distillation.loss", self.loss, DISTILL_LOSSES)
        if not isinstance(self.hidden, bool):
            raise _bad("model.distillation.hidden", self.hidden, "use true or false")
        if self.teacher is not None and (not isinstance(self.teacher, str) or not self.teacher.strip()):
            raise _bad("model.distillation.teacher", self.teacher, "use null (the dense model) or a folder / hub id")
        _integer("model.distillation.chunk_tokens", self.chunk_tokens, 1, optional=True)

    def as_dict(self) -> dict:
        """JSON-able form (hyper-parameters, checkpoints, report)."""
        return asdict(self)


def _chunk_term(student: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """Sum over the rows of one chunk of the per-token distillation term (fp32)."""
    s, t = student.float(), teacher.float()
    if kind == "mse_logits":
        return (s - t).pow(2).mean(dim=-1).sum()
    log_s = F.log_softmax(s / temperature, dim=-1)
    log_t = F.log_softmax(t / temperature, dim=-1)
    if kind == "kl":
        return (log_t.exp() * (log_t - log_s)).sum()
    return (log_s.exp() * (log_s - log_t)).sum()  # reverse_kl


def logit_distillation(student_logits: torch.Tensor, teacher_hidden: torch.Tensor, teacher_head: nn.Module,
                       kind: str, temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean over tokens of the distillation term between [N, V] student logits and `teacher_head(teacher_hidden)`.

    The teacher head runs per chunk of `chunk_tokens` rows without gradients; pass `nn.Identity()` and the teacher
    logits as `teacher_hidden` to compare ready logits.
    """
    n = student_logits.shape[0]
    step = n if chunk_tokens is None else chunk_tokens
    total = student_logits.new_zeros((), dtype=torch.float32)
    for start in range(0, n, step):
        s = student_logits[start : start + step]
        with torch.no_grad():
            t = teacher_head(teacher_hidden[start : start + step])
        if s.requires_grad and step < n:
            # Recompute this chunk's softmaxes in backward rather than keep every chunk's fp32 copies.
            total = total + checkpoint(_chunk_term, s, t, kind, temperature, use_reentrant=False)
        else:
            total = total + _chunk_term(s, t, kind, temperature)
    scale = temperature**2 if kind != "mse_logits" else 1.0
    return total * scale / n


def hidden_mse(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the final hidden states, over tokens and hidden units (fp32)."""
    return F.mse_loss(student_hidden.float(), teacher_hidden.float())


def describe_teacher(settings: DistillationSettings, dense: str | None) -> str:
    """The teacher as the report names it."""
    if settings.teacher:
        return settings.teacher
    return f"dense model before the cut ({dense or 'config'})"
