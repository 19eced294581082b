"""Where a sweep keeps its trials: the Optuna study (journal file or RDB), trial records, heartbeats and stale trials.

Optuna does the bookkeeping: trial numbers, states (a finished trial is never run again), several workers on
one study, the grid's points (GridSampler), retries of killed trials (RetryHeartbeatStaleTrialCallback). What
Optuna's journal storage lacks is a heartbeat: each worker writes one into the running trial's user
attributes (`heartbeat`, with its `worker` host:pid), and a trial whose worker process is gone (same host)
or whose heartbeat is older than 3 intervals is failed as stale and retried. RDB storages use Optuna's own
heartbeat instead of the age of ours: a table in the database, judged by the database's clock, so workers on
nodes whose clocks differ agree on who is dead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prunelight.errors import PrunelightError, _first_line
from prunelight.validate import SettingsError
from prunelight.sweep.space import decode
from prunelight.sweep.settings import SweepSettings

log = logging.getLogger("prunelight")

JOURNAL_FILE = "study.journal"
STALE_INTERVALS = 3  # heartbeats missed before a running trial counts as dead
SCHEMA_TRIES = 5  # attempts to open an RDB storage whose tables other workers are creating at the same moment


def worker_id() -> str:
    """This process as 'host:pid'."""
    return f"{socket.gethostname()}:{os.getpid()}"


def retry_callback(max_retries: int):
    """Optuna's callback that queues a stale trial again with the same parameters (at most `max_retries` times)."""
    import warnings

    from optuna.exceptions import ExperimentalWarning
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        return RetryHeartbeatStaleTrialCallback(max_retry=max_retries)


def open_storage(settings: SweepSettings):
    """The study's storage: a journal file in out_dir by default, else the RDB URL (with Optuna's heartbeat)."""
    from optuna.storages import JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend

    if settings.storage is None:
        path = Path(settings.out_dir) / JOURNAL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    import warnings

    import sqlalchemy.exc
    from optuna.exceptions import ExperimentalWarning

    with storage_errors(settings.storage), warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)  # the heartbeat: one line per worker otherwise
        for attempt in range(SCHEMA_TRIES):
            try:
                return RDBStorage(settings.storage, heartbeat_interval=settings.heartbeat_s,
                                  grace_period=STALE_INTERVALS * settings.heartbeat_s,
                                  heartbeat_stale_trial_callback=retry_callback(settings.max_retries))
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
                # Workers starting at once on a fresh database all create Optuna's tables; PostgreSQL refuses all
                # but one (duplicate key / relation exists). The others find the tables made on their next try.
                if attempt == SCHEMA_TRIES - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))


def shown_url(url: str) -> str:
    """The storage URL with its password masked, for messages and logs."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: mask what looks like user:password@
        return re.sub(r"(//[^/:@]*:)[^@/]*@", r"\1***@", url)


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn SQLAlchemy's and the driver's errors on opening an RDB storage into one line naming the (masked) URL."""
    import sqlalchemy.exc

    shown = shown_url(url)
    try:
        yield
    except ImportError as err:  # Optuna's own wording hides which module: the driver the URL's dialect imports
        driver = getattr(err.__cause__, "name", None) or "its driver"
        raise PrunelightError(
            f"sweep.storage={shown!r}: the database driver {driver!r} is not installed (PostgreSQL: pip install "
            "'prunelight[postgres]', which brings psycopg, and write postgresql+psycopg://...)") from err
    except (sqlalchemy.exc.ArgumentError, ValueError) as err:  # unknown dialect, unreadable URL, bad port
        raise SettingsError(
            f"sweep.storage={shown!r} is not allowed: not a database URL ({_first_line(err)}); use e.g. "
            "postgresql+psycopg://user:password@host:5432/db, mysql://..., sqlite:///path.db") from err
    except sqlalchemy.exc.DBAPIError as err:  # refused, unknown host, bad password, missing database
        why = _first_line(getattr(err, "orig", None) or err)
        raise PrunelightError(f"sweep.storage={shown!r}: cannot open the database: {why}") from err


