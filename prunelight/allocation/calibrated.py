"""`calibrated`: unit scores put on one scale, the calibration loss, by measuring a probe removal per sub-block.

A criterion's scores are comparable inside one sub-block (they order its units) but not across unit kinds
(a GQA group's score and an MLP channel's come from different formulas and activations) nor across layers
(activation scales grow with depth). A global knapsack over raw scores then cuts wherever the scale is small,
not where the loss is: on SmolLM2-135M `taylor` took 2 of 3 KV groups in every layer and `wanda_sp` emptied
the MLPs of layers 1-3 (docs/methods.md, "Calibrated allocation").

The calibrated allocation keeps the criterion's scores as they are and only rescales them:

1. For every sub-block (attention or MLP of one layer) a *probe slice* is taken: its lowest-scored units at
   the operating point, the share f of removable units the budget would take if spread evenly (at least one
   unit: one GQA group on a 3-group model).
2. The probe is masked alone and the calibration NLL increase dL is measured per sequence (paired with the
   dense NLL of the same text, so it has a standard error); only the layers from the probed one onward are
   rerun, from cached layer inputs.
3. Noise is shrunk away per unit kind (empirical Bayes, robust: median prior, MAD spread, no constant to tune):
   a probe within its noise of the kind's median falls back toward it, a clearly sensitive layer keeps its
   measurement (`shrunk_losses`).
4. Scores become non-negative costs (one shift per kind) and every unit of the sub-block is scaled by dL / S,
   S being the probe slice's summed cost, so the slice's calibrated costs add up to its measured loss. Inside a
   sub-block the order and spacing of the criterion's scores are kept; across sub-blocks the scale is the loss.
5. The global fractional knapsack runs on the calibrated costs, each sub-block within a factor `reach` of its
   probe: at most reach x the units the probe removed and at least 1/reach of those it kept (the linear scale a
   probe gives is not trusted far beyond the size it was measured at, on either side).

Its registry row (`allocation/registry.py`) owns its measurement and options: `measure=measure_calibrated`
(the probes, on the calibration batches after scoring, also when the unit scores come from a saved
`prune.scores`; averaged over ranks), `options=CalibratedOptions` (`prune.allocation_args: {reach: 1.5}`) and
`rescale=calibrated_scores`, which `allocation.allocate` applies once, before any shape's function. So every option global takes works on the loss scale: a fixed attention:MLP split (each kind
its share, capped), `auto` (the split search tries shares of this allocation), a KV-cache target (the groups of
lowest calibrated cost), and the stock (UNIFORM) and served (SERVED) layouts, whose functions are global's own
run on calibrated costs (the uniform shape removing the least predicted loss). Under ZeRO-3 (masked forwards on
partitions) it is refused before the weights load; its size pre-check is global's (`width.check_removable`: the
caps widen to the full limits when they must).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from prunelight.allocation.base import AllocationInputs, MeasureInputs, Removal
from prunelight.allocation.budget import Budget, Removed, build_plan, empty_removed, lowest
from prunelight.allocation.split_search import SplitSearch, masked, split_search_of
from prunelight.allocation.width import global_width, kind_targets
from prunelight.console import progress
from prunelight.distributed import mean_over_ranks
from prunelight.families import get_family, unwrap
from prunelight.importance.base import UnitScores
from prunelight.allocation.prefix import recorded_inputs, started_at

KINDS = ("attn", "mlp")


@dataclass
class CalibratedOptions:
    """The calibrated allocation's own options (`prune.allocation_args`)."""

    reach: float = 1.5
    """A sub-block loses at most floor(reach x its probe slice) units and keeps at least 1/reach of what its probe
    kept (the linear loss scale a probe gives is trusted that far; 1.5 lets a one-group probe never vouch for a
    second group); raised by whole steps when the caps cannot meet the budget."""
    split_search: SplitSearch = field(default_factory=SplitSearch)
    """The search of the attention share when `prune.attn_mlp_split: auto`."""

    def __post_init__(self) -> None:
        self.split_search = split_search_of(self.split_search)
        ok = isinstance(self.reach, (int, float)) and not isinstance(self.reach, bool) and math.isfinite(self.reach)
        if not ok or self.reach < 1.0:
            raise ValueError(f"prune.allocation_args.reach={self.reach!r} is not allowed: must be a number in "
                             "[1.0, inf)")
        self.reach = float(self.reach)


