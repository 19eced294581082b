"""`prunelight sweep`: bookkeeping with injected runners (resume, failures, stale trials, two workers), the score
cache key, a bad space key, the tables from a fixed results file, and one real sweep of tiny `prunelight fit` runs."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from prunelight.sweep.cache import ScoreCache, score_key
from prunelight.sweep.command import sweep_main, write_outputs
from prunelight.sweep.driver import Worker, run_sweep
from prunelight.sweep.runner import TrialError
from prunelight.sweep.space import apply_point
from prunelight.sweep.settings import SweepSettings
from prunelight.sweep.tables import all_tables, to_latex, to_markdown

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
SPACE = {"prune.allocation": ["global", "layerwise"], "prune.ratio": [0.2, 0.3]}


def fake_metrics(point: dict) -> dict:
    ppl = 100 + 100 * point["prune.ratio"] + (5 if point["prune.allocation"] == "layerwise" else 0)
    return {"ppl": ppl, "zeroshot_avg": 0.6 - ppl / 1000}


def fake_runner(spec) -> dict:
    """Records each call as a file (so calls from other processes count too); the n-th call hangs when a 'hang'
    file holds n."""
    calls = spec.trial_dir.parents[1] / "calls"
    calls.mkdir(exist_ok=True)
    name = "_".join(f"{v}" for v in spec.point.values())
    (calls / f"{time.time_ns()}.{os.getpid()}.{name}").write_text(json.dumps(spec.point))
    hang = spec.trial_dir.parents[1] / "hang"
    if hang.exists() and hang.read_text() == str(len(list(calls.iterdir()))):
        time.sleep(120)
    deadline = time.time() + 60
    while (spec.trial_dir.parents[1] / "barrier").exists() and time.time() < deadline and \
            len({p.name.split(".")[1] for p in calls.iterdir()}) < 2:
        time.sleep(0.1)  # two workers: each one's first trial waits until the other has started one
    if spec.point.get("prune.ratio") == 0.3 and spec.point.get("prune.allocation") == "layerwise" and \
            (spec.trial_dir.parents[1] / "fail").exists():
        raise TrialError("prune.ratio=0.3 asks to remove more than the layers have (log: run.log)")
    time.sleep(0.2)
    return {"metrics": fake_metrics(spec.point), "times_s": {"wall": 0.2, "scoring": 0.1},
            "reuse": {"scores": "miss", "dense": "miss"}, "peak_rss_mib": 10.0}


def calls(out: Path) -> list[dict]:
    folder = out / "calls"
    return [json.loads(p.read_text()) for p in sorted(folder.iterdir())] if folder.exists() else []


def settings(out: Path, **kw) -> SweepSettings:
    return SweepSettings(**{"base": ["configs/reference.yaml"], "space": dict(SPACE), "out_dir": str(out),
                            "heartbeat_s": 1, **kw})


def states(results: dict) -> list[str]:
    return [t["state"] for t in results["trials"]]


def test_a_trial_that_raises_is_recorded_and_the_sweep_goes_on(tmp_path):
    (tmp_path / "fail").write_text("")
    results = run_sweep(settings(tmp_path), {}, fake_runner)
    failed = [t for t in results["trials"] if t["state"] == "FAIL"]
    assert len(failed) == 1 and sorted(states(results)) == ["COMPLETE"] * 3 + ["FAIL"]
    assert failed[0]["params"] == {"prune.allocation": "layerwise", "prune.ratio": 0.3}
    assert "asks to remove more than the layers have" in failed[0]["error"]
    assert failed[0]["log"].endswith("run.log")
    md = to_markdown(all_tables(results))
    assert "### Failed trials" in md and "asks to remove" in md


def test_a_resumed_sweep_skips_finished_trials(tmp_path):
    s = settings(tmp_path)
    first = run_sweep(s, {}, fake_runner)
    assert states(first) == ["COMPLETE"] * 4 and len(calls(tmp_path)) == 4
    again = run_sweep(s, {}, fake_runner)  # a restart on the same journal
    assert len(calls(tmp_path)) == 4, "a finished trial was run again"
    assert len(again["trials"]) == 4


def _run_worker(s: SweepSettings) -> None:
    Worker(s, {}, fake_runner).run()


def test_a_killed_sweep_restarts_retries_the_killed_trial_and_keeps_the_finished_ones(tmp_path):
    (tmp_path / "hang").write_text("3")  # the third trial hangs until the worker is killed
    s = settings(tmp_path)
    proc = multiprocessing.get_context("spawn").Process(target=_run_worker, args=(s,))
    proc.start()
    deadline = time.time() + 120
    while time.time() < deadline and len(calls(tmp_path)) < 3:
        time.sleep(0.2)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    done_before = len(calls(tmp_path))
    assert done_before == 3
    killed = calls(tmp_path)[2]
    (tmp_path / "hang").unlink()
    results = run_sweep(s, {}, fake_runner)
    ran_again = calls(tmp_path)[done_before:]
    assert len(ran_again) == 2, ran_again  # the killed point, retried, and the one never started
    assert killed in ran_again and calls(tmp_path)[0] not in ran_again and calls(tmp_path)[1] not in ran_again
    stale = [t for t in results["trials"] if t["stale"]]
    assert len(stale) == 1 and stale[0]["state"] == "FAIL" and "gone" in stale[0]["error"]
    retry = [t for t in results["trials"] if t["retry_of"] == stale[0]["number"]]
    assert len(retry) == 1 and retry[0]["state"] == "COMPLETE"
    assert sum(t["state"] == "COMPLETE" for t in results["trials"]) == 4


@pytest.mark.parametrize("mode", ["grid", "optuna"])
def test_two_worker_processes_share_one_journal_study(tmp_path, mode):
    space = {"prune.allocation": ["global", "layerwise"], "prune.ratio": [0.1, 0.2, 0.3]}
    if mode == "optuna":
        space["prune.ratio"] = {"low": 0.1, "high": 0.4}
    extra = {"n_trials": 6} if mode == "optuna" else {}  # TPE, seeded
    (tmp_path / "barrier").write_text("")
    results = run_sweep(settings(tmp_path, space=space, mode=mode, workers=2, **extra), {}, fake_runner)
    made = calls(tmp_path)
    workers = {p.name.split(".")[1] for p in (tmp_path / "calls").iterdir()}  # pids
    assert len(workers) == 2, "both worker processes ran trials"
    assert sum(t["state"] == "COMPLETE" for t in results["trials"]) == 6
    if mode == "optuna":  # each worker seeds its sampler apart: two seeded workers must not draw the same points
        assert len({json.dumps(c, sort_keys=True) for c in made}) >= 4
    if mode == "grid":
        assert sorted(json.dumps(c, sort_keys=True) for c in made) == sorted(
            json.dumps({"prune.allocation": a, "prune.ratio": r}, sort_keys=True)
            for a in space["prune.allocation"] for r in space["prune.ratio"]), "each grid point ran exactly once"
    assert (tmp_path / "study.journal").exists()


ONE_POINT = {"prune.allocation": ["global"], "prune.ratio": [0.2]}


@pytest.mark.parametrize("older_first", [True, False])
def test_of_two_running_duplicates_of_a_grid_point_the_older_runs_and_the_newer_defers(tmp_path, older_first):
    """Two workers drew the same point (GridSampler re-hands a running point once none is left unstarted): each
    sees the other running; only the newer defers, so the point ends up covered by a complete trial."""
    import optuna
    from optuna.trial import TrialState

    from prunelight.sweep.driver import next_step
    from prunelight.sweep.space import suggest

    s = settings(tmp_path, space=dict(ONE_POINT))
    # a one-point space: any sampler draws that point (GridSampler's stop() works only inside optimize)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction=s.objective.direction)
    older, newer = study.ask(), study.ask()
    assert suggest(older, s.space) == suggest(newer, s.space)  # both running, the same point
    worker = Worker(s, {}, fake_runner)
    outcome = {}
    for trial in ((older, newer) if older_first else (newer, older)):
        try:
            outcome[trial.number] = worker.objective(trial)
        except optuna.TrialPruned:
            outcome[trial.number] = "deferred"
    assert outcome[newer.number] == "deferred" and outcome[older.number] != "deferred"
    assert newer.user_attrs["duplicate_of"] == older.number and len(calls(tmp_path)) == 1
    study.tell(newer, state=TrialState.PRUNED)
    study.tell(older, outcome[older.number])
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert next_step(study, s) == "done"


def test_a_pruned_duplicate_does_not_cover_its_grid_point(tmp_path):
    """A point whose only trial was pruned as a duplicate (as two running duplicates used to leave it) is run."""
    import optuna
    from optuna.trial import TrialState

    from prunelight.sweep.driver import next_step
    from prunelight.sweep.space import encode
    from prunelight.sweep.store import open_study

    s = settings(tmp_path, space=dict(ONE_POINT))
    study = open_study(s)
    study.sampler = optuna.samplers.RandomSampler(seed=0)  # GridSampler's stop() works only inside optimize
    pruned = study.ask()
    for key, values in ONE_POINT.items():
        pruned.suggest_categorical(key, [encode(v) for v in values])
    pruned.set_user_attr("duplicate_of", 1)
    study.tell(pruned, state=TrialState.PRUNED)
    assert next_step(study, s) == "run"
    results = run_sweep(s, {}, fake_runner)
    assert states(results) == ["PRUNED", "COMPLETE"] and len(calls(tmp_path)) == 1
    assert next_step(open_study(s), s) == "done"


def test_the_score_cache_key_ignores_ratio_and_allocation_but_not_data_or_seq_len(tmp_path):
    config = {"seed_everything": 0,
              "model": {"pretrained": str(tmp_path / "m"), "dtype": "float32", "attn_implementation": "sdpa"},
              "data": {"calibration": {"path": "a/valid.txt"}, "seq_len": 64, "num_samples": 8, "seed": 0,
                       "calibration_batch_size": 4},
              "prune": {"ratio": 0.2, "allocation": "global", "criterion": "flap", "criterion_args": {},
                        "layer_importance": "block_influence", "report_layer_importance": ["block_influence"]}}
    key = score_key(config)
    assert score_key(apply_point(config, {"prune.ratio": 0.3})) == key
    assert score_key(apply_point(config, {"prune.allocation": "layerwise"})) == key
    assert score_key(apply_point(config, {"data.seq_len": 128})) != key
    assert score_key(apply_point(config, {"data.calibration.path": "b/valid.txt"})) != key
    assert score_key(apply_point(config, {"data.num_samples": 16})) != key
    assert score_key(apply_point(config, {"prune.criterion": "wanda_sp"})) != key

    from prunelight.saved import save_scores

    cache = ScoreCache(tmp_path / "cache")
    run_file = tmp_path / "scores.pt"
    inner = {"model": {"fingerprint": "abc"}, "criterion": "flap", "criterion_args": {},
             "calibration": key["calibration"]}  # what the run writes: scores_key with the same calibration part
    save_scores(run_file, {}, inner)
    stored = cache.store(key, run_file)
    assert cache.lookup(score_key(apply_point(config, {"prune.ratio": 0.3}))) == stored
    assert cache.lookup(score_key(apply_point(config, {"prune.allocation": "layerwise"}))) == stored
    assert cache.lookup(score_key(apply_point(config, {"data.seq_len": 128}))) is None
    # a file whose own key disagrees (another seq_len inside) is never used, whatever its name says
    save_scores(stored, {}, {**inner, "calibration": {**inner["calibration"], "seq_len": 32}})
    assert cache.lookup(key) is None


def _cache_config(tmp_path: Path, **prune) -> dict:
    """A resolved-looking run config; `prune` overrides its prune section."""
    from prunelight.data import TextSource

    return {"seed_everything": 0,
            "model": {"pretrained": str(tmp_path / "m"), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"calibration": dataclasses.asdict(TextSource(path="a/valid.txt")), "seq_len": 64,
                     "num_samples": 8, "seed": 0, "batch_size": 4, "calibration_batch_size": 4},
            "prune": {"ratio": 0.2, "allocation": "global", "criterion": "flap", "criterion_args": {},
                      "layer_importance": "block_influence", "report_layer_importance": ["block_influence"],
                      **prune}}


def _run_scores(path: Path, config: dict, layer_importance=("block_influence",), block_importance=None) -> Path:
    """A scores.pt as a run of `config` writes it: its key, the layer importance and sub-block measures it took."""
    from prunelight.saved import save_scores
    from prunelight.sweep.cache import calibration_part

    key = {"model": {"fingerprint": "abc"}, "criterion": config["prune"]["criterion"],
           "criterion_args": config["prune"]["criterion_args"], "calibration": calibration_part(config)}
    return save_scores(path, {}, key, layer_importance={name: [1.0, 2.0] for name in layer_importance},
                       block_importance=block_importance)


def test_a_null_calibration_batch_size_is_keyed_as_the_size_the_run_scores_with(tmp_path):
    """data.calibration_batch_size: null (quickstart, recover): the run scores with data.batch_size, and so does the
    key; a second trial with the same scoring settings hits the first one's scores."""
    from prunelight.data import PruneDataModule, TextSource
    from prunelight.saved import calibration_identity, save_scores
    from prunelight.settings import PruneSettings
    from prunelight.sweep.cache import calibration_part, prune_section

    config = apply_point(_cache_config(tmp_path), {"data.calibration_batch_size": None})
    data = config["data"]
    source = TextSource(**data["calibration"])
    dm = PruneDataModule(calibration=source, eval=source, num_samples=data["num_samples"], seq_len=data["seq_len"],
                         batch_size=data["batch_size"], calibration_batch_size=None, seed=data["seed"])
    run_calibration = calibration_identity(dm, PruneSettings(**prune_section(config)))
    assert run_calibration["batch_size"] == 4
    assert calibration_part(config) == run_calibration
    # what the run stores (its own calibration identity in the file) is found by the next trial
    run_file = tmp_path / "scores.pt"
    save_scores(run_file, {}, {"model": {"fingerprint": "abc"}, "criterion": "flap", "criterion_args": {},
                               "calibration": run_calibration})
    cache = ScoreCache(tmp_path / "cache")
    stored = cache.store(score_key(config), run_file)
    second = apply_point(config, {"prune.ratio": 0.3})
    assert cache.lookup(score_key(second), prune_section(second)) == stored
    assert score_key(apply_point(config, {"data.batch_size": 8})) != score_key(config)  # scored in batches of 8


