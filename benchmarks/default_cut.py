"""The default cut against the uniform cut over seeds and ratios, and what each phase of the default costs.

Every cell is one `prunelight fit` (the user's path) on `--config` (SmolLM2 from ../shared by default) with no
recovery: calibration `data.num_samples` x `data.seq_len` tokens of WikiText-2 valid drawn with the seed, perplexity
on the first `--eval-blocks` blocks of `--eval-len` tokens of WikiText-2 test (the dense model measured once, in
`evaluation.dense_cache`). A seed is the calibration windows (`data.seed`), the search's mutations
(`allocation_args.seed`) and Lightning's seed. Rows:

- ``default``: the library's defaults (`prune:` of the config at the ratio);
- ``uniform``: the same criterion, repair and model tuning with `allocation: uniform` (the plain baseline);
- a variant of `VARIANTS` (or `--variants` given as JSON name -> `prune:` overrides): one knob of the default
  removed or shrunk, to measure what it costs in perplexity and saves in time.

Each cell records the perplexity ratio to the dense model, the cut's seconds (scoring, allocation, repair, tuning:
`times_s` of report.json) and every phase the run reports (probes, levels database, fitness, search, ridge, repair,
tuning), and the fit's wall time. Run alone (one process on the machine), as timing needs:

    PRUNELIGHT_SHARED=../shared OMP_NUM_THREADS=2 python -m benchmarks default_cut --out /tmp/default-cut \
        --ratios 0.2 --seeds 0 1 2 --rows default,uniform,no_calibrated_seed
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prunelight import bench

WRITES = ("results/benchmarks/<name>.{json,md} (docs/benchmarks.md, \"The default cut: seeds, ratios and what each "
          "phase costs\")")
ROOT = Path(__file__).resolve().parents[1]
# One knob of the default each: what it costs in perplexity, what it saves in time.
VARIANTS: dict[str, dict] = {
    "uniform": {"allocation": "uniform"},
    "no_calibrated_seed": {"allocation_args": {"seed_calibrated": False}},
    "in_sample_fitness": {"allocation_args": {"fitness_folds": 1}},
    "half_generations": {"allocation_args": {"generations": 6}},
    "offspring_4": {"allocation_args": {"offspring": 4}},
    "stages_16": {"allocation_args": {"stages": [2, 8, 16]}},
    "criterion_order": {"allocation_args": {"order": "criterion"}},
    "fixed_ridge": {"allocation_args": {"cut_ridge": "fixed"}},
    "ridge_grid_3": {"allocation_args": {"cv_ridges": [0.03, 0.1, 0.3]}},
    "tuning_1_epoch": {"model_tuning": {"epochs": 1}},
    "no_tuning": {"model_tuning": {"epochs": 0}},
}


def cell_args(config: str, out: Path, ratio: float, seed: int, overrides: dict, eval_len: int, eval_blocks: int,
              dense_cache: Path, state_dir: Path | None = None) -> list[str]:
    """The `prunelight fit` arguments of one cell: no recovery, no export, the seed in every random choice."""
    prune = {k: v for k, v in overrides.items() if k != "allocation_args"}
    args = dict(overrides.get("allocation_args", {}))
    if overrides.get("allocation", "search") == "search":
        args.setdefault("seed", seed)
        if state_dir is not None:  # the seed's levels database, built once and read back by every variant
            args.setdefault("state_dir", str(state_dir))
    out_args = [f"--config={config}", "--model.recovery=none", "--trainer.max_steps=1",
                f"--data.eval_seq_len={eval_len}", f"--data.max_eval_blocks={eval_blocks}", "--data.eval_batch_size=8",
                f"--data.seed={seed}", f"--seed_everything={seed}", f"--prune.ratio={ratio}",
                "--export.model=false", "--export.figures=false", f"--export.out_dir={out}",
                f"--evaluation.dense_cache={dense_cache}", "--trainer.enable_progress_bar=false",
                f"--prune.allocation_args={json.dumps(args)}"]
    return out_args + [f"--prune.{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in prune.items()]


def phases(report: dict) -> dict[str, float]:
    """Seconds per phase of the cut, from report.json."""
    times = dict(report.get("times_s") or {})
    plan = report.get("plan") or {}
    out = {"cut": times.get("calibration_and_allocation", 0.0) + times.get("surgery", 0.0),
           "scoring_and_allocation": times.get("calibration_and_allocation", 0.0), "repair_and_tuning":
           times.get("surgery", 0.0)}
    search = (plan.get("search") or {}).get("times_s") or {}
    out.update({f"search_{k}": v for k, v in search.items()})
    probes = plan.get("probes") or {}
    if "seconds" in probes:
        out["probes"] = probes["seconds"]
    tuning = ((report.get("reconstruction") or {}).get("model_tuning") or {})
    if "time_s" in tuning:
        out["model_tuning"] = tuning["time_s"]
    return out


def run_cell(name: str, ratio: float, seed: int, overrides: dict, args) -> dict:
    """One `prunelight fit`, its figures read back from its report.json."""
    out = Path(args.out) / f"{name}_r{ratio:g}_s{seed}"
    log = out.parent / f"{out.name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    # the levels database is keyed by model, criterion, order, ridge and calibration tokens (the seed's), not the
    # ratio, and the search state by the parameter target: one folder per seed serves every ratio
    shared = Path(args.out) / f"state_s{seed}" if args.shared_state else None
    cmd = [sys.executable, "-m", "prunelight", "fit", *cell_args(args.config, out, ratio, seed, overrides,
                                                                  args.eval_len, args.eval_blocks,
                                                                  Path(args.out) / "dense_cache", shared)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ}, check=False)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{name} at {ratio} seed {seed} failed ({done.returncode}); see {log}")
    report = json.loads((out / "report.json").read_text())
    ppl = report["ppl"]
    return {"row": name, "ratio": ratio, "seed": seed, "overrides": overrides, "dense": ppl["dense"],
            "pruned": ppl["pruned"], "x_dense": ppl["pruned"] / ppl["dense"], "wall_s": wall,
            "seconds": phases(report)}


def _mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def markdown(meta: dict, rows: list[dict]) -> str:
    """The seeds table (x dense, mean ± sd, and against the uniform cut seed by seed) and the phase table."""
    lines = [f"# {meta['name']}", "", f"`{meta['command']}` ({meta['machine']}, {meta['date']}).", "",
             "| row | ratio | seeds | x dense (mean ± sd) | per seed | beats uniform on | cut s (mean) | fit wall s |",
             "|---|---:|---:|---:|---|---|---:|---:|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["row"], r["ratio"]), []).append(r)
    uniform = {(r["ratio"], r["seed"]): r["x_dense"] for r in rows if r["row"] == "uniform"}
    for (row, ratio), cell in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != "default", kv[0][0])):
        cell = sorted(cell, key=lambda r: r["seed"])
        beats = [r for r in cell if (ratio, r["seed"]) in uniform]
        wins = sum(r["x_dense"] < uniform[(ratio, r["seed"])] for r in beats)
        per_seed = ", ".join(f"{r['x_dense']:.3f}" for r in cell)
        against = f"{wins} of {len(beats)}" if beats and row != "uniform" else ""
        lines.append(f"| {row} | {ratio:g} | {len(cell)} | {_mean_sd([r['x_dense'] for r in cell])} | {per_seed} | "
                     f"{against} | "
                     f"{statistics.mean(r['seconds']['cut'] for r in cell):.0f} | "
                     f"{statistics.mean(r['wall_s'] for r in cell):.0f} |")
    keys = sorted({k for r in rows for k in r["seconds"] if k != "cut"})
    lines += ["", "Seconds per phase (mean over seeds):", "", "| row | ratio | " + " | ".join(keys) + " |",
              "|---|---:|" + "---:|" * len(keys)]
    for (row, ratio), cell in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        vals = [statistics.mean(r["seconds"].get(k, 0.0) for r in cell) for k in keys]
        lines.append(f"| {row} | {ratio:g} | " + " | ".join(f"{v:.0f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the cells not in the results yet (`--resume`), writing the tables after each."""
    p = bench.parser(__doc__, __file__)
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--out", required=True, help="a folder for the runs (one subfolder and log each)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rows", default="default,uniform", help="default, uniform and names of VARIANTS or --variants")
    p.add_argument("--variants", type=json.loads, default={}, help="JSON: name -> prune: overrides")
    p.add_argument("--eval-len", type=int, default=128)
    p.add_argument("--eval-blocks", type=int, default=128)
    p.add_argument("--name", default="default_cut_smollm2")
    p.add_argument("--out-dir", default=str(bench.RESULTS))
    p.add_argument("--resume", action="store_true", help="keep the cells already in the JSON")
    p.add_argument("--shared-state", action="store_true",
                   help="one search state folder per seed: the levels database is built by the seed's first cell "
                        "and read back by the others, at every ratio (their search_database seconds are the read)")
    args = p.parse_args(argv)
    if bench.shared_path() is None:
        raise SystemExit("the shared data folder is missing: set PRUNELIGHT_SHARED (the config reads models and text "
                         "from it)")
    variants = {"default": {}, **VARIANTS, **args.variants}
    rows_asked = args.rows.split(",")
    unknown = [r for r in rows_asked if r not in variants]
    if unknown:
        raise SystemExit(f"--rows {','.join(unknown)}: not a row; use default, uniform or one of {', '.join(VARIANTS)}")
    stem = Path(args.out_dir) / args.name
    machine = bench.machine()
    meta = {"name": args.name, "machine": f"{machine['device']}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
            "date": machine["date"], "command": "python -m benchmarks default_cut " + " ".join(argv or sys.argv[1:])}
    rows: list[dict] = []
    if args.resume and stem.with_suffix(".json").is_file():
        rows = json.loads(stem.with_suffix(".json").read_text())["rows"]
    done = {(r["row"], r["ratio"], r["seed"]) for r in rows}
    for ratio in args.ratios:
        for seed in args.seeds:
            for name in rows_asked:
                if (name, ratio, seed) in done:
                    continue
                rows.append(run_cell(name, ratio, seed, variants[name], args))
                bench.write_results(stem, {"meta": meta, "rows": rows}, markdown(meta, rows))
                print(f"{name} ratio {ratio:g} seed {seed}: {rows[-1]['x_dense']:.4f}x dense, "
                      f"cut {rows[-1]['seconds']['cut']:.0f} s", flush=True)
