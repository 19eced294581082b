"""The cut's damping chosen on held-out calibration sequences (`prune.allocation_args.cut_ridge: cv`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from prunelight.allocation.search.fitness import KLFitness, calibration_rows, without_sequences
from prunelight.allocation.search.levels import Levels, LevelsDatabase
from prunelight.allocation.search.options import SearchOptions
from prunelight.console import progress
from prunelight.distributed import ReduceSum

log = logging.getLogger(__name__)

# cut_ridge: cv goes past an end of cv_ridges that wins, by the grid's own step there, while the held-out KL still
# falls, at most this many ridges: the best damping moves with the depth of the cut (SmolLM2: 0.3 at 10-20%, 0.01 or
# less at 50%), so a fixed grid could end where the optimum is still beyond it.
CV_EDGE_STEPS = 3



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
    batch = max(int(batches[0].shape[0]), 1)
    hidden: list[torch.Tensor] = []  # the held-out sequences' dense hidden states, from the Grams' pass
    fit = without_sequences(model, db, held, batch, reduce_sum, hidden)
    fitness = KLFitness(model, fit, held, batch=batch, reduce_sum=reduce_sum, top_k=top_k, hidden=hidden)
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