def make_sampler(settings: SweepSettings, seed: int | None = None):
    """GridSampler over the space (grid mode), else TPE or random sampling, seeded (`seed`, default the sweep's)."""
    import optuna

    from prunelight.sweep.space import optuna_grid

    seed = settings.seed if seed is None else seed
    if settings.grid:
        return optuna.samplers.GridSampler(optuna_grid(settings.space), seed=seed)
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def open_study(settings: SweepSettings, storage=None):
    """Create or join the study named `study_name` in the storage."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is one line of ours, not a traceback
    return optuna.create_study(storage=storage or open_storage(settings), sampler=make_sampler(settings),
                               study_name=settings.study_name, direction=settings.objective.direction,
                               load_if_exists=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(trial, heartbeat_s: int, check_age: bool, now: float | None = None) -> str | None:
    """Why a RUNNING trial is dead (its worker process is gone, or its heartbeat stopped), or None if alive."""
    worker = trial.user_attrs.get("worker")
    if worker:
        host, _, pid = str(worker).rpartition(":")
        if host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            return f"its worker {worker} is gone (killed?)"
    if check_age:
        now = time.time() if now is None else now
        beat = trial.user_attrs.get("heartbeat")
        if beat is None and trial.datetime_start is not None:
            beat = trial.datetime_start.timestamp()
        if beat is not None and now - float(beat) > STALE_INTERVALS * heartbeat_s:
            return f"no heartbeat for {now - float(beat):.0f} s (worker {worker})"
    return None


def fail_stale(study, settings: SweepSettings) -> list[int]:
    """Fail the running trials of dead workers and enqueue their retries (up to max_retries); their numbers."""
    from optuna.trial import TrialState

    storage = study._storage
    # RDB: Optuna's heartbeat table (the study holds the RDBStorage wrapped in Optuna's cache, which passes it on)
    interval = getattr(storage, "get_heartbeat_interval", None)
    native = interval is not None and interval() is not None
    # Optuna fails these itself only when a trial starts: a worker waiting for the last running trials would
    # wait for ever on one whose worker died on another node. The database's clock decides, not the nodes'.
    silent = set(storage._get_stale_trial_ids(study._study_id)) if native else set()
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        why = is_stale(t, settings.heartbeat_s, check_age=not native)
        if why is None and t._trial_id in silent:
            why = (f"no heartbeat in the database for {STALE_INTERVALS * settings.heartbeat_s} s "
                   f"(worker {t.user_attrs.get('worker')})")
        if why is None:
            continue
        try:  # the attributes first: a finished trial cannot be updated
            storage.set_trial_user_attr(t._trial_id, "stale", True)
            storage.set_trial_user_attr(t._trial_id, "error", f"stale: {why}")
            if storage.set_trial_state_values(t._trial_id, TrialState.FAIL) is False:
                continue
        except Exception:  # another worker failed it first
            continue
        log.warning("sweep: trial %d was running when %s; marked failed%s", t.number, why,
                    "" if settings.max_retries == 0 else " and queued for a retry")
        retry_callback(settings.max_retries)(study, storage.get_trial(t._trial_id))
        failed.append(t.number)
    return failed


class Heartbeat:
    """Writes `heartbeat` (and `worker`) into a running trial's user attributes every interval, from a thread."""

    def __init__(self, study, trial_id: int, interval_s: float) -> None:
        self.storage, self.trial_id, self.interval = study._storage, trial_id, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prunelight-sweep-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.storage.set_trial_user_attr(self.trial_id, "worker", worker_id())
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        """One heartbeat now."""
        self.storage.set_trial_user_attr(self.trial_id, "heartbeat", time.time())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as err:  # a storage hiccup must not kill the trial; the next beat retries
                log.warning("sweep: heartbeat of trial %d failed: %s", self.trial_id, err)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def trial_row(t) -> dict[str, Any]:
    """One trial as the results file keeps it: number, state, parameters, objective value and what it measured."""
    result = dict(t.user_attrs.get("result") or {})
    return {
        "number": t.number,
        "state": t.state.name,
        "params": {k: decode(v) for k, v in t.params.items()},
        "value": t.value if t.state.name == "COMPLETE" else None,
        "error": t.user_attrs.get("error"),
        "retry_of": t.system_attrs.get("failed_trial"),
        "duplicate_of": t.user_attrs.get("duplicate_of"),
        "stale": bool(t.user_attrs.get("stale")),
        "started": t.datetime_start.isoformat() if t.datetime_start else None,
        "finished": t.datetime_complete.isoformat() if t.datetime_complete else None,
        **{k: result.get(k) for k in ("model", "metrics", "times_s", "peak_rss_mib", "reuse", "out_dir", "log")},
    }


def results_document(study, settings: SweepSettings) -> dict[str, Any]:
    """Everything the tables and figures need, from the study alone (`results.json`)."""
    return {
        "study": settings.study_name,
        "mode": settings.mode,
        "objective": {"describe": settings.objective.describe(), "direction": settings.objective.direction,
                      "metric": settings.objective.metric, "weights": settings.objective.weights},
        "space": settings.space,
        "group_by": list(settings.group_by),
        "model_key": settings.model_key,
        "trials": stale_by_retry([trial_row(t) for t in study.get_trials(deepcopy=False)]),
    }


def stale_by_retry(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark as stale the failed trials that were retried, but not by `fail_stale`: with an RDB storage, Optuna's own
    heartbeat check (when any worker starts a trial) may fail a dead worker's trial just before `fail_stale` does."""
    retried = {r["retry_of"] for r in rows if r["retry_of"] is not None}
    for r in rows:
        if r["number"] in retried and r["state"] == "FAIL" and not r["stale"]:
            r["stale"] = True
            r["error"] = r["error"] or "stale: no heartbeat in the database (failed by Optuna's heartbeat check)"
    return rows
