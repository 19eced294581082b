"""The sweep's tables, from results.json alone: optimum per model, per-task accuracy of the optima, mean ± std and
best per method, the trend over seq_len, perplexity-vs-accuracy correlation, costs. Markdown and LaTeX (booktabs).

Grouping keys are explicit: a *model* is the value of `model_key` (default model.pretrained), a *method* the
values of `group_by` joined with '/' (default prune.criterion/prune.allocation). Statistics use COMPLETE trials.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

Table = tuple[str, list[str], list[list[str]]]  # title, header, rows


def _complete(results: dict) -> list[dict]:
    return [t for t in results["trials"] if t["state"] == "COMPLETE" and t.get("metrics")]


def model_of(trial: dict, results: dict) -> str:
    """The trial's model, shortened to its folder name."""
    name = trial["params"].get(results.get("model_key", "model.pretrained")) or trial.get("model") or "model"
    return Path(str(name).rstrip("/")).name or str(name)


def method_of(trial: dict, results: dict) -> str:
    """The trial's method: the group_by values joined with '/' (keys not in the space are left out)."""
    keys = [k for k in results.get("group_by") or [] if k in trial["params"]]
    return "/".join(str(trial["params"][k]) for k in keys) or "all"


def lower_is_better(metric: str) -> bool:
    """Perplexities are minimised, accuracies maximised."""
    return "ppl" in metric


def table_metrics(results: dict) -> list[str]:
    """The metrics the per-method and trend tables show: the objective's metric, then zero-shot accuracy if any."""
    obj = results.get("objective") or {}
    first = obj.get("metric") or "objective"
    out = [first]
    if first != "zeroshot_avg" and any("zeroshot_avg" in t["metrics"] for t in _complete(results)):
        out.append("zeroshot_avg")
    return out


def metric_value(trial: dict, metric: str) -> float | None:
    """A metric of a trial ('objective' is the trial's objective value)."""
    return trial.get("value") if metric == "objective" else trial["metrics"].get(metric)


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{min(digits, 1) if abs(x) >= 1000 else digits}f}"


def _varying(results: dict) -> list[str]:
    """Space keys that take more than one value."""
    space = results.get("space") or {}
    return [k for k, v in space.items() if not isinstance(v, list) or len(v) > 1]


def optimum_tables(results: dict) -> list[Table]:
    """The optimal configuration per model, and the per-task zero-shot accuracy of each optimum."""
    obj = results.get("objective") or {}
    maximize = obj.get("direction") == "maximize"
    by_model: dict[str, list[dict]] = defaultdict(list)
    for t in _complete(results):
        by_model[model_of(t, results)].append(t)
    keys = [k for k in _varying(results) if k != results.get("model_key")]
    best_rows, task_rows, tasks = [], [], []
    for model, trials in by_model.items():
        best = (max if maximize else min)(trials, key=lambda t: t["value"])
        m = best["metrics"]
        best_rows.append([model, str(best["number"]), *(str(best["params"].get(k, "")) for k in keys),
                          _fmt(best["value"]), _fmt(m.get("ppl")), _fmt(m.get("zeroshot_avg"))])
        tasks = tasks or sorted(k[len("zeroshot_"):] for k in m if k.startswith("zeroshot_")
                                and k not in ("zeroshot_avg", "zeroshot_dense_avg"))
        if tasks:
            task_rows.append([model, method_of(best, results), *(_fmt(m.get(f"zeroshot_{x}")) for x in tasks),
                              _fmt(m.get("zeroshot_avg"))])
    out: list[Table] = [(f"Optimal configuration per model ({obj.get('describe', 'objective')})",
                         ["model", "trial", *keys, "objective", "ppl", "zero-shot avg"], best_rows)]
    if task_rows:
        out.append(("Zero-shot accuracy per task of each optimum", ["model", "method", *tasks, "average"], task_rows))
    return out


