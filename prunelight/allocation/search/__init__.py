"""`search`: per-sub-block widths chosen by the measured divergence of whole candidate models (EvoPress-style).

A candidate is a *level assignment*: for every sub-block how many of its units are removed, GQA groups one at a
time and MLP channels on a grid of `step` channels (`LevelSpace`). Its weights come from the levels database
(`levels.py`: nested removal orders, each level's o_proj / down_proj refitted as the cut will be), so evaluating a
candidate is one masked forward of the model with those weights swapped in.

The package, in the order a run uses it: `options.py` (`SearchOptions`, `prune.allocation_args`), `levels.py` (the
levels database), `space.py` (level assignments, moves, seeds, the final removal), `fitness.py` (the KL),
`evolve.py` (the search and its saved state), `ridge.py` (the cut's damping by cross-validation), `repair.py` (the
row's cut step: the plan cut with the database's refits), and here the glue the registry row calls:
`measure_search`, `allocate_search`, `cut_search`.

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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelight.allocation.base import AllocationInputs, CutInputs, MeasureInputs, Removal, Shape, zero_scores
from prunelight.allocation.budget import Budget, Removed
from prunelight.allocation.calibrated import calibrated_removal
from prunelight.allocation.search.evolve import SearchResult, auto_generations, evolve, pick_best
from prunelight.allocation.search.fitness import CrossFitKL, KLFitness, auto_fitness_folds, calibration_rows, linear_head
from prunelight.allocation.search.levels import (
    KINDS,
    DensePass,
    Levels,
    LevelsDatabase,
    build_database,
    database_key,
    load_database,
    repair_for,
)
from prunelight.allocation.search.options import SearchOptions
from prunelight.allocation.search.repair import cut_with_levels
from prunelight.allocation.search.ridge import cross_validate_ridge
from prunelight.allocation.search.space import LevelSpace, counts_of, finish, seed_levels, served_seeds, uniform_seeds
from prunelight.allocation.served import candidates as served_candidates
from prunelight.allocation.width import asked, check_keeps_a_layer, check_removable
from prunelight.distributed import ReduceSum
from prunelight.families import get_family, unwrap

log = logging.getLogger(__name__)


def check_search(budget: Budget, settings, shape: Shape) -> None:
    """The row's feasibility, from model sizes before any data: what the knapsack allocations can remove, within one
    MLP level of keeping a unit in some layer, and within what the level grid reaches (each sub-block's last level;
    under the served layout, with the attention of some served layout)."""
    check_removable(budget, settings, shape)
    if shape is Shape.UNIFORM:  # the uniform shapes are measured as they are: the stock shape's size check
        return
    options = settings.allocation_options
    space = LevelSpace.of(budget, options.mlp_levels, settings.align_channels, fixed_attn=shape is Shape.SERVED)
    check_keeps_a_layer(budget, settings, space.window)
    attn = [space.limits["attn"]]
    if shape is Shape.SERVED:
        attn = [counts_of(c["_removed"])["attn"] for c in served_candidates(zero_scores(budget), budget,
                                                                             settings.align_channels)]
    most = max(space.cost({"attn": a, "mlp": space.limits["mlp"]}) for a in attn)
    if budget.target > most:
        raise ValueError(f"{asked(settings)} is not allowed with allocation search: its levels (MLP widths in steps of "
                         f"{space.step} channels, prune.allocation_args.mlp_levels={options.mlp_levels}) remove at "
                         f"most {most:,} of the {budget.target:,} parameters asked; lower the ratio or raise "
                         "mlp_levels")


def run_search(model: nn.Module, batches: Sequence[torch.Tensor], budget: Budget, scores, settings,
               options: SearchOptions, state_dir: Path | None = None, plans: dict[str, Removed] | None = None,
               db: LevelsDatabase | None = None, reduce_sum: ReduceSum | None = None, shape: Shape = Shape.FREE,
               dense: DensePass | None = None) -> tuple[Removed, SearchResult, LevelsDatabase, dict[str, Any]]:
    """Levels database (built or loaded from `state_dir`), the search, and the final removal, with what the
    shape adds to plan.meta. Under DDP (`reduce_sum`) the Grams and every fitness are summed over ranks, so all
    ranks take the same steps.

    `shape`: FREE searches every sub-block's level; SERVED (export.format: nemotron_nas) starts from the served
    layouts (one kept group count) and moves MLP levels only; UNIFORM (stock) measures every uniform shape.
    `dense`: the Grams and hidden states the scoring pass collected (`collect_search`), for a database built here."""
    space = LevelSpace.of(budget, options.mlp_levels, settings.align_channels, fixed_attn=shape is Shape.SERVED)
    t0 = time.perf_counter()
    repair = repair_for(options.order, settings.reconstruct)
    if db is None:
        path = levels_path(options, state_dir)
        key = database_key(model, list(batches), settings.criterion, options.order, settings.reconstruct_ridge,
                           reduce_sum)
        db = load_database(path, model, key, repair) if path is not None else None
        if db is None:
            db = build_database(model, list(batches), scores, {k: budget.limits(k) for k in KINDS}, options.order,
                                settings.reconstruct_ridge, settings.criterion, reduce_sum, repair, key, dense)
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
    """What the row's measurement hands to its allocation and its cut step: the final removal, the search's summary
    and the levels database whose refits are the cut's repair."""

    removed: Removed
    result: SearchResult
    extra: dict[str, Any] = field(default_factory=dict)  # what the shape adds to plan.meta (stock/served report)
    levels: LevelsDatabase | None = None

    @property
    def dense_hidden(self) -> list[torch.Tensor] | None:
        """The dense model's final hidden states on every calibration batch, when this run built the database."""
        return self.levels.dense_hidden if self.levels is not None else None

    def as_dict(self) -> dict[str, Any]:
        """plan.meta["search"]: KL reached and the seeds', trajectory, phase times, the levels chosen."""
        return self.result.as_dict()


