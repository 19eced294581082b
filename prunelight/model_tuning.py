"""Model tuning: after the cut (and its layer tuning, when on), train the whole cut decoder toward the dense model's
next-token distributions on the calibration batches.

The repair and the layer tuning are local: each layer is fitted to the dense layer's outputs from the dense layer's
inputs, so the errors that the cut layers leave still add up from layer to layer. Model tuning fits the end of the
model instead: every weight of the decoder layers and the final norm is trained with Adam to minimize the KL
divergence KL(dense || cut) of the next-token distribution at every calibration position. It is knowledge
distillation from the dense model restricted to the calibration text (as in Minitron, Muralidharan et al. 2024, at
a far smaller budget); the recipe (the calibration text only, the embeddings and LM head frozen, early stopping on
held-out calibration sequences) is our own.

The dense model's targets are its final hidden states (what enters the LM head), taken in one forward pass before
the cut (`dense_hidden`, or recorded by a pass the allocation's measurement ran anyway): the head is
frozen, so the dense distribution follows from them without keeping a vocabulary-sized tensor per token. With a
linear head z = W h + b the KL at a position is lse(z_cut) - lse(z_dense) - (h_cut - h_dense) . W^T p_dense, so
lse(z_dense) and W^T p_dense are computed once and each step runs the head on the cut model's states only. The last
`holdout_sequences` calibration sequences (whole batches) are not trained on: their KL is measured before tuning and
after every epoch, the model keeps the weights of least held-out KL (the cut as it was when no epoch beats it), and
the first epoch that does not lower it stops the tuning. The evaluation text is never read.

Cost: `epochs` forward+backward passes of the whole model over the training batches, plus one dense forward pass
(none when the allocation's measurement recorded them) and the held-out checks (SmolLM2-135M at a 20% cut,
48 x 128 tokens: about 33 s per epoch and 3 s per held-out check on 2 CPU cores). Memory: the model in float32
while it trains (a bf16 weight would round Adam's small steps away), the decoder's gradients and Adam's two moments
(16 bytes per decoder parameter in all) and the training activations of one calibration batch; when that does not
fit in half the free memory the run skips the tuning and says so (Llama-3-8B on an 80 GB GPU). Under DDP every
rank trains on its own batches with the gradients and held-out KL summed over ranks, so every rank writes the same
weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prunelight.console import progress
from prunelight.distributed import ReduceSum, split_holdout, sum_gradients, sum_over_ranks
from prunelight.families import get_family, linear_dense_side, linear_head, unwrap
from prunelight.memory import free_memory
from prunelight.settings import ModelTuning

# share of the free memory the float32 weights, gradients and Adam moments may take
MEMORY_SHARE = 0.5
# lr: auto is this over the hidden size (Adam's rate for hidden weights scales as 1 / width, as in muP): 3e-5 at
# SmolLM2's 576, where 3e-5 beat 1e-5 (docs/methods.md, "Model tuning").
LR_TIMES_WIDTH = 3e-5 * 576
BYTES_PER_PARAM = 16  # a tuned parameter: float32 weight, gradient and Adam's two moments


@torch.no_grad()
def dense_hidden(model: nn.Module, batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The dense model's final hidden states (the LM head's inputs) on each batch, in float32 on the model's device."""
    base = unwrap(model)
    family = get_family(base)
    device = next(base.parameters()).device
    seen: list[torch.Tensor] = []
    hook = family.final_norm(base).register_forward_hook(lambda _m, _i, out: seen.append(out.float()))
    was_training = base.training
    base.eval()
    try:
        decoder = base.get_decoder()  # the hook reads the final norm's output: no logits needed
        for b in batches:
            decoder(input_ids=b.to(device), use_cache=False)
    finally:
        hook.remove()
        base.train(was_training)
    return seen


def learning_rate(tuning: ModelTuning, config) -> float:
    """The tuning's Adam rate: the setting's, or with `auto` LR_TIMES_WIDTH over the model's hidden size."""
    return float(tuning.lr) if tuning.lr != "auto" else LR_TIMES_WIDTH / int(config.hidden_size)


