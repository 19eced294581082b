"""The calibration pass: run batches through the model so a criterion's hooks can score every unit.

Weights are frozen for the pass and only the input embeddings are made to require grad, so the
backward pass computes activation gradients. Weight-gradient criteria name the weights they score
(`criterion.grad_params`); only those require grad, and their hooks reduce and free each gradient as
soon as it is accumulated. Forward-only criteria run under no_grad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prunelight.console import progress
from prunelight.families import unwrap
from prunelight.importance.base import KINDS, Criterion, UnitScores


def calibration_loss(logits: torch.Tensor, input_ids: torch.Tensor, objective: str = "lm") -> torch.Tensor:
    """Sum over samples of each sample's mean loss, in fp32.

    Summing (not averaging) over the batch makes a sample's gradient independent of how samples
    are batched or split across processes, so per-unit statistics add up exactly across ranks.
    """
    logits = logits.float()
    if objective == "lm":
        nll = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none"
        )
        return nll.view(input_ids.shape[0], -1).mean(1).sum()
    if objective == "entropy":
        logp = F.log_softmax(logits, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)  # [batch, tokens]
        return ent.mean(1).sum()
    raise ValueError(f"unknown calibration objective {objective!r}; use 'lm' or 'entropy'")


def _check_finite(criterion: Criterion, batch_idx: int) -> None:
    for kind in KINDS:
        for layer, t in enumerate(criterion.stats[kind]):
            if not torch.isfinite(t).all():
                raise FloatingPointError(
                    f"non-finite importance statistics ({kind}, layer {layer}) after calibration batch {batch_idx}: "
                    "the gradients are NaN/inf; check the model dtype (use fp32 or bf16, not fp16) and the data"
                )


def keep_checkpointing_in_eval(model: nn.Module) -> None:
    """Re-arm gradient checkpointing after `eval()`: transformers checkpoints a layer only in training mode.

    Only the decoder-layer modules are flagged as training; their attention/MLP stay in eval mode,
    so scoring keeps eval semantics while storing one layer's activations at a time.
    """
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True and isinstance(module, nn.Module):
            module.training = True


def _calibrate(base: nn.Module, batches: Iterable[torch.Tensor], criterion: Criterion, max_batches: int | None) -> None:
    """Forward (and backward) every batch with only the criterion's own tensors requiring grad."""
    device = next(base.parameters()).device
    was_training = base.training
    saved = [(p, p.requires_grad) for p in base.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    targets = criterion.grad_params(base)
    for p in targets:
        p.grad = None  # a stale training gradient would otherwise be folded into the scores
        p.requires_grad_(True)
    handles = []
    if criterion.needs_backward and not targets:  # activation-gradient criteria: grads must flow from the embeddings
        handles.append(base.get_input_embeddings().register_forward_hook(lambda m, i, out: out.requires_grad_(True)))
    base.eval()
    keep_checkpointing_in_eval(base)
    try:
        batches = list(batches)[:max_batches]
        for b, input_ids in enumerate(progress(batches, f"scoring units ({criterion.name})")):
            input_ids = input_ids.to(device)
            for chunk in torch.split(input_ids, criterion.micro_batch_size or max(len(input_ids), 1)):
                if criterion.needs_backward:
                    with torch.enable_grad():
                        logits = base(input_ids=chunk, use_cache=False).logits
                        loss = calibration_loss(logits, chunk, criterion.loss)
                        if not torch.isfinite(loss):
                            raise FloatingPointError(f"calibration loss is {loss.item()} on batch {b}")
                        loss.backward()
                    del logits
                else:  # forward-only criteria read the layers' activations: the LM head's logits are not needed
                    with torch.no_grad():
                        base.get_decoder()(input_ids=chunk, use_cache=False)
                criterion.num_samples += chunk.shape[0]
                criterion.num_batches += 1
            _check_finite(criterion, b)
    finally:
        for h in handles:
            h.remove()
        for p in targets:
            p.grad = None  # normally freed by the criterion's hooks already; also after an error
        for p, flag in saved:
            p.requires_grad_(flag)
        base.train(was_training)


def run_calibration(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    criterion: Criterion,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    max_batches: int | None = None,
    also: Sequence[Any] = (),
) -> UnitScores:
    """Accumulate `criterion` over `batches` (input_ids tensors), sum across ranks, return unit scores. `also`:
    collectors (`attach(model)`, `detach()`) that read the same forwards, e.g. an allocation's own statistics."""
    base = unwrap(model)
    criterion.attach(base)
    if criterion.needs_data:
        for c in also:
            c.attach(base)
        try:
            _calibrate(base, batches, criterion, max_batches)
        finally:
            criterion.detach()
            for c in also:
                c.detach()
        if criterion.num_samples == 0:
            raise ValueError("calibration saw no batches: the calibration dataset is empty")
    if reduce_sum is not None:
        criterion.all_reduce(reduce_sum)
    return criterion.scores(base)
