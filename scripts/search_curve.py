"""What `allocation: search` reaches against its budget, and what the same search would cost on an 8B model.

Reads the rows `scripts/benchmark_search.py` wrote (results/benchmarks/search_smollm2*.json) and writes
results/benchmarks/search_curve.{md,png}: the calibration KL of the best candidate after each generation against the
search's wall time and the calibration tokens it forwarded, per ratio, and a computed estimate for Llama-3-8B on one
H100. The estimate scales each measured phase by its arithmetic (no GPU was measured):

- fitness forwards: tokens x 2 x (decoder parameters x the share of decoder layers the row ran, the rest being kept
  prefixes, + the output head), at an assumed sustained bf16 rate (`--gpu-tflops`);
- the database's dense pass: the same for its calibration tokens, plus the Grams (tokens x sum of squared widths);
- structured OBS's removal orders: removals x width^2 x 4 flops per sub-block (one Schur update each), in fp64
  (`--gpu-fp64-tflops`);
- the refits the candidates read (an upper bound: every offspring derives 2 x `moves` = 6 new MLP levels, each a
  solve of kept^3 / 3 + hidden x kept^2 flops in fp64; the database's cache serves repeats).

    python scripts/search_curve.py results/benchmarks/search_smollm2.json results/benchmarks/search_smollm2_hi.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Llama-3-8B: 32 layers, hidden 4096, MLP 14336, 8 KV groups of 4 query heads, head_dim 128, vocabulary 128256.
LLAMA3_8B = {"params": 8.03e9, "layers": 32, "hidden": 4096, "mlp": 14336, "groups": 8, "vocab": 128256, "tied": False}
SMOLLM2 = {"params": 134.5e6, "layers": 30, "hidden": 576, "mlp": 1536, "groups": 3, "vocab": 49152, "tied": True}


def forward_flops(m: dict, layer_share: float = 1.0) -> float:
    """Flops per token of a forward that runs `layer_share` of the decoder layers and the whole output head."""
    head = m["vocab"] * m["hidden"]
    decoder = m["params"] - head * (1 if m["tied"] else 2)  # the input embedding is a lookup
    return 2 * (decoder * layer_share + head)


def layer_share(row: dict) -> float:
    """The share of decoder layers the row's fitness ran (1 for rows written before kept prefixes)."""
    s = row["search"]
    if not s.get("layers_run") or not s.get("layers") or not s.get("forwards"):
        return 1.0
    return s["layers_run"] / (s["forwards"] * s["layers"])


def search_rows(paths: list[Path]) -> list[dict]:
    """Every search row (with its trajectory) of the given benchmark JSON files."""
    rows = []
    for p in paths:
        data = json.loads(p.read_text())
        seq_len = int(data["meta"]["calibration"].split(" x ")[1].split()[0])
        for r in data["rows"]:
            if r["row"].startswith("search") and "search" in r:
                rows.append({**r, "seq_len": seq_len, "dense_ppl": data["meta"]["dense_ppl"]})
    return rows


def obs_flops(m: dict, removed_share: float) -> float:
    """Structured OBS's greedy removal orders for every MLP of a model: removals x width^2 x 4 (fp64)."""
    n = m["mlp"]
    return m["layers"] * removed_share * n * n * n * 4


def estimate(row: dict, gpu_tflops: float, fp64_tflops: float, target: dict = LLAMA3_8B) -> dict:
    """Seconds of each phase for `target` on one GPU, from the row's measured work (see the module docstring)."""
    tokens = row["search"]["forwards"] * row["seq_len"]
    share = layer_share(row)
    search_flops = tokens * forward_flops(target, share)
    db_tokens = 64 * row["seq_len"]  # the database's dense pass reads the calibration set once
    db_flops = db_tokens * (2 * target["params"] + 2 * target["layers"] * (target["hidden"] ** 2 + target["mlp"] ** 2))
    obs = obs_flops(target, min(1.0, 1.5 * row["ratio"] * 1.25)) if row["row"] == "search_obs" else 0.0
    candidates = (len(row["search"]["trajectory"]) - 1) * row.get("offspring", 8) + len(row["search"]["seeds_kl"])
    kept = target["mlp"] * (1 - row["ratio"])
    refit_flops = candidates * 6 * (kept ** 3 / 3 + target["hidden"] * kept ** 2)
    # the measured CPU rate of the same search on SmolLM2 (what the CPU spent per forwarded token)
    cpu_rate = tokens * forward_flops(SMOLLM2, share) / max(row["times_s"]["search"], 1e-9)
    return {"tokens": tokens, "search_s": search_flops / (gpu_tflops * 1e12),
            "database_s": db_flops / (gpu_tflops * 1e12) + obs / (fp64_tflops * 1e12),
            "refits_s": refit_flops / (fp64_tflops * 1e12),
            "cpu_gflops_measured": cpu_rate / 1e9, "layer_share": share}


def plot(rows: list[dict], path: Path) -> None:
    """Best KL after each generation against seconds of search, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        t = r["search"]["trajectory"]
        label = f"{r['row']} {r['ratio']:.0%} ({r.get('variant') or '-'})"
        per_gen = r["search"]["forwards"] * r["seq_len"] / max(len(t) - 1, 1)
        ax[0].plot([p["seconds"] for p in t], [p["kl"] for p in t], marker=".", label=label)
        ax[1].plot([p["generation"] * per_gen / 1e3 for p in t], [p["kl"] / t[0]["kl"] for p in t], marker=".",
                   label=label)
    ax[0].set(xlabel="search wall time (s; 1 thread, CPU shared with other jobs)", ylabel="calibration KL of the best candidate")
    ax[1].set(xlabel="calibration tokens forwarded (thousands)", ylabel="KL / KL of the best seed")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    """Write the curve and the estimate table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--gpu-tflops", type=float, default=350.0,
                   help="sustained bf16 rate of one H100 for batched forwards (about 35%% of its dense peak)")
    p.add_argument("--gpu-fp64-tflops", type=float, default=30.0, help="sustained fp64 rate (OBS's updates)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks" / "search_curve")
    args = p.parse_args(argv)
    rows = search_rows(args.results)
    if not rows:
        raise SystemExit(f"no search rows in {[str(r) for r in args.results]}")
    plot(rows, args.out.with_suffix(".png"))
    lines = ["# allocation search: quality against budget, and an 8B estimate", "",
             f"From {', '.join(str(r) for r in args.results)}; figure: {args.out.with_suffix('.png').name}. "
             f"Estimate for Llama-3-8B on one H100 at {args.gpu_tflops:g} TFLOP/s bf16 and {args.gpu_fp64_tflops:g} "
             "TFLOP/s fp64 (computed from the work each row did, not measured).", "",
             "| row | ratio | generations | KL: best seed -> end | tokens forwarded | layers run | search s (CPU) | "
             "CPU GFLOP/s | 8B: database s | 8B: search forwards s | 8B: refits s (bound) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = r["search"]["trajectory"]
        e = estimate(r, args.gpu_tflops, args.gpu_fp64_tflops)
        lines.append(f"| {r['row']} ({r.get('variant') or '-'}) | {r['ratio']:.0%} | {len(t) - 1} | "
                     f"{t[0]['kl']:.4f} -> {t[-1]['kl']:.4f} | {e['tokens']:,} | {e['layer_share']:.0%} | "
                     f"{r['times_s']['search']:.0f} | "
                     f"{e['cpu_gflops_measured']:.1f} | {e['database_s']:.0f} | {e['search_s']:.0f} | "
                     f"{e['refits_s']:.0f} |")
    text = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
