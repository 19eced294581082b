"""Layer tuning: after the cut and its repair, train each cut decoder layer to give the dense layer's outputs.

`prune.reconstruct` repairs one projection per sub-block, linearly (o_proj / down_proj columns). Layer tuning goes
one step further and stays as local: each cut decoder layer, in order, gets the dense model's inputs to that layer
(the calibration batches) and is trained with Adam, every weight of the layer at once, to reproduce the dense
layer's outputs (mean squared error over tokens), starting from the repaired cut. It is the local objective of
block reconstruction in post-training quantization (BRECQ, Li et al., ICLR 2021), here applied to a pruned decoder
layer; the recipe (dense inputs, Adam, early stopping on held-out calibration sequences) is our own.

The last `holdout_sequences` calibration sequences (whole batches) are not trained on: the layer's error on them is
measured before tuning and after every epoch, and the layer keeps the weights of least held-out error (the repaired
cut itself when no epoch beats it), so the fit stops where it stops generalizing. Calibration text only: the
evaluation text is never read.

Cost: `epochs` forward+backward passes over the training batches per cut layer (SmolLM2-135M, 48 x 128 tokens,
5 epochs: about 2.5 s per layer on 2 CPU cores). The fitted repair (`reconstruct.cut_and_reconstruct`) hands the
tuner the dense inputs and outputs it computes anyway (`LayerTuner.tune`); a cut from the levels database runs no
dense forward of its own, so there the tuner runs one per layer (`LayerTuner.wrap`). Memory: two layer-boundary
streams of the calibration batches (the layer's inputs and the dense outputs) and the layer's parameters with
Adam's two moments in float32 (a layer is tuned in float32 whatever the model's dtype). Under DDP
every rank trains on its own batches and the gradients and held-out errors are summed over ranks, so every rank
writes the same weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from prunelight.distributed import ReduceSum, split_holdout, sum_gradients, sum_over_ranks
from prunelight.families import get_family, unwrap
from prunelight.reconstruct import layer_calls, run_layer
from prunelight.surgery import LayerCut

def _floated(value: Any) -> Any:
    """`value` (a tensor, or a tuple / list / dict of them) with its floating tensors in float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_floated(v) for v in value)
    if isinstance(value, dict):
        return {k: _floated(v) for k, v in value.items()}
    return value


