"""The worker loop: fail dead trials, pick the next one (Optuna), run it, persist it, print progress; repeat.

Any number of workers (processes of this command, on one host or, with an RDB storage, several) run the
same loop on one study. Grid mode stops when every grid point has a complete or failed trial (a duplicate
pruned unrun counts for nothing; of two workers that drew the same point, the older trial runs and the
newer defers); optuna mode when `n_trials` trials have finished. A worker with nothing left to start waits
for the trials other live workers are running, so the tables it writes at the end are complete.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from prunelight.atomic import atomic_write_json
from prunelight.errors import one_line
from prunelight.sweep.cache import ScoreCache, runs_take_scores
from prunelight.sweep.runner import Runner, TrialError, TrialSpec, subprocess_runner
from prunelight.sweep.settings import SweepSettings
from prunelight.sweep.space import apply_point, encode, grid_points, suggest
from prunelight.sweep.store import Heartbeat, fail_stale, make_sampler, open_study, results_document

log = logging.getLogger("prunelight")

RESULTS_FILE = "results.json"
TRIALS_DIR = "trials"


def _signature(params: dict[str, Any]) -> str:
    return json.dumps({k: encode(v) for k, v in sorted(params.items())}, sort_keys=True, default=str)


def next_step(study, settings: SweepSettings) -> str:
    """'run' (a trial to start), 'wait' (only other workers' trials are left) or 'done'."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.WAITING for t in trials):
        return "run"
    running = [t for t in trials if t.state == TrialState.RUNNING]
    if settings.grid:
        covered = {_signature(t.params) for t in trials if t.params and covers_point(t)}
        todo = [p for p in grid_points(settings.space) if _signature(p) not in covered]
        return "run" if todo else ("wait" if running else "done")
    finished = [t for t in trials if t.state.is_finished() and not t.user_attrs.get("stale")
                and t.user_attrs.get("duplicate_of") is None]
    if len(finished) + len(running) < settings.n_trials:
        return "run"
    return "wait" if running and len(finished) < settings.n_trials else "done"


def covers_point(trial) -> bool:
    """Whether a trial accounts for its grid point: complete, running, or failed (its error is the point's result;
    a stale one's retry is queued by the retry callback). A pruned duplicate ran nothing, so it covers nothing."""
    from optuna.trial import TrialState

    return trial.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.FAIL)


def defers_to(trial, other) -> bool:
    """Whether `trial` leaves its grid point to `other` (same params): a complete one, or an older running one.

    Two running duplicates (workers that drew the same point) thus never both step aside: the older runs.
    """
    from optuna.trial import TrialState

    return other.state == TrialState.COMPLETE or (other.state == TrialState.RUNNING and other.number < trial.number)


def total_trials(settings: SweepSettings) -> int:
    """Trials the sweep runs in all: the grid's size, or n_trials."""
    return len(grid_points(settings.space)) if settings.grid else int(settings.n_trials)


