"""Time pieces of the reference evaluation and extrapolate the full one-command report (prints, writes nothing).

    python scripts/time_evaluation.py --threads 2 --rows 100 --windows 200
Run it alone on the machine: the figures are wall-clock timings.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from prunelight.data import TextSource
from prunelight.evaluation.perplexity import PerplexityData, evaluate_perplexity_suite
from prunelight.evaluation.zeroshot import TASKS, evaluate_zeroshot
from prunelight import bench
from prunelight.testing import shared_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=100, help="zero-shot rows timed per task")
    ap.add_argument("--windows", type=int, default=200, help="perplexity windows timed per length")
    ap.add_argument("--pruned-cost", type=float, default=0.82, help="pruned/dense time ratio assumed (20%% of params cut)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shared = shared_dir()
    if shared is None:
        raise SystemExit("set PRUNELIGHT_SHARED to the shared/ folder")
    from transformers import AutoTokenizer

    path = shared / "models" / "ref-llama-gqa"
    tok = AutoTokenizer.from_pretrained(path)
    model = bench.load_model(path, attn_implementation="sdpa")
    sets = {"wikitext2": TextSource(path=str(shared / "data/wikitext2/test.txt")),
            "ptb": TextSource(path=str(shared / "data/ptb/test.txt"))}
    est, out = 0.0, {}
    for requested in (128, 2048):
        data = PerplexityData.build(tok, sets, [requested], max_windows=args.windows)
        t0 = time.perf_counter()
        recs = evaluate_perplexity_suite(model, data, batch_size=16)
        dt = time.perf_counter() - t0
        timed = sum(r["windows"] for r in recs)
        full = sum(ids.numel() // r["seq_len"] for ids, r in zip(data.streams.values(), recs))
        out[f"ppl_{requested}"] = {"seconds": dt, "windows": timed, "full_windows": full, "full_s": dt * full / timed}
        est += dt * full / timed
    for task in TASKS:
        rows = sum(1 for _ in open(shared / "data/zeroshot" / f"{task}.jsonl"))
        t0 = time.perf_counter()
        evaluate_zeroshot(model, tok, [task], data_dir=shared / "data/zeroshot", limit=args.rows, batch_size=32)
        dt = time.perf_counter() - t0
        out[task] = {"seconds": dt, "rows": args.rows, "full_rows": rows, "full_s": dt * rows / args.rows}
        est += dt * rows / args.rows
    out["dense_model_s"] = est
    out["dense_pruned_recovered_s"] = est * (1 + 2 * args.pruned_cost)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
