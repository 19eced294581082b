"""The sweep's settings (`prunelight sweep --config sweep.yaml`): one typed field per option, checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from prunelight.validate import bad as _bad
from prunelight.validate import choice as _choice
from prunelight.validate import integer as _integer

MODES = ("grid", "optuna")
SAMPLERS = ("tpe", "random")
DIRECTIONS = ("minimize", "maximize")


@dataclass
class Objective:
    """What a trial is scored by: one metric of the trial's results, or a weighted sum of several.

    Metric names (see docs of `prunelight.sweep.store.trial_metrics`): `ppl` (perplexity on data.eval of the
    final model: recovered, else pruned), `ppl_dense`, `zeroshot_avg` (average zero-shot accuracy of the final
    model), `zeroshot_<task>`, `suite_ppl` (the evaluation suite's first perplexity), `removed_fraction`.
    """

    metric: str | None = "ppl"
    """One metric name (null when `weights` is given)."""
    weights: dict[str, float] | None = None
    """A weighted sum of metrics instead, e.g. {ppl: -0.01, zeroshot_avg: 1} (null: use `metric`)."""
    direction: Literal["minimize", "maximize"] | None = None
    """minimize or maximize; null: minimize for a perplexity metric, maximize otherwise."""

    def __post_init__(self) -> None:
        if self.weights:
            bad = {k: v for k, v in self.weights.items()
                   if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)}
            if bad:
                raise _bad("sweep.objective.weights", self.weights, "every weight must be a finite number")
            self.weights = {str(k): float(v) for k, v in self.weights.items()}
            self.metric = None
        elif not self.metric or not isinstance(self.metric, str):
            raise _bad("sweep.objective.metric", self.metric, "name a metric (e.g. ppl, zeroshot_avg) or give weights")
        if self.direction is None:
            if self.metric is not None:
                self.direction = "minimize" if "ppl" in self.metric else "maximize"
            else:
                raise _bad("sweep.objective.direction", None, "a weighted objective needs minimize or maximize")
        _choice("sweep.objective.direction", self.direction, DIRECTIONS)

    def value(self, metrics: dict[str, float]) -> float:
        """The objective of one trial's metrics; a missing metric is a clear error naming it."""
        weights = self.weights or {self.metric: 1.0}
        missing = [k for k in weights if metrics.get(k) is None]
        if missing:
            raise KeyError(f"the objective needs metric(s) {missing}, which the trial did not report "
                           f"(it reported {sorted(metrics)})")
        return float(sum(w * float(metrics[k]) for k, w in weights.items()))

    def describe(self) -> str:
        """e.g. 'minimize ppl' or 'maximize -0.01*ppl + 1*zeroshot_avg'."""
        if self.weights:
            return f"{self.direction} " + " + ".join(f"{w:g}*{k}" for k, w in self.weights.items())
        return f"{self.direction} {self.metric}"


@dataclass
class SweepSettings:
    """A search over run-config keys: base config(s), a search space, a mode, an objective and where to keep it."""

    base: list[str] = field(default_factory=list)
    """The run config(s) every trial starts from, applied in order like `prunelight fit --config A --config B`."""
    space: dict[str, Any] = field(default_factory=dict)
    """Dotted run-config keys -> a list of values (grid and optuna), or for optuna a range {low, high, step|log}."""
    mode: Literal["grid", "optuna"] = "grid"
    """grid: every combination once (Optuna's GridSampler); optuna: `n_trials` trials chosen by `sampler`."""
    sampler: Literal["tpe", "random"] = "tpe"
    """optuna mode: tpe (Optuna's TPESampler) or random; seeded with `seed`."""
    n_trials: int | None = None
    """optuna mode: trials in all (over all workers and restarts); grid mode: ignored (the grid's size)."""
    seed: int = 0
    """Seed of the sampler."""
    objective: Objective = field(default_factory=Objective)
    """The number a trial is scored by, and its direction."""
    out_dir: str = "runs/sweep"
    """The sweep's folder: trials/<n>/ (each trial's config, log, run output), caches, study.journal, tables,
    figures."""
    study_name: str = "prunelight-sweep"
    """Name of the Optuna study inside the storage (several sweeps may share one database)."""
    storage: str | None = None
    """Optuna storage: null = a journal file <out_dir>/study.journal (one host); or an RDB URL
    (postgresql+psycopg://user:password@host:5432/db with the `postgres` extra, mysql://..., sqlite:///...) for
    several workers or nodes."""
    workers: int = 1
    """Worker processes started by this command; more workers may join by running the same command."""
    heartbeat_s: int = 30
    """A running trial's heartbeat interval; a trial silent for 3 intervals (or whose worker process is gone)
    is failed as stale and retried."""
    max_retries: int = 1
    """How many times a killed (stale) trial is retried; a trial whose run raises is recorded, not retried."""
    score_cache: bool = True
    """Reuse calibration scores across trials that differ only in what is done with them (ratio, allocation)."""
    dense_cache: bool = True
    """Reuse the dense model's evaluation across trials with the same model and evaluation settings."""
    trial_timeout_s: int | None = None
    """Kill a trial's run after this many seconds (null: no limit); it is recorded as failed."""
    group_by: list[str] = field(default_factory=lambda: ["prune.criterion", "prune.allocation"])
    """The keys whose values name a method in the tables (mean ± std and best per method, heatmaps)."""
    model_key: str = "model.pretrained"
    """The key whose value names a model in the tables (one optimum per model)."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments given to every trial's `prunelight fit`
    (e.g. --trainer.enable_progress_bar=false)."""

    def __post_init__(self) -> None:
        if isinstance(self.base, str):
            self.base = [self.base]
        if not self.base:
            raise _bad("sweep.base", self.base, "name at least one run config (a YAML file for `prunelight fit`)")
        if not isinstance(self.space, dict) or not self.space:
            raise _bad("sweep.space", self.space, "a mapping of dotted run-config keys to value lists")
        _choice("sweep.mode", self.mode, MODES)
        _choice("sweep.sampler", self.sampler, SAMPLERS)
        if self.mode == "optuna":
            _integer("sweep.n_trials", self.n_trials, 1)
        else:
            _integer("sweep.n_trials", self.n_trials, 1, optional=True)
        _integer("sweep.seed", self.seed, 0)
        if isinstance(self.objective, dict):
            self.objective = Objective(**self.objective)
        if not str(self.out_dir).strip():
            raise _bad("sweep.out_dir", self.out_dir, "must be a folder path")
        if not str(self.study_name).strip():
            raise _bad("sweep.study_name", self.study_name, "must be a non-empty name")
        if self.storage is not None and "://" not in str(self.storage):
            raise _bad("sweep.storage", self.storage, "null (a journal file in out_dir) or an RDB URL such as "
                       "postgresql+psycopg://user:password@host/db, mysql://..., sqlite:///path.db")
        _integer("sweep.workers", self.workers, 1)
        _integer("sweep.heartbeat_s", self.heartbeat_s, 1)
        _integer("sweep.max_retries", self.max_retries, 0)
        _integer("sweep.trial_timeout_s", self.trial_timeout_s, 1, optional=True)
        if not self.group_by:
            raise _bad("sweep.group_by", self.group_by, "name at least one key (e.g. prune.criterion)")
        from prunelight.sweep.space import check_space  # the space's own checks (values, ranges, mode)

        check_space(self.space, self.mode)

    @property
    def grid(self) -> bool:
        """True in grid mode."""
        return self.mode == "grid"
