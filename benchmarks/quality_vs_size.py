"""Quality vs size, side by side with a peer: WikiText-2 perplexity at 10-50% of parameters removed, no recovery.

Every method sees the same calibration windows (WikiText-2 valid, 128 x 128 tokens, seed 0) and the same
evaluation blocks (WikiText-2 test, 65,024 scored tokens), prepared once by `prunelight.bench.token_data`
(as a run's data module makes them), and is scored by the run's perplexity (`prunelight.bench.perplexity`).

prunelight methods (one process, scores computed once per criterion with `prunelight.score`, a fresh copy cut
per ratio with `prunelight.prune` from them, as a run cuts):
  default (the library's defaults, `prunelight.PruneSettings(ratio=r)`), flap + least_squares under the global
  allocation, the two best criteria of results/criteria.md with and without reconstruction (flap, wanda_sp), and
  the baselines magnitude, random and depth (no reconstruction).
Torch-Pruning (the peer), following its examples/LLMs/prune_llm.py (MetaPruner, per-projection `num_heads`,
`prune_num_heads=True`, `prune_head_dims=False`, `round_to=4`, `global_pruning=False`), in three setups:
  tp_l2_hidden   as shipped: L2 group magnitude, hidden size pruned too (only lm_head ignored);
  tp_l2_heads    embeddings kept: embed_tokens, lm_head, o_proj and down_proj outputs ignored (heads + MLP);
  tp_taylor      as tp_l2_heads with Taylor importance (gradients of the calibration loss).
Its `pruning_ratio` (= `head_pruning_ratio`) knob is bisected until the fraction of all parameters removed is
closest to the target; the actual fraction is reported. Each (setup, ratio) runs in a subprocess bounded by
--peer-timeout; a timeout or an error is recorded with its message, and a setup that times out is not tried at
higher ratios. The peer is imported from --torch-pruning-path (or an installed torch_pruning); without it
the peer rows are skipped with a note.

Outputs (under --out-dir, named after the model): <name>.json, <name>.md and <name>.png (log-scale
perplexity vs % removed). Results are kept per method in the JSON, so a run can be resumed (--resume) or
split (--methods / --peer-setups) and the table and figure are rebuilt from everything recorded.

Reference runs (2 CPU cores; see docs/benchmarks.md "Benchmarks"):
    python -m benchmarks quality_vs_size --torch-pruning-path <folder holding torch_pruning>
    python -m benchmarks quality_vs_size --model ../shared/models/ref-mistral-gqa --torch-pruning-path ...
    python -m benchmarks quality_vs_size --tiny-family qwen2 --torch-pruning-path ...   # failure facts
Quick check:
    python -m benchmarks quality_vs_size --tiny-family llama --ratios 0.2 --out-dir /tmp/qvs
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import prunelight
from prunelight import bench

WRITES = ("results/benchmarks/<name>.{json,md,png}, <name> = quality_<model> (docs/benchmarks.md, \"Quality vs "
          "size\" and \"Quality on a real model\")")
_DEFAULTS = prunelight.PruneSettings()  # the defaults have one owner: the settings dataclass
DEFAULT_LABEL = f"prunelight default ({_DEFAULTS.criterion} / {_DEFAULTS.allocation})"
# label -> (criterion, preset or allocation, reconstruction); None: the library's defaults at the ratio
METHODS = {
    DEFAULT_LABEL: None,
    "flap+least_squares (global)": ("flap", "global", "least_squares"),
    "flap": ("flap", "global", "none"),
    "wanda_sp": ("wanda_sp", "global", "none"),
    "wanda_sp+least_squares": ("wanda_sp", "global", "least_squares"),
    "magnitude": ("magnitude", "global", "none"),
    "random": ("random", "global", "none"),
    "depth (block influence, taylor fill)": ("taylor", "depth", "none"),
}
METHOD_KEYS = {"default": DEFAULT_LABEL, "flap_ls": "flap+least_squares (global)", "flap": "flap",
               "wanda_sp": "wanda_sp", "wanda_sp_ls": "wanda_sp+least_squares", "magnitude": "magnitude",
               "random": "random", "depth": "depth (block influence, taylor fill)"}
PEER_SETUPS = {
    "tp_l2_hidden": "Torch-Pruning as shipped (L2 magnitude, hidden size pruned)",
    "tp_l2_heads": "Torch-Pruning, embeddings kept (L2, heads + MLP)",
    "tp_taylor": "Torch-Pruning, Taylor importance, embeddings kept",
}
TINY_OVERRIDES = {  # the tiny families of prunelight.testing, made to show the peer's GQA cases
    "qwen2": dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=192),  # 3:1, biases
    "mistral": dict(hidden_size=64, intermediate_size=192),  # 2:1
    "llama": dict(hidden_size=64, intermediate_size=192),
}


# --------------------------------------------------------------------------------------------- prunelight
def method_cells(labels: list[str], ratios: list[float]) -> list[tuple[dict, Callable]]:
    """The --methods rows as cells: (the row's head, a function making its settings)."""
    cells = []
    for label in labels:
        for ratio in ratios:
            if METHODS[label] is None:
                make = functools.partial(prunelight.PruneSettings, ratio=ratio)
            else:
                criterion, method, mode = METHODS[label]
                make = functools.partial(bench.cell_settings, method, criterion, ratio, reconstruct=mode)
            cells.append(({"method": label, "kind": "prunelight", "target": ratio}, make))
    return cells


# --------------------------------------------------------------------------------------------- the grid
# `--grid CRITERIA:ALLOCATIONS:RATIOS` (each a comma list or "all"): every criterion x allocation x ratio, one
# row each, labelled "<criterion> / <allocation>", cut with --reconstruct (the run's default: least_squares).
DEFAULT_GRID_LABEL = f"{_DEFAULTS.criterion} / {_DEFAULTS.allocation}"


def grid_label(criterion: str, allocation: str, reconstruct: str = "least_squares") -> str:
    """The row label of one grid cell ('flap / global'; the reconstruction named when it is not least_squares)."""
    return f"{criterion} / {allocation}" + ("" if reconstruct == "least_squares" else f" ({reconstruct})")


def parse_grid(specs: list[str], ratios_default: list[float]) -> list[tuple[str, str, float]]:
    """Expand 'CRITERIA:ALLOCATIONS[:RATIOS]' specs into (criterion, allocation, ratio) cells, first seen first."""
    known_criteria, known_allocations = bench.criteria(), bench.allocations()
    cells: list[tuple[str, str, float]] = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"--grid {spec!r}: expected CRITERIA:ALLOCATIONS[:RATIOS]")
        crits = known_criteria if parts[0] == "all" else [c for c in parts[0].split(",") if c]
        allocs = known_allocations if parts[1] == "all" else [a for a in parts[1].split(",") if a]
        ratios = [float(r) for r in parts[2].split(",") if r] if len(parts) == 3 else ratios_default
        bad = [c for c in crits if c not in known_criteria] + [a for a in allocs if a not in known_allocations]
        bad += [r for r in ratios if not 0 < r < 1]
        if bad:
            raise ValueError(f"--grid {spec!r}: unknown {bad}; criteria {', '.join(known_criteria)}; "
                             f"allocations {', '.join(known_allocations)}; ratios in (0, 1)")
        for r in ratios:  # the ratios in the order given: the first ratio's cells are run (and recorded) first
            for a in allocs:
                for c in crits:
                    if (c, a, r) not in cells:
                        cells.append((c, a, r))
    return cells


