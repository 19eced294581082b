"""Recovery by distillation: the cut model (student) learns the dense model's (teacher's) next-token distributions.

The loss of one batch is `alpha * distill + (1 - alpha) * CE`, where CE is the usual next-token loss (mean over
the predicted positions) and `distill` compares the student's and the teacher's logits at every position:

- `kl`: KL(teacher || student) of the temperature-T softmaxes, times T^2 (Hinton et al., 2015), mean over tokens;
- `reverse_kl`: KL(student || teacher), same scaling;
- `mse_logits`: mean squared difference of the raw logits (temperature unused), mean over tokens and vocabulary.

With `hidden: true` the distill term also adds the MSE between the final hidden states (the decoder output
after its last norm, i.e. what the LM head reads), mean over tokens and hidden units.

Memory: the student's logits are the model forward's output (in the model's dtype); nothing else of size
(batch tokens x vocab) is held for the whole batch. The teacher runs its decoder once without gradients (no
activations kept), and its LM head plus the family's logit transform (Gemma's soft-cap) is applied
`chunk_tokens` positions at a time. Both terms, distill and CE, are computed in those chunks in one pass; each
chunk's fp32 softmaxes are recomputed in the backward pass (activation checkpointing) instead of being kept, so
only one chunk's (tokens x vocab) fp32 tensors live at once. At alpha 1 no CE is computed; at alpha 0 the
teacher never runs (plain CE). The teacher itself costs one more copy of the dense model's weights, held in
`dtype` (auto: bf16 on a GPU, 16 GB for Llama-3-8B), plus one forward per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from prunelight.validate import bad as _bad
from prunelight.validate import choice as _choice
from prunelight.validate import integer as _integer
from prunelight.validate import number as _number

DISTILL_LOSSES = ("kl", "reverse_kl", "mse_logits")
DistillLoss = Literal[DISTILL_LOSSES]  # type: ignore[valid-type]
TEACHER_DTYPES = ("auto", "bfloat16", "float16", "float32", "model")
TeacherDtype = Literal[TEACHER_DTYPES]  # type: ignore[valid-type]
IGNORE_INDEX = -100  # a target position without a next token (transformers' ignore_index)


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
    """Token positions per chunk of the teacher's LM head and of both loss terms (null: the whole batch at once)."""
    dtype: TeacherDtype = "auto"
    """The dtype the teacher copy is held and run in: auto (bfloat16 on a CUDA device that computes in it, else
    `model.dtype`: a CPU without bf16 instructions runs a bf16 teacher several times slower than fp32), bfloat16,
    float16, float32, or model (`model.dtype`, the student's). Its memory is one extra copy of the dense model's
    weights in this dtype (activations are not kept)."""

    def __post_init__(self) -> None:
        _number("model.distillation.alpha", self.alpha, 0.0, 1.0, False, False)
        _number("model.distillation.temperature", self.temperature, 0.0, float("inf"), True, True)
        _choice("model.distillation.loss", self.loss, DISTILL_LOSSES)
        if not isinstance(self.hidden, bool):
            raise _bad("model.distillation.hidden", self.hidden, "use true or false")
        if self.teacher is not None and (not isinstance(self.teacher, str) or not self.teacher.strip()):
            raise _bad("model.distillation.teacher", self.teacher, "use null (the dense model) or a folder / hub id")
        _integer("model.distillation.chunk_tokens", self.chunk_tokens, 1, optional=True)
        _choice("model.distillation.dtype", self.dtype, TEACHER_DTYPES)

    @property
    def uses_teacher(self) -> bool:
        """Whether the loss has a distillation term (alpha 0 is plain CE: no teacher is kept or run)."""
        return self.alpha > 0

    @property
    def uses_ce(self) -> bool:
        """Whether the loss has a CE term (alpha 1 is distillation only: no CE is computed)."""
        return self.alpha < 1

    def teacher_dtype(self, model_dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
        """The torch dtype of the teacher on `device` (`model_dtype`: the student's, for `model` and `auto`)."""
        if self.dtype == "auto":
            on_bf16_gpu = device is not None and device.type == "cuda" and torch.cuda.is_bf16_supported()
            return torch.bfloat16 if on_bf16_gpu else model_dtype
        return model_dtype if self.dtype == "model" else getattr(torch, self.dtype)

    def as_dict(self) -> dict:
        """JSON-able form (hyper-parameters, checkpoints, report)."""
        return asdict(self)


def _distill_sum(s: torch.Tensor, t: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """Sum over the rows of fp32 student / teacher logits of the per-token distillation term."""
    if kind == "mse_logits":
        return (s - t).pow(2).mean(dim=-1).sum()
    log_s = F.log_softmax(s / temperature, dim=-1)
    log_t = F.log_softmax(t / temperature, dim=-1)
    if kind == "kl":
        return (log_t.exp() * (log_t - log_s)).sum()
    return (log_s.exp() * (log_s - log_t)).sum()  # reverse_kl


def _chunk_terms(student: torch.Tensor, teacher: torch.Tensor | None, targets: torch.Tensor | None, kind: str,
                 temperature: float) -> torch.Tensor:
    """[distillation sum, CE sum] over the rows of one chunk (fp32); a term without its input is 0."""
    s = student.float()  # the chunk's one fp32 copy, shared by both terms
    zero = s.new_zeros(())
    distill = zero if teacher is None else _distill_sum(s, teacher.float(), kind, temperature)
    ce = zero if targets is None else F.cross_entropy(s, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return torch.stack([distill, ce])


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """The [B * T] next-token targets of [B, T] ids, row by row as the flattened logits (IGNORE_INDEX at the end)."""
    return F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)


def chunked_losses(student_logits: torch.Tensor, targets: torch.Tensor | None, teacher_hidden: torch.Tensor | None,
                   teacher_head: nn.Module | None, kind: str = "kl", temperature: float = 1.0,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(distill, CE) of [N, V] student logits, both computed `chunk_tokens` rows at a time in one pass.

    distill: the mean over all N rows of the term against `teacher_head(teacher_hidden)` (None without a teacher);
    CE: the mean over the rows whose target is not IGNORE_INDEX of the cross-entropy (None without `targets`).
    The teacher head runs per chunk without gradients; pass `nn.Identity()` and ready logits to compare logits.
    """
    n = student_logits.shape[0]
    step = n if chunk_tokens is None else chunk_tokens
    total = student_logits.new_zeros(2, dtype=torch.float32)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        s = student_logits[rows]
        t = None
        if teacher_hidden is not None:
            with torch.no_grad():
                t = teacher_head(teacher_hidden[rows])
        y = None if targets is None else targets[rows]
        if s.requires_grad and step < n:
            # Recompute this chunk's softmaxes in backward rather than keep every chunk's fp32 copies.
            total = total + checkpoint(_chunk_terms, s, t, y, kind, temperature, use_reentrant=False)
        else:
            total = total + _chunk_terms(s, t, y, kind, temperature)
    distill = ce = None
    if teacher_hidden is not None:
        scale = temperature**2 if kind != "mse_logits" else 1.0
        distill = total[0] * scale / n
    if targets is not None:
        ce = total[1] / (targets != IGNORE_INDEX).sum().clamp(min=1)
    return distill, ce


def logit_distillation(student_logits: torch.Tensor, teacher_hidden: torch.Tensor, teacher_head: nn.Module,
                       kind: str, temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean over tokens of the distillation term between [N, V] student logits and `teacher_head(teacher_hidden)`.

    The teacher head runs per chunk of `chunk_tokens` rows without gradients; pass `nn.Identity()` and the teacher
    logits as `teacher_hidden` to compare ready logits.
    """
    distill, _ = chunked_losses(student_logits, None, teacher_hidden, teacher_head, kind, temperature, chunk_tokens)
    return distill


def hidden_mse(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the final hidden states, over tokens and hidden units (fp32)."""
    return F.mse_loss(student_hidden.float(), teacher_hidden.float())


def describe_teacher(settings: DistillationSettings, dense: str | None) -> str:
    """The teacher as the report names it."""
    if settings.teacher:
        return settings.teacher
    return f"dense model before the cut ({dense or 'config'})"
