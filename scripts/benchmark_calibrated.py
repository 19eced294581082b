"""Allocation on a real model: criteria x {global, calibrated} at given ratios, no recovery, one process.

The model is loaded once; each criterion scores once on the calibration windows (`prunelight.score`, the run's
scoring pass), and every (criterion, ratio, allocation) cuts a fresh copy with `prunelight.prune` from those
scores: allocation (calibrated measures its probe removals on the first `--probe-samples` windows), the
`--reconstruct` repair and surgery, as a run does; each cut is evaluated on the same blocks. With
`--measure-dtype bfloat16` the scores and probes come from a bf16 copy (a bf16 GPU run's plan) and that plan is
applied to the float32 model with the repair, as `prune.plan` applies a saved plan.
Default protocol: WikiText-2 valid, 64 x 128-token windows (seed 0) for calibration; the first 60,000
characters of WikiText-2 test in 128-token blocks for the run's own perplexity. One JSON line per result on
stdout and in --out.

    OMP_NUM_THREADS=1 python scripts/benchmark_calibrated.py --model /path/to/smollm2-f32 \\
        --criteria flap wanda_sp taylor --ratios 0.2 0.3 --out results/benchmarks/calibrated_smollm2.jsonl
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from prunelight import bench  # noqa: E402

CALIBRATION_BATCH = 8  # windows per calibration batch (what --importance-batches counts)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print one JSON line per (criterion, ratio, allocation)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    bench.add_data_arguments(ap, model=False)
    ap.add_argument("--criteria", nargs="+", default=["flap"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.2])
    ap.add_argument("--allocations", nargs="+", default=["global", "calibrated"])
    ap.add_argument("--reconstruct", default="least_squares")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--probe-samples", type=int, default=8,
                    help=f"calibration windows the probe removals read (whole batches of {CALIBRATION_BATCH}: the "
                         "run's prune.importance_batches)")
    ap.add_argument("--eval-chars", type=int, default=60000)
    ap.add_argument("--measure-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="scoring and probes run on a copy in this dtype (a bf16 GPU run's plan); that plan is then "
                         "applied to the float32 model with the refit (prune.plan), and evaluated in float32")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    bench.set_threads()

    data = bench.token_data(args.model, args.calibration, args.eval, samples=args.samples, seq_len=128,
                            eval_chars=args.eval_chars)
    calib, evals = data.calibration_batches(CALIBRATION_BATCH), data.eval_batches(16)
    model = bench.load_model(args.model)

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    dense = bench.perplexity(model, evals)
    emit({"model": args.model, "method": "dense", "ppl": dense["ppl"], "tokens": dense["tokens"]})
    measure = model if args.measure_dtype == "float32" else copy.deepcopy(model).to(getattr(torch, args.measure_dtype))
    scorer = bench.Scorer(measure, calib)
    importance_batches = max(1, math.ceil(args.probe_samples / CALIBRATION_BATCH))
    for criterion in args.criteria:
        for ratio in args.ratios:
            for allocation in args.allocations:
                settings = bench.preset_settings(None, ratio=ratio, criterion=criterion, allocation=allocation,
                                                 reconstruct=args.reconstruct, report_layer_importance=[],
                                                 importance_batches=importance_batches)
                scores = scorer(settings)
                if measure is model:
                    pruned, plan, seconds = bench.cut_copy(model, settings, calib, scores=scores)
                else:  # the plan of a run in that dtype, then applied to the float32 model with the repair
                    _, plan, seconds = bench.cut_copy(measure, dataclasses.replace(settings, reconstruct="none"), calib,
                                                      scores=scores)
                    with tempfile.TemporaryDirectory() as tmp:
                        path = Path(tmp) / "plan.json"
                        path.write_text(json.dumps(plan.to_dict()))
                        pruned, _, more = bench.cut_copy(model, dataclasses.replace(settings, plan=str(path)), calib)
                    seconds += more
                res = bench.perplexity(pruned, evals)
                probes = plan.meta.get("probes")
                emit({"model": args.model, "criterion": criterion, "ratio": ratio, "allocation": allocation,
                      "reconstruct": args.reconstruct, "ppl": res["ppl"], "x_dense": res["ppl"] / dense["ppl"],
                      "groups_removed": plan.meta["groups_removed"], "channels_removed": plan.meta["channels_removed"],
                      "kept": [[len(lp.keep_groups), len(lp.keep_channels)] for lp in plan.layers],
                      "measure_dtype": args.measure_dtype, "scoring_s": scorer.seconds.get(criterion),
                      **({"probes": probes} if probes is not None else {}), "seconds": seconds})
                del pruned


if __name__ == "__main__":
    main()