def plan_summary(plan) -> dict:
    """What a plan cuts, in a few numbers: KV groups removed, layers losing attention, MLP widths, dropped layers."""
    kept = [i for i in range(len(plan.layers)) if i not in plan.drop_layers]
    widths = [len(plan.layers[i].keep_channels) for i in kept]
    groups = [len(plan.layers[i].keep_groups) for i in kept]
    return {"layers_dropped": list(plan.drop_layers),
            "attn_removed_layers": sum(1 for i, g in zip(kept, groups) if g == 0),
            "groups_kept": groups, "mlp_kept": widths,
            "mlp_kept_min": min(widths) if widths else 0, "mlp_kept_max": max(widths) if widths else 0,
            "attn_share_removed": plan.meta.get("attn_share_removed")}


def evaluate_protocols(model, protocols: dict[str, list]) -> dict:
    """Perplexity under each protocol: {'own': {...}, 'paper': {...}} with ppl, nll, tokens."""
    return {name: bench.perplexity(model, batches) for name, batches in protocols.items()}


def grid_cells(cells: list[tuple[str, str, float]], reconstruct: str, extra: dict, done: set
               ) -> list[tuple[dict, Callable]]:
    """The --grid cells not done yet: (the row's head, a function making its settings)."""
    out = []
    for criterion, allocation, ratio in cells:
        label = grid_label(criterion, allocation, reconstruct)
        if (label, round(ratio, 6)) not in done:
            head = {"method": label, "kind": "grid", "criterion": criterion, "allocation": allocation,
                    "reconstruct": reconstruct, "target": ratio}
            out.append((head, functools.partial(bench.cell_settings, allocation, criterion, ratio,
                                                **{**extra.get(allocation, {}), "reconstruct": reconstruct})))
    return out


def run_cells(model, calib, protocols: dict[str, list], cells: list[tuple[dict, Callable]], zeroshot_for: set,
              zeroshot_fn, on_row) -> None:
    """Score once per criterion (and layer measure), then per cell cut a fresh copy as a run does, evaluate."""
    scorer = bench.Scorer(model, calib)
    total = bench.count_params(model)
    for head, make_settings in cells:
        row, label, ratio = dict(head), head["method"], head["target"]
        t0 = time.perf_counter()
        try:
            settings = make_settings()
            scores = scorer(settings)
            row["scoring_s"] = scorer.seconds[settings.criterion]
            for name in scores.layer_importance:  # a measure the allocation needs, measured once on the dense model
                row["layer_importance"] = {"measure": name, "batches": settings.importance_batches,
                                           "seconds": scorer.measure_seconds.get(name)}
            pruned, plan, row["cut_s"] = bench.cut_copy(model, settings, calib, scores=scores)
            row["cut"] = plan_summary(plan)
            after = bench.count_params(pruned)
            te = time.perf_counter()
            ppl = evaluate_protocols(pruned, protocols)
            row["eval_s"] = time.perf_counter() - te
            row.update(ppl=ppl["own"]["ppl"], eval_tokens=ppl["own"]["tokens"], params_after=after,
                       removed=1 - after / total)
            if "paper" in ppl:
                row.update(ppl_paper=ppl["paper"]["ppl"], eval_tokens_paper=ppl["paper"]["tokens"])
            if f"{label}@{ratio:g}" in zeroshot_for and zeroshot_fn is not None:
                row["zeroshot"] = zeroshot_fn(pruned)
            row["seconds"] = time.perf_counter() - t0
            del pruned
        except Exception as err:  # noqa: BLE001 - recorded in the table; must not void a long run
            row["error"] = f"{type(err).__name__}: {err}"
        on_row(row)