class Worker:
    """One worker: runs trials of the study until the sweep is done."""

    def __init__(self, settings: SweepSettings, config: dict[str, Any], runner: Runner | None = None,
                 cwd: str | None = None, index: int = 0) -> None:
        self.settings, self.config, self.index = settings, config, index
        self.runner = runner or subprocess_runner
        self.cwd = cwd or os.getcwd()
        self.out = Path(settings.out_dir)
        self.durations: list[float] = []
        use_scores = settings.score_cache and (runner is not None or runs_take_scores())
        self.score_cache = ScoreCache(self.out / "cache" / "scores") if use_scores else None
        self.dense_cache = str(self.out / "cache" / "dense") if settings.dense_cache else None

    def run(self) -> None:
        """Run trials until none is left for this worker."""
        import optuna

        study = open_study(self.settings)
        while True:
            fail_stale(study, self.settings)
            step = next_step(study, self.settings)
            if step == "done":
                break
            if step == "wait":
                time.sleep(min(5.0, self.settings.heartbeat_s))
                continue
            if not self.settings.grid:
                # A fresh seed per trial, from the sweep's seed, this worker's index and the trials so far: workers
                # with one seeded sampler each would otherwise draw the same points. (Not for the grid: its seed
                # orders the grid, which every worker must share.)
                study.sampler = make_sampler(self.settings, self.settings.seed + 7919 * self.index
                                             + len(study.get_trials(deepcopy=False)))
            try:
                study.optimize(self.objective, n_trials=1, catch=(TrialError,), gc_after_trial=False)
            except optuna.exceptions.UpdateFinishedTrialError as err:
                # another worker took this trial for dead (no heartbeat for 3 intervals) and failed it meanwhile
                log.warning("sweep: %s; its result is kept in its trial folder only", one_line(err))
            self._progress(study)
        write_results(study, self.settings)

    def objective(self, trial) -> float:
        """Optuna's objective: the point, a duplicate check, the run (with heartbeat), the objective value."""
        import optuna

        point = suggest(trial, self.settings.space)
        for attr in ("stale", "error", "result", "duplicate_of"):  # a retry inherits its failed trial's attributes
            if attr in trial.user_attrs:
                trial.set_user_attr(attr, None)
        if self.settings.grid:
            dup = self._duplicate(trial, point)
            if dup is not None:
                trial.set_user_attr("duplicate_of", dup)
                log.info("sweep: trial %d repeats trial %d's grid point; skipped", trial.number, dup)
                raise optuna.TrialPruned()
        spec = TrialSpec(number=trial.number, point=point,
                         trial_dir=self.out / TRIALS_DIR / f"{trial.number:04d}", base=list(self.settings.base),
                         config=apply_point(self.config, point), extra_args=list(self.settings.extra_args),
                         score_cache=self.score_cache, dense_cache=self.dense_cache,
                         timeout_s=self.settings.trial_timeout_s, cwd=self.cwd)
        # where it writes, recorded first: a worker killed mid-trial leaves the trial's folder and log findable
        trial.set_user_attr("result", {"out_dir": str(spec.trial_dir), "log": str(spec.trial_dir / "run.log")})
        log.info("sweep: trial %d starts: %s", trial.number, ", ".join(f"{k}={v}" for k, v in point.items()))
        t0 = time.perf_counter()
        with Heartbeat(trial.study, trial._trial_id, self.settings.heartbeat_s):
            try:
                result = self.runner(spec)
                value = self.settings.objective.value(result.get("metrics") or {})
            except Exception as err:
                self.durations.append(time.perf_counter() - t0)
                message = one_line(err)
                trial.set_user_attr("error", message)
                trial.set_user_attr("result", {"out_dir": str(spec.trial_dir), "log": str(spec.trial_dir / "run.log")})
                if not (spec.trial_dir / "trial.json").exists():
                    atomic_write_json(spec.trial_dir / "trial.json", {"number": trial.number, "point": point,
                                                                       "error": message})
                log.warning("sweep: trial %d failed: %s", trial.number, message)
                raise TrialError(message) from None
        self.durations.append(time.perf_counter() - t0)
        trial.set_user_attr("result", result)
        return value

    def _duplicate(self, trial, point: dict[str, Any]) -> int | None:
        """The trial with the same grid point this one defers to (`defers_to`), or None."""
        from optuna.trial import TrialState

        sig = _signature(point)
        for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)):
            if t.number != trial.number and t.params and _signature(t.params) == sig and defers_to(trial, t):
                return t.number
        return None

    def _progress(self, study) -> None:
        """One line: trials done / total, failed, best so far, ETA."""
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        done = sum(t.state == TrialState.COMPLETE for t in trials)
        failed = sum(t.state == TrialState.FAIL and not t.user_attrs.get("stale") for t in trials)
        total = total_trials(self.settings)
        best = ""
        if done:
            b = study.best_trial
            best = f" | best {self.settings.objective.describe().split(' ', 1)[1]} = {b.value:.4g} (trial {b.number})"
        left = max(0, total - done - failed)
        eta = ""
        if self.durations and left:
            seconds = left * sum(self.durations) / len(self.durations) / max(1, self.settings.workers)
            eta = f" | ETA {seconds / 60:.1f} min"
        log.info("sweep: %d/%d trials done%s%s%s", done, total, f", {failed} failed" if failed else "", best, eta)


def write_results(study, settings: SweepSettings) -> Path:
    """results.json: every trial of the study, what the tables and figures are made from."""
    return atomic_write_json(Path(settings.out_dir) / RESULTS_FILE, results_document(study, settings))


def _worker_main(settings: SweepSettings, config: dict[str, Any], runner: Runner | None, cwd: str, index: int) -> None:
    from prunelight.console import setup_logging

    setup_logging()
    Worker(settings, config, runner, cwd, index).run()


def run_sweep(settings: SweepSettings, config: dict[str, Any], runner: Runner | None = None) -> dict[str, Any]:
    """Run the sweep with `settings.workers` processes (this one and workers-1 spawned), then return results.json."""
    cwd = os.getcwd()
    ctx = multiprocessing.get_context("spawn")
    others = [ctx.Process(target=_worker_main, args=(settings, config, runner, cwd, i), name=f"sweep-worker-{i}")
              for i in range(1, settings.workers)]
    for p in others:
        p.start()
    try:
        Worker(settings, config, runner, cwd).run()
    finally:
        for p in others:
            p.join()
    bad = [p.exitcode for p in others if p.exitcode]
    if bad:
        log.warning("sweep: %d worker process(es) exited with status %s", len(bad), bad)
    study = open_study(settings)
    write_results(study, settings)
    return results_document(study, settings)
