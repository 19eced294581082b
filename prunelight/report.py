"""report.json and report.md: what was cut, what it cost, and what perplexity did."""

from __future__ import annotations

from pathlib import Path

from prunelight.io import atomic_write_json, atomic_write_text


def _fmt(x, nd: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def render_markdown(report: dict) -> str:
    """A short human-readable summary of a run report."""
    ppl = report.get("ppl", {})
    plan = report.get("plan", {})
    cal = report.get("calibration", {})
    lines = [
        "# prunelight report",
        "",
        f"Model: `{report.get('model', 'n/a')}`  ",
        f"Criterion: `{cal.get('criterion')}`, allocation: `{cal.get('allocation')}`, target ratio: {cal.get('ratio')}  ",
        f"Calibration: {cal.get('samples')} samples x {cal.get('seq_len')} tokens from `{cal.get('source')}` (seed {cal.get('seed')})  ",
        f"Evaluation: `{report.get('eval', {}).get('source')}`, {report.get('eval', {}).get('seq_len')} tokens per window",
        "",
        "| | params | perplexity |",
        "|---|---:|---:|",
        f"| dense | {_fmt(report.get('params_before'))} | {_fmt(ppl.get('dense'))} |",
        f"| pruned | {_fmt(report.get('params_after'))} | {_fmt(ppl.get('pruned'))} |",
        f"| recovered | {_fmt(report.get('params_after'))} | {_fmt(ppl.get('recovered'))} |",
        "",
        f"Removed {_fmt(plan.get('params_removed'))} parameters = {100 * plan.get('removed_fraction_total', 0):.2f}% of the "
        f"model, {100 * plan.get('removed_fraction_decoder', 0):.2f}% of the decoder layers "
        f"(target {_fmt(plan.get('params_target_removed'))}; off by {_fmt(plan.get('budget_error_params'))}).",
        "",
        "| layer | attention heads | KV heads | MLP channels |",
        "|---:|---:|---:|---:|",
    ]
    for i, layer in enumerate(report.get("layers", [])):
        lines.append(
            f"| {i} | {layer['num_attention_heads']} | {layer['num_key_value_heads']} | {layer['intermediate_size']} |"
        )
    times = report.get("times_s", {})
    if times:
        lines += ["", "Wall times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())]
    if report.get("export_dir"):
        lines += ["", f"Exported model: `{report['export_dir']}`"]
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
