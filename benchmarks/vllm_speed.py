"""Prefill and decode tokens/s in vLLM: dense vs pruned SmolLM2 (stock, nemotron_nas, nemotron_nas with aligned widths).

Each pruned folder is cut from the dense float32 folder by weight magnitude (speed depends on shapes, not on
which units go; the layout choices are those of a real run: stock = one shape, nemotron_nas = free MLP widths
with one GQA group count, aligned = the same with `align_channels`), exported by prunelight, then served by
vLLM (its own environment, float32, eager) in a fresh engine per folder: one warm-up, then `--repeats` timed
runs of a prefill-only request (1 output token) and a decode request (`--decode-tokens`); decode time is the
decode request less its prefill. Medians; speedup vs dense and the ideal (params_dense / params_pruned).
Run it ALONE on the machine (other processes change the figures); ~15 min on 2 cores:

    OMP_NUM_THREADS=1 python -m benchmarks vllm_speed --dense /path/to/smollm2-f32 --tag cpu

(OMP_NUM_THREADS applies to the pruning here; the vLLM processes get vLLM's own thread binding.)
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import prunelight
from prunelight import bench

WRITES = "results/benchmarks/vllm_speed_<tag>.{json,md} (docs/serving.md, \"Speed in vLLM\")"
VARIANTS = (("stock", 1), ("nemotron_nas", 1), ("nemotron_nas", 64))  # (format, align_channels)


def prune_folder(dense: Path, fmt: str, ratio: float, align: int, out: Path) -> Path:
    """`dense` cut by magnitude to `ratio` for `fmt` (align_channels `align`) and exported to `out`."""
    if (out / "config.json").is_file():
        return out
    model = bench.load_model(dense)
    # the format's shape constraint, as export.format sets it
    prunelight.prune(model, bench.shape_settings(ratio, align_channels=align), export_format=fmt)
    return bench.export(model, out, bench.load_tokenizer(dense), format=fmt)


def n_params(folder: Path) -> int:
    """Parameters stored in a folder's safetensors (tied embeddings once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                total += math.prod(st.get_slice(k).get_shape())
    return total


def time_folder(folder: Path, args, log: Path) -> dict:
    """vLLM timings of one folder (a fresh engine in vLLM's environment)."""
    from prunelight.vllm import run_vllm

    res = run_vllm(args.vllm_python, {"folder": str(folder), "max_model_len": 512,
                                      "speed": {"repeats": args.repeats, "prompt_len": args.prompt_len,
                                                "decode_tokens": args.decode_tokens, "batch": args.batch}}, log)
    runs = res["speed"]
    return {"engine": res["engine"], "architecture": res["architecture"][0], "runs": runs,
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}


def main(argv: list[str] | None = None) -> None:
    """Prune, serve and time every variant; write the JSON and markdown table."""
    ap = bench.parser(__doc__, __file__)
    ap.add_argument("--dense", required=True, help="a float32 Hugging Face folder of the dense model (served as the baseline)")
    ap.add_argument("--ratios", default="0.2,0.3")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vllm-python", default=os.environ.get("PRUNELIGHT_VLLM_PYTHON"), required="PRUNELIGHT_VLLM_PYTHON" not in os.environ)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "vllm_speed"))
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default=str(bench.RESULTS))
    args = ap.parse_args(argv)
    dense, work = Path(args.dense), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folders = [("dense", "-", 0.0, 1, dense)]
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for fmt, align in VARIANTS:
            name = f"{fmt}_{int(round(ratio * 100))}" + (f"_a{align}" if align > 1 else "")
            folders.append((name, fmt, ratio, align, prune_folder(dense, fmt, ratio, align, work / name)))
    rows = []
    for name, fmt, ratio, align, folder in folders:
        t0 = time.time()
        timing = time_folder(folder, args, work / f"{name}.log")
        rows.append({"name": name, "format": fmt, "ratio": ratio, "align_channels": align,
                     "params": n_params(folder), **timing})
        print(f"{name}: prefill {timing['prefill_tok_s']:.0f} tok/s, decode {timing['decode_tok_s']:.1f} tok/s "
              f"({time.time() - t0:.0f} s)", flush=True)
    write(rows, args)


def write(rows: list[dict], args) -> None:
    """results/benchmarks/vllm_speed_<tag>.{json,md}."""
    base = rows[0]
    bench.add_speedups(rows, {"prefill": "prefill_tok_s", "decode": "decode_tok_s"}, lambda r: r is base)
    meta = {"engine": base["engine"], **bench.machine(), **vars(args)}
    lines = [f"# vLLM speed: dense vs pruned SmolLM2-135M ({base['engine']}, float32, eager, CPU)", "",
             f"batch {args.batch} x {args.prompt_len} prompt tokens; decode {args.decode_tokens} tokens; median of "
             f"{args.repeats} runs after one warm-up; a fresh engine per folder. Ideal = params_dense / params_pruned.",
             "", "| folder | format | align | params | prefill tok/s | decode tok/s | prefill x | decode x | ideal x |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['format']} ({r['architecture']}) | {r['align_channels']} | {r['params']:,} | "
                     f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {r['prefill_speedup']:.2f} | "
                     f"{r['decode_speedup']:.2f} | {r['ideal_speedup']:.2f} |")
    bench.write_results(Path(args.out) / f"vllm_speed_{args.tag}", {"settings": meta, "rows": rows},
                        "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