# --------------------------------------------------------------------------------------------- the peer
def import_torch_pruning(path: str | None):
    """torch_pruning from `path` (put first on sys.path) or installed; None when absent."""
    if path:
        sys.path.insert(0, str(path))
    try:
        return importlib.import_module("torch_pruning")
    except ImportError:
        return None


def _peer_prune(tp, model, setup: str, knob: float, example, grad_batches) -> None:
    """Prune `model` in place the way examples/LLMs/prune_llm.py does, with `knob` as both pruning ratios."""
    cfg = model.config
    num_heads, ignored = {}, [model.lm_head]
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            num_heads[m.q_proj] = cfg.num_attention_heads
            num_heads[m.k_proj] = cfg.num_key_value_heads
            num_heads[m.v_proj] = cfg.num_key_value_heads
            if setup != "tp_l2_hidden":
                ignored.append(m.o_proj)
        if name.endswith("mlp") and setup != "tp_l2_hidden":
            ignored.append(m.down_proj)
    if setup != "tp_l2_hidden":
        ignored.append(model.get_input_embeddings())
    if setup == "tp_taylor":
        importance = tp.importance.GroupTaylorImportance(group_reduction="mean")
        model.zero_grad()
        for ids in grad_batches:  # the same next-token loss the example's Taylor variant back-propagates
            model(input_ids=ids, labels=ids).loss.backward()
    else:
        importance = tp.importance.GroupMagnitudeImportance(p=2, group_reduction="mean")
    pruner = tp.pruner.MetaPruner(
        # use_cache=False: transformers 5 returns a DynamicCache that the tracer cannot walk (the one adaptation).
        model, example_inputs={"input_ids": example, "use_cache": False}, importance=importance, global_pruning=False, pruning_ratio=knob,
        ignored_layers=ignored, num_heads=num_heads, prune_num_heads=True, prune_head_dims=False,
        head_pruning_ratio=knob, round_to=4,
    )
    for group in pruner.step(interactive=True):
        group.prune()
    model.zero_grad(set_to_none=True)
    # The example's attribute updates after pruning (transformers 5 names).
    cfg.hidden_size = model.lm_head.in_features
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            q_heads = m.q_proj.out_features // m.head_dim
            kv_heads = m.k_proj.out_features // m.head_dim
            m.num_key_value_groups = q_heads // max(kv_heads, 1)
            cfg.num_attention_heads, cfg.num_key_value_heads = q_heads, kv_heads
        elif name.endswith("mlp"):
            cfg.intermediate_size = m.gate_proj.out_features


def run_peer_worker(args: argparse.Namespace) -> dict:
    """One (setup, ratio): bisect the knob on parameter count, then evaluate the closest model."""
    tp = import_torch_pruning(args.torch_pruning_path)
    data = bench.TokenData.load(args.data_file)
    calib, evals = data.calibration_batches(args.batch_size), data.eval_batches(args.eval_batch_size)
    dense = bench.load_model(args.model)
    total = bench.count_params(dense)
    example = calib[0][:1]
    tried, best, lo, hi = [], None, 0.0, 0.95
    t0 = time.perf_counter()
    for _ in range(args.peer_steps):
        knob = (lo + hi) / 2
        model = copy.deepcopy(dense)
        _peer_prune(tp, model, args.peer_worker, knob, example, calib)
        removed = 1 - bench.count_params(model) / total
        tried.append({"knob": knob, "removed": removed})
        if best is None or abs(removed - args.ratio) < abs(best[1] - args.ratio):
            best = (model, removed, knob)
        if abs(removed - args.ratio) < 0.0025:
            break
        lo, hi = (knob, hi) if removed < args.ratio else (lo, knob)
    model, removed, knob = best
    prune_s = time.perf_counter() - t0
    ppl = bench.perplexity(model.eval(), evals)
    attn = model.model.layers[0].self_attn
    return {"ppl": ppl["ppl"], "eval_tokens": ppl["tokens"], "removed": removed, "knob": knob, "tried": tried,
            "params_after": bench.count_params(model), "prune_s": prune_s,
            "shape": {"hidden": model.config.hidden_size, "q_heads_layer0": attn.q_proj.out_features // attn.head_dim,
                      "kv_heads_layer0": attn.k_proj.out_features // attn.head_dim,
                      "intermediate_layer0": model.model.layers[0].mlp.gate_proj.out_features}}


