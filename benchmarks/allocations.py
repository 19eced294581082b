"""The default cut and every allocation against the uniform cut, per ratio, without recovery, on one model.

Rows per ratio (perplexity on the run's own protocol: the first --eval-chars characters of --eval in --seq-len
windows; calibration --samples x --seq-len tokens of --calibration), no recovery:

- ``stock``: flap + least_squares under `export.format: stock` (one shape in every layer, the candidate of least
  calibration NLL: `attn_mlp_split: auto`).
- ``search``: the levels database from flap's order, each level refitted as `reconstruct: least_squares` does, the
  evolutionary search on calibration KL (seeds: uniform counts, global's knapsack and the stock plan), then the cut
  with least_squares.
- ``search_obs``: the same with structured OBS's order and `reconstruct: obs`.
- ``search_stock`` / ``search_served``: search_obs cut for `export.format: stock` (every uniform shape measured) /
  `nemotron_nas` (the served layouts' search: one kept group count, per-layer MLP widths).
- ``default``: the library's defaults at the ratio (`prunelight.PruneSettings(ratio=...)`: flap, search with OBS's
  order, least_squares), the levels database kept in --state-dir so later ratios read it back.
- ``calibrated``: flap + calibrated + least_squares (the default before search; its probes are the slow part).
- ``global``, ``layerwise``, ``blockwise_removal`` (blockwise with `block_importance: removal`), ``depth``: the
  library's defaults with that allocation.

`--settings` (with `--variant`) changes the library's defaults for these rows, so a lever (fewer generations, fewer
probe sequences, another search seed) is measured as its own labelled row beside the defaults' rows.

`--zeroshot-rows` evaluates those rows (and ``dense``) on the seven zero-shot sets of ../shared/data/zeroshot, the
first `--zeroshot-limit` rows of each.

Writes results/benchmarks/<name>.json and .md (rows appended as they finish; --resume keeps finished rows), with
each phase's wall time (scoring, database, search, cut, evaluation) and the search trajectory.

    PRUNELIGHT_SHARED=../shared OMP_NUM_THREADS=1 python -m benchmarks allocations --model <fp32 folder> \
        --ratios 0.2 --rows stock,default --name default_smollm2 --state-dir <empty folder>
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

import prunelight
from prunelight import bench

WRITES = ("results/benchmarks/<name>.{json,md} (docs/benchmarks.md, \"Where the quality targets stand\" and "
          "\"Every allocation against the uniform cut\")")
ROWS = ("stock", "search", "search_obs", "search_stock", "search_served", "default", "calibrated", "global",
        "layerwise", "blockwise_removal", "depth")
# the search rows under a shape constraint (OBS's order, as search_obs): the export format they are cut for
SHAPED_SEARCH = {"search_stock": "stock", "search_served": "nemotron_nas"}
# rows that are the library defaults with one allocation (and its option) changed
ALLOCATION_ROWS = {"calibrated": {"allocation": "calibrated"}, "global": {"allocation": "global"},
                   "layerwise": {"allocation": "layerwise"},
                   "blockwise_removal": {"allocation": "blockwise", "block_importance": "removal"},
                   "depth": {"allocation": "depth"}}


def run_row(kind: str, model, calib, evals, ratio: float, args, state_dir: Path, stock_removed,
            zeroshot: tuple[set, object] | None = None) -> dict:
    """Cut a copy of `model` one way (`prunelight.prune`), evaluate it; returns the row (and keeps the stock
    removal for the seeds)."""
    row: dict = {"row": kind, "ratio": ratio, "variant": row_variant(kind, args)}
    t0 = time.perf_counter()
    if kind in ("stock", "default") or kind in ALLOCATION_ROWS:
        # default: the library's own defaults (criterion, allocation, repair, probe batches) at this ratio
        opts = {"ratio": ratio, **ALLOCATION_ROWS.get(kind, {})}
        if kind == "stock":
            opts.update(criterion="flap", reconstruct="least_squares", allocation="global", attn_mlp_split="auto")
        if kind != "stock":  # --settings changes the library's defaults (a lever measured as a variant)
            extra = dict(args.settings)
            opts["allocation_args"] = {**opts.get("allocation_args", {}), **extra.pop("allocation_args", {})}
            opts.update(extra)
        if kind == "default":  # where the default search keeps its levels database (it serves every ratio)
            opts["allocation_args"]["state_dir"] = str(state_dir)
        pruned, plan, seconds = bench.cut_copy(model, prunelight.PruneSettings(**opts), calib,
                                               export_format="stock" if kind == "stock" else "auto")
        row["times_s"] = {"cut": seconds}
        if "search" in plan.meta:  # scoring and the cut are the rest of the run's time
            res = plan.meta["search"]
            row["times_s"] = {**res["times_s"], "scoring and cut": seconds - sum(res["times_s"].values())}
            row["search"] = {k: v for k, v in res.items() if k != "levels"}
        if kind == "stock":
            stock_removed[ratio] = {
                "attn": [set(range(n)) - set(lp.keep_groups) for n, lp in zip(plan.num_groups, plan.layers)],
                "mlp": [set(range(n)) - set(lp.keep_channels) for n, lp in zip(plan.num_channels, plan.layers)]}
    else:
        order = "criterion" if kind == "search" else "obs"
        seeds = ({"stock": {k: [sorted(s) for s in v] for k, v in stock_removed[ratio].items()}}
                 if ratio in stock_removed else {})
        search_args = {"generations": args.generations, "offspring": args.offspring, "order": order,
                       "stages": list(args.stages), "survivors": list(args.survivors), "mlp_levels": args.mlp_levels,
                       "seeds": seeds, "state_dir": str(state_dir)}  # the database serves every ratio
        settings = prunelight.PruneSettings(criterion="flap", ratio=ratio, allocation="search",
                                            allocation_args=search_args,
                                            reconstruct="obs" if order == "obs" else "least_squares")
        ts = time.perf_counter()
        scores = prunelight.score(model, settings, calib)
        t_score = time.perf_counter() - ts
        pruned, plan, seconds = bench.cut_copy(model, settings, calib, scores=scores,
                                               export_format=SHAPED_SEARCH.get(kind, "auto"))
        res = plan.meta["search"]
        row["times_s"] = {"scoring": t_score, **res["times_s"],
                          "cut": seconds - sum(res["times_s"].values())}  # the cut after database and search
        row["search"] = {k: v for k, v in res.items() if k != "levels"}
        row["levels"] = res.get("levels")
    row["budget_error_params"] = plan.meta.get("budget_error_params")
    row["kept_groups"] = [len(lp.keep_groups) for lp in plan.layers]
    row["kept_channels"] = [len(lp.keep_channels) for lp in plan.layers]
    te = time.perf_counter()
    ppl = bench.perplexity(pruned, evals)
    row["times_s"]["eval"] = time.perf_counter() - te
    row.update(ppl=ppl["ppl"], eval_tokens=ppl["tokens"], params_after=bench.count_params(pruned),
               removed=1 - bench.count_params(pruned) / bench.count_params(model), seconds=time.perf_counter() - t0)
    if zeroshot is not None and kind in zeroshot[0]:
        row["zeroshot"] = zeroshot[1](pruned)
    return row


def row_variant(kind: str, args) -> str:
    """The label that keeps a row apart from other runs' rows: search rows and rows with --settings carry it."""
    return args.variant if kind.startswith("search") or (args.settings and kind != "stock") else ""


