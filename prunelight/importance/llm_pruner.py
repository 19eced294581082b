"""LLM-Pruner's element-wise Taylor criteria (Ma et al., 2023), computed as its code computes them.

Reference: horseee/LLM-Pruner, `LLMPruner/pruner/hf_llama_pruner.py::TaylorImportance` (the `param_*`
modes) and `hf_prune.py` (how `acc_grad` is gathered). Per weight w, with

    g_bar = the gradient of the batch's mean token NLL (`model(x, labels=x).loss`), and
    H     = acc_grad = (1/N) sum_s g_s^2, g_s the gradient of sample s's own mean token NLL,

a unit's score is the sum over the weights it owns of

    taylor_element (param_first):   |w * g_bar|
    taylor_second  (param_second):  |w * H * w|        (= w^2 H, never negative)
    taylor_mix     (param_mix):     |w * g_bar - 0.5 * w * H * w|

Unit sums: LLM-Pruner sums |salience| over each output row (q/k/v, gate/up) and each input column
(o_proj, down_proj), adds the members of a dependency group ("sum" group reduction) and sums the
head_dim channels of a head (`consecutive_groups`); so a GQA group's score is the sum over its q/k/v
rows and o_proj columns, and a channel's over its gate/up rows and down_proj column. Only `.weight` is
read there, so biases (Qwen2's q/k/v biases) are not scored here either.

Batches. LLM-Pruner scores one batch of N samples (all of the same length, no padding). With one
calibration batch every criterion here is exactly its formula. With several:
- `taylor_element` sums the per-batch scores: one backward of each batch's mean loss, |w * g_bar_b|
  reduced per unit in the gradient hook. The score depends on how samples are grouped into batches.
- `taylor_second` and `taylor_mix` treat all N calibration samples as LLM-Pruner's one batch: H is
  the mean over all samples, and g_bar = (1/N) sum_s g_s is the gradient of the mean loss over all of
  them (equal to the batch-loss gradient because every sample has the same number of tokens). Both
  are independent of batching and add up exactly over ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import KINDS, ModelFamily
from prunelight.importance.base import UnitScores
from prunelight.importance.ownership import OwnedTensor
from prunelight.importance.weight_grad import WeightGradCriterion


class _LLMPrunerCriterion(WeightGradCriterion):
    """Shared set-up: the LM objective, weight matrices only (no biases), no criterion arguments."""

    scores_biases = False

    def __init__(self) -> None:
        super().__init__(objective="lm", micro_batch_size=1)


class TaylorElementCriterion(_LLMPrunerCriterion):
    """LLM-Pruner `param_first`: sum over a unit's weights of |w * g_bar|, g_bar the batch-loss gradient.

    One backward per calibration batch (the batch as given, not per sample): calibration's loss is the
    sum of the samples' mean NLLs, whose gradient is B * g_bar for a batch of B equal-length samples, so
    the hook divides by B. |w * g_bar| is reduced per unit at once and the gradient freed. Several
    batches: the per-batch scores are summed; with one batch this is exactly LLM-Pruner's score.
    """

    name = "taylor_element"

    def __init__(self) -> None:
        super().__init__()
        self.micro_batch_size = None  # the whole batch in one backward: g_bar is taken before |.|
        self._batch_size = 1

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        # The batch size of the backward in flight, read from the embedding's input (input_ids).
        def remember(module, args):
            self._batch_size = int(args[0].shape[0])

        self._handles.append(model.get_input_embeddings().register_forward_pre_hook(remember))
        super()._register(model, family)

    def accumulate(self, owned: OwnedTensor, w: torch.Tensor, g: torch.Tensor) -> None:
        self.stats[owned.kind][owned.layer] += owned.to_units((w * g).abs()) / self._batch_size


class TaylorSecondCriterion(_LLMPrunerCriterion):
    """LLM-Pruner `param_second`: sum over a unit's weights of w^2 * H, H = mean_s g_s^2 over all samples.

    One backward per sample; sum_w w^2 g_s^2 is reduced per unit in the hook (no per-weight H is kept)
    and divided by the number of samples at the end. With one calibration batch this is exactly
    LLM-Pruner's score; with several it is LLM-Pruner's score on all samples as one batch.
    """

    name = "taylor_second"

    def accumulate(self, owned: OwnedTensor, w: torch.Tensor, g: torch.Tensor) -> None:
        self.stats[owned.kind][owned.layer] += owned.to_units((w * g).pow(2))

    def scores(self, model: nn.Module) -> UnitScores:
        n = max(self.num_samples, 1)
        return {kind: [t / n for t in self.stats[kind]] for kind in KINDS}


class TaylorMixCriterion(_LLMPrunerCriterion):
    """LLM-Pruner `param_mix`: sum over a unit's weights of |w * g_bar - 0.5 * w^2 * H|.

    The |.| of a per-weight combination cannot be reduced per sample, so this criterion keeps two fp32
    buffers per scored weight, sum_s g_s and sum_s g_s^2 (2 x 4 bytes x the decoder's q/k/v/o and
    gate/up/down weights: 8 bytes x 6.98e9 = 55.8 GB for Llama-3-8B), filled by one backward per sample
    and turned into per-unit scores once, in `scores()`, after the cross-rank sum. g_bar = sum_s g_s / N
    is the gradient of the mean loss over all N samples (all have the same length), H = sum_s g_s^2 / N.
    With one calibration batch this is exactly LLM-Pruner's score.
    """

    name = "taylor_mix"

    def __init__(self) -> None:
        super().__init__()
        self._sums: list = []
        self._index: dict[int, int] = {}
        self._final: UnitScores | None = None

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        super()._register(model, family)
        # Per scored weight, in `self._owned` order: [sum_s g_s, sum_s g_s^2] in fp32 (the owned part of a fused one).
        self._sums = [
            (torch.zeros_like(o.spec.owned_part(o.param), dtype=torch.float32),
             torch.zeros_like(o.spec.owned_part(o.param), dtype=torch.float32))
            for o in self._owned
        ]
        self._index = {id(o): i for i, o in enumerate(self._owned)}
        self._final = None

    def accumulate(self, owned: OwnedTensor, w: torch.Tensor, g: torch.Tensor) -> None:
        g_sum, g2_sum = self._sums[self._index[id(owned)]]
        g = owned.spec.owned_part(g)
        g_sum.add_(g)
        g2_sum.addcmul_(g, g)
        # A cheap per-unit gradient sum, only so calibration's non-finite check sees NaN/inf gradients;
        # `scores()` replaces the statistics with the real ones.
        self.stats[owned.kind][owned.layer] += owned.to_units(g)

    def all_reduce(self, reduce_sum) -> None:
        super().all_reduce(reduce_sum)
        # One tensor at a time: a concatenated copy would double the buffers' memory.
        self._sums = [(reduce_sum(a), reduce_sum(b)) for a, b in self._sums]

    def scores(self, model: nn.Module) -> UnitScores:
        if self._final is None:
            self._final = self._finish()
        return {kind: [t.clone() for t in self._final[kind]] for kind in KINDS}

    @torch.no_grad()
    def _finish(self) -> UnitScores:
        """Per-unit sums of |w g_bar - w^2 H / 2| from the buffers, which are consumed in place and freed."""
        n = max(self.num_samples, 1)
        out = {kind: [torch.zeros_like(t) for t in self.stats[kind]] for kind in KINDS}
        for i, owned in enumerate(self._owned):
            g_sum, g2_sum = self._sums[i]
            self._sums[i] = None  # freed as soon as this tensor is scored
            w = owned.spec.owned_part(owned.param.detach().float())
            first = g_sum.mul_(w).div_(n)  # w * g_bar
            second = g2_sum.mul_(w).mul_(w).mul_(0.5 / n)  # 0.5 * w * H * w
            out[owned.kind][owned.layer] += owned.to_units(first.sub_(second).abs_())
            del g_sum, g2_sum, first, second
        self._sums = []
        self.stats = out
        return out