def run_peer(args, data_file: Path, setups: list[str], ratios: list[float], on_row) -> None:
    """Each (setup, ratio) in a subprocess with a time limit; errors and timeouts are recorded."""
    for setup in setups:
        stopped = None
        for ratio in ratios:
            row: dict = {"method": PEER_SETUPS[setup], "kind": "peer", "setup": setup, "target": ratio}
            if stopped:
                row["error"] = stopped
                on_row(row)
                continue
            cmd = [__file__, "--peer-worker", setup, "--data-file", str(data_file), "--model", str(args.model),
                   "--ratio", str(ratio), "--threads", str(args.threads), "--batch-size", str(args.batch_size),
                   "--eval-batch-size", str(args.eval_batch_size), "--peer-steps", str(args.peer_steps)]
            if args.torch_pruning_path:
                cmd += ["--torch-pruning-path", str(args.torch_pruning_path)]
            t0 = time.perf_counter()
            row.update(bench.run_worker(cmd, threads=args.threads, timeout=args.peer_timeout))
            if row.get("error", "").startswith("timeout"):
                stopped = f"not run: timed out at {ratio:.0%}"
            row["seconds"] = time.perf_counter() - t0
            on_row(row)


# --------------------------------------------------------------------------------------------- output
def markdown(meta: dict, rows: list[dict]) -> str:
    """A table: one row per method, one column per target ratio (perplexity, actual % removed)."""
    ratios = meta["ratios"]
    head = (f"`{meta['model_name']}` ({meta['params_total']:,} parameters, {meta['model_type']}); dense perplexity "
            f"{meta['dense_ppl']:.1f}. Calibration {meta['calibration']}; perplexity on {meta['eval_tokens']:,} "
            f"scored tokens of {meta['eval_name']}; no recovery. Cells: perplexity (actual % of all parameters "
            f"removed). {meta['threads']} thread(s), torch {meta['torch']}, {meta['date']}.")
    lines = [head, "", "| method | " + " | ".join(f"{r:.0%}" for r in ratios) + " |",
             "|---|" + "---:|" * len(ratios)]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for m in methods:
        cells = []
        for ratio in ratios:
            row = next((r for r in rows if r["method"] == m and abs(r["target"] - ratio) < 1e-9), None)
            if row is None:
                cells.append("—")
            elif "error" in row:
                cells.append(f"fails: {row['error'][:90]}".replace("|", "/"))
            else:
                cells.append(f"{row['ppl']:,.1f} ({row['removed']:.1%})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    ratio_line = ratio_to_peer(meta, rows)
    if ratio_line:
        lines += ["", ratio_line]
    return "\n".join(lines) + "\n"


def ratio_to_peer(meta: dict, rows: list[dict]) -> str:
    """'default / best peer' perplexity at each ratio (the target is <= 0.5); the default is the library's."""
    parts = []
    for ratio in meta["ratios"]:
        at = [r for r in rows if abs(r["target"] - ratio) < 1e-9 and "ppl" in r]
        ours = next((r["ppl"] for r in at if r["method"] in (DEFAULT_LABEL, DEFAULT_GRID_LABEL)), None)
        peers = [r["ppl"] for r in at if r["kind"] == "peer"]
        if ours is None:
            continue
        parts.append(f"{ratio:.0%}: {ours / min(peers):.2f}" if peers else f"{ratio:.0%}: no peer result")
    return ("prunelight default / best Torch-Pruning setup, perplexity ratio (target <= 0.5): " + ", ".join(parts)
            if parts else "")


def _cell(row: dict | None, key: str, dense: float | None) -> str:
    """'73.9 (1.43x)', with the actual % removed where it misses the target; the error where it failed."""
    if row is None:
        return "—"
    if "error" in row:
        return f"fails: {row['error'][:80]}".replace("|", "/")
    if key not in row:
        return "n/a"
    text = f"{row[key]:,.1f}" + (f" ({row[key] / dense:.2f}x)" if dense else "")
    if abs(row["removed"] - row["target"]) > 0.005:
        text += f" [{row['removed']:.1%}]"
    return text


def markdown_grid(meta: dict, rows: list[dict]) -> str:
    """Tables of a grid run: perplexity under both protocols (x dense), what the cut removed, zero-shot with errors."""
    ratios = meta["ratios"]
    dense, dense_p = meta["dense_ppl"], meta.get("dense_ppl_paper")
    lines = [
        f"`{meta['model_name']}` ({meta['params_total']:,} parameters, {meta['model_type']}, "
        f"{meta['query_heads']} query / {meta['kv_heads']} KV heads), {meta['date']}, {meta['threads']} thread(s), "
        f"torch {meta['torch']}. No recovery; calibration {meta['calibration']}; grid rows are "
        f"`<criterion> / <allocation>` with reconstruction `{meta.get('grid', {}).get('reconstruct', '?')}` "
        f"(the run's default); `{DEFAULT_GRID_LABEL}` is the default.",
        "",
        f"- the run's own protocol: {meta['eval_name']}, lines joined by newlines, non-overlapping windows as the run "
        f"makes them, {meta['eval_tokens']:,} scored tokens; dense **{dense:.2f}**.",
    ]
    if dense_p:
        lines.append(f"- paper protocol: {meta['paper_protocol']}; {meta['eval_tokens_paper']:,} scored tokens; "
                     f"dense **{dense_p:.2f}**.")
    if meta.get("reduced"):
        lines.append(f"- **reduced grid**: {meta['reduced']}")
    commands = [shlex.split(c) for c in meta.get("commands", [])]
    common = os.path.commonprefix(commands) if len(commands) > 1 else []
    lines += ["- commands (in order; each resumes the JSON of the one before)"
              + (", all starting with the first line:" if common else ":"), ""]
    if common:
        lines.append("      " + shlex.join(common))
    lines += [f"      {'... ' if common else ''}{shlex.join(c[len(common):])}" for c in commands] + [""]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    at = {(r["method"], round(r["target"], 6)): r for r in rows}
    for title, key, base in (("Perplexity, the run's own protocol (x dense)", "ppl", dense),
                             ("Perplexity, paper protocol (x dense)", "ppl_paper", dense_p)):
        if key == "ppl_paper" and not dense_p:
            continue
        lines += [f"### {title}", "", "| method | " + " | ".join(f"{r:.0%}" for r in ratios) + " |",
                  "|---|" + "---:|" * len(ratios)]
        for m in methods:
            cells = [_cell(at.get((m, round(r, 6))), key, base) for r in ratios]
            if all(c == "—" for c in cells):
                continue
            if key == "ppl_paper" and all(c in ("—", "n/a") for c in cells):
                continue
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    ratio_line = ratio_to_peer({**meta, "ratios": ratios}, rows)
    if ratio_line:
        lines += [ratio_line, ""]
    cut_rows = [r for r in rows if r.get("kind") == "grid" and "cut" in r]
    if cut_rows:
        lines += ["### What each cut removed", "",
                  "| method | target | removed | attention gone (layers) | layers dropped | MLP channels kept (min-max) "
                  "| scoring s | cut+refit s |", "|---|---:|---:|---:|---:|---|---:|---:|"]
        for r in cut_rows:
            c = r["cut"]
            lines.append(f"| {r['method']} | {r['target']:.0%} | {r['removed']:.1%} | {c['attn_removed_layers']} | "
                         f"{len(c['layers_dropped'])} | {c['mlp_kept_min']}-{c['mlp_kept_max']} | "
                         f"{r.get('scoring_s', 0):.0f} | {r.get('cut_s', 0):.0f} |")
        lines.append("")
    zs = ([("dense", meta["dense_zeroshot"])] if "dense_zeroshot" in meta else []) + [
        (f"{r['method']} @ {r['target']:.0%}", r["zeroshot"]) for r in rows if "zeroshot" in r]
    if zs:
        lines += [f"### Zero-shot accuracy (%, ± binomial standard error), first {zs[0][1]['limit']} rows per task",
                  "", *bench.zeroshot_table(zs), ""]
    peers = [r for r in rows if r.get("kind") == "peer"]
    if peers:
        lines += [f"Torch-Pruning ({meta.get('peer')}) runs the own protocol only; its failures are quoted as raised.",
                  ""]
    return "\n".join(lines)


def figure_grid(meta: dict, rows: list[dict], path: Path) -> None:
    """Left: perplexity / dense vs % removed for rows run at several ratios; right: every criterion at one ratio."""
    import matplotlib.ticker

    plt = bench.pyplot()
    ok = [r for r in rows if "ppl" in r]
    methods = list(dict.fromkeys(r["method"] for r in ok))
    multi = [m for m in methods if sum(r["method"] == m for r in ok) > 1]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    for m in multi:
        pts = sorted((r["removed"] * 100, r["ppl"] / meta["dense_ppl"]) for r in ok if r["method"] == m)
        style = dict(lw=2.5, color="black") if m == DEFAULT_GRID_LABEL else {}
        ax.plot(*zip(*pts), marker="o", label=m, **style)
        paper = sorted((r["removed"] * 100, r["ppl_paper"] / meta["dense_ppl_paper"]) for r in ok
                       if r["method"] == m and "ppl_paper" in r)
        if paper and m == DEFAULT_GRID_LABEL:
            ax.plot(*zip(*paper), marker="s", ls="--", color="grey", label=f"{m}, paper protocol")
    ax.axhline(1.0, color="grey", ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("% of parameters removed")
    ax.set_ylabel("perplexity / dense (log), run's own protocol")
    ax.set_title("allocations (no recovery)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    single = sorted({round(r["target"], 6) for r in ok if r["method"] not in multi} or {0.2})
    ratio = single[0]
    bars = sorted(((r["ppl"] / meta["dense_ppl"], r["method"]) for r in ok if abs(r["target"] - ratio) < 1e-6
                   and (r.get("allocation") == "global" or r.get("kind") == "peer")), reverse=True)
    if bars:
        bx.barh([b[1] for b in bars], [b[0] for b in bars],
                color=["black" if b[1] == DEFAULT_GRID_LABEL else "tab:blue" for b in bars])
        bx.set_xscale("log")
        bx.set_xlim(left=1.0)  # bars start at dense
        bx.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        bx.axvline(2.0, color="red", ls=":", label="target for every criterion: 2x")
        bx.axvline(1.2, color="green", ls=":", label="target for the default: 1.2x")
        bx.legend(fontsize=7)
    bx.set_xlabel(f"perplexity / dense at {ratio:.0%} (log)")
    bx.set_title(f"criteria, global allocation, {ratio:.0%}")
    bx.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"{meta['model_name']}: quality vs size, no recovery ({meta['date']})")
    fig.tight_layout()
    bench.save_figure(fig, path)


def figure(meta: dict, rows: list[dict], path: Path) -> None:
    """Perplexity vs % removed, log y; the dense model as a dotted line; failed peer runs as crosses on the axis."""
    fig, ax = bench.pyplot().subplots(figsize=(7.5, 4.8))
    for m in dict.fromkeys(r["method"] for r in rows):
        ok = sorted((r["removed"] * 100, r["ppl"]) for r in rows if r["method"] == m and "ppl" in r)
        peer = any(r["kind"] == "peer" for r in rows if r["method"] == m)
        style = dict(ls="--", marker="s") if peer else dict(ls="-", marker="o")
        if m == DEFAULT_LABEL:
            style.update(lw=2.5, color="black")
        if ok:
            ax.plot(*zip(*ok), label=m, **style)
        else:
            ax.plot([], [], label=f"{m}: failed at every ratio", ls="none", marker="x")
    ax.axhline(meta["dense_ppl"], color="grey", ls=":", label=f"dense ({meta['dense_ppl']:.1f})")
    ax.set_yscale("log")
    ax.set_xlabel("% of parameters removed")
    ax.set_ylabel("WikiText-2 perplexity (log)")
    ax.set_title(f"{meta['model_name']}: quality vs size, no recovery")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    bench.save_figure(fig, path)


def _paper_batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """The paper protocol's windows: --eval rows joined by blank lines, BOS once, --paper-seq-len windows."""
    blocks = bench.paper_blocks(args.model, args.eval, args.paper_seq_len, args.paper_windows or None)
    return list(torch.split(blocks, max(1, args.eval_batch_size * args.seq_len // args.paper_seq_len)))


def _dist_version(name: str) -> str:
    """An installed distribution's version ('?' when unknown)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def _tiny_setup(family: str, folder: Path) -> tuple[str, str, str]:
    from prunelight.testing import make_tiny_checkpoint, write_tiny_corpus

    model = make_tiny_checkpoint(folder / f"tiny-{family}", family, **TINY_OVERRIDES[family])
    corpus = write_tiny_corpus(folder / "corpus", lines=600)
    return str(model), str(corpus["valid"]), str(corpus["test"])


def main(argv: list[str] | None = None) -> None:
    """Run the quality-vs-size benchmark (or one peer worker of it)."""
    p = bench.parser(__doc__, __file__)
    bench.add_data_arguments(p, samples=128)
    p.add_argument("--tiny-family", choices=sorted(TINY_OVERRIDES),
                   help="use a tiny random model of this family and a tiny corpus (peer-failure facts, tests)")
    p.add_argument("--ratios", default="0.1,0.2,0.3,0.4,0.5")
    p.add_argument("--methods", default=None,
                   help=f"prunelight rows: {', '.join(METHOD_KEYS)} (default: all, or none when --grid is given)")
    p.add_argument("--grid", action="append", default=[], metavar="CRITERIA:ALLOCATIONS[:RATIOS]",
                   help="grid rows '<criterion> / <allocation>': comma lists or 'all' (every criterion / allocation); "
                        "repeatable, e.g. --grid flap:all:0.2,0.3 --grid all:global:0.2. Full grid: --grid all:all")
    p.add_argument("--reconstruct", default="least_squares", help="reconstruction of the grid rows")
    p.add_argument("--importance-batches", type=int, default=None,
                   help="calibration batches for layer/sub-block importance (overrides the presets' 4)")
    p.add_argument("--eval-chars", type=int, default=None,
                   help="the run's own protocol reads only the first N characters of --eval (the reference protocol: 60000)")
    p.add_argument("--protocols", default="own", help="own (the run's: --eval lines, --seq-len windows) and/or "
                   "paper (rows joined by blank lines, BOS once, --paper-seq-len windows)")
    p.add_argument("--paper-seq-len", type=int, default=2048)
    p.add_argument("--paper-windows", type=int, default=None, help="first N windows of the paper protocol")
    p.add_argument("--zeroshot-dir", default=bench.shared_path("data", "zeroshot"))
    p.add_argument("--zeroshot-limit", type=int, default=200, help="first N rows of each zero-shot task")
    p.add_argument("--zeroshot-for", default="",
                   help="comma list of 'dense' and grid cells '<criterion> / <allocation>@<ratio>' to score zero-shot")
    p.add_argument("--zeroshot-batch-size", type=int, default=16)
    p.add_argument("--reduced", default=None, help="a note for the table: what this run left out of the full grid")
    p.add_argument("--peer-setups", default=",".join(PEER_SETUPS), help="comma-separated; '' for none")
    p.add_argument("--torch-pruning-path", default=None, help="folder holding the torch_pruning package")
    p.add_argument("--peer-timeout", type=float, default=180.0, help="seconds per peer (setup, ratio) subprocess")
    p.add_argument("--peer-steps", type=int, default=10, help="bisection steps on the peer's ratio knob")
    p.add_argument("--eval-tokens", type=int, default=65536, help="test prefix in tokens (65,024 scored at 128)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out-dir", default=str(bench.RESULTS))
    p.add_argument("--name", default=None, help="output file stem (default: quality_<model folder name>)")
    p.add_argument("--resume", action="store_true", help="keep rows of methods already in the JSON")
    p.add_argument("--merge", nargs="*", default=None,
                   help="run nothing: add the rows of these JSON files to --name's JSON, rebuild table and figure")
    p.add_argument("--ratio", type=float, help=argparse.SUPPRESS)
    args = bench.parse_args(p, argv, run_peer_worker, "--peer-worker")
    if args is None:  # a worker process: it has answered
        return

    ratios = [float(r) for r in args.ratios.split(",") if r]
    bad = [r for r in ratios if not 0 < r < 1]
    if args.methods is None:
        args.methods = "" if args.grid else ",".join(METHOD_KEYS)
    labels = [k for k in args.methods.split(",") if k]
    try:
        cells = parse_grid(args.grid, ratios)
    except ValueError as err:
        p.error(str(err))
    protocols = [x for x in args.protocols.split(",") if x]
    if "own" not in protocols or set(protocols) - {"own", "paper"}:
        p.error(f"--protocols must include 'own' and may add 'paper' (got {args.protocols!r})")
    zeroshot_for = {x.strip() for x in args.zeroshot_for.split(",") if x.strip()}
    setups = [s for s in args.peer_setups.split(",") if s]
    unknown = [k for k in labels if k not in METHOD_KEYS] + [s for s in setups if s not in PEER_SETUPS]
    if bad or unknown:
        p.error(f"ratios must be in (0, 1) (got {bad}); unknown methods/setups {unknown}; "
                f"allowed: {', '.join(METHOD_KEYS)} / {', '.join(PEER_SETUPS)}")
    labels = [METHOD_KEYS[k] for k in labels]
    tiny_tmp = tempfile.TemporaryDirectory(prefix="prunelight-tiny-") if args.tiny_family else None
    if tiny_tmp:
        args.model, args.calibration, args.eval = _tiny_setup(args.tiny_family, Path(tiny_tmp.name))
        given = sys.argv[1:] if argv is None else argv  # a tiny model's sizes, unless the command line set them
        if "--samples" not in given:
            args.samples = 32
        if "--eval-tokens" not in given:
            args.eval_tokens = 4096
    if not args.model or not args.calibration:
        p.error("--model/--calibration/--eval are required when the shared reference data is not found "
                "(set PRUNELIGHT_SHARED) or use --tiny-family")
    tp = import_torch_pruning(args.torch_pruning_path) if setups else None
    peer_note = None
    if setups and tp is None:
        peer_note = "Torch-Pruning not importable (pass --torch-pruning-path or install torch-pruning): peer skipped"
        print(peer_note, flush=True)
        setups = []
    elif tp is not None:
        peer_note = f"torch_pruning {getattr(tp, '__version__', None) or _dist_version('torch-pruning')}"

    name = args.name or ("quality_tiny_" + args.tiny_family if args.tiny_family else "quality_" + Path(args.model).name)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else {}
    if args.merge is not None:
        merged = json.loads(json_path.read_text())
        for other in args.merge:
            extra = json.loads(Path(other).read_text())["rows"]
            names = {r["method"] for r in extra}
            merged["rows"] = [r for r in merged["rows"] if r["method"] not in names] + extra
        _finish(merged["meta"], merged["rows"], ratios, out_dir, name)
        return
    with tempfile.TemporaryDirectory(prefix="prunelight-qvs-") as tmp:
        data = bench.token_data(args.model, args.calibration, args.eval, samples=args.samples, seq_len=args.seq_len,
                                seed=args.seed, eval_tokens=args.eval_tokens, eval_chars=args.eval_chars)
        data_file = data.save(Path(tmp) / "data.pt")
        data_meta = {"calibration_samples": int(data.calib.shape[0]), "eval_blocks": int(data.eval.shape[0])}
        calib, evals = data.calibration_batches(args.batch_size), data.eval_batches(args.eval_batch_size)
        protocol_batches = {"own": evals}
        if "paper" in protocols:
            protocol_batches["paper"] = _paper_batches(args)
        model = bench.load_model(args.model)
        key = {"model": args.tiny_family or str(args.model), "samples": args.samples, "seq_len": args.seq_len,
               "seed": args.seed, "eval": Path(args.eval).name if args.tiny_family else str(args.eval),
               "eval_chars": args.eval_chars, "eval_tokens": args.eval_tokens,
               "protocols": protocols, "paper_seq_len": args.paper_seq_len, "paper_windows": args.paper_windows}
        old_meta = previous.get("meta", {})
        same = old_meta.get("protocol_key") == key
        dense = evaluate_protocols(model, protocol_batches) if not same else None
        zeroshot_fn = None
        if zeroshot_for:
            tokenizer = bench.load_tokenizer(args.model)

            def zeroshot_fn(m):
                return bench.zeroshot_result(m, tokenizer, args.zeroshot_dir, args.zeroshot_limit, args.zeroshot_batch_size)
        meta = {
            "model": str(args.model) if not args.tiny_family else f"tiny {args.tiny_family} (random weights)",
            "model_name": Path(args.model).name, "model_type": model.config.model_type,
            "query_heads": model.config.num_attention_heads, "kv_heads": model.config.num_key_value_heads,
            "params_total": bench.count_params(model),
            "dense_ppl": dense["own"]["ppl"] if dense else old_meta["dense_ppl"],
            "eval_tokens": dense["own"]["tokens"] if dense else old_meta["eval_tokens"], "ratios": ratios,
            "protocol_key": key,
            "calibration": f"{data_meta['calibration_samples']} x {args.seq_len} tokens of "
                           f"{Path(args.calibration).parent.name}/{Path(args.calibration).name} (seed {args.seed})",
            "eval_name": f"{Path(args.eval).parent.name}/{Path(args.eval).name}",
            "threads": args.threads, "torch": torch.__version__,
            "peer": peer_note or (old_meta.get("peer") if same else None),
            "machine": f"{platform.machine()} {os.cpu_count()} CPU(s)", "date": time.strftime("%Y-%m-%d"),
        }
        if args.eval_chars:
            meta["eval_name"] += f", first {args.eval_chars:,} characters"
        if "paper" in protocols:
            meta["dense_ppl_paper"] = dense["paper"]["ppl"] if dense else old_meta["dense_ppl_paper"]
            meta["eval_tokens_paper"] = dense["paper"]["tokens"] if dense else old_meta["eval_tokens_paper"]
            meta["paper_protocol"] = (f"{Path(args.eval).parent.name}/{Path(args.eval).name}, rows joined by blank "
                                      f"lines, the tokenizer's default special tokens once, non-overlapping "
                                      f"{args.paper_seq_len}-token windows"
                                      + (f", first {args.paper_windows}" if args.paper_windows else ""))
        for k in ("grid", "dense_zeroshot", "commands", "reduced"):
            if k in old_meta and same:
                meta[k] = old_meta[k]
        meta.setdefault("commands", []).append("python -m benchmarks quality_vs_size " + " ".join(
            a if a and " " not in a else repr(a) for a in (sys.argv[1:] if argv is None else argv)))
        if args.reduced:
            meta["reduced"] = args.reduced
        if cells:
            meta["grid"] = {"specs": meta.get("grid", {}).get("specs", []) + args.grid, "reconstruct": args.reconstruct, "recovery": "none",
                            "importance_batches": args.importance_batches}
        if "dense" in zeroshot_for and "dense_zeroshot" not in meta:
            meta["dense_zeroshot"] = zeroshot_fn(model)
            print(f"dense zero-shot: {meta['dense_zeroshot']['average']:.3f}", flush=True)
        keep = set(labels) | {PEER_SETUPS[s] for s in setups}
        wanted = {(c.rsplit("@", 1)[0], round(float(c.rsplit("@", 1)[1]), 6)) for c in zeroshot_for if "@" in c}

        def redo(r: dict) -> bool:  # a failed grid cell, or one now asked for zero-shot that has none
            key = (r["method"], round(r["target"], 6))
            return r.get("kind") == "grid" and ("error" in r or (key in wanted and "zeroshot" not in r))

        rows = [r for r in previous.get("rows", []) if r["method"] not in keep and not redo(r)]
        if "protocol_key" in old_meta and not same:  # rows measured on other data or protocols are not comparable: run them again
            print("--resume: the JSON was made with other data/protocol settings; its rows are dropped", flush=True)
            rows = []
        done = {(r["method"], round(r["target"], 6)) for r in rows if r.get("kind") == "grid"}

        def on_row(row: dict) -> None:
            rows.append(row)
            shown = f"ppl {row['ppl']:.1f} at {row['removed']:.1%}" if "ppl" in row else row["error"]
            if "ppl_paper" in row:
                shown += f", paper {row['ppl_paper']:.1f}"
            if "zeroshot" in row:
                shown += f", zero-shot {row['zeroshot']['average']:.3f}"
            print(f"{row['method']} @ {row['target']:.0%}: {shown} ({row.get('seconds', 0):.0f} s)", flush=True)
            bench.write_results(json_path.with_suffix(""), {"meta": meta, "rows": rows})

        bench.write_results(json_path.with_suffix(""), {"meta": meta, "rows": rows})
        extra = {a: {"importance_batches": args.importance_batches} for a in ("layerwise", "blockwise", "depth")
                 } if args.importance_batches else {}
        run_cells(model, calib, protocol_batches, grid_cells(cells, args.reconstruct, extra, done)
                  + method_cells(labels, ratios), zeroshot_for, zeroshot_fn, on_row)
        if setups:
            run_peer(args, data_file, setups, ratios, on_row)
    _finish(meta, rows, ratios, out_dir, name)
    if tiny_tmp:
        tiny_tmp.cleanup()


def _finish(meta: dict, rows: list[dict], ratios: list[float], out_dir: Path, name: str) -> None:
    """Sort the rows, write JSON, Markdown and the figure."""
    order = [*METHODS, *PEER_SETUPS.values()]
    first = {m: i for i, m in reversed(list(enumerate(r["method"] for r in rows)))}

    def rank(r: dict) -> tuple:
        if r["method"] in METHODS:
            return (order.index(r["method"]), 0, r["target"])
        if r.get("kind") == "grid":  # the default first, then the allocations, then the criteria, as run
            return (50, 0 if r["method"] == DEFAULT_GRID_LABEL else first[r["method"]] + 1, r["target"])
        return (100 + (order.index(r["method"]) if r["method"] in order else 99), 0, r["target"])

    rows.sort(key=rank)
    meta["ratios"] = sorted({r["target"] for r in rows} | set(ratios))
    grid = any(r.get("kind") == "grid" for r in rows)
    table = markdown_grid(meta, rows) if grid else markdown(meta, rows)
    bench.write_results(out_dir / name, {"meta": meta, "rows": rows}, table)
    (figure_grid if grid else figure)(meta, rows, out_dir / f"{name}.png")
    print("\n" + table)


if __name__ == "__main__":
    main()