@dataclass
class Probes:
    """Measured calibration-loss increases of each sub-block's probe slice (None where nothing can be probed)."""

    base_nll: float
    loss: dict[str, list[float | None]]  # kind -> per layer, NLL increase of removing the probe slice
    slices: dict[str, list[list[int]]]  # kind -> per layer, the probed unit indices
    tokens: int
    stderr: dict[str, list[float | None]] | None = None  # standard error of each loss over calibration sequences

    def as_dict(self) -> dict:
        """JSON-able form for the plan's meta."""
        return {"base_nll": self.base_nll, "loss": self.loss, "stderr": self.stderr,
                "slice_sizes": {k: [len(s) for s in v] for k, v in self.slices.items()}, "tokens": self.tokens}


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


def _token_nll(base: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL (fp64) of each sequence of one batch."""
    logits = base(input_ids=ids, use_cache=False).logits.float()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return nll.view(ids.shape[0], -1).sum(1).double().cpu()


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
    was_training = base.training
    base.eval()
    with recorded_inputs(base) as inputs:  # every layer's input per batch, from one dense pass
        base_seq = torch.cat([_token_nll(base, ids) for ids in batches])
    tokens = sum(ids[:, 1:].numel() for ids in batches)
    per_seq = tokens / base_seq.numel()  # scored tokens per sequence (all sequences have one length per batch)
    base_nll = float(base_seq.sum()) / tokens
    slices = probe_slices(scores, budget, fraction)
    loss: dict[str, list[float | None]] = {k: [None] * len(layers) for k in KINDS}
    stderr: dict[str, list[float | None]] = {k: [None] * len(layers) for k in KINDS}
    jobs = [(i, kind) for i in range(len(layers)) for kind in KINDS if slices[kind][i]]
    try:
        for i, kind in progress(jobs, "calibrated allocation: probe removals", unit="probe"):
            removed = empty_removed(budget)
            removed[kind][i] = set(slices[kind][i])
            plan = build_plan(budget, removed)
            # Masks go on the real modules first (masked() walks the full layer list), then the layers before i
            # stand aside and layer i starts from its cached input.
            with masked(base, plan), started_at(base, i) as start:
                seqs = []
                for b, ids in enumerate(batches):
                    if start is not None:
                        start.state = inputs[i][b]
                    seqs.append(_token_nll(base, ids))
            # Paired per-sequence differences: the same text with and without the slice.
            diff = (torch.cat(seqs) - base_seq) / per_seq
            loss[kind][i] = float(diff.sum()) * per_seq / tokens
            n = diff.numel()
            stderr[kind][i] = float(diff.std(unbiased=True)) / n ** 0.5 if n > 1 else 0.0
    finally:
        base.train(was_training)
    return Probes(base_nll, loss, slices, tokens, stderr)


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    if not n:
        return 0.0
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def shrunk_losses(scores: UnitScores, probes: Probes) -> dict[str, list[float | None]]:
    """Probe losses with their noise shrunk away (empirical Bayes), per unit kind.

    Probes of one kind remove the same share of units (the same parameters), so before measuring, their losses
    are exchangeable: the prior of each is the kind's median loss m. The spread of the losses beyond what the
    probes' own standard errors explain, tau^2 = max(0, MAD^2 - median(se_i^2)) (robust: one very sensitive
    layer does not inflate it), is the real per-layer signal; a layer far outside the noise has its own,
    t_i^2 = max(tau^2, (dL_i - m)^2 - se_i^2), and each loss moves toward m by se_i^2 / (t_i^2 + se_i^2).
    Precise probes keep their measurement, noisy ones fall back on the kind's mean: no constant chooses how much
    to trust a layer.
    """
    out: dict[str, list[float | None]] = {}
    for kind in KINDS:
        loss = probes.loss[kind]
        se = (probes.stderr or {}).get(kind) or [0.0] * len(loss)
        live = [i for i, d in enumerate(loss) if d is not None]
        # Median and MAD: one very sensitive layer (often the first) must not set the prior or the spread.
        center = _median([loss[i] for i in live])
        prior = {i: center for i in live}
        spread = 1.4826 * _median([abs(loss[i] - center) for i in live])  # the normal-consistent MAD
        noise = _median([float(se[i] or 0.0) ** 2 for i in live])
        tau2 = max(0.0, spread ** 2 - noise)
        shrunk: list[float | None] = [None] * len(loss)
        for i in live:
            s2 = float(se[i] or 0.0) ** 2
            # A layer far outside the noise keeps its measurement (its own signal estimate (dL_i - m)^2 - se_i^2
            # beats the pooled one): a normal prior alone would shrink a truly sensitive layer to the median.
            signal = max(tau2, (loss[i] - center) ** 2 - s2)
            w = signal / (signal + s2) if signal + s2 > 0 else 1.0
            shrunk[i] = prior[i] + w * (loss[i] - prior[i])
        out[kind] = shrunk
    return out


def _costs(scores: UnitScores) -> UnitScores:
    """Scores as non-negative costs: one shift per kind so its lowest score is 0 when some are negative.

    Criteria that standardise their scores (FLAP's z-scores) give negative values; one shift per kind keeps
    every spacing between units (what a knapsack compares) and makes a slice's summed cost meaningful.
    """
    out: UnitScores = {}
    for kind in KINDS:
        ts = [t.detach().float() for t in scores[kind]]
        finite = [t[torch.isfinite(t)] for t in ts]
        low = min((float(t.min()) for t in finite if t.numel()), default=0.0)
        shift = min(low, 0.0)
        out[kind] = [torch.nan_to_num(t - shift, nan=0.0, posinf=float(torch.finfo(torch.float32).max), neginf=0.0)
                     for t in ts]
    return out


def calibrated_scores(scores: UnitScores, probes: Probes) -> UnitScores:
    """Each sub-block's scores scaled so its probe slice sums to the probe's (noise-shrunk) loss increase."""
    scores = _costs(scores)
    losses = shrunk_losses(scores, probes)
    measured = [v for k in KINDS for v in losses[k] if v is not None]
    # A probe that lowered the loss (or changed nothing) is not free: it gets the smallest positive measured cost
    # so its units still go first, in the criterion's order, without a zero scale erasing that order.
    positive = [v for v in measured if v > 0]
    floor = min(positive) * 1e-3 if positive else 1e-12
    out: UnitScores = {}
    for kind in KINDS:
        scaled = []
        for i, t in enumerate(scores[kind]):
            s = t.detach().float().clamp_min(0)
            d = losses[kind][i]
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


def trust_cap(n: int, probed: int, reach: float) -> int:
    """Most units a sub-block of `n` may lose on the linear scale of a probe that removed `probed`: within a
    factor `reach` of the probe on both sides, at most reach x the removed units and at least 1/reach of the
    kept ones (removing 60% and extrapolating to 95% shrinks what is left 8-fold: no linear scale holds there)."""
    removed = math.floor(reach * probed + 1e-9)  # a 1-unit probe with reach 1.5 allows 1 unit, not 2
    kept = math.ceil((n - probed) / reach - 1e-9)
    return max(min(removed, n - kept), 0)


def reach_limits(budget: Budget, probes: Probes, reach: float,
                 targets: dict[str, int] | None = None) -> tuple[dict[str, list[int]], float]:
    """Per-sub-block caps `trust_cap`, the reach grown by whole steps until the caps can meet the budget (each
    kind its share, with a split); returns the caps and the reach used."""
    lim_full = {k: budget.limits(k) for k in KINDS}
    sizes = {k: budget.sizes(k) for k in KINDS}
    while True:
        lim = {k: [min(lim_full[k][i], trust_cap(sizes[k][i], len(probes.slices[k][i]), reach))
                   for i in range(budget.num_layers)]
               for k in KINDS}
        room = {k: sum(lim[k]) * budget.cost(k) for k in KINDS}
        if (sum(room.values()) >= budget.target if targets is None
                else all(room[k] >= targets[k] for k in KINDS)):
            return lim, reach
        if all(lim[k] == lim_full[k] for k in KINDS):
            return lim, reach  # precheck (and kind_targets) already refused targets beyond the full limits
        reach += 1.0


def capped_width(costs: UnitScores, budget: Budget, probes: Probes, reach: float = 1.5,
                 attn_share: float | None = None) -> tuple[Removed, float]:
    """Global knapsack on calibrated costs (`calibrated_scores`), each sub-block within `trust_cap` of its probe;
    with `attn_share`, attention gives its share and the MLP the rest, each on the loss scale.

    A probe measures the loss at one removal size; the linear scale it gives is trusted up to `reach` times
    that size (loss grows faster than linearly beyond it). If those caps cannot meet the budget, the reach
    grows by one probe size at a time until they can. Returns the removal and the reach used.
    """
    lim, reach = reach_limits(budget, probes, reach, kind_targets(budget, attn_share))
    return global_width(costs, budget, attn_share, lim=lim), reach


def calibrated_width(scores: UnitScores, budget: Budget, probes: Probes, reach: float = 1.5,
                     attn_share: float | None = None) -> Removed:
    """`capped_width` on the criterion's `scores` put on the loss scale by `probes`."""
    return capped_width(calibrated_scores(scores, probes), budget, probes, reach, attn_share)[0]


def measure_calibrated(inp: MeasureInputs) -> Probes:
    """The row's measurement: the probe removals, averaged over ranks so every rank builds the same plan."""
    if not inp.batches:
        raise ValueError("allocation 'calibrated' needs calibration batches to measure its probe removals")
    probes = measure_probes(inp.model, inp.batches, inp.scores, inp.budget)
    reduce_sum = inp.reduce_sum
    if reduce_sum is not None:
        # Every rank must shrink and rescale the same numbers: losses are averaged, and so are the squared standard
        # errors, divided by the number of ranks (the mean over W equal shards has 1/W of one shard's variance).
        world = float(reduce_sum(torch.ones(1, dtype=torch.float64))[0])
        probes.base_nll = mean_over_ranks([probes.base_nll], reduce_sum)[0]
        for kind, values in probes.loss.items():
            mean = mean_over_ranks([0.0 if v is None else v for v in values], reduce_sum)
            probes.loss[kind] = [None if v is None else m for v, m in zip(values, mean)]
            if probes.stderr is not None:
                se = probes.stderr[kind]
                var = mean_over_ranks([0.0 if v is None else v * v for v in se], reduce_sum)
                probes.stderr[kind] = [None if v is None else (w / world) ** 0.5 for v, w in zip(se, var)]
    return probes


def calibrated_removal(inp: MeasureInputs) -> Removed:
    """The FREE-shape removal `allocation: calibrated` makes from these inputs (probes, rescale, capped knapsack)."""
    probes = measure_calibrated(inp)
    removed, _ = capped_width(calibrated_scores(inp.scores, probes), inp.budget, probes, CalibratedOptions().reach,
                              inp.settings.attn_share)
    return removed


def allocate_calibrated(inp: AllocationInputs) -> Removal:
    """Shape.FREE: the capped global knapsack on calibrated costs (`allocate` rescaled `inp.scores` with the row's
    `rescale`); the true-up moves units on the same scale."""
    removed, reach = capped_width(inp.scores, inp.budget, inp.measured, inp.options.reach, inp.attn_share)
    return Removal(removed, extra={"calibrated_reach": reach})
