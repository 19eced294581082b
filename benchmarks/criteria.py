"""Every importance criterion x every allocation at one prune ratio, without recovery.

For each criterion in the registry, a fresh subprocess loads the model and the pre-tokenized data,
scores every unit once with `prunelight.score` (timed; peak memory read from the process's own high-water
mark), then for each registered allocation (`prunelight.bench.allocations()`) cuts a fresh copy of the
model with `prunelight.prune` from those scores (allocation, repair and surgery as a run makes them) and
measures WikiText-2 perplexity. Results go to a Markdown table (stdout and
--out) and JSON (--json), both written atomically.

Peak memory: `prunelight.bench.peak_memory`, the same measurement as the report's. On
Linux CPU the criterion's process returns freed heap to the OS, resets its resident-set high-water mark
(/proc/self/clear_refs) once the model and token tensors are loaded, and reads VmHWM after scoring: "peak
memory" is the process's peak RSS while scoring and "scoring +MiB" is that peak minus the RSS just before
scoring, i.e. what the criterion itself needed. tracemalloc does not see torch's allocator, so it is not
used. On CUDA, torch.cuda.max_memory_allocated after reset_peak_memory_stats is reported instead.

Reference run (the docs/benchmarks.md tables; about 20 min on 2 CPU cores):
    python -m benchmarks criteria --out results/criteria.md --json results/criteria.json
Quick check:
    python -m benchmarks criteria --samples 8 --eval-tokens 4096 --criteria taylor,wanda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from prunelight import bench

WRITES = "--out (results/criteria.md) and --json (results/criteria.json) (docs/benchmarks.md, docs/criteria.md)"


def _lists(args: argparse.Namespace) -> argparse.Namespace:
    """The comma-separated options as lists (all registered allocations when none are given)."""
    args.allocations = args.allocations.split(",") if args.allocations else bench.allocations()
    args.reconstruct = [m for m in args.reconstruct.split(",") if m]
    args.reconstruct_allocations = [a for a in args.reconstruct_allocations.split(",") if a]
    return args


def run_worker(args: argparse.Namespace) -> dict:
    """Score with one criterion (timed, peak memory), then cut + evaluate per allocation, each as a run does."""
    device = torch.device(args.device)
    model = bench.load_model(args.model, device)
    data = bench.TokenData.load(args.data_file)
    calib, evals = data.calibration_batches(args.batch_size), data.eval_batches(args.eval_batch_size)
    result: dict = {"criterion": args.worker, "rows": []}
    if args.worker == "dense":
        ppl = bench.perplexity(model, evals)
        result["rows"].append({"allocation": "-", "ppl": ppl["ppl"], "eval_tokens": ppl["tokens"], "params_removed": 0})
        return result

    criterion_args = json.loads(args.criterion_args).get(args.worker, {})
    scorer = bench.Scorer(model, calib)
    with bench.peak_memory(device) as mem:  # the unit scores every cell shares: the criterion's own scoring pass
        scores = scorer(bench.preset_settings(None, criterion=args.worker, criterion_args=criterion_args,
                                              report_layer_importance=[]))
    result["scoring_s"] = scorer.seconds[args.worker]
    if mem.peak is not None:  # None off Linux/CUDA: the table shows "—"
        result["peak_mib"], result["scoring_extra_mib"] = mem.peak / 2**20, mem.rise / 2**20
    result["samples"] = scores.samples

    extra_args = json.loads(args.allocation_args)
    for method in args.allocations:
        row: dict = {"allocation": method}
        try:
            settings = bench.cell_settings(method, args.worker, args.ratio, criterion_args,
                                           **extra_args.get(method, {}))
            scores = scorer(settings)  # scored once; a layer measure the allocation needs measured once, added
            modes = ["none"] + (args.reconstruct if method in args.reconstruct_allocations else [])
            for mode in modes:
                row = {"allocation": method if mode == "none" else f"{method}+{mode}"}
                pruned, plan, seconds = bench.cut_copy(model, dataclasses.replace(settings, reconstruct=mode), calib,
                                                       scores=scores)
                ppl = bench.perplexity(pruned, evals)
                row.update(ppl=ppl["ppl"], eval_tokens=ppl["tokens"], params_removed=plan.meta["params_removed"],
                           removed_fraction=plan.meta["removed_fraction_total"],
                           params_after=bench.count_params(pruned), cut_s=seconds)
                del pruned
                result["rows"].append(row)
            continue
        except Exception as err:  # noqa: BLE001 - reported in the table; must not void a long run
            row["error"] = f"{type(err).__name__}: {err}"
        result["rows"].append(row)
    return result


def _markdown(meta: dict, results: list[dict]) -> str:
    lines = [
        (
            f"Model `{meta['model_name']}` ({meta['params_total']:,} parameters), "
            f"{meta['ratio']:.0%} of parameters removed, no recovery. "
            f"Calibration: {meta['calibration_samples']} x {meta['seq_len']} tokens of "
            f"{meta['calibration_name']} (seed {meta['seed']}); perplexity on {meta['eval_tokens']:,} scored tokens of "
            f"{meta['eval_name']} ({meta['eval_blocks']} blocks of {meta['seq_len']}). "
            f"Peak memory: {meta['memory_note']}. "
            f"{meta['threads']} thread(s), torch {meta['torch']}, {meta['device']}."
        ),
        "",
        "| criterion | allocation | params removed | WikiText-2 ppl | scoring time (s) | peak memory (MiB) "
        + "| scoring +MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for row in res["rows"]:
            if "error" in row:
                cells = [res["criterion"], row["allocation"], "—", f"error: {row['error']}", "", "", ""]
            else:
                removed = row["params_removed"]
                frac = removed / meta["params_total"]
                cells = [
                    res["criterion"],
                    row["allocation"],
                    f"{removed:,} ({frac:.1%})",
                    f"{row['ppl']:.2f}",
                    f"{res['scoring_s']:.1f}" if "scoring_s" in res else "—",
                    f"{res['peak_mib']:.0f}" if "peak_mib" in res else "—",
                    f"{res['scoring_extra_mib']:.0f}" if "scoring_extra_mib" in res else "—",
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + _pivot(meta, results)) + "\n"


def _pivot(meta: dict, results: list[dict]) -> list[str]:
    """The same numbers as one row per criterion: perplexity per allocation, scoring time and memory."""
    allocs = list(meta["allocations"]) + [f"{a}+{m}" for a in meta.get("reconstruct_allocations", [])
                                          for m in meta.get("reconstruct", [])]
    dense = next((r["rows"][0]["ppl"] for r in results if r["criterion"] == "dense" and r["rows"]), None)
    lines = [f"WikiText-2 perplexity after removing {meta['ratio']:.0%} of parameters (dense: "
             f"{'n/a' if dense is None else f'{dense:.2f}'}); a `*` marks a plan more than 0.5% of the model off "
             f"the budget.", "",
             "| criterion | " + " | ".join(allocs) + " | scoring time (s) | scoring +MiB |",
             "|---|" + "---:|" * (len(allocs) + 2)]
    for res in results:
        if res["criterion"] == "dense":
            continue
        rows = {row["allocation"]: row for row in res["rows"]}
        cells = []
        for a in allocs:
            row = rows.get(a)
            if row is None or "error" in row:
                cells.append("error" if row else "—")
                continue
            off = abs(row["params_removed"] / meta["params_total"] - meta["ratio"]) > 0.005
            cells.append(f"{row['ppl']:.1f}{'*' if off else ''}")
        cells += [f"{res['scoring_s']:.1f}" if "scoring_s" in res else "—",
                  f"{res['scoring_extra_mib']:.0f}" if "scoring_extra_mib" in res else "—"]
        lines.append(f"| {res['criterion']} | " + " | ".join(cells) + " |")
    return lines


def _worker_args(args: argparse.Namespace, name: str, data_file: Path) -> list[str]:
    return [
        __file__, "--worker", name, "--data-file", str(data_file),
        "--model", str(args.model), "--ratio", str(args.ratio), "--batch-size", str(args.batch_size),
        "--eval-batch-size", str(args.eval_batch_size), "--device", args.device, "--threads", str(args.threads),
        "--allocations", ",".join(args.allocations), "--criterion-args", args.criterion_args,
        "--allocation-args", args.allocation_args, "--reconstruct", ",".join(args.reconstruct),
        "--reconstruct-allocations", ",".join(args.reconstruct_allocations),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the criterion x allocation benchmark (or one worker of it)."""
    criteria_known, allocations_known = bench.criteria(), bench.allocations()
    p = bench.parser(__doc__, __file__)
    bench.add_data_arguments(p, samples=128)
    p.add_argument("--criteria", default=",".join(criteria_known),
                   help="comma-separated names (default: all registered)")
    p.add_argument("--allocations", default=None, help="comma-separated (default: all registered at run time)")
    p.add_argument("--criterion-args", default="{}", help='JSON: {"taylor_weight": {"micro_batch_size": 4}}')
    p.add_argument("--allocation-args", default="{}", help='JSON, prune settings merged over each preset: {"global": {...}}')
    p.add_argument("--reconstruct", default="bias,least_squares",
                   help="reconstructions measured besides none (comma-separated; '' for none)")
    p.add_argument("--reconstruct-allocations", default="global", help="allocations that get reconstruction rows")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--eval-tokens", type=int, default=65536, help="test-set prefix in tokens; 0 = the whole set")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default="results.md")
    p.add_argument("--json", default=None, help="JSON results (default: --out with .json)")
    args = bench.parse_args(p, argv, lambda a: run_worker(_lists(a)), "--worker")
    if args is None:  # a worker process: it has answered
        return
    if not args.model:
        p.error("--model is required when the shared reference data is not found (set PRUNELIGHT_SHARED)")
    _lists(args)

    criteria = [c for c in args.criteria.split(",") if c]
    unknown = [c for c in criteria if c not in criteria_known]
    bad_alloc = [a for a in args.allocations if a not in allocations_known]
    if unknown or bad_alloc:
        p.error(f"unknown criteria {unknown} / allocations {bad_alloc}; available: {sorted(criteria_known)} / "
                f"{allocations_known}")
    with tempfile.TemporaryDirectory(prefix="prunelight-bench-") as tmp:
        t0 = time.perf_counter()
        data = bench.token_data(args.model, args.calibration, args.eval, samples=args.samples, seq_len=args.seq_len,
                                seed=args.seed, eval_tokens=args.eval_tokens)
        data_file = data.save(Path(tmp) / "data.pt")
        data_meta = {"calibration_samples": int(data.calib.shape[0]), "eval_blocks": int(data.eval.shape[0])}
        print(f"data prepared in {time.perf_counter() - t0:.1f}s: {data_meta}", flush=True)
        results = []
        for name in ["dense", *criteria]:
            t0 = time.perf_counter()
            res = bench.run_worker(_worker_args(args, name, data_file), threads=args.threads)
            if "error" in res:  # keep the other criteria of a long run
                results.append({"criterion": name, "rows": [{"allocation": a, "error": res["error"]}
                                                            for a in args.allocations]})
                if name == "dense":
                    raise SystemExit(f"the dense baseline failed: {res['error']}")
                continue
            results.append(res)
            print(f"{name}: done in {time.perf_counter() - t0:.1f}s", flush=True)

    model = bench.load_model(args.model)
    meta = {
        "model": str(args.model),
        "model_name": Path(args.model).name,
        "model_type": model.config.model_type,
        "params_total": bench.count_params(model),
        "ratio": args.ratio,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "calibration_name": Path(args.calibration).parent.name + "/" + Path(args.calibration).name,
        "eval_name": Path(args.eval).parent.name + "/" + Path(args.eval).name,
        "eval_tokens": results[0]["rows"][0]["eval_tokens"],
        "memory_note": "CUDA max allocated while scoring"
        if args.device.startswith("cuda")
        else "peak RSS of the scoring process while scoring (VmHWM); +MiB = above the RSS with the model loaded",
        "threads": args.threads,
        "torch": torch.__version__,
        "device": args.device if args.device != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
        "allocations": args.allocations,
        "reconstruct": args.reconstruct,
        "reconstruct_allocations": args.reconstruct_allocations,
        "criterion_args": json.loads(args.criterion_args),
        **data_meta,
    }
    table = _markdown(meta, results)
    print(f"\nevaluated on {meta['eval_tokens']:,} tokens ({meta['eval_blocks']} blocks)\n")
    print(table)
    json_path = Path(args.json or Path(args.out).with_suffix(".json"))
    bench.write_results(json_path.with_suffix(""), {"meta": meta, "results": results})
    bench.write_text(args.out, table)


if __name__ == "__main__":
    main()