def method_table(results: dict, metric: str) -> Table:
    """Mean ± std (best) of a metric per model and method."""
    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for t in _complete(results):
        v = metric_value(t, metric)
        if v is not None:
            cells[(model_of(t, results), method_of(t, results))].append(v)
    models = list(dict.fromkeys(k[0] for k in cells))
    methods = list(dict.fromkeys(k[1] for k in cells))
    pick = min if lower_is_better(metric) else max
    rows = []
    for model in models:
        row = [model]
        for method in methods:
            vals = cells.get((model, method))
            if not vals:
                row.append("—")
                continue
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            row.append(f"{_fmt(statistics.mean(vals))} ± {_fmt(sd)} ({_fmt(pick(vals))})")
        rows.append(row)
    keys = "/".join(results.get("group_by") or [])
    return (f"{metric}: mean ± std (best) per method ({keys}), over all complete trials of the method",
            ["model", *methods], rows)


def trend(xs: list[float], ys: list[float]) -> str:
    """'rising', 'falling', 'peak at X', 'dip at X' or 'flat', and the least-squares slope's sign."""
    if len(xs) < 2:
        return "one value"
    diffs = [b - a for a, b in zip(ys, ys[1:])]
    if all(d > 0 for d in diffs):
        shape = "rising monotonically"
    elif all(d < 0 for d in diffs):
        shape = "falling monotonically"
    elif all(d == 0 for d in diffs):
        shape = "flat"
    else:
        i_max, i_min = ys.index(max(ys)), ys.index(min(ys))
        shape = f"peak at {xs[i_max]:g}" if 0 < i_max < len(ys) - 1 else f"dip at {xs[i_min]:g}" \
            if 0 < i_min < len(ys) - 1 else "not monotone"
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return f"{shape} (slope {'+' if slope > 0 else '−' if slope < 0 else '0'})"


def seq_len_table(results: dict, metric: str, key: str = "data.seq_len") -> Table | None:
    """Mean of a metric by seq_len per model and method, with the trend."""
    if key not in (results.get("space") or {}):
        return None
    cells: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t in _complete(results):
        v = metric_value(t, metric)
        if v is not None and key in t["params"]:
            cells[(model_of(t, results), method_of(t, results))][float(t["params"][key])].append(v)
    xs_all = sorted({x for c in cells.values() for x in c})
    rows = []
    for (model, method), per in cells.items():
        xs = sorted(per)
        ys = [statistics.mean(per[x]) for x in xs]
        rows.append([model, method, *(_fmt(statistics.mean(per[x])) if x in per else "—" for x in xs_all),
                     trend(xs, ys)])
    return (f"{metric}: mean by {key} (over the other keys)", ["model", "method", *(f"{x:g}" for x in xs_all),
                                                                 "trend"], rows)


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's r (None for fewer than 3 points or no spread)."""
    if len(xs) < 3:
        return None
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sx * sy)


def correlation_table(results: dict, x: str = "ppl", y: str = "zeroshot_avg") -> Table | None:
    """Pearson r between perplexity and zero-shot accuracy per model."""
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in _complete(results):
        if t["metrics"].get(x) is not None and t["metrics"].get(y) is not None:
            per[model_of(t, results)].append((t["metrics"][x], t["metrics"][y]))
    if not per:
        return None
    rows = [[m, str(len(p)), _fmt(pearson([a for a, _ in p], [b for _, b in p]))] for m, p in per.items()]
    return (f"Correlation of {x} and {y} (Pearson r over complete trials)", ["model", "trials", "r"], rows)


def costs_table(results: dict) -> Table:
    """Per trial: state, wall time by phase, peak memory, what it reused."""
    keys = _varying(results)
    rows = []
    for t in results["trials"]:
        if t.get("duplicate_of") is not None:
            continue
        ts = t.get("times_s") or {}
        reuse = t.get("reuse") or {}
        state = t["state"].lower() + (" (stale)" if t.get("stale") else "")
        rows.append([str(t["number"]), state, *(model_of(t, results) if k == results.get("model_key")
                                                 else str(t["params"].get(k, "")) for k in keys),
                     *(_fmt(ts.get(p), 1) if ts.get(p) is not None else "—"
                       for p in ("scoring", "recovery", "evaluation", "wall")),
                     _fmt(t.get("peak_rss_mib"), 0) if t.get("peak_rss_mib") else "—",
                     reuse.get("scores", "—"), reuse.get("dense", "—")])
    return ("Costs per trial (wall seconds; recovery = wall time outside the timed phases, incl. process start; "
            "peak = the trial process's peak RSS)",
            ["trial", "state", *keys, "scoring s", "recovery s", "evaluation s", "wall s", "peak MiB",
             "scores", "dense eval"], rows)