class LayerTuner:
    """Wraps a cut's per-layer step (`surgery.apply_plan`'s `cut_layer`) so each cut layer is tuned after it."""

    def __init__(self, model: nn.Module, batches: Sequence[torch.Tensor], tuning, reduce_sum: ReduceSum | None = None,
                 drop_layers: Sequence[int] = ()) -> None:
        self.base = unwrap(model)
        self.family = get_family(self.base)
        self.batches = list(batches)
        self.tuning = tuning
        self.reduce_sum = reduce_sum
        self.drop = set(drop_layers)
        self.sizes = [b.shape[0] for b in self.batches]
        self.train_batches, self.held_batches = split_holdout(self.sizes, tuning.holdout_sequences, reduce_sum)
        self.figures: list[dict[str, Any]] = []
        self.seconds = 0.0

    def tune(self, i: int, layer: nn.Module, cuts, inputs: list[torch.Tensor], targets: list[torch.Tensor],
             kwargs: list[dict]) -> None:
        """Tune decoder layer `i`, just cut (`cuts`, as `surgery.apply_plan` passes them), toward the dense layer's
        outputs `targets` from its inputs `inputs` (one tensor per calibration batch); uncut and dropped layers, and
        layers without parameters, are left as they are."""
        if cuts and i not in self.drop and any(True for _ in layer.parameters()):
            t0 = time.perf_counter()
            with torch.enable_grad():
                self.figures.append({"layer": i, **self._tune(i, layer, inputs, targets, kwargs)})
            self.seconds += time.perf_counter() - t0

    def wrap(self, cut_layer: LayerCut) -> LayerCut:
        """`cut_layer` followed by this layer's tuning, for a cut that runs no dense forward of its own: the dense
        inputs of layer 0 are taken now and each layer's dense outputs before its cut."""
        with torch.no_grad():
            calls = layer_calls(self.base, self.family, self.batches, next(self.base.parameters()).device)
        stream = calls.hidden

        def step(i: int, layer: nn.Module, shape, cuts) -> None:
            nonlocal stream
            kw = [c[i] for c in calls.layer_kwargs]
            with torch.no_grad():
                dense_out = run_layer(layer, stream, kw, {})
            cut_layer(i, layer, shape, cuts)
            self.tune(i, layer, cuts, stream, dense_out, kw)
            stream = dense_out

        return step

    def _tune(self, i: int, layer: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor],
              kwargs: list[dict]) -> dict[str, Any]:
        """Train `layer` on the training batches, keep the epoch of least held-out error; returns its figures."""
        dtype = next(layer.parameters()).dtype
        was_training = layer.training
        layer.float().eval()
        params = list(layer.parameters())
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(True)
        kwargs = [_floated(kw) for kw in kwargs]

        def out(b: int) -> torch.Tensor:
            o = layer(inputs[b].float(), **kwargs[b])
            return o[0] if isinstance(o, tuple) else o

        def held_error() -> float | None:
            """Σ||ŷ - y||² / Σ||y - x||² on the held-out batches (the error relative to what the dense layer adds),
            None when nothing is held out."""
            if not self.held_batches:
                return None
            err = own = 0.0
            with torch.no_grad():
                for b in self.held_batches:
                    y = targets[b].float()
                    err += float((out(b) - y).pow(2).sum())
                    own += float((y - inputs[b].float()).pow(2).sum())
            err, own = sum_over_ranks([err, own], self.reduce_sum)
            if not math.isfinite(own):
                raise FloatingPointError(f"layer tuning: the dense decoder layer {i} gives non-finite outputs on the "
                                         "held-out calibration batches")
            return err / own if own > 0 else (0.0 if err == 0 else math.inf)

        start = best = held_error()
        if start is not None and not math.isfinite(start):
            raise FloatingPointError(f"layer tuning: decoder layer {i} of the cut model gives non-finite outputs on "
                                     "the held-out calibration batches before any tuning step")
        best_state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
        best_epoch = epochs_run = 0
        opt = torch.optim.Adam(params, lr=self.tuning.lr)
        for epoch in range(1, self.tuning.epochs + 1):
            for b in self.train_batches:
                opt.zero_grad(set_to_none=True)
                loss = (out(b) - targets[b].float()).pow(2).mean()
                loss.backward()
                total = sum_gradients(params, loss, self.reduce_sum)
                if not math.isfinite(total):
                    summed = " (summed over the ranks)" if self.reduce_sum is not None else ""
                    raise FloatingPointError(
                        f"layer tuning: the loss of decoder layer {i} is {total}{summed} at epoch {epoch}; lower "
                        f"prune.layer_tuning.lr ({self.tuning.lr:g}) or set prune.layer_tuning.epochs: 0")
                opt.step()
            epochs_run = epoch
            err = held_error()
            if err is None:  # nothing held out (one calibration batch): every epoch is kept
                best_epoch = epoch
                continue
            if not err < best:  # worse, equal or not finite: the previous epoch was the best
                break
            best, best_epoch = err, epoch
            best_state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
        if start is not None:
            layer.load_state_dict(best_state)
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
            p.grad = None
        layer.to(dtype)
        layer.train(was_training)
        return {"held_out_error_before": start, "held_out_error_after": best, "epoch": best_epoch,
                "epochs_run": epochs_run}

    def summary(self) -> dict[str, Any]:
        """The run-record figures: per tuned layer the held-out error before and after and the epoch kept."""
        def mean(key: str) -> float | None:
            vals = [f[key] for f in self.figures if f[key] is not None]
            return sum(vals) / len(vals) if vals else None

        train, held = sum_over_ranks([float(sum(self.sizes[b] for b in self.train_batches)),
                                      float(sum(self.sizes[b] for b in self.held_batches))], self.reduce_sum)
        return {"epochs": self.tuning.epochs, "lr": self.tuning.lr,
                "train_sequences": int(train), "held_out_sequences": int(held),
                "mean_held_out_error_before": mean("held_out_error_before"),
                "mean_held_out_error_after": mean("held_out_error_after"),
                "layers": self.figures, "time_s": self.seconds}


def tuning_line(figures: dict[str, Any]) -> str:
    """The run's one line on the layer tuning."""
    before, after = figures["mean_held_out_error_before"], figures["mean_held_out_error_after"]
    kept = [f["epoch"] for f in figures["layers"]]
    errs = (f"held-out error relative to the dense layer's change {before:.4f} -> {after:.4f} (mean of "
            f"{len(kept)} layers; {figures['held_out_sequences']} held-out sequences)" if before is not None
            else f"{len(kept)} layers, no held-out sequences (one calibration batch): every epoch kept")
    return (f"layer tuning ({figures['epochs']} epochs, lr {figures['lr']:g}, {figures['train_sequences']} training "
            f"sequences): {errs}; epochs kept {min(kept, default=0)}-{max(kept, default=0)}; {figures['time_s']:.0f} s")
