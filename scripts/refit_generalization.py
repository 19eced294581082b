"""How far the levels' least-squares refits fit their own calibration tokens better than other text, per ridge.

On one model and ratio, from a finished `allocation: search` run's folder (`--state-dir`: its levels database and
search state, e.g. what `scripts/benchmark_search.py --rows default --state-dir DIR` leaves): the search's result and
its uniform seed, their o_proj / down_proj refitted with each `--ridges` value (x mean diagonal of the kept inputs'
Gram, as `prune.reconstruct_ridge`), each scored by the mean per-token KL(dense || pruned) on three sets of 32
sequences: the calibration sequences the search measured (the refits were fitted on them), other windows of the
calibration text (seed `--other-seed`), and the first blocks of the evaluation text. Writes
results/benchmarks/<name>.{json,md}. This is why the cut's ridge is cross-validated (`allocation_args.cut_ridge: cv`).

    PRUNELIGHT_SHARED=../shared python scripts/refit_generalization.py --model /tmp/smollm2-f32 \
        --state-dir /tmp/state --ratio 0.2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import prunelight
from prunelight import bench
from prunelight.allocation import make_budget
from prunelight.allocation.search import KLFitness, LevelSpace, SearchOptions, seed_levels
from prunelight.levels import database_key, load_database

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    """Score the two level assignments at every ridge on the three sets and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face folder (fp32)")
    bench.add_data_arguments(p, model=False)
    p.add_argument("--state-dir", required=True, help="the search's folder: levels_<order>.pt and its search state")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--samples", type=int, default=64, help="calibration sequences of the search run")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--sequences", type=int, default=32, help="sequences in each scored set")
    p.add_argument("--other-seed", type=int, default=1)
    p.add_argument("--eval-chars", type=int, default=60000)
    p.add_argument("--ridges", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    p.add_argument("--out-dir", default=str(ROOT / "results" / "benchmarks"))
    p.add_argument("--name", default="refit_generalization_smollm2")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    own = bench.token_data(args.model, args.calibration, args.eval, samples=args.samples, seq_len=args.seq_len,
                           eval_chars=args.eval_chars)
    other = bench.token_data(args.model, args.calibration, args.eval, samples=args.sequences, seq_len=args.seq_len,
                             seed=args.other_seed, eval_chars=args.eval_chars)
    model = bench.load_model(args.model)
    settings = prunelight.PruneSettings(ratio=args.ratio)
    options = SearchOptions()
    budget = make_budget(model, settings)
    state_dir = Path(args.state_dir)
    key = database_key(model, own.calibration_batches(8), settings.criterion, options.order,
                       settings.reconstruct_ridge)
    db = load_database(state_dir / f"levels_{options.order}.pt", model, key)
    if db is None:
        p.error(f"--state-dir {state_dir} holds no levels database of this model, criterion {settings.criterion}, "
                f"order {options.order} and {own.calib.numel()} calibration tokens")
    state = state_dir / f"search_state_{options.order}-{db.repair}_{budget.target}.pt"
    if not state.is_file():
        p.error(f"{state} is missing: run the search at --ratio {args.ratio} with this --state-dir first")
    space = LevelSpace.of(budget, options.mlp_levels, settings.align_channels)
    scores = prunelight.score(model, settings, own.calibration_batches(8)).unit_scores
    levels = {"search result": torch.load(state, weights_only=False)["parent"],
              "uniform seed": seed_levels(space, scores)["uniform"]}
    n = args.sequences
    sets = {"own calibration sequences": own.calib[:n], "other calibration windows": other.calib[:n],
            "evaluation text": own.eval[:n]}
    fits = {name: KLFitness(model, db, rows) for name, rows in sets.items()}
    rows = []
    for ridge in args.ridges:
        db.set_ridge(ridge)
        for name, lv in levels.items():
            kl = {s: fit(lv, n) for s, fit in fits.items()}
            rows.append({"ridge": ridge, "levels": name, "kl": kl})
            print(f"ridge {ridge:g} {name}: " + ", ".join(f"{s} {v:.4f}" for s, v in kl.items()), flush=True)
    meta = {"model": Path(args.model).name, "ratio": args.ratio, "calibration_tokens": own.calib.numel(),
            "sequences": n, "seq_len": args.seq_len, "seconds": time.perf_counter() - t0, "torch": torch.__version__}
    md = [f"# Refit generalization: {meta['model']} at {args.ratio:.0%}", "",
          (f"The levels database's least-squares refits (fitted on {own.calib.shape[0]} x {args.seq_len} calibration "
           f"tokens of {Path(args.calibration).name}) of the search's result and of its uniform seed, per ridge; mean "
           f"per-token KL(dense || pruned) on {n} sequences of {args.seq_len} tokens each: the calibration sequences "
           f"the search measures (in-sample), {n} other windows of the calibration text (seed {args.other_seed}), "
           f"and the first {n} blocks of {Path(args.eval).name} (first {args.eval_chars:,} characters)."), "",
          "| ridge | levels | " + " | ".join(sets) + " |", "|---:|---|" + "---:|" * len(sets)]
    for r in rows:
        md.append(f"| {r['ridge']:g} | {r['levels']} | " + " | ".join(f"{r['kl'][s]:.4f}" for s in sets) + " |")
    md += ["", (f"{meta['seconds']:.0f} s. `python scripts/refit_generalization.py --model <fp32 folder> "
                f"--state-dir <the search's folder> --ratio {args.ratio:g}`"), ""]
    bench.write_results(Path(args.out_dir) / args.name, {"meta": meta, "rows": rows}, "\n".join(md))


if __name__ == "__main__":
    main()