def cost_summary_table(results: dict) -> Table:
    """Per model: trials, total and mean wall time, mean scoring time with and without a score-cache hit, the
    largest peak memory, and how often each cache was hit."""
    per: dict[str, list[dict]] = defaultdict(list)
    for t in results["trials"]:
        if t.get("duplicate_of") is None and t.get("times_s"):
            per[model_of(t, results)].append(t)
    rows = []
    for model, trials in per.items():
        walls = [t["times_s"]["wall"] for t in trials if t["times_s"].get("wall") is not None]

        def mean_scoring(hit: bool) -> str:
            v = [t["times_s"]["scoring"] for t in trials if t["times_s"].get("scoring") is not None
                 and ((t.get("reuse") or {}).get("scores") == "hit") == hit]
            return _fmt(statistics.mean(v), 1) if v else "—"

        peaks = [t["peak_rss_mib"] for t in trials if t.get("peak_rss_mib")]
        hits = {c: sum((t.get("reuse") or {}).get(c) == "hit" for t in trials) for c in ("scores", "dense")}
        rows.append([model, str(len(trials)), _fmt(sum(walls) / 60, 1), _fmt(statistics.mean(walls), 1) if walls
                     else "—", mean_scoring(False), mean_scoring(True), _fmt(max(peaks), 0) if peaks else "—",
                     f"{hits['scores']}/{len(trials)}", f"{hits['dense']}/{len(trials)}"])
    return ("Costs per model (budget a sweep from these)",
            ["model", "trials", "total wall min", "mean wall s", "scoring s (computed)", "scoring s (cache hit)",
             "max peak MiB", "score-cache hits", "dense-cache hits"], rows)


def failures_table(results: dict) -> Table | None:
    """Failed trials with their one-line error."""
    rows = [[str(t["number"]), t.get("error") or "", str(t.get("log") or "")] for t in results["trials"]
            if t["state"] == "FAIL"]
    return ("Failed trials", ["trial", "error", "log"], rows) if rows else None


def all_tables(results: dict) -> list[Table]:
    """Every table, in the order they are written."""
    out = optimum_tables(results)
    for metric in table_metrics(results):
        out.append(method_table(results, metric))
        t = seq_len_table(results, metric)
        if t:
            out.append(t)
    for t in (correlation_table(results), cost_summary_table(results), costs_table(results),
              failures_table(results)):
        if t:
            out.append(t)
    return out


def to_markdown(tables: list[Table]) -> str:
    """Tables as Markdown, each under a '###' heading."""
    lines: list[str] = []
    for title, header, rows in tables:
        lines += [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def _tex(s: str) -> str:
    for a, b in (("\\", "\\textbackslash{}"), ("&", "\\&"), ("%", "\\%"), ("_", "\\_"), ("#", "\\#"),
                 ("±", "$\\pm$"), ("—", "--"), ("−", "$-$")):
        s = s.replace(a, b)
    return s


def to_latex(tables: list[Table]) -> str:
    """Tables as LaTeX booktabs tabulars (needs \\usepackage{booktabs})."""
    out: list[str] = []
    for title, header, rows in tables:
        out += [f"% {title}", "\\begin{table}[t]", "\\centering", f"\\caption{{{_tex(title)}}}",
                "\\begin{tabular}{" + "l" * len(header) + "}", "\\toprule",
                " & ".join(_tex(h) for h in header) + " \\\\", "\\midrule"]
        out += [" & ".join(_tex(c) for c in row) + " \\\\" for row in rows]
        out += ["\\bottomrule", "\\end{tabular}", "\\end{table}", ""]
    return "\n".join(out)
