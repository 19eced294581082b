"""report.json and report.md: what was cut, what it cost, and what perplexity did."""

from __future__ import annotations

from pathlib import Path

from prunelight.atomic import atomic_write_json, atomic_write_text


def _acc(row: dict, metric: str) -> str:
    """An accuracy cell, with its standard error where the record has one (acc only)."""
    err = row.get("acc_stderr") if metric == "acc" else None
    return _fmt(row.get(metric), 4) + (f" ± {err:.4f}" if err is not None else "")


def _fmt(x, nd: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


MODELS = ("dense", "pruned", "recovered")


def _mb(n: int | None) -> float | None:
    return None if n is None else n / 1e6


def overlap_warning(report: dict) -> str | None:
    """A loud one-line warning when calibration/training text overlaps the evaluation text."""
    ov = report.get("overlap") or {}
    if not ov.get("flagged"):
        return None
    return (f"**WARNING: calibration/training text OVERLAPS the evaluation text** (same source: "
            f"{', '.join(ov.get('same_source') or []) or 'no'}; {ov.get('calibration_eval_shared_lines', 0)} calibration "
            f"and {ov.get('train_eval_shared_lines', 0)} training lines also in eval). Perplexity is optimistic; "
            "the run was allowed by `allow_overlap`.")


def _evaluation_sections(ev: dict) -> list[str]:
    names = [m for m in MODELS if m in ev] + [m for m in ev if m not in MODELS and isinstance(ev[m], dict)
                                              and ("perplexity" in ev[m] or "zeroshot" in ev[m] or "efficiency" in ev[m])]
    if not names:
        return []
    lines: list[str] = []
    ppl_rows = {}
    for m in names:
        for r in ev[m].get("perplexity", []):
            ppl_rows.setdefault((r["dataset"], r["seq_len_requested"]), {})[m] = r
    if ppl_rows:
        lines += ["", "## Perplexity", "",
                  "Token-weighted, non-overlapping windows, fp32 loss; tokens = scored tokens (window length - 1 per window).", "",
                  "| dataset | split / source | length (requested -> used) | tokens | " + " | ".join(names) + " |",
                  "|---|---|---|---:|" + "---:|" * len(names)]
        for (ds, req), per in ppl_rows.items():
            r0 = next(iter(per.values()))
            lines.append(f"| {ds} | {r0.get('split') or r0['source']} | {req} -> {r0['seq_len']} | {_fmt(r0['tokens'])} | "
                         + " | ".join(_fmt(per[m]['ppl']) if m in per else "n/a" for m in names) + " |")
    zs = {m: ev[m]["zeroshot"] for m in names if "zeroshot" in ev[m]}
    if zs:
        z0 = next(iter(zs.values()))
        lines += ["", "## Zero-shot accuracy", "",
                  f"lm-eval {z0.get('lm_eval_version')}, {z0.get('mode')} tasks"
                  + (f" from `{z0['data_dir']}`" if z0.get("data_dir") else "")
                  + (f", limit {z0['limit']} rows per task" if z0.get("limit") else ", full sets") + ", 0-shot.", "",
                  "| task | metric | rows | version | " + " | ".join(zs) + " |",
                  "|---|---|---:|---|" + "---:|" * len(zs)]
        for task, row in z0["tasks"].items():
            for metric in ("acc", "acc_norm"):
                if metric in row:
                    lines.append(f"| {task} | {metric} | {row.get('samples')} | {row.get('version')} | "
                                 + " | ".join(_acc(z['tasks'][task], metric) for z in zs.values()) + " |")
        for key, label in (("acc", "average acc"), ("acc_norm_else_acc", "average (acc_norm where defined)")):
            lines.append(f"| **{label}** | | | | " + " | ".join(_acc(z['average'], key) for z in zs.values()) + " |")
    eff = {m: ev[m]["efficiency"] for m in names if "efficiency" in ev[m]}
    if eff:
        sp = next(iter(eff.values()))["speed"]
        lines += ["", "## Efficiency", "",
                  f"Measured the same way for every model: batch {sp['batch_size']}, prompt {sp['prompt_len']} tokens, "
                  f"{sp['new_tokens']} decoded tokens, median of {sp['repeats']}, {sp['device']}, {sp['dtype']}, "
                  f"{sp['threads']} threads. Peak memory: {sp['peak_memory_kind']} (freed heap returned to the OS "
                  f"first); the rise is the peak minus the memory in use when generation started.", "",
                  "| | " + " | ".join(eff) + " |", "|---|" + "---:|" * len(eff)]
        rows = [("parameters", lambda e: e["params"]["total"]),
                ("attention params", lambda e: e["params"]["attention"]),
                ("MLP params", lambda e: e["params"]["mlp"]),
                ("embedding + LM head params", lambda e: e["params"]["embeddings"] + e["params"]["lm_head"]),
                ("weights in memory (MB)", lambda e: e["weight_bytes"] / 1e6),
                ("size on disk (MB)", lambda e: None if e.get("disk_bytes") is None else e["disk_bytes"] / 1e6),
                ("KV cache (MB)", lambda e: e["speed"]["kv_cache_bytes"] / 1e6),
                ("peak memory (MB)", lambda e: _mb(e["speed"].get("peak_memory_bytes"))),
                ("peak rise while generating (MB)", lambda e: _mb(e["speed"].get("peak_memory_rise_bytes"))),
                ("prefill tokens/s", lambda e: e["speed"]["prefill_tokens_per_s"]),
                ("decode tokens/s", lambda e: e["speed"]["decode_tokens_per_s"]),
                ("decode latency (ms/token)", lambda e: e["speed"]["decode_latency_ms_per_token"])]
        for label, fn in rows:
            lines.append(f"| {label} | " + " | ".join(_fmt(fn(e)) for e in eff.values()) + " |")
    sim = ev.get("hidden_similarity")
    if sim:
        lines += ["", "## Hidden-state similarity to dense (mean cosine, last hidden state)", ""]
        lines += [f"- {m}: {_fmt(v[-1], 4)} (lowest {_fmt(min(v), 4)} at hidden state {v.index(min(v))})" for m, v in sim.items()]
    return lines


def _suite_headline(ev: dict) -> tuple[dict, dict] | None:
    """Perplexity per model state from the evaluation suite's first record, and that record."""
    first = {m: ev[m]["perplexity"][0] for m in MODELS if (ev.get(m) or {}).get("perplexity")}
    if not first:
        return None
    return {m: r["ppl"] for m, r in first.items()}, next(iter(first.values()))


def recovery_line(rec: dict) -> str:
    """How the cut model was recovered, in one line: mode, steps, and the distillation's teacher and loss."""
    line = f"{rec.get('mode')}, {rec.get('steps')} steps"
    d = rec.get("distillation")
    if d:
        held = f" (held in {d['dtype']})" if d.get("dtype") else ""  # records before distillation.dtype lack it
        line += (f"; distillation from {d['teacher']}{held}: {d['alpha']} x {d['loss']} (T={d['temperature']}"
                 f"{', + hidden-state MSE' if d.get('hidden') else ''}) + {1 - d['alpha']:.2g} x next-token CE")
    return line


def source_line(source: dict) -> str:
    """How the model was loaded, in one line: the format, and for GGUF the file, its quantization and the dtype."""
    if source.get("format") == "gguf":
        return (f"GGUF file `{source.get('gguf_file')}` ({source.get('quantization') or 'unknown'} quantization), "
                f"dequantized to {source.get('dtype')}")
    return f"{source.get('format')} `{source.get('value')}` in {source.get('dtype')}"


def render_markdown(report: dict) -> str:
    """A short human-readable summary of a run report."""
    ppl = report.get("ppl", {})
    plan = report.get("plan", {})
    cal = report.get("calibration", {})
    warn = overlap_warning(report)
    lines = [
        "# prunelight report",
        "",
        *([warn, ""] if warn else []),
        f"Model: `{report.get('model', 'n/a')}`  ",
        *([f"Loaded from: {source_line(report['source'])}  "] if report.get("source") else []),
        *([f"Criterion: `{cal.get('criterion')}`, allocation: `{cal.get('allocation')}`, target ratio: {cal.get('ratio')}  "] if cal else []),
        *([f"Recovery: {recovery_line(report['recovery'])}  "] if report.get("recovery") else []),
    ]
    eval_line = (f"Evaluation: `{report.get('eval', {}).get('source')}`, "
                 f"{report.get('eval', {}).get('seq_len')} tokens per window")
    suite = _suite_headline(report.get("evaluation") or {})
    if suite and not any(ppl.get(m) is not None for m in MODELS):
        # The callbacks' own perplexity was off because the evaluation suite measures it: show its first set.
        ppl, rec = suite
        eval_line = (f"Evaluation: {rec['dataset']} `{rec.get('source') or rec.get('split')}`, {rec['seq_len']} tokens "
                     f"per window ({_fmt(rec['tokens'])} tokens; the first perplexity set of the evaluation below)")
    if plan or ppl:
        lines += [
            f"Calibration: {cal.get('samples')} samples x {cal.get('seq_len')} tokens from `{cal.get('source')}` (seed {cal.get('seed')})  ",
            eval_line,
            "",
            "| | params | perplexity |",
            "|---|---:|---:|",
            f"| dense | {_fmt(report.get('params_before'))} | {_fmt(ppl.get('dense'))} |",
            f"| pruned | {_fmt(report.get('params_after'))} | {_fmt(ppl.get('pruned'))} |",
            f"| recovered | {_fmt(report.get('params_after'))} | {_fmt(ppl.get('recovered'))} |",
        ]
    if plan:
        lines += [
            "",
            f"Removed {_fmt(plan.get('params_removed'))} parameters = {100 * plan.get('removed_fraction_total', 0):.2f}% of the "
            f"model, {100 * plan.get('removed_fraction_decoder', 0):.2f}% of the decoder layers "
            f"(target {_fmt(plan.get('params_target_removed'))}; off by {_fmt(plan.get('budget_error_params'))}).",
        ]
        goal = plan.get("target")
        if goal:  # a deployment target (prune.target_*) and what was met
            met = goal["met"]
            lines.append(f"Target `{goal['option']}={goal['text']}` ({goal['unit']}): {_fmt(goal['achieved'])} "
                         f"{'<=' if goal['within_target'] else '>'} {_fmt(round(goal['value']))}; parameters after "
                         f"{_fmt(met['params_after'])}, weights {_fmt(met['weight_bytes_after'])} B and KV cache "
                         f"{_fmt(met['kv_bytes_per_token_after'])} B per token at {met['bytes_dtype']}.")
        for key, what in (("plan_source", "Plan applied from"), ("scores_source", "Re-allocated from scores")):
            if cal.get(key):
                lines.append(f"{what} `{cal[key]}` (no scoring pass).")
    # Layer importance is measured on the dense layers; after depth pruning the kept layers are fewer.
    imp = {k: v for k, v in (report.get("layer_importance") or {}).items()
           if isinstance(v, list) and len(v) == len(report.get("layers", []))}
    if report.get("layers"):
        lines += ["", "| layer | attention heads | KV heads | MLP channels |" + "".join(f" {k} |" for k in imp),
                  "|---:|---:|---:|---:|" + "---:|" * len(imp)]
    for i, layer in enumerate(report.get("layers", [])):
        lines.append(
            f"| {i} | {layer['num_attention_heads']} | {layer['num_key_value_heads']} | {layer['intermediate_size']} |"
            + "".join(f" {_fmt(v[i], 4)} |" for v in imp.values())
        )
    for note in report.get("notes", []):
        lines += ["", f"Note: {note}"]
    lines += _evaluation_sections(report.get("evaluation") or {})
    figs = report.get("figures") or {}
    if figs:
        lines += ["", "## Figures", ""] + [f"![{name}]({fname})" for name, fname in figs.items()]
    times = report.get("times_s", {})
    if times:
        lines += ["", "Wall times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())]
    if report.get("export_dir"):
        fmt = report.get("export_format")
        lines += ["", f"Exported model: `{report['export_dir']}`" + (f" (format `{fmt}`)" if fmt else "")]
        if report.get("engines_verified"):
            lines.append(f"Engines this format is verified in (prunelight's serving check, scripts/serve_check.py): "
                         f"{'; '.join(report['engines_verified'])}")
    if report.get("export_gguf"):
        lines += ["", f"GGUF (llama.cpp): `{report['export_gguf']}`"]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """Write report.json and report.md atomically into `out_dir`."""
    out_dir = Path(out_dir)
    slim = {k: v for k, v in report.items() if k != "unit_scores"}
    js = atomic_write_json(out_dir / "report.json", slim)
    md = atomic_write_text(out_dir / "report.md", render_markdown(slim))
    if "unit_scores" in report:
        atomic_write_json(out_dir / "unit_scores.json", report["unit_scores"])
    return js, md
