"""The (1 + lambda) search with staged selection (`evolve`), its result and its resumable state."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prunelight.allocation.budget import Budget
from prunelight.allocation.search.levels import Levels
from prunelight.allocation.search.options import SearchOptions
from prunelight.allocation.search.space import LevelSpace
from prunelight.atomic import atomic_path
from prunelight.console import progress

log = logging.getLogger(__name__)

# generations: auto gives the search a budget in proportion to how much it cuts: a level move shifts one group or one
# MLP grid step, so a deeper cut has proportionally more of them to place. 6 per 20% keeps the default 20% cut of
# SmolLM2 near 7.5 minutes on 2 CPU cores (docs/benchmarks.md, "The default cut").
AUTO_GENERATIONS = 6
AUTO_GENERATIONS_PER = 0.2


def auto_generations(budget: Budget) -> int:
    """`generations: auto`: AUTO_GENERATIONS per AUTO_GENERATIONS_PER of the model's parameters removed, at least
    AUTO_GENERATIONS."""
    removed = budget.target / budget.total if budget.total else 0.0
    generations = max(AUTO_GENERATIONS, round(AUTO_GENERATIONS * removed / AUTO_GENERATIONS_PER))
    log.info("allocation search: generations auto -> %d (%.0f%% of the parameters removed)", generations,
             100 * removed)
    return generations



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
    # A state resumes the same search: the same options, the same first generation (its seeds within the budget),
    # and no more generations than asked (a shorter search is not a prefix of a longer one's saved end).
    first = {name for name, lv in seeds.items() if lv is not None and space.within(lv)}
    if (state is not None and state.get("options") == _opts(options) and set(state["seeds"]) == first
            and state["generation"] <= options.generations):
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
        # Some seed meets the budget: `check_search` refused, before any data, a budget the levels cannot meet.
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



def pick_best(fitness: Callable[[Levels, int], float], seeds: dict[str, Levels], final: int) -> SearchResult:
    """The seed of least KL on the `final` sequences (the uniform shapes: a short list, no evolution)."""
    t0 = time.perf_counter()
    kl = {name: fitness(lv, final) for name, lv in progress(list(seeds.items()), "uniform shape search",
                                                            unit="shape")}
    best = min(kl, key=lambda k: (kl[k], k))
    return SearchResult(seeds[best], kl[best], kl, [{"generation": 0, "kl": kl[best],
                                                      "seconds": time.perf_counter() - t0}],
                        {"search": time.perf_counter() - t0})