def _accepts(hit: Path, config: dict) -> None:
    """The trial's run takes the cached file: its settings with prune.scores, and the measures its allocation needs."""
    from prunelight.saved import check_scores_cover, load_scores
    from prunelight.settings import PruneSettings
    from prunelight.sweep.cache import prune_section

    check_scores_cover(load_scores(hit), PruneSettings(**{**prune_section(config), "scores": str(hit)}))


@pytest.mark.parametrize("point, reused", [
    ({"prune.attn_mlp_split": "1:3"}, True),
    ({"prune.attn_mlp_split": None}, True),
    ({"prune.attn_mlp_split": "auto"}, False),  # the run refuses prune.scores: no calibration pass to search on
    ({"prune.allocation": "calibrated"}, True),  # its probes run on the calibration batches the run still reads
])
def test_cached_scores_go_only_to_a_trial_whose_run_takes_them(tmp_path, point, reused):
    from prunelight.sweep.cache import prune_section

    config = _cache_config(tmp_path)
    cache = ScoreCache(tmp_path / "cache")
    stored = cache.store(score_key(config), _run_scores(tmp_path / "scores.pt", config))
    trial = apply_point(config, point)
    assert score_key(trial) == score_key(config)  # the same scores: only the settings decide
    hit = cache.lookup(score_key(trial), prune_section(trial))
    assert hit == (stored if reused else None)
    if hit is not None:
        _accepts(hit, trial)