def markdown(meta: dict, rows: list[dict]) -> str:
    """The table: ppl and x dense per row and ratio, the phases' wall time, the search's KL against its seeds."""
    dense = meta["dense_ppl"]
    out = [f"# allocation search on {meta['model_name']}", "",
           f"Dense perplexity {dense:.2f} ({meta['eval_tokens']} tokens: {meta['eval']}); "
           f"calibration {meta['calibration']}; no recovery; {meta['threads']} thread(s), {meta['machine']}, "
           f"torch {meta['torch']}.", "",
           *(["Search settings per variant: " + "; ".join(f"{k}: {v}" for k, v in meta["searches"].items()) + ".", ""]
             if meta.get("searches") else []),
           *(["Changed defaults per variant: " + "; ".join(f"{k}: {json.dumps(v)}" for k, v in
                                                       meta["settings_variants"].items()) + ".", ""]
             if meta.get("settings_variants") else []),
           "| row | ratio | removed | ppl | x dense | budget error (params) | wall time (s) | search KL (seeds) |",
           "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in sorted(rows, key=lambda r: (r["ratio"], ROWS.index(r["row"]), r.get("variant", ""))):
        name = r["row"] + (f" ({r['variant']})" if r.get("variant") else "")
        if "error" in r:
            out.append(f"| {name} | {r['ratio']:g} | - | error: {r['error']} | | | | |")
            continue
        times = ", ".join(f"{k} {v:.0f}" for k, v in r["times_s"].items())
        kl = ""
        if "search" in r:
            s = r["search"]
            kl = f"{s['kl']:.4f} ({', '.join(f'{k} {v:.4f}' for k, v in s['seeds_kl'].items())})"
        out.append(f"| {name} | {r['ratio']:g} | {r['removed']:.4f} | {r['ppl']:.2f} | {r['ppl'] / dense:.3f} | "
                   f"{r['budget_error_params']} | {times} | {kl} |")
    out += ["", "Rows: stock = flap + least_squares, export.format stock (split auto); search = levels from flap's "
            "order + least_squares refits, evolutionary search on calibration KL; search_obs = levels from structured "
            "OBS's order, reconstruct obs; search_stock / search_served = search_obs under export.format stock / "
            "nemotron_nas; default = the library's defaults (flap, search with OBS's order and least_squares refits, "
            "generations auto (12 up to a 20% cut, 12 per 20% beyond) x 8 offspring, stages 2 / 8 / 32 sequences, "
            "calibrated's plan a seed); calibrated = "
            "flap + calibrated + least_squares; global, layerwise, "
            "blockwise_removal (block_importance: removal) and depth = the defaults with that allocation. "
            "A database time near 0 s "
            "is the saved database of an earlier row read back (the database serves every ratio and variant). "
            "KL figures are on each variant's last-stage sequences, so they compare within a row only.", ""]
    zs = ([("dense", meta["dense_zeroshot"])] if "dense_zeroshot" in meta else []) + [
        (f"{r['row']}" + (f" ({r['variant']})" if r.get("variant") else "") + f" @ {r['ratio']:g}", r["zeroshot"])
        for r in rows if "zeroshot" in r]
    if zs:
        out += [f"Zero-shot accuracy (%, ± binomial standard error), first {zs[0][1]['limit']} rows of each set:", "",
                *bench.zeroshot_table(zs), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Run the rows, append to the JSON, rewrite the Markdown."""
    p = bench.parser(__doc__, __file__)
    p.add_argument("--model", required=True, help="a Hugging Face folder (fp32)")
    bench.add_data_arguments(p, model=False, samples=64)
    p.add_argument("--eval-chars", type=int, default=60000)
    p.add_argument("--ratios", default="0.2")
    p.add_argument("--rows", default="stock,search,search_obs")
    p.add_argument("--generations", type=int, default=20)
    p.add_argument("--offspring", type=int, default=8)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 8, 16])
    p.add_argument("--survivors", type=int, nargs="+", default=[8, 2, 1])
    p.add_argument("--mlp-levels", type=int, default=32)
    p.add_argument("--state-dir", default=str(Path(tempfile.gettempdir()) / "prunelight-search-state"))
    p.add_argument("--out-dir", default=str(bench.RESULTS))
    p.add_argument("--name", default="search_smollm2")
    p.add_argument("--resume", action="store_true", help="keep the rows already in the JSON")
    p.add_argument("--variant", default="", help="a label for these rows (search settings), kept beside other runs'")
    p.add_argument("--settings", type=json.loads, default={},
                   help='JSON of PruneSettings fields for the rows made from the library defaults (default, '
                        'calibrated, ...), e.g. \'{"importance_batches": 1, "allocation_args": {"generations": 8}}\'; '
                        'needs --variant')
    p.add_argument("--zeroshot-rows", default="", help="rows (and 'dense') to evaluate on the zero-shot sets")
    p.add_argument("--zeroshot-limit", type=int, default=100, help="first N rows of each zero-shot set")
    p.add_argument("--zeroshot-dir", default=bench.shared_path("data", "zeroshot"))
    args = p.parse_args(argv)
    rows_asked = [r for r in args.rows.split(",") if r]
    zs_rows = {r for r in args.zeroshot_rows.split(",") if r}
    bad = [r for r in rows_asked + sorted(zs_rows - {"dense"}) if r not in ROWS]
    if bad:
        p.error(f"--rows {bad} not allowed: use {', '.join(ROWS)}")
    if args.settings and not args.variant:
        p.error(f"--settings {json.dumps(args.settings)} needs --variant: a label keeps these rows apart from the "
                "library defaults' rows")
    ratios = [float(r) for r in args.ratios.split(",") if r]
    out_dir = Path(args.out_dir)
    json_path = out_dir / f"{args.name}.json"
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else {}
    data = bench.token_data(args.model, args.calibration, args.eval, samples=args.samples, seq_len=args.seq_len,
                            seed=args.seed, eval_chars=args.eval_chars)
    calib = data.calibration_batches(args.batch_size)
    evals = data.eval_batches(args.eval_batch_size)
    model = bench.load_model(args.model)
    zeroshot = None
    if zs_rows:
        if not args.zeroshot_dir or not Path(args.zeroshot_dir).is_dir():
            p.error(f"--zeroshot-dir {args.zeroshot_dir!r} is not a folder: the zero-shot rows need the shared sets")
        tokenizer = bench.load_tokenizer(args.model)
        zeroshot = (zs_rows, lambda m: bench.zeroshot_result(m, tokenizer, args.zeroshot_dir, args.zeroshot_limit))
    meta = previous.get("meta")
    if meta is None:
        dense = bench.perplexity(model, evals)
        meta = {"model": args.model, "model_name": Path(args.model).name, "dense_ppl": dense["ppl"],
                "eval_tokens": dense["tokens"],
                "eval": f"{Path(args.eval).name}, first {args.eval_chars:,} characters, {args.seq_len}-token windows",
                "calibration": f"{data.calib.shape[0]} x {args.seq_len} tokens of {Path(args.calibration).name}",
                "threads": torch.get_num_threads(),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f} at start",
                "torch": torch.__version__}
    if zeroshot is not None and "dense" in zs_rows and "dense_zeroshot" not in meta:
        meta["dense_zeroshot"] = zeroshot[1](model)
    if "search" in meta:  # written before variants were labelled
        meta.setdefault("searches", {})["-"] = meta.pop("search")
    if any(r.startswith("search") for r in rows_asked):  # the default row runs the library's own search settings
        meta.setdefault("searches", {})[args.variant or "-"] = (
            f"{args.generations} generations x {args.offspring} offspring, stages {args.stages} sequences, "
            f"survivors {args.survivors}, MLP levels 1/{args.mlp_levels}")
    if args.settings:
        meta.setdefault("settings_variants", {})[args.variant] = args.settings
    meta.setdefault("commands", []).append("python -m benchmarks allocations " + shlex.join(
        sys.argv[1:] if argv is None else argv))
    rows = previous.get("rows", [])
    def key(r: dict) -> tuple:
        return r["row"], r["ratio"], r.get("variant", "")

    done = {key(r) for r in rows if "error" not in r}
    rows = [r for r in rows if key(r) in done]
    stock_removed: dict = {}
    state_dir = Path(args.state_dir)
    for ratio in ratios:
        for kind in sorted(rows_asked, key=ROWS.index):  # stock first: its plan seeds the search
            stock_done = [r for r in rows if r["row"] == "stock" and r["ratio"] == ratio and "error" not in r]
            if kind == "stock" and stock_done:  # the stock plan (a seed of the search) is read back from its row
                r = stock_done[0]
                if "removed_units" in r:
                    stock_removed[ratio] = {k: [set(v) for v in r["removed_units"][k]] for k in ("attn", "mlp")}
                    continue
            if (kind, ratio, row_variant(kind, args)) in done:
                continue
            print(f"[search benchmark] {kind} at {ratio:g} ...", flush=True)
            try:
                row = run_row(kind, model, calib, evals, ratio, args, state_dir, stock_removed, zeroshot)
                if kind == "stock" and ratio in stock_removed:
                    row["removed_units"] = {k: [sorted(s) for s in v] for k, v in stock_removed[ratio].items()}
            except Exception as err:  # noqa: BLE001 - recorded in the table; must not void a long run
                import traceback

                traceback.print_exc()
                row = {"row": kind, "ratio": ratio, "variant": row_variant(kind, args),
                       "error": f"{type(err).__name__}: {err}"}
            rows = [r for r in rows if key(r) != (kind, ratio, row_variant(kind, args))] + [row]
            x = (row.get("ppl") or 0) / meta["dense_ppl"]
            print(f"[search benchmark] {kind} at {ratio:g}: ppl {row.get('ppl')} x{x:.3f} times {row.get('times_s')}",
                  flush=True)
            bench.write_results(out_dir / args.name, {"meta": meta, "rows": rows}, markdown(meta, rows))


if __name__ == "__main__":
    main()
