"""Allocation on a real model: criteria x {global, calibrated} at given ratios, no recovery, one process.

The model is loaded once; each criterion scores once on the calibration windows, each (criterion, ratio)
measures its probes once (calibrated), and every plan cuts a fresh copy, reconstructs (`--reconstruct`) and is
evaluated on the same blocks. Protocol of issue 21 by default: WikiText-2 valid, 64 x 128-token windows (seed
0) for calibration; the first 60,000 characters of WikiText-2 test in 128-token blocks for the run's own
perplexity. Probes read `--probe-samples` calibration windows. One JSON line per result on stdout and in --out.

    OMP_NUM_THREADS=1 python scripts/benchmark_calibrated.py --model /path/to/smollm2-f32 \\
        --criteria flap wanda_sp taylor --ratios 0.2 0.3 --out results/benchmarks/calibrated_smollm2.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from prunelight.testing import shared_dir  # noqa: E402  ($PRUNELIGHT_SHARED, else ../shared)

SHARED = shared_dir() or Path(__file__).resolve().parents[2] / "shared"


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print one JSON line per (criterion, ratio, allocation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prunelight.allocation import allocate, allocation_of, precheck
    from prunelight.allocation.calibrated import measure_probes
    from prunelight.calibration import run_calibration
    from prunelight.data import TextSource, pack_blocks, sample_windows, tokenize_source, window_prefix
    from prunelight.evaluation.perplexity import evaluate_perplexity
    from prunelight.importance import build_criterion
    from prunelight.reconstruct import cut_and_reconstruct
    from prunelight.settings import PruneSettings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--criteria", nargs="+", default=["flap"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.2])
    ap.add_argument("--allocations", nargs="+", default=["global", "calibrated"])
    ap.add_argument("--reconstruct", default="least_squares")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--probe-samples", type=int, default=8)
    ap.add_argument("--eval-chars", type=int, default=60000)
    ap.add_argument("--measure-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="scoring and probes run on a copy in this dtype (a bf16 GPU run's plan); the cut, the refit "
                         "and the evaluation stay float32")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    tok = AutoTokenizer.from_pretrained(args.model)
    prefix = window_prefix(tok, "auto")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tokenize_source(tok, TextSource(path=str(SHARED / "data/wikitext2/valid.txt")))
    calib = list(torch.split(sample_windows(ids, args.samples, 128, 0, prefix), 16))
    text = (SHARED / "data/wikitext2/test.txt").read_text(encoding="utf-8")[: args.eval_chars]
    # As TextSource(lines) does: rows joined by newlines, no special tokens.
    test_ids = tokenize_source(tok, _InMemory(text.splitlines()))
    evals = list(torch.split(pack_blocks(test_ids, 128, prefix), 16))

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    dense = evaluate_perplexity(model, evals)
    emit({"model": args.model, "method": "dense", "ppl": dense["ppl"], "tokens": dense["tokens"],
          "bos_per_window": bool(prefix)})
    measure = model if args.measure_dtype == "float32" else copy.deepcopy(model).to(getattr(torch, args.measure_dtype))
    for criterion in args.criteria:
        crit = build_criterion(criterion)
        scores = run_calibration(measure, calib if crit.needs_data else [], crit)
        scores = {k: [t.float() for t in v] for k, v in scores.items()}
        for ratio in args.ratios:
            for allocation in args.allocations:
                t0 = time.perf_counter()
                settings = PruneSettings(ratio=ratio, criterion=criterion, allocation=allocation,
                                         reconstruct=args.reconstruct)
                budget = precheck(model, settings)
                probes = None
                if allocation_of(allocation).measure is not None:  # the row measures probe removals
                    probes = measure_probes(measure, [torch.cat(calib)[: args.probe_samples]], scores, budget)
                plan = allocate(budget, scores, settings, measured=probes)
                pruned = copy.deepcopy(model)
                cut_and_reconstruct(pruned, plan, calib, settings)
                res = evaluate_perplexity(pruned, evals)
                emit({"model": args.model, "criterion": criterion, "ratio": ratio, "allocation": allocation,
                      "reconstruct": args.reconstruct, "ppl": res["ppl"], "x_dense": res["ppl"] / dense["ppl"],
                      "groups_removed": plan.meta["groups_removed"], "channels_removed": plan.meta["channels_removed"],
                      "kept": [[len(lp.keep_groups), len(lp.keep_channels)] for lp in plan.layers],
                      "measure_dtype": args.measure_dtype,
                      **({"probe_loss": probes.loss, "probe_stderr": probes.stderr} if probes is not None else {}),
                      "seconds": time.perf_counter() - t0})
                del pruned


class _InMemory:
    """A TextSource stand-in over rows already in memory (protocol 'lines')."""

    protocol = "lines"
    max_tokens = None

    def __init__(self, rows: list[str]) -> None:
        self.rows = rows

    def lines(self) -> list[str]:
        return self.rows


if __name__ == "__main__":
    main()