def test_blockwise_removal_never_reuses_scores_without_sub_block_removals(tmp_path):
    from prunelight.sweep.cache import prune_section

    config = _cache_config(tmp_path)
    cache = ScoreCache(tmp_path / "cache")
    plain = _run_scores(tmp_path / "scores.pt", config)  # a global run: no sub-block removal measures
    stored = cache.store(score_key(config), plain)
    removal = apply_point(config, {"prune.allocation": "blockwise",
                                   "prune.allocation_args.block_importance": "removal"})
    units = apply_point(config, {"prune.allocation": "blockwise", "prune.allocation_args.block_importance": "units"})
    assert score_key(removal) != score_key(config)
    assert cache.lookup(score_key(removal), prune_section(removal)) is None
    assert cache.lookup(score_key(units), prune_section(units)) == stored  # units need nothing more
    # a file stored under the removal key that lacks the measures (an older cache, say) is declined too
    cache.store(score_key(removal), plain)
    assert cache.lookup(score_key(removal), prune_section(removal)) is None
    # and a blockwise-removal run's own file is reused by the next such trial
    blocks = {"attn": [0.1, 0.2], "mlp": [0.3, 0.4]}
    other = ScoreCache(tmp_path / "other")
    own = other.store(score_key(removal), _run_scores(tmp_path / "removal.pt", removal, block_importance=blocks))
    again = apply_point(removal, {"prune.ratio": 0.3})
    assert other.lookup(score_key(again), prune_section(again)) == own
    _accepts(own, again)


