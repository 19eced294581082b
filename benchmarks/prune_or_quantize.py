"""Prune, quantize or both? The default cut recovered with 200 LoRA steps against the dense model, in llama.cpp.

SmolLM2-135M-Instruct (../shared). Each cut is the user's command, `prunelight fit --config configs/smollm2.yaml
--trainer.max_steps 200 --prune.ratio R --prune.align_channels 32` (the default search, its repair and model tuning,
then 200 LoRA steps of 4 x 128 tokens of English prose, merged; channels aligned to 32 so Q8_0 / Q4_0 blocks fit),
written as GGUF in F16, Q8_0 and Q4_0 beside the dense model in the same types. Every file is measured in llama.cpp:
perplexity on WikiText-2 test windows, file size, prompt and generation tokens/s (2 threads; every file is timed
in turn, over several rounds, and each figure is the median of all its runs).

Three phases over one work folder (each can be rerun alone; finished runs and files are kept):

    PRUNELIGHT_SHARED=../shared python -m benchmarks prune_or_quantize cut --work /tmp/pq --ratios 0.2 0.3 0.5
    python -m benchmarks prune_or_quantize gguf --work /tmp/pq
    # run alone (timing): perplexity, size and speed of every file
    python -m benchmarks prune_or_quantize measure --work /tmp/pq

Needs PRUNELIGHT_LLAMA_NODE (see prunelight/llama_cpp.py) for `measure`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prunelight import bench
from prunelight.llama_cpp import SMOLLM2, WIKITEXT, run_llama_cpp, token_windows

WRITES = ("results/benchmarks/prune_or_quantize_smollm2.{json,md,png} (README.md, \"Prune or quantize?\"; "
          "docs/benchmarks.md)")
ROOT = Path(__file__).resolve().parents[1]
TYPES = ("f16", "q8_0", "q4_0")
STEPS = 200


def cut_dir(work: Path, ratio: float) -> Path:
    """The output folder of the cut at `ratio`."""
    return work / f"cut{round(ratio * 100)}"


def cut(work: Path, ratios: list[float], config: str) -> None:
    """One `prunelight fit` per ratio (skipped when its model folder exists), its log beside it."""
    for ratio in ratios:
        out = cut_dir(work, ratio)
        if (out / "model" / "config.json").is_file() and (out / "report.json").is_file():
            continue
        cmd = [sys.executable, "-m", "prunelight", "fit", f"--config={config}", f"--trainer.max_steps={STEPS}",
               f"--prune.ratio={ratio}", "--prune.align_channels=32", f"--export.out_dir={out}",
               "--export.figures=false", "--trainer.enable_progress_bar=false"]
        t0 = time.perf_counter()
        with open(out.with_suffix(".log"), "w") as f:
            done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
        if done.returncode:
            raise SystemExit(f"the cut at {ratio:g} failed ({done.returncode}); see {out.with_suffix('.log')}")
        print(f"cut {ratio:g}: {time.perf_counter() - t0:.0f} s", flush=True)


def models(work: Path) -> dict[str, dict]:
    """name -> {"path", "ratio", "ppl"} of the dense model and every finished cut in `work`."""
    found = {"dense": {"path": SMOLLM2, "ratio": 0.0}}
    for out in sorted(work.glob("cut*")):
        if (out / "report.json").is_file():
            report = json.loads((out / "report.json").read_text())
            removed = 1 - report["params_after"] / report["params_before"]
            found[out.name] = {"path": str(out / "model"), "ratio": round(removed, 3), "ppl": report["ppl"]}
    return found


def gguf(work: Path) -> None:
    """Every model written in every type (files already there are kept); facts.json: parameters and file sizes."""
    facts_path = work / "facts.json"
    facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
    source = bench.gguf_file(SMOLLM2)
    for name, m in models(work).items():
        if name in facts and all((work / f"{name}.{t}.gguf").is_file() for t in TYPES):
            continue
        model = bench.load_model(m["path"], trust_remote_code=True) if name != "dense" else bench.load_model(SMOLLM2)
        facts[name] = {**m, "params": bench.count_params(model), "file_bytes": {}}
        for dtype in TYPES:
            path = bench.write_gguf(model, work / f"{name}.{dtype}.gguf", dtype, source_gguf=source)
            facts[name]["file_bytes"][dtype] = path.stat().st_size
        print(name, facts[name]["params"], flush=True)
        tmp = facts_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(facts, indent=1))
        tmp.replace(facts_path)
        del model


def measure(work: Path, windows: int, window_len: int, runs: int, rounds: int, prompt_len: int, new_tokens: int,
            out: Path) -> None:
    """Perplexity, file size, prompt and generation tokens/s of every file; the table, JSON and figure."""
    facts = json.loads((work / "facts.json").read_text())
    tokenizer = bench.load_tokenizer(SMOLLM2)
    text = WIKITEXT.read_text(encoding="utf-8")
    wins = token_windows(tokenizer, text, windows, window_len)
    prompt = token_windows(tokenizer, text, 1, prompt_len)[0]
    load = os.getloadavg()[0]
    paths = {(name, dtype): work / f"{name}.{dtype}.gguf" for name in facts for dtype in TYPES}
    rows = {}
    for (name, dtype), path in paths.items():
        got = run_llama_cpp({"model": str(path), "threads": 2, "perplexity": {"windows": wins}})
        rows[name, dtype] = {"model": name, "ratio": facts[name]["ratio"], "type": dtype,
                             "params": facts[name]["params"], "file_mb": path.stat().st_size / 2**20,
                             "ppl": got["perplexity"]["ppl"], "prompt_runs": [], "gen_runs": []}
    # The host's speed drifts over minutes (one file measured twice, minutes apart, differed by up to 60%): every
    # round takes each file in turn, so a slow spell touches every file, and each file's figure is the median of
    # all its rounds' runs.
    for i in range(rounds):
        for key, path in paths.items():
            got = run_llama_cpp({"model": str(path), "threads": 2,
                                 "speed": {"prompt": prompt, "new_tokens": new_tokens, "runs": runs}})
            rows[key]["prompt_runs"] += got["speed"]["prompt_runs"]
            rows[key]["gen_runs"] += got["speed"]["gen_runs"]
        print(f"round {i + 1}/{rounds} done", flush=True)
    rows = list(rows.values())
    for r in rows:
        r["prompt_tps"] = statistics.median(r["prompt_runs"])
        r["gen_tps"] = statistics.median(r["gen_runs"])
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("_runs")}), flush=True)
    bench.add_speedups(rows, {"prompt": "prompt_tps", "gen": "gen_tps"}, lambda r: r["model"] == "dense", ("type",))
    date = time.strftime("%Y-%m-%d", time.gmtime())
    meta = {"model": SMOLLM2, "recovery": f"{STEPS} LoRA steps (configs/smollm2.yaml)", "windows": windows,
            "window_len": window_len, "runs": runs, "rounds": rounds, "prompt_tokens": prompt_len,
            "new_tokens": new_tokens,
            "engine": got["llama_cpp"], "threads": 2, "load_before": load, "date": date}
    bench.write_results(out / "prune_or_quantize_smollm2", {"meta": meta, "rows": rows},
                        markdown(meta, rows))
    figure(rows, out / "prune_or_quantize_smollm2.png")


def markdown(meta: dict, rows: list[dict]) -> str:
    """One table: every model in every type, against the dense model in the same type."""
    lines = ["# Prune, quantize or both? SmolLM2-135M in llama.cpp", "",
             f"The default cut (`prunelight fit --config configs/smollm2.yaml --trainer.max_steps {STEPS} "
             "--prune.ratio R --prune.align_channels 32`: search, repair, model tuning, then "
             f"{STEPS} LoRA steps, merged) against the dense model. llama.cpp {meta['engine']['release']} "
             f"(node-llama-cpp 3.21.1), CPU, {meta['threads']} threads; perplexity over {meta['windows']} x "
             f"{meta['window_len']} tokens of WikiText-2 test; prompt {meta['prompt_tokens']} tokens in one batch, "
             f"then {meta['new_tokens']} generated, median of {meta['rounds']} rounds x {meta['runs']} runs "
             "(each round takes every file in turn, a warm-up run before each file's), load average "
             f"{meta['load_before']:.2f} before the first, {meta['date']}.", "",
             "`python -m benchmarks prune_or_quantize cut --work W && python -m benchmarks prune_or_quantize gguf "
             "--work W && python -m benchmarks prune_or_quantize measure --work W`", "",
             "| model | type | params | file MB | perplexity | prompt tok/s | gen tok/s | prompt vs dense | gen vs dense |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["ratio"], -r["file_mb"])):
        label = "dense" if r["model"] == "dense" else f"{r['ratio']:.0%} cut + {STEPS} LoRA steps"
        lines.append(f"| {label} | {r['type'].upper()} | {r['params'] / 1e6:.1f}M | {r['file_mb']:.0f} | "
                     f"{r['ppl']:.2f} | {r['prompt_tps']:.0f} | {r['gen_tps']:.1f} | {r['prompt_speedup']:.2f}x | "
                     f"{r['gen_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path) -> None:
    """Perplexity vs prompt throughput: one line per GGUF type through the dense model and the cuts."""
    fig, ax = bench.pyplot().subplots(figsize=(7, 4.5))
    for dtype, marker in zip(TYPES, "osD"):
        mine = sorted((r for r in rows if r["type"] == dtype), key=lambda r: r["ratio"])
        line, = ax.plot([r["prompt_tps"] for r in mine], [r["ppl"] for r in mine], "-" + marker,
                        label=dtype.upper())
        for r in mine:
            ax.annotate("dense" if r["model"] == "dense" else f"{r['ratio']:.0%}", (r["prompt_tps"], r["ppl"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens/s in llama.cpp (2 CPU threads)")
    ax.set_ylabel("perplexity in llama.cpp (WikiText-2 test)")
    ax.set_title(f"SmolLM2-135M: default cut + {STEPS} LoRA steps\nagainst the dense model, per GGUF type", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    bench.save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    """Run one phase."""
    ap = bench.parser(__doc__, __file__)
    ap.add_argument("phase", choices=("cut", "gguf", "measure"))
    ap.add_argument("--work", required=True)
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.3, 0.5])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per file per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over every file (each speed is the median of all)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default=str(bench.RESULTS))
    args = ap.parse_args(argv)
    for flag, value in (("--runs", args.runs), ("--rounds", args.rounds)):
        if value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.phase == "cut":
        if bench.shared_path() is None:
            raise SystemExit("the shared data folder is missing: set PRUNELIGHT_SHARED (the config reads the model "
                             "and text from it)")
        cut(work, args.ratios, args.config)
    elif args.phase == "gguf":
        gguf(work)
    else:
        measure(work, args.windows, args.window_len, args.runs, args.rounds, args.prompt_len, args.new_tokens,
                Path(args.out_dir))


if __name__ == "__main__":
    main()
