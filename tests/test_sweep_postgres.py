"""A sweep over a real PostgreSQL server: two worker processes on one study, one killed with -9 mid-trial.

The server is the one `scripts/postgres_server.sh` starts (Debian's `postgresql`, its own data folder, 127.0.0.1
only), or the one `.ci/run` started and named in PRUNELIGHT_POSTGRES_URL; the tests skip with the reason when neither
can be had. Trials are `test_sweep.fake_runner` (no model): what is tested is the study's bookkeeping under
concurrent writers — each grid point run once, the killed trial failed as stale and retried, the tables the same as
a journal-file run's. Bad storage URLs and an unreachable server are one line from `prunelight sweep`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from test_sweep import calls, fake_runner, settings

from prunelight.sweep.driver import Worker, run_sweep
from prunelight.sweep.space import grid_points
from prunelight.sweep.store import open_study, results_document
from prunelight.sweep.tables import all_tables, to_markdown

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "scripts" / "postgres_server.sh"
URL_ENV = "PRUNELIGHT_POSTGRES_URL"
GRID = {"prune.allocation": ["global", "layerwise"], "prune.ratio": [0.1, 0.2, 0.3]}
HANG = {"prune.allocation": "layerwise", "prune.ratio": 0.2}  # its first run hangs until its worker is killed


def _driver_missing() -> str | None:
    try:
        import psycopg  # noqa: F401  (SQLAlchemy's default driver for postgresql:// URLs)
    except ImportError:
        return "the PostgreSQL driver psycopg is not installed: pip install 'prunelight[postgres]'"
    return None


@pytest.fixture(scope="module")
def postgres_url():
    """The URL of a running server: PRUNELIGHT_POSTGRES_URL, else one started here (and stopped after)."""
    if _driver_missing():
        pytest.skip(_driver_missing())
    if os.environ.get(URL_ENV):
        yield os.environ[URL_ENV]
        return
    from dist_probe import free_port  # here, not at the top: the spawned workers import this module, not Lightning

    folder = tempfile.mkdtemp(prefix="prunelight-pg-")  # under /tmp: the server's OS user must reach it
    proc = subprocess.run(["bash", str(SERVER), "start", folder, str(free_port())], capture_output=True, text=True,
                          timeout=900)
    try:
        if proc.returncode != 0:
            pytest.skip(f"no PostgreSQL server could be started: {proc.stderr.strip() or proc.stdout.strip()}")
        yield proc.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run(["bash", str(SERVER), "stop", folder], capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def killable_runner(spec) -> dict:
    """fake_runner, a little slower so both workers take trials; the first run of HANG hangs (its pid in `hung`)."""
    out = spec.trial_dir.parents[1]
    if spec.point == HANG:
        try:
            fd = os.open(out / "hung", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass  # the retry
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            time.sleep(600)
    time.sleep(0.3)
    return fake_runner(spec)


def _worker(s, host: str) -> None:
    """One worker process, naming itself as on node `host` (its pid then tells other workers nothing)."""
    from prunelight.sweep import store

    store.worker_id = lambda: f"{host}:{os.getpid()}"
    Worker(s, {}, killable_runner).run()


def _comparable(results: dict) -> str:
    """The tables, less the two that list trials by number (numbers follow the workers' timing)."""
    tables = [t for t in all_tables(results) if not t[0].startswith(("Costs per trial", "Failed trials"))]
    return to_markdown(tables)


def test_two_workers_share_a_postgres_study_and_a_killed_workers_trial_is_retried(tmp_path, postgres_url):
    """The workers name themselves as on two nodes, so the killed one is found by its silent heartbeat in the
    database, as across machines (on one host its missing pid gives it away at once: tested on the journal file)."""
    hosts = ("node-a", "node-b")
    s = settings(tmp_path, space=dict(GRID), storage=postgres_url,
                 study_name=f"test-{uuid.uuid4().hex[:12]}")  # one server, many tests: a study each
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_worker, args=(s, host), name=f"worker-{i}") for i, host in enumerate(hosts)]
    for w in workers:
        w.start()
    try:
        deadline = time.time() + 180
        while not (tmp_path / "hung").exists() and time.time() < deadline and any(w.is_alive() for w in workers):
            time.sleep(0.1)
        assert (tmp_path / "hung").exists(), "no worker reached the hanging grid point"
        time.sleep(0.5)
        killed_pid = int((tmp_path / "hung").read_text())
        os.kill(killed_pid, signal.SIGKILL)
        killed = next(w for w in workers if w.pid == killed_pid)
        survivor = next(w for w in workers if w.pid != killed_pid)
        killed.join(30)
        survivor.join(180)
        assert killed.exitcode == -signal.SIGKILL and survivor.exitcode == 0
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()

    results = results_document(open_study(s), s)
    # every grid point ran to its end exactly once (the killed run never ended)
    assert sorted(json.dumps(c, sort_keys=True) for c in calls(tmp_path)) == sorted(
        json.dumps(p, sort_keys=True) for p in grid_points(GRID))
    stale = [t for t in results["trials"] if t["stale"]]
    assert len(stale) == 1 and stale[0]["state"] == "FAIL" and stale[0]["params"] == HANG, results["trials"]
    assert "no heartbeat in the database" in stale[0]["error"]
    retry = [t for t in results["trials"] if t["retry_of"] == stale[0]["number"]]
    assert len(retry) == 1 and retry[0]["state"] == "COMPLETE" and retry[0]["params"] == HANG
    complete = [json.dumps(t["params"], sort_keys=True) for t in results["trials"] if t["state"] == "COMPLETE"]
    assert len(complete) == len(set(complete)) == 6
    # two workers may draw the same grid point at once: the newer then steps aside as a pruned duplicate, runs nothing
    assert {t["state"] for t in results["trials"]} - {"PRUNED"} == {"COMPLETE", "FAIL"}
    pruned = [t for t in results["trials"] if t["state"] == "PRUNED"]
    assert all(t["duplicate_of"] is not None and t["params"] in grid_points(GRID) for t in pruned), pruned

    journal = run_sweep(settings(tmp_path / "journal", space=dict(GRID)), {}, fake_runner)
    assert (tmp_path / "journal" / "study.journal").exists()
    assert _comparable(results) == _comparable(journal)
    assert "Optimal configuration per model" in _comparable(journal)


