"""One trial: `prunelight fit` with the trial's overrides, in a subprocess, and what it measured.

A subprocess isolates the trial: a crash or an out-of-memory kill fails that trial only, and all its
memory goes back when it ends. The trial's folder (`<sweep>/trials/<number>/`) is the run's `out_dir`; it
holds `trial.yaml` (the overrides given to the run), `run.log`, the run's report.json, and `trial.json`
(this module's result, written atomically when the trial ends). Peak memory is the child's peak resident
set size (`wait4` rusage).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prunelight.atomic import atomic_write_json, atomic_write_text
from prunelight.sweep.cache import SCORES_FILE, ScoreCache, prune_section, score_key
from prunelight.sweep.space import nested

log = logging.getLogger("prunelight")


@dataclass
class TrialSpec:
    """What one trial runs: its number and point, where it writes, the base configs and the caches."""

    number: int
    point: dict[str, Any]
    trial_dir: Path
    base: list[str]
    config: dict[str, Any] = field(default_factory=dict)  # the resolved run config with the point applied
    extra_args: list[str] = field(default_factory=list)
    score_cache: ScoreCache | None = None
    dense_cache: str | None = None
    timeout_s: int | None = None
    cwd: str = "."


class TrialError(RuntimeError):
    """A trial's run failed; the message is the run's one-line error."""


Runner = Callable[[TrialSpec], dict]


def final_state(report: dict) -> str:
    """The last model state a run measured: recovered, else pruned, else dense."""
    for state in ("recovered", "pruned", "dense"):
        if state in (report.get("ppl") or {}) or state in (report.get("evaluation") or {}):
            return state
    return "pruned"


def trial_metrics(report: dict) -> dict[str, float]:
    """The numbers an objective or a table can use, from a run's report.json.

    ppl / ppl_dense / ppl_pruned / ppl_recovered: perplexity on data.eval (ppl = the final model's);
    zeroshot_avg, zeroshot_<task>, zeroshot_dense_avg: zero-shot accuracy; suite_ppl and ppl_<set>_<len>: the
    evaluation suite's perplexities of the final model; removed_fraction, params_after.
    """
    out: dict[str, float] = {}
    final = final_state(report)
    ppl = report.get("ppl") or {}
    if final in ppl:
        out["ppl"] = ppl[final]
    for state, value in ppl.items():
        out[f"ppl_{state}"] = value
    ev = report.get("evaluation") or {}
    for state, tag in ((final, ""), ("dense", "dense_")):
        zs = (ev.get(state) or {}).get("zeroshot") or {}
        if zs.get("average", {}).get("acc") is not None:
            out[f"zeroshot_{tag}avg"] = zs["average"]["acc"]
            if not tag:
                for task, res in (zs.get("tasks") or {}).items():
                    if res.get("acc") is not None:
                        out[f"zeroshot_{task}"] = res["acc"]
    for i, r in enumerate((ev.get(final) or {}).get("perplexity") or []):
        if i == 0:
            out["suite_ppl"] = r["ppl"]
        out[f"ppl_{r['dataset']}_{r.get('seq_len_requested', r.get('seq_len'))}"] = r["ppl"]
    plan = report.get("plan") or {}
    if plan.get("removed_fraction_total") is not None:
        out["removed_fraction"] = plan["removed_fraction_total"]
    if report.get("params_after") is not None:
        out["params_after"] = report["params_after"]
    return {k: float(v) for k, v in out.items() if v is not None}


def trial_times(report: dict, wall_s: float) -> dict[str, float]:
    """Scoring, evaluation and recovery wall time of a run; recovery = the wall time the timed phases leave."""
    t = report.get("times_s") or {}
    scoring = float(t.get("calibration_and_allocation", 0.0))
    evaluation = sum(float(v) for k, v in t.items() if k.startswith(("eval_", "evaluation_")))
    other = sum(float(t.get(k, 0.0)) for k in ("load", "surgery", "export"))
    return {"wall": wall_s, "scoring": scoring, "evaluation": evaluation,
            "recovery": max(0.0, wall_s - scoring - evaluation - other), "load": float(t.get("load", 0.0))}


def _die_with_parent() -> None:
    """In the child: be killed when the sweep worker dies, so a killed sweep leaves no orphan run behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _error_line(log_path: Path, returncode: int) -> str:
    """The run's one-line error from its log, else the exit status."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("prunelight: error:"):
            return ln[len("prunelight: "):]
    for ln in reversed(lines):
        if ("Error" in ln or "error" in ln) and not ln.startswith(("File ", "^")):
            return f"exit status {returncode}: {ln[:300]}"
    if returncode < 0:
        return f"killed by signal {-returncode}" + (" (out of memory?)" if -returncode == signal.SIGKILL else "")
    return f"exit status {returncode}"


def _cached_scores(spec: TrialSpec) -> tuple[dict[str, Any] | None, Path | None]:
    """The trial's score-cache key (None: no cache, or prune settings its run refuses) and the cached file its run
    takes (None: a miss)."""
    if spec.score_cache is None:
        return None, None
    try:
        key = score_key(spec.config)
    except (TypeError, ValueError) as err:  # the run refuses these settings itself, with its own one-line error
        log.info("sweep: trial %d: no score cache (%s)", spec.number, err)
        return None, None
    return key, spec.score_cache.lookup(key, prune_section(spec.config))


def subprocess_runner(spec: TrialSpec) -> dict:
    """Run one trial as `python -m prunelight fit` and return its result (metrics, times, memory, reuse)."""
    spec.trial_dir.mkdir(parents=True, exist_ok=True)
    overrides = nested(spec.point)
    overrides.setdefault("export", {})["out_dir"] = str(spec.trial_dir)
    reuse: dict[str, Any] = {"scores": "off", "dense": "off"}
    key, hit = _cached_scores(spec)
    if key is not None:
        reuse["scores"] = "hit" if hit else "miss"
    if hit:
        overrides.setdefault("prune", {})["scores"] = str(hit.resolve())
    if spec.dense_cache:
        overrides.setdefault("evaluation", {})["dense_cache"] = str(Path(spec.dense_cache).resolve())
    import yaml

    config_path = spec.trial_dir / "trial.yaml"
    atomic_write_text(config_path, yaml.safe_dump(overrides, sort_keys=False))
    cmd = [sys.executable, "-m", "prunelight", "fit"]
    for b in spec.base:
        cmd += ["--config", b]
    cmd += ["--config", str(config_path), *spec.extra_args]
    log_path = spec.trial_dir / "run.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=spec.cwd, env=env,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        status, usage, timed_out = None, None, False
        while status is None:
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, usage = st, ru
                break
            if spec.timeout_s is not None and time.perf_counter() - t0 > spec.timeout_s:
                proc.kill()
                timed_out = True
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.25)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    peak_mib = usage.ru_maxrss / 1024.0 if usage is not None else None  # KiB on Linux
    result: dict[str, Any] = {"number": spec.number, "point": spec.point, "out_dir": str(spec.trial_dir),
                              "log": str(log_path), "peak_rss_mib": peak_mib, "reuse": reuse,
                              "returncode": proc.returncode,
                              "model": (spec.config.get("model") or {}).get("pretrained")}
    report_path = spec.trial_dir / "report.json"
    if proc.returncode != 0 or not report_path.is_file():
        why = f"timed out after {spec.timeout_s} s" if timed_out else _error_line(log_path, proc.returncode)
        result.update(error=why, times_s={"wall": wall})
        atomic_write_json(spec.trial_dir / "trial.json", result)
        raise TrialError(f"{why} (log: {log_path})")
    report = json.loads(report_path.read_text())
    dense = ((report.get("evaluation") or {}).get("reuse") or {}).get("dense")
    if dense is not None:
        reuse["dense"] = "hit" if dense.get("hit") else "miss"
    if spec.score_cache is not None and reuse["scores"] == "miss" and key is not None:
        stored = spec.score_cache.store(key, spec.trial_dir / SCORES_FILE)
        if stored is None:
            reuse["scores"] = "miss (the run wrote no scores.pt)"
    result.update(metrics=trial_metrics(report), times_s=trial_times(report, wall))
    atomic_write_json(spec.trial_dir / "trial.json", result)
    return result
