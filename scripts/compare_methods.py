"""Compare the method presets on equal terms: same model, ratio, calibration and evaluation data, no recovery.

Reads each preset's `prune:` section from configs/methods/*.yaml and cuts a copy of the model with
`prunelight.prune` (exactly what `prunelight fit` does: scoring, allocation, the least-squares refit that is
the run's default repair, and surgery), then prints parameters removed, pruned perplexity and wall times. Run
from the repository root, alone:

    python scripts/compare_methods.py --eval-blocks 256          # reference model in ../shared
    python scripts/compare_methods.py --samples 8 --eval-blocks 4 --importance-batches 1   # smoke check
"""

from __future__ import annotations

import argparse
import time

from prunelight import bench


def main(argv: list[str] | None = None) -> None:
    """Print one row per method."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_data_arguments(p)
    p.add_argument("--methods", nargs="+", default=["taylor", "layerwise", "blockwise", "depth"])
    p.add_argument("--ratio", type=float, default=None, help="override every preset's ratio")
    p.add_argument("--reconstruct", default=None, help="override every preset's repair (default: the run's)")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-blocks", type=int, default=None, help="cap on 128-token evaluation blocks (default: all)")
    p.add_argument("--importance-batches", type=int, default=None)
    args = p.parse_args(argv)
    if not args.model:
        p.error("--model is required when ../shared is absent")

    data = bench.token_data(args.model, args.calibration, args.eval, samples=args.samples, seq_len=args.seq_len,
                            eval_tokens=args.eval_blocks * args.seq_len if args.eval_blocks else None)
    calib, evals = data.calibration_batches(16), data.eval_batches(16)
    model = bench.load_model(args.model)
    t0 = time.perf_counter()
    dense = bench.perplexity(model, evals)["ppl"]
    print(f"dense: {bench.count_params(model):,} params, ppl {dense:.2f} ({time.perf_counter() - t0:.1f} s)")
    print("| method | allocation | ratio | reconstruct | params removed | layers dropped | pruned ppl | cut s | eval s |")
    print("|---|---|---:|---|---:|---|---:|---:|---:|")
    for name in args.methods:
        overrides = {"report_layer_importance": []}  # only what the allocation needs: the table times the cut
        overrides.update({k: v for k, v in (("ratio", args.ratio), ("importance_batches", args.importance_batches),
                                            ("reconstruct", args.reconstruct)) if v is not None})
        settings = bench.preset_settings(name, **overrides)
        work, plan, t_cut = bench.cut_copy(model, settings, calib)
        t0 = time.perf_counter()
        ppl = bench.perplexity(work, evals)["ppl"]
        t_eval = time.perf_counter() - t0
        print(f"| {name} | {plan.meta['allocation']} | {settings.ratio} | {settings.reconstruct} | "
              f"{plan.meta['params_removed']:,} ({100 * plan.meta['removed_fraction_total']:.1f}%) | "
              f"{plan.drop_layers or '-'} | {ppl:.2f} | {t_cut:.1f} | {t_eval:.1f} |")


if __name__ == "__main__":
    main()
