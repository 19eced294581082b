"""`calibrated`: unit scores put on one scale, the calibration loss, by measuring a probe removal per sub-block.

A criterion's scores are comparable inside one sub-block (they order its units) but not across unit kinds
(a GQA group's score and an MLP channel's come from different formulas and activations) nor across layers
(activation scales grow with depth). A global knapsack over raw scores then cuts wherever the scale is small,
not where the loss is: on SmolLM2-135M `taylor` took 2 of 3 KV groups in every layer and `wanda_sp` emptied
the MLPs of layers 1-3 (docs/methods.md, "Calibrated allocation").

The calibrated allocation keeps the criterion's scores as they are and only rescales them:

1. For every sub-block (attention or MLP of one layer) a *probe slice* is taken: its lowest-scored units
   worth one GQA group's parameters (one group; the same parameter count of MLP channels), so every probe
   removes about the same number of parameters and the measured losses are comparable per parameter.
2. The probe is masked alone and the calibration NLL increase dL is measured (only the layers from the probed
   one onward are rerun, from cached layer inputs).
3. Every unit of the sub-block is scaled by dL / S, S being the probe slice's summed (non-negative) scores,
   so the probe slice's calibrated scores add up to its measured loss. Inside a sub-block the order and
   the relative spacing of the criterion's scores are kept; across sub-blocks the scale is the loss.
4. The global fractional knapsack (`width.global_width`) runs on the calibrated scores.

Because the scores are sorted inside a sub-block, the knapsack takes each sub-block's units cheapest first:
it is a marginal-cost allocation with the criterion's score curve as the shape of each sub-block's cost and
the measured probe loss as its scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prunelight.allocation.budget import Budget, Removed, build_plan, empty_removed, lowest, meet, units
from prunelight.allocation.split_search import masked
from prunelight.console import progress
from prunelight.families import get_family, unwrap
from prunelight.importance.base import UnitScores

KINDS = ("attn", "mlp")


@dataclass
class Probes:
    """Measured calibration-loss increases of each sub-block's probe slice (None where nothing can be probed)."""

    base_nll: float
    loss: dict[str, list[float | None]]  # kind -> per layer, NLL increase of removing the probe slice
    slices: dict[str, list[list[int]]]  # kind -> per layer, the probed unit indices
    tokens: int

    def as_dict(self) -> dict:
        """JSON-able form for the plan's meta."""
        return {"base_nll": self.base_nll, "loss": self.loss, "slice_sizes": {k: [len(s) for s in v]
                                                                             for k, v in self.slices.items()},
                "tokens": self.tokens}


def probe_fraction(budget: Budget) -> float:
    """The share of the removable units the budget takes if spread evenly: the operating point probes measure at."""
    removable = budget.removable("attn") + budget.removable("mlp")
    return min(1.0, budget.target / removable) if removable else 0.0


def probe_slices(scores: UnitScores, budget: Budget, fraction: float | None = None) -> dict[str, list[list[int]]]:
    """Per sub-block, its lowest-scored `fraction` of units (at least one, within the removal limits)."""
    f = probe_fraction(budget) if fraction is None else fraction
    out: dict[str, list[list[int]]] = {}
    for kind in KINDS:
        limits = budget.limits(kind)
        out[kind] = [sorted(lowest(t.float(), min(max(1, int(round(f * t.numel()))), limits[i])))
                     for i, t in enumerate(scores[kind])]
    return out


class _Inject(nn.Module):
    """Stands in for the decoder layers before the probed one: returns the cached input of the probed layer."""

    def __init__(self, states: list[torch.Tensor], attention_type: str | None) -> None:
        super().__init__()
        self.states, self.batch = states, 0
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.states[self.batch]


