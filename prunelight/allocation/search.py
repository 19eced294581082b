"""`search`: per-sub-block widths chosen by the measured divergence of whole candidate models (EvoPress-style).

A candidate is a *level assignment*: for every sub-block how many of its units are removed, GQA groups one at a
time and MLP channels on a grid of `step` channels (`LevelSpace`). Its weights come from the levels database
(`prunelight.levels`: nested removal orders, each level's o_proj / down_proj refitted as the cut will be), so
evaluating a candidate is one masked forward of the model with those weights swapped in.

- Budget: every candidate removes target <= units' parameters < target + step x c_cost (`LevelSpace.repair`); the
  final removal (`finish`) gives back the last channels of the orders until target <= P < target + c_cost counting
  everything `plan_params_removed` counts, the contract of the other allocations (`plan.budget_error_params`).
- Fitness: the mean per-token KL(dense || candidate) of the next-token distributions on calibration sequences
  (`KLFitness`; the dense log-probabilities are computed once). With `fitness_folds` > 1 it is cross-fitted
  (`CrossFitKL`): each fold of the scored sequences is scored with refits fitted without it (`auto`, the default:
  two folds where their copies of the Grams fit in memory, `auto_fitness_folds`).
- Search (`evolve`): (1 + λ) with elitism, as EvoPress: each generation λ offspring of the best candidate, each
  with a few *level moves* (`mutate`): one sub-block gives a level and another of the same kind takes one (equal
  cost), or a GQA group is traded for MLP steps and the MLP side is repaired to the budget window. Selection runs in
  stages: all offspring on a few sequences, the best of them on more, the best one on the most, against the parent
  on the same sequences. The first generation holds the seeds (uniform, global, calibrated's plan with
  `seed_calibrated`, and whatever plans the caller adds, e.g. a stock cut's), so the result is never worse than
  they are on the last stage's calibration KL.
- Shapes (`export.format`): FREE evolves every sub-block's level; SERVED (nemotron_nas) starts from the served
  layouts (one kept group count each) and moves MLP levels only; UNIFORM (stock) measures every uniform shape meeting
  the budget and keeps the lowest KL (a short list: no evolution).
- Resumable: after every generation the state (parent, its fitness, the trajectory, the generator state) is
  written to `state_dir/search_state_<order>-<repair>_<target>.pt`, and a run finding it goes on from there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prunelight.allocation import served as served_layout
from prunelight.allocation import stock as stock_shape
from prunelight.allocation.base import Removal, Shape
from prunelight.allocation.budget import Budget, Removed, build_plan, empty_removed, plan_params_removed
from prunelight.allocation.calibrated import calibrated_removal
from prunelight.allocation.width import global_width, uniform_counts
from prunelight.atomic import atomic_path
from prunelight.console import progress
from prunelight.families import get_family, unwrap
from prunelight.levels import (
    ORDERS,
    LevelsDatabase,
    SubBlock,
    build_database,
    database_key,
    input_grams,
    load_database,
    repair_for,
)
from prunelight.prefix import recorded_inputs, started_at
from prunelight.reconstruct import ReduceSum, output_proj

log = logging.getLogger(__name__)
KINDS = ("attn", "mlp")
Levels = dict[str, list[int]]  # kind -> per layer, removed units (attn: groups; mlp: channels, a multiple of step)
# kl_top_k: auto takes the whole distribution with a float32 linear head (exact from W^T p, hidden-size floats per
# token), else keeps the whole dense distribution up to 1 GiB (SmolLM2's 49k vocabulary, 32 x 128 tokens: 0.8 GB);
# beyond it the top 256, which ranked 12 candidates as the full KL did on SmolLM2 (Spearman 0.993, same best;
# results/benchmarks/search_kl_top_k.md) in 2 KB per token.
AUTO_FULL_KL_BYTES = 1 << 30
AUTO_TOP_K = 256
# fitness_folds: auto cross-fits with 2 folds when their copies of the Grams take at most half of the free memory
# (the rest is for the search's forwards, the refits' solves and their cache); Llama-3-8B's 2 x 28 GB do not fit
# beside the model and the database on an 80 GB GPU, SmolLM2's 2 x 0.3 GB fit anywhere.
AUTO_FOLDS = 2
AUTO_FOLDS_MEMORY_SHARE = 0.5
# generations: auto gives the search a budget in proportion to how much it cuts: a level move shifts one group or one
# MLP grid step, so a deeper cut has proportionally more of them to place. 12 per 20% is the budget that keeps the
# default 20% cut of SmolLM2 within 10 minutes on 2 CPU cores.
AUTO_GENERATIONS = 12
AUTO_GENERATIONS_PER = 0.2
# The fitness keeps every layer's input for 2 candidates scored on all its sequences (the best, which is the search's
# parent, and the newest) where they fit in a quarter of the memory free when it is set up (each fold checks its own;
# SmolLM2, 16 x 128 tokens per fold: 2 x 0.14 GB; Llama-3-8B, 16 x 2048 tokens in bf16: 2 x 8.6 GB).
PREFIX_ENTRIES = 2
PREFIX_MEMORY_SHARE = 0.25
# cut_ridge: cv goes past an end of cv_ridges that wins, by the grid's own step there, while the held-out KL still
# falls, at most this many ridges: the best damping moves with the depth of the cut (SmolLM2: 0.3 at 10-20%, 0.01 or
# less at 50%), so a fixed grid could end where the optimum is still beyond it.
CV_EDGE_STEPS = 3


@dataclass(frozen=True)
class SearchOptions:
    """Options of `prune.allocation: search` (`prune.allocation_args`)."""

    generations: int | str = "auto"
    """Generations of the (1 + λ) search. "auto": AUTO_GENERATIONS per AUTO_GENERATIONS_PER of the parameters removed,
    at least AUTO_GENERATIONS (12 up to a 20% cut, 18 at 30%, 30 at 50%: `auto_generations`); plan.meta.search
    records the count. Deeper cuts start further from the best plan (more levels to move between sub-blocks): on
    SmolLM2 twice the generations at 30% gave 1.555x against 1.598x, still improving (docs/benchmarks.md)."""
    offspring: int = 8
    """λ: candidates per generation, each a few level moves away from the best so far."""
    stages: tuple[int, ...] = (2, 8, 32)
    """Calibration sequences each selection stage scores candidates on (more in later stages, as EvoPress). The
    last stage decides; fewer than 32 sequences over-fit on SmolLM2 (docs/methods.md)."""
    survivors: tuple[int, ...] = (8, 2, 1)
    """Candidates entering each stage (the first is all offspring)."""
    moves: int = 3
    """Most level moves per offspring (1..moves, drawn uniformly)."""
    mlp_levels: int = 32
    """MLP widths on a grid of 1/mlp_levels of the width (rounded to prune.align_channels)."""
    order: str = "obs"
    """Removal order inside a sub-block: "obs" (structured OBS's greedy: each unit the one whose removal, after the
    refit, adds the least output error), "obs_kfac" (the same greedy with that error weighted by the output side of
    the Kronecker-factored Fisher, labels drawn from the dense model: one backward pass over the calibration
    batches; not the default: on SmolLM2 it was 9% better at 50%, level at 20-30% and 2.3% worse at 10%,
    docs/benchmarks.md) or "criterion" (the criterion's scores, lowest first). `prune.reconstruct: obs` chooses
    units again by plain OBS at the cut: pair it with "obs"."""
    seed: int = 0
    """Random seed of the mutations."""
    fitness_folds: int | str = "auto"
    """Cross-fitting of the search's fitness: the scored sequences (the last stage's) are split into this many folds
    and each fold is scored with every level refitted without it (the database's Grams less the fold's), so
    candidates are ranked by how their refits do on text they were not fitted to. 1: the refits have seen the
    sequences they are scored on (in-sample). Each fold holds a copy of the Grams while the search runs (Llama-3-8B:
    28 GB each). "auto": 2 when two copies take at most half of the memory free where the Grams are held (the GPU's,
    or the host's on CPU) on every rank, else 1 (`auto_fitness_folds`; plan.meta.search records the count). On
    SmolLM2, 2 folds gave 1.270x against 1.284x in-sample at 20% and 2.745x against 2.857x at 50%, level at 10%, 1%
    worse at 30% (docs/benchmarks.md)."""
    restarts: int = 1
    """Independent searches from the same first generation, with mutation seeds seed, seed + 1, ... The cut takes
    the result of least KL on the held-out sequences with `cut_ridge: cv` (runs of equal calibration KL differ in
    how they generalize), else of least calibration KL. Each restart costs one search."""
    cut_ridge: str = "cv"
    """How the cut's refits of the chosen levels are damped. "cv": each ridge of `cv_ridges` refits the levels on
    all but the last `cv_sequences` calibration sequences, the one whose model has the least KL on those held-out
    sequences wins, and the cut refits on every sequence with the same absolute damping (the ridge times fit tokens
    / all tokens). "fixed": prune.reconstruct_ridge, the damping the search ranks candidates with."""
    cv_sequences: int = 16
    """Calibration sequences held out to choose the cut's ridge (at most a quarter of them)."""
    cv_ridges: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0)
    """The ridges (x mean diagonal of the kept inputs' Gram, as prune.reconstruct_ridge) `cut_ridge: cv` tries. When
    an end of the grid wins, up to 3 more ridges past it are tried, each one grid step further, while the held-out KL
    falls (SmolLM2 at 50%: 0.01 won the grid, 0.00037 after extending it, 1.1% lower test perplexity;
    `ridge_cv.extended` lists them)."""
    cv_seed: bool = False
    """With `cut_ridge: cv`, also measure the first generation's best seed on the held-out sequences (at the chosen
    ridge) and cut it instead of the search's result when its KL there is lower. Off by default: on SmolLM2 it kept
    the search's result at 20% and 50%, and at 30% took the seed on a 0.14% lower held-out KL, 3% worse on test
    (docs/benchmarks.md)."""
    seeds: dict[str, Any] = field(default_factory=dict)
    """More plans for the first generation besides uniform and global: name -> the units each sub-block removes,
    {"attn": [[group, ...] per layer], "mlp": [[channel, ...] per layer]} (e.g. a stock cut's)."""
    seed_calibrated: bool = True
    """Add the `calibrated` allocation's plan to the first generation (its probes run on the
    prune.importance_batches sequences), so the search is never worse than the default on calibration KL."""
    state_dir: str | None = None
    """A folder for the levels database and the resumable search state (None: the run's output folder; the
    database is kept per model, criterion, order, ridge and calibration tokens, so it serves every ratio)."""
    kl_top_k: int | str | None = "auto"
    """null: the KL over the whole next-token distribution (with a float32 linear head, exact from hidden-size floats
    per token; otherwise the dense log-probabilities are kept: sequences x length x vocabulary x 4 B, 17 GB for
    16 x 2048 tokens of a 128k vocabulary); k: over the dense model's k most likely tokens at each position plus one
    bucket for all the others (k x 8 B per token; a lower bound of the full KL, equal to it when k is the
    vocabulary); "auto": the whole distribution with a float32 linear head or when it fits in 1 GiB, else k = 256
    (`top_k_for`)."""

    def __post_init__(self) -> None:
        k = self.kl_top_k
        if k is not None and k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"prune.allocation_args.kl_top_k={k!r} is not allowed: null (the full distribution), "
                             "an integer >= 1 (e.g. 256) or auto")
        ridges = tuple(self.cv_ridges)
        object.__setattr__(self, "cv_ridges", ridges)
        if self.cut_ridge not in ("cv", "fixed"):
            raise ValueError(f"prune.allocation_args.cut_ridge={self.cut_ridge!r} is not allowed: use cv or fixed")
        if not ridges or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < math.inf
                             for r in ridges):
            raise ValueError(f"prune.allocation_args.cv_ridges={list(ridges)} is not allowed: a non-empty list of "
                             "finite numbers >= 0")
        for name in ("seed_calibrated", "cv_seed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"prune.allocation_args.{name}={getattr(self, name)!r} is not allowed: true or false")
        folds = self.fitness_folds
        if folds != "auto" and (isinstance(folds, bool) or not isinstance(folds, int) or folds < 1):
            raise ValueError(f"prune.allocation_args.fitness_folds={folds!r} is not allowed: an integer >= 1 or auto")
        gens = self.generations
        if gens != "auto" and (isinstance(gens, bool) or not isinstance(gens, int) or gens < 0):
            raise ValueError(f"prune.allocation_args.generations={gens!r} is not allowed: an integer >= 0 or auto")
        for name in ("offspring", "moves", "mlp_levels", "cv_sequences", "restarts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"prune.allocation_args.{name}={v!r} is not allowed: an integer >= 1")
        stages, surv = tuple(self.stages), tuple(self.survivors)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "survivors", surv)
        if not stages or len(stages) != len(surv) or any(int(s) < 1 for s in stages + surv):
            raise ValueError(f"prune.allocation_args.stages={list(stages)} / survivors={list(surv)} are not allowed: "
                             "two lists of equal length of integers >= 1")
        if list(surv) != sorted(surv, reverse=True) or list(stages) != sorted(stages):
            raise ValueError(f"prune.allocation_args.stages={list(stages)} / survivors={list(surv)} are not allowed: "
                             "stages must not shrink and survivors must not grow")
        if self.order not in ORDERS:
            raise ValueError(f"prune.allocation_args.order={self.order!r} is not allowed: use one of "
                             f"{', '.join(ORDERS)}")
        seeds = dict(self.seeds or {})
        for name, units in seeds.items():
            if not isinstance(units, dict) or set(units) != set(KINDS) or not all(
                    isinstance(v, (list, tuple)) for v in units.values()):
                raise ValueError(f"prune.allocation_args.seeds.{name} is not allowed: a dict of the removed units "
                                 "per layer, {attn: [[group, ...], ...], mlp: [[channel, ...], ...]}")
        object.__setattr__(self, "seeds", seeds)

    def top_k_for(self, sequences: int, length: int, vocab: int, linear: bool = False) -> int | None:
        """The k the fitness uses for `sequences` x `length` tokens over `vocab` (None: the whole distribution);
        `linear`: the model has a float32 linear head, whose whole-distribution KL needs no vocabulary-wide copy."""
        if self.kl_top_k != "auto":
            return self.kl_top_k
        if linear:
            return None
        full = sequences * max(length - 1, 1) * vocab * 4
        return None if full <= AUTO_FULL_KL_BYTES else min(AUTO_TOP_K, vocab)

    def seed_plans(self) -> dict[str, Removed]:
        """`seeds` as removals (sets of units per sub-block)."""
        return {name: {k: [set(int(u) for u in layer) for layer in units[k]] for k in KINDS}
                for name, units in self.seeds.items()}


# --- the space of level assignments --------------------------------------------------------------------------------
@dataclass
class LevelSpace:
    """Which levels each sub-block may take, their parameter cost and the budget window."""

    budget: Budget
    step: int  # MLP channels per level
    limits: dict[str, list[int]]  # most units removable per sub-block (a multiple of step for the MLP)
    fixed_attn: bool = False  # moves change MLP levels only (the served layout: attention comes from its seeds)

    @classmethod
    def of(cls, budget: Budget, mlp_levels: int, align: int = 1, fixed_attn: bool = False) -> LevelSpace:
        """Levels from the budget's limits: every group count, MLP widths every 1/mlp_levels (x align)."""
        width = max(budget.n_chans) if budget.n_chans else 1
        step = max(1, int(round(width / mlp_levels)))
        step = max(align, int(round(step / align)) * align) if align > 1 else step
        lim = {"attn": list(budget.limits("attn")), "mlp": [(m // step) * step for m in budget.limits("mlp")]}
        return cls(budget, step, lim, fixed_attn)

    def cost(self, levels: Levels) -> int:
        """Unit parameters the assignment removes."""
        return sum(levels["attn"]) * self.budget.g_cost + sum(levels["mlp"]) * self.budget.c_cost

    @property
    def window(self) -> int:
        """Width of the budget window in parameters: one MLP level."""
        return self.step * self.budget.c_cost

    def within(self, levels: Levels) -> bool:
        """Whether the assignment is inside target <= cost < target + one MLP level, and inside the limits."""
        c = self.cost(levels)
        inside = all(0 <= levels[k][i] <= self.limits[k][i] for k in KINDS for i in range(len(levels[k])))
        return inside and self.budget.target <= c < self.budget.target + self.window

    def snap(self, removed_counts: Levels) -> Levels:
        """An assignment near the given removed counts per sub-block (MLP on the grid), repaired to the window."""
        out = {"attn": [min(a, lim) for a, lim in zip(removed_counts["attn"], self.limits["attn"])],
               "mlp": [min(int(round(m / self.step)) * self.step, lim)
                       for m, lim in zip(removed_counts["mlp"], self.limits["mlp"])]}
        return self.repair(out, random.Random(0))

    def repair(self, levels: Levels, rng: random.Random) -> Levels | None:
        """Move MLP levels of random sub-blocks until the cost is inside the window; None if it cannot."""
        lv = {k: list(v) for k, v in levels.items()}
        target, window = self.budget.target, self.window
        n = len(lv["mlp"])
        for _ in range(10 * sum(self.limits["mlp"]) // max(self.step, 1) + 10):
            c = self.cost(lv)
            if c < target:
                room = [i for i in range(n) if lv["mlp"][i] + self.step <= self.limits["mlp"][i]]
                if not room:
                    return None
                lv["mlp"][rng.choice(room)] += self.step
            elif c >= target + window:
                room = [i for i in range(n) if lv["mlp"][i] >= self.step]
                if not room:
                    return None
                lv["mlp"][rng.choice(room)] -= self.step
            else:
                return lv
        return None

    def mutate(self, levels: Levels, rng: random.Random, moves: int) -> Levels | None:
        """1..moves level moves: equal-cost swaps inside a kind, or a GQA group traded against the MLP (repaired)."""
        lv = {k: list(v) for k, v in levels.items()}
        for _ in range(rng.randint(1, moves)):
            kind = "mlp" if self.fixed_attn or not any(self.limits["attn"]) or rng.random() < 0.5 else "attn"
            unit = self.step if kind == "mlp" else 1
            ups = [i for i in range(len(lv[kind])) if lv[kind][i] + unit <= self.limits[kind][i]]
            downs = [i for i in range(len(lv[kind])) if lv[kind][i] >= unit]
            if not ups or not downs:
                continue
            up = rng.choice(ups)
            if kind == "attn" and rng.random() < 0.5:  # trade: one group more or less, the MLP repairs the budget
                if rng.random() < 0.5:
                    lv["attn"][up] += 1
                else:
                    lv["attn"][rng.choice(downs)] -= 1
                continue
            down = rng.choice([i for i in downs if i != up] or downs)
            if down == up:
                continue
            lv[kind][up] += unit
            lv[kind][down] -= unit
        return self.repair(lv, rng)

    def removed(self, levels: Levels, db: LevelsDatabase) -> Removed:
        """The units removed: each sub-block's first `levels` units of its order."""
        out = empty_removed(self.budget)
        for kind in KINDS:
            for i, r in enumerate(levels[kind]):
                if r:
                    out[kind][i] = set(db.blocks[(kind, i)].order[:r])
        return out


def counts_of(removed: Removed) -> Levels:
    """Per-sub-block removed counts of a removal."""
    return {k: [len(s) for s in removed[k]] for k in KINDS}


def finish(space: LevelSpace, levels: Levels, db: LevelsDatabase, align: int = 1) -> Removed:
    """The final removal: the assignment's units, then the last channels of the orders given back (one sub-block
    after another, most-removed first, `align` at a time) until target <= P < target + align x c_cost counting
    everything the plan removes."""
    budget = space.budget
    removed = space.removed(levels, db)
    total = plan_params_removed(budget, build_plan(budget, removed))
    excess = (total - budget.target) // (budget.c_cost * align)
    layers = sorted(range(budget.num_layers), key=lambda i: -len(removed["mlp"][i]))
    live = [i for i in layers if 0 < len(removed["mlp"][i]) < budget.n_chans[i]]
    k = 0
    while excess > 0 and live:
        i = live[k % len(live)]
        order = db.blocks[("mlp", i)].order
        r = len(removed["mlp"][i])
        if r > align:
            for j in order[r - align:r]:
                removed["mlp"][i].discard(j)
            excess -= 1
        else:
            live.remove(i)
            continue
        k += 1
    return removed


# --- fitness --------------------------------------------------------------------------------------------------------
class KLFitness:
    """Mean per-token KL(dense || candidate) of next-token distributions on the first n calibration sequences.

    With `top_k` the distributions are coarsened to the dense model's k most likely tokens at each position plus
    one bucket for the rest: KL = sum_top p (log p - log q) + p_rest (log p_rest - log q_rest), a lower bound of
    the full KL (coarsening never raises a divergence) that keeps k log-probabilities and indices per token.
    """

    def __init__(self, model: nn.Module, db: LevelsDatabase, sequences: torch.Tensor, batch: int = 8,
                 reduce_sum: ReduceSum | None = None, top_k: int | None = None,
                 prefix_entries: int | None = None) -> None:
        self.base = unwrap(model)
        self.reduce_sum = reduce_sum  # under DDP: each rank scores its own sequences, the KL is their pooled mean
        self.family = get_family(self.base)
        self.db, self.batch = db, batch
        self.device = next(self.base.parameters()).device
        self.seqs = sequences.to(self.device)
        self.projs = {(k, i): output_proj(self.family, layer, k)
                      for i, layer in enumerate(self.family.layers(self.base)) for k in KINDS
                      if (k, i) in db.blocks}
        self.dense_w = {key: p.weight.data for key, p in self.projs.items()}
        self.top_k = top_k
        self.n_layers = len(self.family.layers(self.base))
        self.decoder = self.base.get_decoder()
        self.head = self.family.logits_head(self.base)
        self.linear = top_k is None and linear_head(self.base)
        with torch.no_grad():
            self.dense = [self._dense(self._hidden(chunk)) for chunk in torch.split(self.seqs, batch)]
        self.forwards = 0  # sequences run
        self.layers_run = 0  # decoder layers run, summed over sequences (forwards x layers without the prefixes)
        # Candidates scored on every sequence keep each decoder layer's input. Offspring differ from their parent
        # in a few sub-blocks, so each runs from its first layer that differs from a kept candidate. The one of
        # least KL (the search's parent) is never dropped; of the others the least recently used goes first.
        self.prefix_entries = prefix_entries if prefix_entries is not None else self._prefix_entries()
        self.kept: OrderedDict[tuple, tuple[float, list[list[torch.Tensor]]]] = OrderedDict()

    def _prefix_entries(self) -> int:
        """PREFIX_ENTRIES when that many copies of every layer's input fit in PREFIX_MEMORY_SHARE of the free
        memory on every rank (ranks must run the same layers), else 0 (every candidate runs every layer)."""
        hidden = int(self.base.get_input_embeddings().weight.shape[1])
        dtype = next(self.base.parameters()).dtype
        need = PREFIX_ENTRIES * self.seqs.numel() * hidden * self.n_layers * torch.finfo(dtype).bits // 8
        free = free_memory(self.device)
        fits = free is not None and need <= PREFIX_MEMORY_SHARE * free
        if self.reduce_sum is not None:
            fits = float(self.reduce_sum(torch.tensor([0.0 if fits else 1.0], dtype=torch.float64))[0]) == 0.0
        return PREFIX_ENTRIES if fits else 0

    def _dense(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What is kept of the dense next-token distributions of one batch: with a linear head, per position the
        hidden state h, logsumexp(z) and W^T p; else all log-probabilities (indices None) or the top k and their
        indices."""
        # fp32: bf16 log-probabilities alone put ~2e-4 nats of KL between the dense model and itself.
        logits = self.head(hidden).float()
        if self.linear:
            lse = torch.logsumexp(logits, dim=-1)
            p = (logits - lse.unsqueeze(-1)).exp_()
            return hidden, lse, p @ self.base.get_output_embeddings().weight
        logp = F.log_softmax(logits, dim=-1)
        if self.top_k is None or self.top_k >= logp.shape[-1]:
            return logp, None
        return logp.topk(self.top_k, dim=-1)

    def _linear_kl(self, dense: tuple[torch.Tensor, ...], hidden: torch.Tensor) -> float:
        """Summed KL(dense || candidate) over one batch's positions with a linear head z = W h + b: per position
        sum_v p (log p - log q) = lse(z_c) - lse(z_d) - (h_c - h_d) . W^T p (the bias cancels), where the dense side
        is kept as h_d, lse(z_d) and W^T p; the differences keep it exact to float32 for near-dense candidates."""
        rows = hidden.shape[0]
        h_d, lse_d, wp = (t[:rows] for t in dense)
        lse = torch.logsumexp(self.head(hidden).float(), dim=-1)
        kl = (lse - lse_d).double() - ((hidden.float() - h_d) * wp).sum(-1).double()
        return float(kl.sum())

    @staticmethod
    def _kl(top: torch.Tensor, idx: torch.Tensor | None, logp: torch.Tensor) -> float:
        """Summed KL(dense || candidate) over the chunk's positions (`idx` None: the whole distribution)."""
        if idx is None:
            return float((top.exp() * (top - logp)).sum())
        q = logp.gather(-1, idx)
        p_rest = (1 - top.exp().sum(-1)).clamp_min(0).double()
        q_rest = (1 - q.exp().sum(-1)).clamp_min(1e-30).double()
        rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), 0.0)
        return float((top.exp() * (top - q)).sum()) + float(rest.sum())

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states at every position that predicts a next token."""
        return self.decoder(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]

    def _start(self, key: tuple) -> tuple[int, list[list[torch.Tensor]] | None]:
        """The first layer to run for the candidate `key` and the kept inputs it starts from (0, None: all)."""
        best, source = 0, None
        for kept_key in self.kept:
            if kept_key[0] != key[0]:  # refitted another way: no layer's output is known
                continue
            same = next((i for i, (a, b) in enumerate(zip(key[1], kept_key[1])) if a != b), self.n_layers)
            start = min(same, self.n_layers - 1)  # the same candidate still runs its last layer
            if start > best:
                best, source = start, kept_key
        if source is None:
            return 0, None
        self.kept.move_to_end(source)
        return best, self.kept[source][1]

    def _keep(self, key: tuple, kl: float, states: list[list[torch.Tensor]]) -> None:
        """Keep a candidate's layer inputs; past `prefix_entries`, drop the least recently used but the best."""
        self.kept[key] = (kl, states)
        self.kept.move_to_end(key)
        while len(self.kept) > self.prefix_entries:
            best = min(self.kept, key=lambda k: self.kept[k][0])
            del self.kept[next(k for k in self.kept if k != best)]

    @torch.no_grad()
    def __call__(self, levels: Levels, n: int) -> float:
        """KL on the first `n` sequences with the assignment's weights swapped in (the dense ones restored after)."""
        was = self.base.training
        self.base.eval()
        # The refits' ridge and kind, then per layer the levels: the first layer that differs is where a run starts.
        key = ((self.db.ridge, self.db.repair), tuple(zip(levels["attn"], levels["mlp"])))
        start, source = self._start(key) if self.prefix_entries else (0, None)
        keep = self.prefix_entries > 0 and n >= self.seqs.shape[0]
        record_from = start if keep else self.n_layers  # the layers whose inputs this run adds to the kept ones
        try:
            for (kind, i), proj in self.projs.items():
                r = levels[kind][i]
                if r:
                    proj.weight.data = self.db.weight_at(kind, i, r).to(proj.weight.dtype)
            total, tokens = 0.0, 0
            with started_at(self.base, start) as stand, recorded_inputs(self.base, record_from) as inputs:
                for b, chunk in enumerate(torch.split(self.seqs[:n], self.batch)):
                    rows = chunk.shape[0]  # the last chunk may hold fewer sequences than the dense one kept
                    if stand is not None:
                        stand.state = source[start][b][:rows]
                    hidden = self._hidden(chunk)
                    if self.linear:
                        total += self._linear_kl(self.dense[b], hidden)
                    else:
                        top, idx = self.dense[b]
                        logp = F.log_softmax(self.head(hidden).float(), dim=-1)
                        total += self._kl(top[:rows], None if idx is None else idx[:rows], logp)
                    tokens += hidden.shape[0] * hidden.shape[1]
                    self.forwards += rows
                    self.layers_run += rows * (self.n_layers - start)
            if self.reduce_sum is not None:
                t = self.reduce_sum(torch.tensor([total, float(tokens)], dtype=torch.float64)).cpu()
                total, tokens = float(t[0]), int(t[1])
            kl = total / max(tokens, 1)
            if keep:
                self._keep(key, kl, [source[i] if i < start else inputs[i] for i in range(self.n_layers)])
            return kl
        finally:
            for key_, proj in self.projs.items():
                proj.weight.data = self.dense_w[key_]
            self.base.train(was)


def linear_head(model: nn.Module) -> bool:
    """Whether the logits are the float32 LM head's output itself (no soft cap): the fitness's exact KL then keeps
    hidden-size floats per token instead of the vocabulary's (`KLFitness._linear_kl`)."""
    base = unwrap(model)
    head = base.get_output_embeddings()
    return (get_family(base).logit_softcap(base.config) is None and isinstance(head, nn.Linear)
            and head.weight.dtype == torch.float32)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: the GPU's free memory, the host's available memory for CPU (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        import psutil  # a dependency of accelerate; only needed here

        return int(psutil.virtual_memory().available)
    return None


def auto_fitness_folds(db: LevelsDatabase, sequences: int, reduce_sum: ReduceSum | None = None) -> int:
    """`fitness_folds: auto`: AUTO_FOLDS when every rank scores at least that many sequences and the folds' copies
    of the Grams take at most AUTO_FOLDS_MEMORY_SHARE of the memory free where the Grams are held, else 1."""
    grams = [b.gram for b in db.blocks.values()]
    need = AUTO_FOLDS * sum(g.numel() * g.element_size() for g in grams)
    free = free_memory(grams[0].device) if grams else None
    fits = sequences >= AUTO_FOLDS and free is not None and need <= AUTO_FOLDS_MEMORY_SHARE * free
    if reduce_sum is not None:  # every rank must take the same count: one that does not fit decides for all
        fits = float(reduce_sum(torch.tensor([0.0 if fits else 1.0], dtype=torch.float64))[0]) == 0.0
    folds = AUTO_FOLDS if fits else 1
    log.info("allocation search: fitness_folds auto -> %d (fold copies %.2f GB, free %s)", folds, need / 1e9,
             "unknown" if free is None else f"{free / 1e9:.1f} GB")
    return folds


def auto_generations(budget: Budget) -> int:
    """`generations: auto`: AUTO_GENERATIONS per AUTO_GENERATIONS_PER of the model's parameters removed, at least
    AUTO_GENERATIONS."""
    removed = budget.target / budget.total if budget.total else 0.0
    generations = max(AUTO_GENERATIONS, round(AUTO_GENERATIONS * removed / AUTO_GENERATIONS_PER))
    log.info("allocation search: generations auto -> %d (%.0f%% of the parameters removed)", generations,
             100 * removed)
    return generations


def without_sequences(model: nn.Module, db: LevelsDatabase, rows: torch.Tensor, batch: int,
                      reduce_sum: ReduceSum | None = None) -> LevelsDatabase:
    """The database refitted without `rows`: the same orders, each Gram less those sequences' (summed over ranks)."""
    grams, tokens = input_grams(model, list(rows.split(max(batch, 1))), reduce_sum)
    blocks = {}
    for (kind, i), b in db.blocks.items():
        g = grams[i][kind].to(b.gram.device)
        blocks[(kind, i)] = SubBlock(b.order, b.columns, g.neg_().add_(b.gram), b.weight)  # in place: G - G_rows
    del grams
    return LevelsDatabase(blocks, db.order, db.ridge, db.tokens - tokens, repair=db.repair,
                          cache_bytes=db.cache_bytes)


class CrossFitKL:
    """`KLFitness` cross-fitted: the sequences in `folds` contiguous folds, each scored with the levels refitted
    without its own sequences; the KL on the first n sequences is the token-weighted mean over the folds they span.

    In-sample, a level's least-squares refit partly fits the noise of the very tokens it is scored on, which flatters
    every refitted level by an amount of its own; here each fold measures what its refits do on unseen tokens."""

    def __init__(self, model: nn.Module, db: LevelsDatabase, sequences: torch.Tensor, folds: int, batch: int = 8,
                 reduce_sum: ReduceSum | None = None, top_k: int | None = None) -> None:
        parts = [p for p in torch.tensor_split(sequences, min(folds, sequences.shape[0])) if p.shape[0]]
        self.sizes = [p.shape[0] for p in parts]
        self.parts = [KLFitness(model, without_sequences(model, db, p, batch, reduce_sum), p, reduce_sum=reduce_sum,
                                top_k=top_k) for p in progress(parts, "search fitness folds", unit="fold")]

    @property
    def forwards(self) -> int:
        """Calibration sequences run by every fold."""
        return sum(p.forwards for p in self.parts)

    @property
    def layers_run(self) -> int:
        """Decoder layers run by every fold, summed over sequences."""
        return sum(p.layers_run for p in self.parts)

    def __call__(self, levels: Levels, n: int) -> float:
        """Mean KL on the first `n` sequences, each fold's with its own refits (rows of equal length)."""
        total, left = 0.0, n
        for size, part in zip(self.sizes, self.parts):
            k = min(left, size)
            if k <= 0:
                break
            total += k * part(levels, k)
            left -= k
        return total / max(n - left, 1)


# --- the search -----------------------------------------------------------------------------------------------------
@dataclass
class SearchResult:
    """The best assignment, its KL, and what the search did (for plan.meta and the report)."""

    levels: Levels
    kl: float
    seeds: dict[str, float]
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    times_s: dict[str, float] = field(default_factory=dict)
    step: int = 0
    forwards: int = 0  # calibration sequences run by the fitness
    layers_run: int = 0  # decoder layers those forwards ran (a kept prefix is not run again)
    layers: int = 0  # decoder layers of the model
    kl_top_k: int | None = None  # the k the fitness used (None: the whole distribution)
    repair: str = "least_squares"  # the levels' refit (the database's)
    ridge_cv: dict[str, Any] = field(default_factory=dict)  # the cut's ridge and how it was chosen
    restarts: dict[str, float] = field(default_factory=dict)  # with restarts: "seed=s" -> its calibration KL
    fitness_folds: int = 1  # folds of the cross-fitted fitness (1: in-sample refits)
    generations: int = 0  # generations the search ran to (the resolved `generations`)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        out = {"kl": self.kl, "seeds_kl": self.seeds, "trajectory": self.trajectory, "times_s": self.times_s,
               "mlp_step": self.step, "levels": self.levels, "forwards": self.forwards, "kl_top_k": self.kl_top_k,
               "repair": self.repair, "ridge_cv": self.ridge_cv, "fitness_folds": self.fitness_folds,
               "generations": self.generations, "layers_run": self.layers_run, "layers": self.layers}
        if self.restarts:
            out["restarts_kl"] = self.restarts
        return out


def evolve(space: LevelSpace, fitness: Callable[[Levels, int], float], seeds: dict[str, Levels],
           options: SearchOptions, state_path: Path | None = None) -> SearchResult:
    """(1 + λ) search with staged selection from the best seed (module docstring); resumes from `state_path`."""
    t0 = time.perf_counter()
    final = options.stages[-1]
    state = torch.load(state_path, weights_only=False) if state_path is not None and state_path.is_file() else None
    rng = random.Random(options.seed)
    if state is not None and state.get("options") == _opts(options):
        parent, best, seed_kl, trajectory, start = (state["parent"], state["kl"], state["seeds"], state["trajectory"],
                                                    state["generation"])
        rng.setstate(state["rng"])
        log.info("allocation search: resumed at generation %d (KL %.5f)", start, best)
    else:
        seed_kl = {}
        parent, best = None, math.inf
        for name, lv in seeds.items():
            if lv is None or not space.within(lv):
                continue
            kl = fitness(lv, final)
            seed_kl[name] = kl
            if kl < best:
                parent, best = lv, kl
        if parent is None:
            raise ValueError("allocation search: no seed assignment meets the budget")
        trajectory, start = [{"generation": 0, "kl": best, "seconds": time.perf_counter() - t0}], 0
    bar = progress(range(start, options.generations), "allocation search", total=options.generations, unit="gen")
    bar.update(start)
    for gen in bar:
        kids = []
        for _ in range(options.offspring * 4):
            if len(kids) == options.offspring:
                break
            kid = space.mutate(parent, rng, options.moves)
            if kid is not None and kid != parent and kid not in kids:
                kids.append(kid)
        pool = kids
        for survivors, n in zip(options.survivors, options.stages):
            pool = pool[:survivors]
            if n == final:
                break
            pool = sorted(pool, key=lambda lv: fitness(lv, n))
        for lv in pool:
            kl = fitness(lv, final)
            if kl < best:
                parent, best = lv, kl
        trajectory.append({"generation": gen + 1, "kl": best, "seconds": time.perf_counter() - t0})
        bar.set_postfix(kl=f"{best:.5f}")
        if state_path is not None:
            _save_state(state_path, {"parent": parent, "kl": best, "seeds": seed_kl, "trajectory": trajectory,
                                     "generation": gen + 1, "rng": rng.getstate(), "options": _opts(options)})
    return SearchResult(parent, best, seed_kl, trajectory, {"search": time.perf_counter() - t0}, space.step)


def _opts(options: SearchOptions) -> dict:
    # not the cut's ridge: it does not change a step
    out = {k: getattr(options, k) for k in ("offspring", "stages", "survivors", "moves", "mlp_levels", "order", "seed",
                                            "kl_top_k")}
    if options.fitness_folds != 1:  # only then: states saved before the option still resume
        out["fitness_folds"] = options.fitness_folds
    return out


def _save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # a temporary name of its own: every rank writes the same state
        torch.save(state, tmp)


def calibration_rows(batches: Sequence[torch.Tensor], n: int | None = None) -> torch.Tensor:
    """The first `n` calibration sequences (None: all) as one [n, seq_len] tensor (rows of equal length)."""
    rows = [r for b in batches for r in b]
    if not rows:
        raise ValueError("allocation search needs calibration batches")
    length = min(r.numel() for r in rows)
    return torch.stack([r[:length] for r in rows[:n]])


def cross_validate_ridge(model: nn.Module, db: LevelsDatabase, batches: Sequence[torch.Tensor], levels: Levels,
                         options: SearchOptions, reduce_sum: ReduceSum | None = None, top_k: int | None = None,
                         alternatives: dict[str, Levels] | None = None) -> tuple[LevelsDatabase, dict[str, Any]]:
    """The cut's damping by cross-validation (`cut_ridge: cv`): the database with the chosen ridge, and the report.

    `alternatives` (name -> levels: the best seed with `cv_seed`, the other `restarts`) are measured on the same
    held-out sequences at the chosen ridge; the report's `plan` names the one of least held-out KL ("search":
    `levels`), and `candidates` holds every held-out KL.

    With few calibration tokens per refit input (SmolLM2: 8192 tokens for down_proj's 1536 inputs) the refits fit
    their own tokens far better than other text (the search's KL on its sequences is about half the KL on other
    WikiText-2 windows), so the damping is chosen on held-out sequences instead of fixed. Ridge regression's
    optimal absolute damping λ does not grow with the tokens while the Gram's mean diagonal does, hence the scaling
    of the winner by fit tokens / all tokens for the final refit on every sequence.
    """
    t0 = time.perf_counter()
    rows = calibration_rows(batches)
    h = min(options.cv_sequences, rows.shape[0] // 4)
    if h == 0:
        log.warning("allocation search: cut_ridge cv needs 4 calibration sequences or more; the cut keeps "
                    "prune.reconstruct_ridge=%s", db.ridge)
        return db, {"chosen_by": "fixed (fewer than 4 calibration sequences)", "ridge": db.ridge}
    held = rows[-h:]
    fit = without_sequences(model, db, held, int(batches[0].shape[0]), reduce_sum)
    fitness = KLFitness(model, fit, held, reduce_sum=reduce_sum, top_k=top_k)
    kl: dict[float, float] = {}

    def measure(r: float) -> None:
        fit.set_ridge(r)
        kl[float(r)] = fitness(levels, h)

    for r in progress(list(options.cv_ridges), "cut ridge (cross-validation)", unit="ridge"):
        measure(r)
    extended = []
    while len(extended) < CV_EDGE_STEPS and (r := beyond_edge(kl)) is not None:
        measure(r)
        extended.append(r)
    kl = dict(sorted(kl.items()))
    best = min(kl, key=lambda r: (kl[r], r))
    candidates = {"search": kl[best]}
    if alternatives:
        fit.set_ridge(best)
        for name, lv in alternatives.items():
            candidates[name] = fitness(lv, h)
    plan = min(candidates, key=lambda k: (candidates[k], k != "search"))  # a tie keeps the search's result
    final = best * fit.tokens / db.tokens
    out = dataclasses.replace(db, ridge=final, ridge_validated=True)  # the same Grams, refits derived anew
    report = {"chosen_by": "cv", "sequences": h, "kl": {str(r): v for r, v in kl.items()}, "chosen": best,
              "ridge": final, "seconds": time.perf_counter() - t0}
    if extended:
        report["extended"] = extended
    if alternatives:
        report.update(candidates=candidates, plan=plan)
    log.info("allocation search: cut ridge %.4g (%.4g on %d held-out sequences, KL %.5f; %s)%s", final, best, h,
             kl[best], ", ".join(f"{r:g}: {v:.5f}" for r, v in kl.items()),
             f"; past the end of cv_ridges: {', '.join(f'{r:g}' for r in extended)}" if extended else "")
    if plan != "search":
        log.info("allocation search: the cut takes %r (held-out KL %.5f against the search's %.5f)", plan,
                 candidates[plan], candidates["search"])
    return out, report


def beyond_edge(kl: dict[float, float]) -> float | None:
    """The next ridge past the end of the grid that holds the least KL (the grid's step there), or None when the
    least is inside the grid, the grid has fewer than two ridges, or the end is a ridge of 0."""
    ridges = sorted(kl)
    if len(ridges) < 2:
        return None
    best = min(ridges, key=lambda r: (kl[r], r))
    lo, hi = ridges[0], ridges[-1]
    if best == lo and lo > 0 and ridges[1] > 0:
        return float(f"{lo * lo / ridges[1]:.3g}")  # 3 digits: the ridge names a row of plan.json and the log
    if best == hi and ridges[-2] > 0:
        return float(f"{hi * hi / ridges[-2]:.3g}")
    return None


# --- glue: one measurement, one allocation --------------------------------------------------------------------------
def seed_levels(space: LevelSpace, scores, plans: dict[str, Removed] | None = None) -> dict[str, Levels]:
    """The first generation: the uniform counts, global's knapsack on the criterion's scores, and `plans`."""
    budget = space.budget
    out: dict[str, Levels] = {}
    g, c = uniform_counts(budget)
    out["uniform"] = space.snap({"attn": [min(g, n) for n in budget.n_groups], "mlp": [c] * budget.num_layers})
    out["global"] = space.snap(counts_of(global_width(scores, budget)))
    for name, removed in (plans or {}).items():
        out[name] = space.snap(counts_of(removed))
    return {k: v for k, v in out.items() if v is not None}


def served_seeds(space: LevelSpace, scores, align: int, plans: dict[str, Removed] | None = None
                 ) -> tuple[dict[str, Levels], list[dict]]:
    """The first generation under the served layout: for each kept group count, the served allocation's best
    layout (`served.best_per_count`), and its attention with the MLP widths of uniform, global and `plans`;
    with the served candidates (their report)."""
    free = seed_levels(space, scores, plans)
    cands = served_layout.best_per_count(served_layout.candidates(scores, space.budget, align))
    out: dict[str, Levels] = {}
    for c in cands:
        attn = counts_of(c["_removed"])["attn"]
        name = f"g{c['groups_kept']}" + (f"-{len(c['attention_removed_layers'])}" if c["attention_removed_layers"]
                                         else "")
        out[f"served {name}"] = space.snap(counts_of(c["_removed"]))
        for seed, lv in free.items():
            out[f"{seed} {name}"] = space.snap({"attn": attn, "mlp": lv["mlp"]})
    return {k: v for k, v in out.items() if v is not None}, [
        {k: v for k, v in c.items() if k != "_removed"} for c in cands]


def uniform_seeds(space: LevelSpace, scores, align: int) -> tuple[dict[str, Levels], list[dict]]:
    """Every uniform shape meeting the budget (`stock.candidates`) as an assignment, with the candidates."""
    budget = space.budget
    cands = stock_shape.candidates(scores, budget, align)
    n_c = budget.n_chans[0]
    out = {f"groups_removed={c['groups_removed_per_layer']}": {
        "attn": [c["groups_removed_per_layer"]] * budget.num_layers,
        "mlp": [n_c - c["intermediate_size"]] * budget.num_layers} for c in cands}
    return out, cands


def pick_best(fitness: Callable[[Levels, int], float], seeds: dict[str, Levels], final: int) -> SearchResult:
    """The seed of least KL on the `final` sequences (the uniform shapes: a short list, no evolution)."""
    t0 = time.perf_counter()
    kl = {name: fitness(lv, final) for name, lv in progress(list(seeds.items()), "uniform shape search",
                                                            unit="shape")}
    best = min(kl, key=lambda k: (kl[k], k))
    return SearchResult(seeds[best], kl[best], kl, [{"generation": 0, "kl": kl[best],
                                                      "seconds": time.perf_counter() - t0}],
                        {"search": time.perf_counter() - t0})


def run_search(model: nn.Module, batches: Sequence[torch.Tensor], budget: Budget, scores, settings,
               options: SearchOptions, state_dir: Path | None = None, plans: dict[str, Removed] | None = None,
               db: LevelsDatabase | None = None, reduce_sum: ReduceSum | None = None, shape: Shape = Shape.FREE,
               ) -> tuple[Removed, SearchResult, LevelsDatabase, dict[str, Any]]:
    """Levels database (built or loaded from `state_dir`), the search, and the final removal, with what the
    shape adds to plan.meta. Under DDP (`reduce_sum`) the Grams and every fitness are summed over ranks, so all
    ranks take the same steps.

    `shape`: FREE searches every sub-block's level; SERVED (export.format: nemotron_nas) starts from the served
    layouts (one kept group count) and moves MLP levels only; UNIFORM (stock) measures every uniform shape."""
    space = LevelSpace.of(budget, options.mlp_levels, settings.align_channels, fixed_attn=shape is Shape.SERVED)
    t0 = time.perf_counter()
    repair = repair_for(options.order, settings.reconstruct)
    if db is None:
        path = state_dir / f"levels_{options.order}.pt" if state_dir is not None else None
        key = database_key(model, list(batches), settings.criterion, options.order, settings.reconstruct_ridge,
                           reduce_sum)
        db = load_database(path, model, key, repair) if path is not None else None
        if db is None:
            db = build_database(model, list(batches), scores, {k: budget.limits(k) for k in KINDS}, options.order,
                                settings.reconstruct_ridge, settings.criterion, reduce_sum, repair, key)
            if path is not None:
                db.save(path)
    t_db = time.perf_counter() - t0
    rows = calibration_rows(batches, options.stages[-1])
    top_k = options.top_k_for(rows.shape[0], rows.shape[1], int(unwrap(model).get_output_embeddings().weight.shape[0]),
                              linear_head(model))
    batch = int(batches[0].shape[0])
    t_fit = time.perf_counter()
    if options.fitness_folds == "auto":  # resolved before the search: the state's key holds the count
        options = dataclasses.replace(options, fitness_folds=auto_fitness_folds(db, rows.shape[0], reduce_sum))
    if options.generations == "auto":  # likewise
        options = dataclasses.replace(options, generations=auto_generations(budget))
    fitness = (CrossFitKL(model, db, rows, options.fitness_folds, batch, reduce_sum, top_k)
               if options.fitness_folds > 1
               else KLFitness(model, db, rows, reduce_sum=reduce_sum, top_k=top_k))
    t_fit = time.perf_counter() - t_fit  # the dense log-probabilities (and the folds' Grams)
    align = settings.align_channels
    extra: dict[str, Any] = {}
    runs: dict[str, SearchResult] = {}  # the restarts (not for the uniform shape, which measures every candidate)
    if shape is Shape.UNIFORM:
        seeds, cands = uniform_seeds(space, scores, align)
        result = pick_best(fitness, seeds, options.stages[-1])
        k = result.levels["attn"][0]
        extra = {"uniform_shape": True, "stock_shapes": {
            "candidates": [{**c, "kl": result.seeds[f"groups_removed={c['groups_removed_per_layer']}"]}
                           for c in cands], "chosen": k, "chosen_by": "search_kl"}}
        removed = space.removed(result.levels, db)  # one shape in every layer: no channel is given back
    else:
        if shape is Shape.SERVED:
            seeds, cands = served_seeds(space, scores, align, plans)
        else:
            seeds = seed_levels(space, scores, plans)
        # One state file per order, shape and budget: a state of another search is never resumed from.
        tag = "" if shape is Shape.FREE else f"_{shape.name.lower()}"
        state = (state_dir / f"search_state_{options.order}-{db.repair}{tag}_{budget.target}.pt"
                 if state_dir is not None else None)
        for r in range(options.restarts):
            opts = dataclasses.replace(options, seed=options.seed + r)
            path = state if r == 0 or state is None else state.with_name(f"{state.stem}_seed{opts.seed}.pt")
            runs[f"seed={opts.seed}"] = evolve(space, fitness, seeds, opts, path)
        result = min(runs.values(), key=lambda x: x.kl)  # ties: the first seed's
        result.times_s["search"] = sum(x.times_s["search"] for x in runs.values())
        if len(runs) > 1:
            result.restarts = {name: x.kl for name, x in runs.items()}
    result.times_s = {"database": t_db, "fitness": t_fit, "search": result.times_s["search"]}
    result.forwards, result.layers_run = fitness.forwards, fitness.layers_run
    result.layers = len(get_family(unwrap(model)).layers(unwrap(model)))
    if result.forwards:
        log.info("allocation search: %d sequence forwards ran %.0f%% of their decoder layers (the rest were kept "
                 "prefixes)", result.forwards, 100 * result.layers_run / (result.forwards * result.layers))
    result.kl_top_k, result.repair = top_k, db.repair
    result.fitness_folds = len(fitness.parts) if isinstance(fitness, CrossFitKL) else 1
    result.generations = options.generations
    del fitness  # its dense log-probabilities
    if options.cut_ridge == "cv":
        alternatives: dict[str, tuple[Levels, float]] = {}  # name -> levels and calibration KL
        if shape is not Shape.UNIFORM:
            for name, run in runs.items():
                if run is not result and run.levels != result.levels:
                    alternatives[f"restart {name}"] = (run.levels, run.kl)
        if options.cv_seed and shape is not Shape.UNIFORM and result.seeds:
            name = min(result.seeds, key=lambda k: (result.seeds[k], k))
            if seeds.get(name) is not None and seeds[name] != result.levels:
                alternatives[name] = (seeds[name], result.seeds[name])
        db, result.ridge_cv = cross_validate_ridge(model, db, batches, result.levels, options, reduce_sum, top_k,
                                                   {k: lv for k, (lv, _) in alternatives.items()})
        result.times_s["ridge_cv"] = result.ridge_cv.get("seconds", 0.0)
        chosen = result.ridge_cv.get("plan", "search")
        if chosen != "search":
            result.levels, result.kl = alternatives[chosen]
    else:
        result.ridge_cv = {"chosen_by": "fixed", "ridge": db.ridge}
    if shape is not Shape.UNIFORM:
        removed = finish(space, result.levels, db, align)
        if shape is Shape.SERVED:
            attn = result.levels["attn"]
            n_g = budget.n_groups[0]
            kept = sorted({n_g - a for a in attn if a < n_g})
            extra = {"served_layout": True, "served_shapes": {
                "candidates": cands, "chosen_by": "search_kl",
                "chosen": {"groups_kept": kept[0] if kept else 0,
                           "attention_removed_layers": [i for i, a in enumerate(attn) if a >= n_g]}}}
    return removed, result, db, extra


@dataclass
class SearchMeasured:
    """What the row's measurement hands to its allocation: the final removal and the search's summary."""

    removed: Removed
    result: SearchResult
    extra: dict[str, Any] = field(default_factory=dict)  # what the shape adds to plan.meta (stock/served report)
    levels: LevelsDatabase | None = None  # its refits are the cut's repair (make_plan hands it to the plan)

    def as_dict(self) -> dict[str, Any]:
        """plan.meta["search"]: KL reached and the seeds', trajectory, phase times, the levels chosen."""
        return self.result.as_dict()


def measure_search(inp) -> SearchMeasured:
    """The row's measurement (`MeasureInputs`): the levels database and the search on the calibration batches."""
    options = inp.options if inp.options is not None else SearchOptions()
    state_dir = Path(options.state_dir) if options.state_dir else inp.state_dir
    plans = options.seed_plans()
    if options.seed_calibrated and "calibrated" not in plans and inp.shape is not Shape.UNIFORM:
        plans["calibrated"] = calibrated_removal(inp)
    # The database's Grams and the KL sequences come from every calibration batch, not the probes' bounded share.
    batches = inp.calibration or inp.batches
    removed, result, db, extra = run_search(inp.model, batches, inp.budget, inp.scores, inp.settings, options,
                                            state_dir, plans=plans, reduce_sum=inp.reduce_sum, shape=inp.shape)
    return SearchMeasured(removed, result, extra, db)


def allocate_search(inp) -> Removal:
    """Every shape: the removal the search measured under the run's shape (already within the shape's budget
    window: exact), with the stock / served report the shape adds."""
    if inp.measured is None:
        raise ValueError("allocation 'search' needs its measurement (measure_search) before allocate")
    return Removal({k: [set(s) for s in v] for k, v in inp.measured.removed.items()},
                   extra=dict(inp.measured.extra), exact=True)