def tuned_params(model: nn.Module) -> list[nn.Parameter]:
    """What model tuning trains: every weight of the decoder layers and the final norm (not the embeddings or head)."""
    base = unwrap(model)
    family = get_family(base)
    return [*family.layers(base).parameters(), *family.final_norm(base).parameters()]


def fits_in_memory(model: nn.Module, reduce_sum: ReduceSum | None = None) -> bool:
    """Whether a float32 copy of the model and the tuned parameters' gradients and Adam moments fit in MEMORY_SHARE of
    the free memory (on every rank)."""
    base = unwrap(model)
    tuned = sum(p.numel() for p in tuned_params(base))
    need = 4 * sum(p.numel() for p in base.parameters()) + (BYTES_PER_PARAM - 4) * tuned
    free = free_memory(next(base.parameters()).device)
    fits = free is not None and need <= MEMORY_SHARE * free
    if reduce_sum is not None:
        fits = float(reduce_sum(torch.tensor([0.0 if fits else 1.0], dtype=torch.float64))[0]) == 0.0
    return fits


class ModelTuner:
    """Trains the cut model toward the dense model's next-token distributions (`dense_hidden` targets)."""

    def __init__(self, model: nn.Module, batches: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                 tuning: ModelTuning, reduce_sum: ReduceSum | None = None) -> None:
        self.base = unwrap(model)
        self.head = get_family(self.base).logits_head(self.base)
        self.decoder = self.base.get_decoder()
        self.dense: list[tuple[torch.Tensor, ...]] | None = None  # `_dense_side`, set when the training starts
        self.batches = list(batches)
        self.targets = list(targets)
        self.tuning = tuning
        self.reduce_sum = reduce_sum
        self.device = next(self.base.parameters()).device
        sizes = [b.shape[0] for b in self.batches]
        self.train_batches, self.held_batches = split_holdout(sizes, tuning.holdout_sequences, reduce_sum)
        self.sequences = sum_over_ranks([float(sum(sizes[b] for b in self.train_batches)),
                                         float(sum(sizes[b] for b in self.held_batches))], reduce_sum)
        self.lr = learning_rate(tuning, self.base.config)
        # the steps after which the held-out KL is measured: `checks_per_epoch` evenly spread over each epoch
        n = len(self.train_batches)
        checks = min(tuning.checks_per_epoch, n)
        self.check_after = {round(n * (k + 1) / checks) for k in range(checks)}

    @torch.no_grad()
    def _dense_side(self) -> list[tuple[torch.Tensor, ...]] | None:
        """With a linear head z = W h + b (`linear_head`), per batch what the KL keeps of the dense distribution p:
        its hidden states h_d, logsumexp(z_d) and W^T p, once (None: another head, the log-probabilities are
        taken at every step)."""
        if not linear_head(self.base):
            return None
        return [linear_dense_side(self.head, t.to(self.device).float()) for t in self.targets]

    def _kl(self, b: int) -> tuple[torch.Tensor, int]:
        """Σ over positions of KL(dense || cut) on batch `b`, and the number of positions."""
        x = self.batches[b].to(self.device)
        if self.dense is not None:
            # Σ_v p (log p - log q) = lse(z_c) - lse(z_d) - (h_c - h_d) . W^T p (the bias cancels): the same KL
            # without the dense model's vocabulary-wide log-probabilities at every step
            h_d, lse_d, wp = self.dense[b]
            h = self.decoder(input_ids=x, use_cache=False).last_hidden_state.float()
            kl = torch.logsumexp(self.head(h).float(), dim=-1) - lse_d - ((h - h_d) * wp).sum(-1)
            return kl.sum(), kl.numel()
        logits = self.base(input_ids=x, use_cache=False).logits.float()
        with torch.no_grad():
            dense = F.log_softmax(self.head(self.targets[b].to(self.device)).float(), dim=-1)
        cut = F.log_softmax(logits, dim=-1)
        kl = (dense.exp() * (dense - cut)).sum(-1)
        return kl.sum(), kl.numel()

    def _held_kl(self) -> float | None:
        if not self.held_batches:
            return None
        total = count = 0.0
        with torch.no_grad():
            for b in self.held_batches:
                s, n = self._kl(b)
                total += float(s)
                count += n
        total, count = sum_over_ranks([total, count], self.reduce_sum)
        return total / count

    def tune(self) -> dict[str, Any]:
        """Train, keep the epoch of least held-out KL; returns the run-record figures."""
        t0 = time.perf_counter()
        base = self.base
        params = tuned_params(base)
        # the whole model runs in float32 while it trains (a bf16 weight would lose Adam's small steps); every
        # parameter and buffer gets its own dtype back afterwards
        dtypes = {name: t.dtype for name, t in (*base.named_parameters(), *base.named_buffers())}
        flags = {id(p): p.requires_grad for p in base.parameters()}
        was_training = base.training
        base.float()
        for p in base.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        base.eval()  # no dropout: the targets are the dense model's deterministic outputs
        try:
            figures = self._train(params)
        finally:
            for name, t in (*base.named_parameters(), *base.named_buffers()):  # .float() replaced the buffers
                t.data = t.data.to(dtypes[name])
            for p in base.parameters():
                p.grad = None
                p.requires_grad_(flags[id(p)])
            base.train(was_training)
        figures["time_s"] = time.perf_counter() - t0
        return figures

    def _train(self, params: list[nn.Parameter]) -> dict[str, Any]:
        self.dense = self._dense_side()  # after the model went to float32
        start = best = self._held_kl()
        if start is not None and not math.isfinite(start):
            raise FloatingPointError(f"model tuning: the cut model's held-out KL from the dense model is {start} "
                                     "before any step; set prune.model_tuning.epochs: 0")
        best_state = [p.detach().clone() for p in params]
        best_at = steps_run = 0.0  # in epochs
        history: list[float] = []
        opt = torch.optim.Adam(params, lr=self.lr)
        n = len(self.train_batches)
        bar = progress(None, "model tuning", total=self.tuning.epochs * n, unit="step")
        stop = False
        with torch.enable_grad(), bar:
            for epoch in range(1, self.tuning.epochs + 1):
                for step, b in enumerate(self.train_batches, 1):
                    opt.zero_grad(set_to_none=True)
                    s, count = self._kl(b)
                    loss = s / count
                    loss.backward()
                    total = sum_gradients(params, loss, self.reduce_sum)
                    if not math.isfinite(total):
                        raise FloatingPointError(
                            f"model tuning: the KL loss is {total} at epoch {epoch}; lower prune.model_tuning.lr "
                            f"({self.lr:g}) or set prune.model_tuning.epochs: 0")
                    opt.step()
                    bar.update()
                    steps_run = epoch - 1 + step / n
                    if step not in self.check_after:
                        continue
                    kl = self._held_kl()
                    if kl is None:  # one calibration batch: nothing held out, every step is kept
                        best_at = steps_run
                        continue
                    history.append(kl)
                    bar.set_postfix(held_out_kl=f"{kl:.4f}")
                    if not kl < best:  # worse, equal or not finite: the previous check was the best
                        stop = True
                        break
                    best, best_at = kl, steps_run
                    best_state = [p.detach().clone() for p in params]
                if stop:
                    break
        if start is not None:
            with torch.no_grad():
                for p, saved in zip(params, best_state):
                    p.copy_(saved)
        return {"epochs": self.tuning.epochs, "lr": self.lr, "train_sequences": int(self.sequences[0]),
                "held_out_sequences": int(self.sequences[1]), "held_out_kl_before": start,
                "held_out_kl_after": best, "held_out_kl_per_check": history, "checks_per_epoch":
                len(self.check_after), "epoch": round(best_at, 3), "epochs_run": round(steps_run, 3)}


def model_tuning_line(figures: dict[str, Any]) -> str:
    """The run's one line on the model tuning."""
    if figures.get("skipped"):
        return f"model tuning skipped: {figures['skipped']}"
    before, after = figures["held_out_kl_before"], figures["held_out_kl_after"]
    kl = (f"held-out KL from the dense model {before:.4f} -> {after:.4f} ({figures['held_out_sequences']} held-out "
          "sequences)" if before is not None else "no held-out sequences (one calibration batch): every epoch kept")
    return (f"model tuning ({figures['epochs']} epochs, lr {figures['lr']:.2g}, {figures['train_sequences']} training "
            f"sequences): {kl}; weights kept after {figures['epoch']:g} of {figures['epochs_run']:g} epochs run; "
            f"{figures['time_s']:.0f} s")