def test_layer_importance_is_keyed_only_where_the_allocation_measures_it(tmp_path):
    from prunelight.sweep.cache import prune_section

    config = _cache_config(tmp_path)  # records block_influence (report_layer_importance)
    cache = ScoreCache(tmp_path / "cache")
    plain = _run_scores(tmp_path / "scores.pt", config)
    stored = cache.store(score_key(config), plain)
    # global measures no layer importance of its own: trials differing only in an unused one share scores
    unused = apply_point(config, {"prune.layer_importance": "activation_change"})
    assert score_key(unused) == score_key(config)
    assert cache.lookup(score_key(unused), prune_section(unused)) == stored
    # layerwise with a measure the global run recorded: the same scores, and its run takes them
    same = apply_point(config, {"prune.allocation": "layerwise"})
    assert cache.lookup(score_key(same), prune_section(same)) == stored
    _accepts(stored, same)
    # layerwise / depth with a measure the file lacks: another key, and never that file
    for allocation in ("layerwise", "depth"):
        needs = apply_point(unused, {"prune.allocation": allocation})
        assert score_key(needs) != score_key(config)
        assert cache.lookup(score_key(needs), prune_section(needs)) is None
        cache.store(score_key(needs), plain)  # even under its key (an older cache): declined
        assert cache.lookup(score_key(needs), prune_section(needs)) is None