def levels_path(options: SearchOptions, state_dir: Path | None) -> Path | None:
    """Where the levels database is saved and read back: `state_dir/levels_<order>.pt` (None: no state folder)."""
    return state_dir / f"levels_{options.order}.pt" if state_dir is not None else None


def search_state_dir(options: SearchOptions, state_dir: Path | None) -> Path | None:
    """The search's state folder: `allocation_args.state_dir`, else the run's."""
    return Path(options.state_dir) if options.state_dir else state_dir


def collect_search(settings, state_dir: Path | None) -> DensePass | None:
    """What the scoring pass collects for the search: the levels database's Grams and hidden states (`DensePass`),
    unless a saved database in the state folder will likely be read back (its Grams would go unused)."""
    options = settings.allocation_options if settings.allocation_options is not None else SearchOptions()
    path = levels_path(options, search_state_dir(options, state_dir))
    return None if path is not None and path.is_file() else DensePass()


def measure_search(inp: MeasureInputs) -> SearchMeasured:
    """The row's measurement: the levels database and the search on the calibration batches."""
    options = inp.options if inp.options is not None else SearchOptions()
    state_dir = search_state_dir(options, inp.state_dir)
    plans = options.seed_plans()
    t0 = time.perf_counter()
    if options.seed_calibrated and "calibrated" not in plans and inp.shape is not Shape.UNIFORM:
        plans["calibrated"] = calibrated_removal(inp)
    seeding = time.perf_counter() - t0
    # The database's Grams and the KL sequences come from every calibration batch, not the probes' bounded share.
    batches = inp.calibration or inp.batches
    removed, result, db, extra = run_search(inp.model, batches, inp.budget, inp.scores, inp.settings, options,
                                            state_dir, plans=plans, reduce_sum=inp.reduce_sum, shape=inp.shape,
                                            dense=inp.collected)
    result.times_s = {"calibrated_seed": seeding, **result.times_s}
    return SearchMeasured(removed, result, extra, db)


def allocate_search(inp: AllocationInputs) -> Removal:
    """Every shape: the removal the search measured under the run's shape (already within the shape's budget
    window: exact), with the stock / served report the shape adds; a cross-validated ridge travels with the plan as
    its repair (`plan.meta["repair"]`), so the plan re-applied elsewhere repairs as this run does."""
    extra = dict(inp.measured.extra)
    cv = inp.measured.result.ridge_cv
    if cv.get("chosen_by") == "cv":
        extra["repair"] = {"reconstruct_ridge": float(cv["ridge"]), "chosen_by": "cv"}
    return Removal({k: [set(s) for s in v] for k, v in inp.measured.removed.items()}, extra=extra, exact=True)


def cut_search(inp: CutInputs) -> dict[str, Any] | None:
    """The row's cut step: the plan cut with the levels database's refits (None, nothing cut, when the database does
    not hold this run's repair: the usual repair then runs)."""
    return cut_with_levels(inp.model, inp.plan, inp.measured.levels, inp.settings, inp.batches, inp.reduce_sum,
                           inp.wrap)