def _sweep_yaml(tmp_path: Path, storage: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": [str(ROOT / "configs" / "reference.yaml")], "space": dict(GRID),
                                    "out_dir": str(tmp_path / "out"), "storage": storage}))
    return path


@pytest.mark.parametrize("storage, says", [
    ("postgres://u:secret@127.0.0.1:5432/db", "is not allowed: not a database URL (Can't load plugin: "
                                              "sqlalchemy.dialects:postgres)"),
    ("postgresql://u:secret@127.0.0.1:notaport/db", "is not allowed: not a database URL"),
    ("postgresql://u:secret@127.0.0.1:{port}/db", "cannot open the database: connection failed: "),
], ids=["unknown-dialect", "bad-port", "unreachable"])
def test_a_bad_storage_url_or_an_unreachable_server_is_one_line(tmp_path, capsys, storage, says):
    from dist_probe import free_port

    from prunelight.cli import main

    if "cannot open" in says and _driver_missing():
        pytest.skip(_driver_missing())
    path = _sweep_yaml(tmp_path, storage.format(port=free_port()))
    t0 = time.perf_counter()
    assert main(["sweep", "--config", str(path)]) == 2
    assert time.perf_counter() - t0 < 60
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("prunelight: error: sweep.storage='postgres") and says in err[0], err[0]
    assert "secret" not in err[0] and "***" in err[0]  # the password is masked
    assert not (tmp_path / "out" / "trials").exists()


def test_a_missing_database_driver_is_one_line(tmp_path, capsys):
    from prunelight.cli import main

    try:
        import MySQLdb  # noqa: F401
        pytest.skip("mysqlclient is installed here: no driver is missing")
    except ImportError:
        pass
    path = _sweep_yaml(tmp_path, "mysql://u:secret@127.0.0.1:3306/db")
    assert main(["sweep", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prunelight: error: sweep.storage='mysql://u:***@127.0.0.1:3306/db': the database driver 'MySQLdb' "
                   "is not installed (PostgreSQL: pip install 'prunelight[postgres]', which brings psycopg, and write "
                   "postgresql+psycopg://...)"]