def _token_nll(base: nn.Module, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL (fp32) and the scored tokens of one batch."""
    logits = base(input_ids=ids, use_cache=False).logits.float()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
    return float(nll), ids[:, 1:].numel()


@torch.no_grad()
def measure_probes(model: nn.Module, batches: Sequence[torch.Tensor], scores: UnitScores, budget: Budget,
                   fraction: float | None = None) -> Probes:
    """Calibration NLL increase of masking each sub-block's probe slice alone (layers before it are not rerun)."""
    base = unwrap(model)
    family = get_family(base)
    layers = family.layers(base)
    device = next(base.parameters()).device
    batches = [b.to(device) for b in batches]
    if not batches:
        raise ValueError("allocation 'calibrated' needs calibration batches to measure its probes")
    # Every layer's input per batch, from one dense pass.
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]

    def keep_input(i):
        def hook(module, args, kwargs):
            inputs[i].append((args[0] if args else kwargs["hidden_states"]).detach())
        return hook

    was_training = base.training
    base.eval()
    handles = [layer.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        total, tokens = 0.0, 0
        for ids in batches:
            nll, n = _token_nll(base, ids)
            total, tokens = total + nll, tokens + n
    finally:
        for h in handles:
            h.remove()
    base_nll = total / tokens
    slices = probe_slices(scores, budget, fraction)
    loss: dict[str, list[float | None]] = {k: [None] * len(layers) for k in KINDS}
    jobs = [(i, kind) for i in range(len(layers)) for kind in KINDS if slices[kind][i]]
    try:
        for i, kind in progress(jobs, "calibrated allocation: probe removals", unit="probe"):
            removed = empty_removed(budget)
            removed[kind][i] = set(slices[kind][i])
            plan = build_plan(budget, removed)
            inject = _Inject(inputs[i], getattr(layers[i], "attention_type", None))
            # Masks go on the real modules first (masked() walks the full layer list), then the earlier layers
            # are replaced by the cached input of layer i.
            with masked(base, plan):
                if i:  # layer 0 is run from the embeddings as usual
                    family.set_layers(base, nn.ModuleList([inject, *list(layers)[i:]]))
                try:
                    total = 0.0
                    for b, ids in enumerate(batches):
                        inject.batch = b
                        total += _token_nll(base, ids)[0]
                finally:
                    family.set_layers(base, layers)
            loss[kind][i] = total / tokens - base_nll
    finally:
        base.train(was_training)
    return Probes(base_nll, loss, slices, tokens)


def calibrated_scores(scores: UnitScores, probes: Probes) -> UnitScores:
    """Each sub-block's scores scaled so its probe slice sums to the probe's measured loss increase."""
    measured = [v for k in KINDS for v in probes.loss[k] if v is not None]
    # A probe that lowered the loss (or changed nothing) is not free: it gets the smallest positive measured cost
    # so its units still go first, in the criterion's order, without a zero scale erasing that order.
    positive = [v for v in measured if v > 0]
    floor = min(positive) * 1e-3 if positive else 1e-12
    out: UnitScores = {}
    for kind in KINDS:
        scaled = []
        for i, t in enumerate(scores[kind]):
            s = t.detach().float().clamp_min(0)
            d = probes.loss[kind][i]
            if d is None:  # nothing removable here: keep the order, scale never used by the knapsack's limits
                scaled.append(s)
                continue
            idx = probes.slices[kind][i]
            total = float(s[idx].sum())
            d = max(float(d), floor)
            if total <= 0:  # the probed units score zero: spread the loss evenly over them, keep the rest's order
                peak = float(s.max())
                scaled.append(d / len(idx) + (s * (d / peak) if peak > 0 else s))
            else:
                scaled.append(s * (d / total))
        out[kind] = scaled
    return out


def calibrated_width(scores: UnitScores, budget: Budget, probes: Probes, reach: float = 2.0) -> Removed:
    """Global knapsack on calibrated scores, each sub-block removing at most `reach` x its probe slice.

    A probe measures the loss at one removal size; the linear scale it gives is trusted up to `reach` times
    that size (loss grows faster than linearly beyond it). If those caps cannot meet the budget, the reach
    grows by one probe size at a time until they can.
    """
    cal = calibrated_scores(scores, probes)
    lim_full = {k: budget.limits(k) for k in KINDS}
    while True:
        lim = {k: [min(lim_full[k][i], int(round(reach * len(probes.slices[k][i])))) for i in range(budget.num_layers)]
               for k in KINDS}
        if sum(sum(lim[k]) * budget.cost(k) for k in KINDS) >= budget.target:
            break
        if all(lim[k] == lim_full[k] for k in KINDS):
            break  # precheck already refused targets beyond the full limits
        reach += 1.0
    removed = empty_removed(budget)
    meet(units(cal, budget), budget.target, removed, lim, 0, budget.c_cost)
    return removed
