"""Quality of the served per-layer layout (export.format: nemotron_nas) between `stock` and free `global` widths.

For each model: three `prunelight fit` runs that differ only in `export.format` (auto = global allocation with
per-layer widths, stock = one shape in every layer, nemotron_nas = free MLP widths and one GQA group count),
prune-only (`--model.recovery none`), the run's own perplexity on its eval text. Writes
results/benchmarks/served_quality.{json,md}.

    python scripts/benchmark_served_quality.py --model ../shared/models/ref-llama-gqa --model /path/smollm2-f32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("stock", "nemotron_nas", "auto")


def run(model: str, fmt: str, out: Path, ratio: float, samples: int, eval_batches: int, extra: list[str]) -> dict:
    """One prune-only run; its report.json figures."""
    report = out / "report.json"
    if not report.is_file():
        cmd = [sys.executable, "-m", "prunelight", "fit", "--config", str(ROOT / "configs" / "reference.yaml"),
               f"--model.pretrained={model}", "--model.recovery=none", f"--prune.ratio={ratio}",
               f"--data.num_samples={samples}", f"--evaluation.max_eval_batches={eval_batches}",
               f"--evaluation.dense_cache={out.parent / 'dense_cache'}", f"--export.format={fmt}",
               f"--export.out_dir={out}", "--export.figures=false", *extra]
        t0 = time.time()
        subprocess.run(cmd, check=True, cwd=ROOT)
        print(f"{Path(model).name} {fmt}: {time.time() - t0:.0f} s", flush=True)
    rep = json.loads(report.read_text())
    cfg = json.loads((out / "model" / "config.json").read_text())
    return {"model": Path(model).name, "format": fmt, "written_as": cfg.get("model_type"),
            "ppl_dense": rep["ppl"].get("dense"), "ppl_pruned": rep["ppl"].get("pruned"),
            "params_before": rep.get("params_before"), "params_after": rep.get("params_after"),
            "layers": rep.get("layers")}


def main() -> None:
    """Run every model x format and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--work", default="runs/served_quality")
    ap.add_argument("--out", default=str(ROOT / "results" / "benchmarks" / "served_quality"))
    args, extra = ap.parse_known_args()
    rows = []
    for model in args.model:
        for fmt in FORMATS:
            rows.append(run(model, fmt, Path(args.work) / Path(model).name / fmt, args.ratio, args.samples,
                            args.eval_batches, extra))
            write(rows, Path(args.out), args)
    print(Path(args.out).with_suffix(".md").read_text())


def write(rows: list[dict], out: Path, args) -> None:
    """results JSON + markdown table (written after every run, so a partial sweep leaves its figures)."""
    from prunelight import bench

    names = {"stock": "stock (one shape)", "nemotron_nas": "nemotron_nas (served per-layer)",
             "auto": "global (per-layer, prunelight type)"}
    lines = [f"# Served layout quality: {args.ratio:.0%} pruned, flap + least_squares, no recovery",
             "", f"{args.samples} calibration samples of 128 tokens (WikiText-2 valid), perplexity on "
             f"{args.eval_batches} batches of 16 x 128 tokens of WikiText-2 test (the run's own evaluation).", "",
             "| model | allocation / format | written as | params after | dense ppl | pruned ppl | vs stock |",
             "|---|---|---|---|---|---|---|"]
    stock = {r["model"]: r["ppl_pruned"] for r in rows if r["format"] == "stock"}
    for r in rows:
        rel = (f"{100 * (r['ppl_pruned'] / stock[r['model']] - 1):+.2f}%" if r["model"] in stock else "")
        lines.append(f"| {r['model']} | {names[r['format']]} | `{r['written_as']}` | {r['params_after']:,} | "
                     f"{r['ppl_dense']:.2f} | {r['ppl_pruned']:.2f} | {rel} |")
    bench.write_results(out, {"settings": vars(args), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
