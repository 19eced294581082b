"""`SearchOptions`: the options of `prune.allocation: search` (`prune.allocation_args`), checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prunelight.allocation.budget import Removed
from prunelight.allocation.search.levels import KINDS, ORDERS

# kl_top_k: auto takes the whole distribution with a float32 linear head (exact from W^T p, hidden-size floats per
# token), else keeps the whole dense distribution up to 1 GiB (SmolLM2's 49k vocabulary, 32 x 128 tokens: 0.8 GB);
# beyond it the top 256, which ranked 12 candidates as the full KL did on SmolLM2 (Spearman 0.993, same best;
# results/benchmarks/search_kl_top_k.md) in 2 KB per token.
AUTO_FULL_KL_BYTES = 1 << 30
AUTO_TOP_K = 256



@dataclass(frozen=True)
class SearchOptions:
    """Options of `prune.allocation: search` (`prune.allocation_args`)."""

    generations: int | str = "auto"
    """Generations of the (1 + λ) search. "auto": AUTO_GENERATIONS per AUTO_GENERATIONS_PER of the parameters removed,
    at least AUTO_GENERATIONS (6 up to a 20% cut, 9 at 30%, 15 at 50%: `auto_generations`); plan.meta.search
    records the count. Deeper cuts start further from the best plan (more levels to move between sub-blocks). On
    SmolLM2 at 20% (seed 0) 12 generations gave 1.259x against 1.274x with 6, for 113 s more
    (docs/benchmarks.md, "The default cut")."""
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
    cv_ridges: tuple[float, ...] = (0.03, 0.1, 0.3)
    """The ridges (x mean diagonal of the kept inputs' Gram, as prune.reconstruct_ridge) `cut_ridge: cv` tries. When
    an end of the grid wins, up to 3 more ridges past it are tried, each one grid step further, while the held-out KL
    falls (`ridge_cv.extended` lists them). Three ridges around SmolLM2's winners at 10-30% (0.1-0.3); a cut that
    wants 0.01 or 1 reaches it by the extension (at 50% the extension took SmolLM2 to 0.00037, 1.1% lower test
    perplexity than the grid's end)."""
    cv_seed: bool = False
    """With `cut_ridge: cv`, also measure the first generation's best seed on the held-out sequences (at the chosen
    ridge) and cut it instead of the search's result when its KL there is lower. Off by default: on SmolLM2 it kept
    the search's result at 20% and 50%, and at 30% took the seed on a 0.14% lower held-out KL, 3% worse on test
    (docs/benchmarks.md)."""
    seeds: dict[str, Any] = field(default_factory=dict)
    """More plans for the first generation besides uniform and global: name -> the units each sub-block removes,
    {"attn": [[group, ...] per layer], "mlp": [[channel, ...] per layer]} (e.g. a stock cut's)."""
    seed_calibrated: bool = False
    """Add the `calibrated` allocation's plan to the first generation (its probes run on the
    prune.importance_batches sequences). Off by default: on SmolLM2 at 20% its probes cost 106 s and its plan, the
    best seed, held the search in its neighbourhood (calibration KL 0.412 after 12 generations, flat from the 5th)
    where the global seed went on to 0.391 and 1.259x against 1.296x on test (docs/benchmarks.md, "The default
    cut")."""
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