def _write_sweep(tmp_path: Path, space: dict, **kw) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": [str(ROOT / "configs" / "reference.yaml")], "space": space,
                                    "out_dir": str(tmp_path / "out"), **kw}))
    return path


def test_a_space_key_the_run_config_lacks_is_refused_before_any_trial(tmp_path, capsys):
    from prunelight.cli import main

    path = _write_sweep(tmp_path, {"prune.ratoi": [0.2, 0.3]})
    assert main(["sweep", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("prunelight: error: sweep.space='prune.ratoi' is not allowed: not a key of the run config")
    assert "did you mean 'prune.ratio'?" in err and "ratio" in err  # the likely key first, then what exists
    assert not (tmp_path / "out" / "trials").exists()
    bad_value = _write_sweep(tmp_path, {"prune.ratio": [0.2, 1.5]})
    assert main(["sweep", "--config", str(bad_value)]) == 2
    assert "prune.ratio=1.5 is not allowed" in capsys.readouterr().err


def test_settings_refuse_bad_values_with_one_line():
    with pytest.raises(ValueError, match=r"sweep.mode='random' is not allowed"):
        SweepSettings(base=["a.yaml"], space=SPACE, mode="random")
    with pytest.raises(ValueError, match=r"sweep.n_trials=None is not allowed"):
        SweepSettings(base=["a.yaml"], space=SPACE, mode="optuna")
    with pytest.raises(ValueError, match=r"sweep.space.prune.ratio=.* ranges are for optuna mode"):
        SweepSettings(base=["a.yaml"], space={"prune.ratio": {"low": 0.1, "high": 0.3}})
    with pytest.raises(ValueError, match=r"sweep.storage='journal.log' is not allowed"):
        SweepSettings(base=["a.yaml"], space=SPACE, storage="journal.log")
    s = SweepSettings(base=["a.yaml"], space=SPACE, objective={"weights": {"ppl": -0.01, "zeroshot_avg": 1},
                                                              "direction": "maximize"})
    assert s.objective.value({"ppl": 10.0, "zeroshot_avg": 0.5}) == pytest.approx(0.4)


def test_tables_from_a_fixed_results_file_match_the_snapshot(tmp_path):
    results = json.loads((DATA / "sweep_results.json").read_text())
    tables = all_tables(results)
    expected = (DATA / "sweep_tables.md").read_text()
    assert to_markdown(tables) == expected
    tex = to_latex(tables)
    assert "\\toprule" in tex and "\\midrule" in tex and "\\bottomrule" in tex and "$\\pm$" in tex
    paths = write_outputs(results, tmp_path)
    names = {p.name for p in paths}
    assert {"heatmap_qwen-mini_global.png", "heatmap_llama-mini_layerwise.png", "ppl_vs_accuracy.png",
            "tables.md", "tables.tex"} <= names


@pytest.fixture(scope="module")
def tiny_sweep_files(tmp_path_factory):
    from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

    tmp = tmp_path_factory.mktemp("sweep")
    ckpt = make_tiny_checkpoint(tmp / "tiny", "llama")
    files = write_tiny_corpus(tmp / "data")
    base = tmp / "base.yaml"
    base.write_text(yaml.safe_dump({
        "model": {"pretrained": str(ckpt), "attn_implementation": "eager", "recovery": "none"},
        # every text the run reads is local: a clone without ../shared must run this too
        "data": {"calibration": {"path": str(files["valid"])}, "eval": {"path": str(files["test"])},
                 "train": {"path": str(files["train"])},
                 "seq_len": 16, "eval_seq_len": 16, "num_samples": 8,
                 "calibration_batch_size": None},  # as quickstart/recover: the run scores in data.batch_size
        "trainer": {"limit_val_batches": 0, "enable_progress_bar": False},
        "export": {"model": False, "figures": False},
    }))
    return tmp, base


def test_a_real_sweep_of_tiny_runs_reuses_dense_evaluation_and_scores(tiny_sweep_files, tmp_path):
    """Two `prunelight fit` subprocesses (global, layerwise allocation): the second reuses the first's dense
    evaluation and its calibration scores (and layer importance), with data.calibration_batch_size null."""
    from prunelight.sweep.cache import runs_take_scores

    _, base = tiny_sweep_files
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": [str(ROOT / "configs" / "reference.yaml"), str(base)],
                                     "space": {"prune.allocation": ["global", "layerwise"]},
                                     "out_dir": str(tmp_path / "out")}))
    assert sweep_main(["--config", str(sweep)]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    trials = sorted(results["trials"], key=lambda t: t["number"])
    assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"], [t.get("error") for t in trials]
    assert {t["params"]["prune.allocation"] for t in trials} == {"global", "layerwise"}
    assert all(t["metrics"]["ppl"] > 0 and t["metrics"]["removed_fraction"] >= 0.19 for t in trials)
    assert [t["reuse"]["dense"] for t in trials] == ["miss", "hit"]
    assert trials[0]["metrics"]["ppl_dense"] == trials[1]["metrics"]["ppl_dense"]
    assert runs_take_scores()
    assert [t["reuse"]["scores"] for t in trials] == ["miss", "hit"]
    assert "no scoring pass: unit scores from" in Path(trials[1]["log"]).read_text()
    assert trials[1]["peak_rss_mib"] > 50 and trials[1]["times_s"]["wall"] > 0
    trial_dir = Path(trials[0]["out_dir"])
    assert (trial_dir / "trial.yaml").exists() and (trial_dir / "trial.json").exists()
    assert (trial_dir / "report.json").exists()
    md = (tmp_path / "out" / "tables.md").read_text()
    assert "Optimal configuration per model" in md and "Costs per trial" in md
    # the outputs come back from the persisted trials alone
    (tmp_path / "out" / "tables.md").unlink()
    assert sweep_main(["--config", str(sweep), "--report-only"]) == 0
    assert (tmp_path / "out" / "tables.md").read_text() == md


def test_a_real_sweep_never_hands_cached_scores_to_an_auto_split_trial(tiny_sweep_files, tmp_path):
    """attn_mlp_split auto searches the split on the calibration pass, so its run refuses prune.scores: the trial
    after a fixed-split one with the same scoring settings scores itself instead of taking the cached file."""
    _, base = tiny_sweep_files
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": [str(ROOT / "configs" / "reference.yaml"), str(base)],
                                     "space": {"prune.attn_mlp_split": ["1:3", "auto"]},
                                     "seed": 1, "out_dir": str(tmp_path / "out")}))
    assert sweep_main(["--config", str(sweep)]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    trials = sorted(results["trials"], key=lambda t: t["number"])
    # the grid's seed 1 runs the fixed split first: its scores are in the cache when the auto trial starts
    assert [t["params"]["prune.attn_mlp_split"] for t in trials] == ["1:3", "auto"]
    assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"], [t.get("error") for t in trials]
    assert [t["reuse"]["scores"] for t in trials] == ["miss", "miss"]
    assert "no scoring pass" not in Path(trials[1]["log"]).read_text()


@pytest.mark.parametrize("name", ["reference_grid.yaml", "optuna_example.yaml"])
def test_shipped_sweep_configs_parse_and_name_real_keys(name, monkeypatch):
    from prunelight.sweep.command import parse
    from prunelight.sweep.driver import total_trials
    from prunelight.sweep.space import check_keys, check_values, resolved_config

    monkeypatch.chdir(ROOT)  # base configs and ../shared paths are relative to the repository root
    s, report_only = parse(["--config", f"configs/sweeps/{name}"])
    assert not report_only
    config = resolved_config(s.base)
    check_keys(s.space, config, s.base)
    check_values(s.space, config)
    assert total_trials(s) == (16 if s.grid else s.n_trials)
    assert config["model"]["recovery"] == "none" and config["evaluation"]["suite"]["limit"] == 30
