"""SmolLM2 in llama.cpp: speed of pruned GGUF exports, and pruned-or-quantized at equal file size.

Three phases over one work folder (GGUF files are kept there, so each phase can be rerun alone):

    # 1. cuts + GGUF files (shared CPU): dense and per-layer 20/30/50% cuts (prunelight's global allocation of FLAP
    #    scores, channels aligned to 32, the run's least-squares repair, 64 x 128 calibration tokens of the shipped
    #    text) in every GGUF
    #    type; uniform 20/30% cuts (every layer 1024 / 768 of 1536 channels, FLAP-ranked) in f16 and q8_0.
    #    Files already in the work folder are kept.
    python -m benchmarks llama_cpp build --work /tmp/llama-bench
    # 2. perplexity in llama.cpp vs file size (WikiText-2 test windows): results/benchmarks/llama_cpp_size_quality.*
    python -m benchmarks llama_cpp quality --work /tmp/llama-bench --windows 8
    # 3. speed, run alone: prompt and generation tokens/s, 2 threads, median of 5: results/benchmarks/llama_cpp_speed.*
    flock -x /tmp/prunelight-cpu.lock python -m benchmarks llama_cpp speed --work /tmp/llama-bench

Needs PRUNELIGHT_LLAMA_NODE (see prunelight/llama_cpp.py).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch

import prunelight
from prunelight import bench
from prunelight.llama_cpp import SMOLLM2, WIKITEXT, calibration_batches, run_llama_cpp, token_windows
from prunelight.testing import sized_plan

WRITES = ("results/benchmarks/llama_cpp_size_quality.{json,md,png} and llama_cpp_speed.{json,md} (README.md, "
          "\"llama.cpp\"; docs/gguf.md)")
GGUF_TYPES = bench.GGUF_TYPES
DEFAULT_CUTS = {"perlayer20": 0.2, "perlayer30": 0.3, "perlayer50": 0.5}
UNIFORM_CUTS = {"uniform20": 1024, "uniform30": 768}  # MLP channels kept per layer (of 1536): 19.7% / 29.6%
SPEED_MODELS = ("dense", "uniform20", "uniform30", "perlayer20", "perlayer30")
SPEED_TYPES = ("f16", "q8_0")
CALIBRATION_SAMPLES = 64
CUTS = (f"prunelight's global allocation of FLAP scores (align_channels 32, the run's least-squares repair, no "
        f"recovery) on {CALIBRATION_SAMPLES} x 128 calibration tokens of the shipped text")


def build(work: Path) -> None:
    """Cut SmolLM2 every way and write each model in every GGUF type; facts.json records parameters and shapes."""
    dense = bench.load_model(SMOLLM2, dtype=torch.float32)
    tokenizer = bench.load_tokenizer(SMOLLM2)
    source_gguf = bench.gguf_file(SMOLLM2)
    batches = calibration_batches(tokenizer, samples=CALIBRATION_SAMPLES)
    facts = json.loads((work / "facts.json").read_text()) if (work / "facts.json").is_file() else {}
    if facts.get("cuts") not in (None, CUTS):  # files cut another way: start again
        facts = {}
    facts["cuts"] = CUTS
    flap = prunelight.score(dense, prunelight.PruneSettings(criterion="flap", allocation="global",
                                                            reconstruct="none"), batches).unit_scores
    models = {"dense": lambda m: None}
    for name, ratio in DEFAULT_CUTS.items():
        models[name] = lambda m, r=ratio: prunelight.prune(m, prunelight.PruneSettings(
            ratio=r, criterion="flap", allocation="global", reconstruct="least_squares", align_channels=32), batches)
    for name, chans in UNIFORM_CUTS.items():
        models[name] = lambda m, c=chans: prunelight.apply_plan(m, sized_plan(
            m, [s["num_key_value_heads"] for s in bench.layer_shapes(m)], [c] * len(m.model.layers), flap))
    for name, cut in models.items():
        types = GGUF_TYPES if name in ("dense", *DEFAULT_CUTS) else SPEED_TYPES
        if name in facts and all((work / f"{name}.{dtype}.gguf").is_file() for dtype in types):
            continue
        model = copy.deepcopy(dense)
        cut(model)
        facts[name] = {"params": bench.count_params(model), "shapes": bench.layer_shapes(model)}
        for dtype in types:
            path = bench.write_gguf(model, work / f"{name}.{dtype}.gguf", dtype, source_gguf=source_gguf)
            facts[name].setdefault("file_bytes", {})[dtype] = path.stat().st_size
        print(name, facts[name]["params"], flush=True)
        (work / "facts.json").write_text(json.dumps(facts, indent=1))
        del model


def quality(work: Path, windows: int, window_len: int, out: Path) -> None:
    """Perplexity in llama.cpp of every file vs its size; JSON, Markdown and the PNG figure."""
    facts = json.loads((work / "facts.json").read_text())
    tokenizer = bench.load_tokenizer(SMOLLM2)
    wins = token_windows(tokenizer, WIKITEXT.read_text(encoding="utf-8"), windows, window_len)
    rows = []
    for name in ("dense", *DEFAULT_CUTS):
        for dtype in GGUF_TYPES:
            path = work / f"{name}.{dtype}.gguf"
            got = run_llama_cpp({"model": str(path), "threads": 2, "perplexity": {"windows": wins}})
            rows.append({"model": name, "type": dtype, "params": facts[name]["params"],
                         "file_mb": path.stat().st_size / 2**20, "ppl": got["perplexity"]["ppl"]})
            print(json.dumps(rows[-1]), flush=True)
    meta = {"model": SMOLLM2, "text": WIKITEXT.name, "windows": windows, "window_len": window_len,
            "engine": got["llama_cpp"], "cuts": facts.get("cuts", CUTS)}
    lines = ["# Pruned or quantized? SmolLM2 in llama.cpp", "",
             f"Perplexity in llama.cpp ({got['llama_cpp']['release']}, node-llama-cpp 3.21.1) over {windows} x "
             f"{window_len} tokens of WikiText-2 test vs GGUF file size. Cuts: {meta['cuts']}.", "",
             "`python -m benchmarks llama_cpp build --work W && python -m benchmarks llama_cpp "
             f"quality --work W --windows {windows}`", "",
             "| model | params | " + " | ".join(GGUF_TYPES) + " |", "|---|---|" + "---|" * len(GGUF_TYPES)]
    for name in ("dense", *DEFAULT_CUTS):
        cells = [f"{r['ppl']:.2f} ({r['file_mb']:.0f} MB)" for r in rows if r["model"] == name]
        lines.append(f"| {name} | {facts[name]['params'] / 1e6:.1f}M | " + " | ".join(cells) + " |")
    bench.write_results(out / "llama_cpp_size_quality", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    figure(rows, out / "llama_cpp_size_quality.png")


def figure(rows: list[dict], path: Path) -> None:
    """Perplexity vs file size: one line per model (its types), one marker per type."""
    fig, ax = bench.pyplot().subplots(figsize=(7, 4.5))
    markers = dict(zip(GGUF_TYPES, "osD^v"))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == name), key=lambda r: r["file_mb"])
        line, = ax.plot([r["file_mb"] for r in mine], [r["ppl"] for r in mine], "-", alpha=0.6, label=name)
        for r in mine:
            ax.plot(r["file_mb"], r["ppl"], markers[r["type"]], color=line.get_color())
    for dtype, m in markers.items():
        ax.plot([], [], m, color="gray", label=dtype)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GGUF file size (MB)")
    ax.set_ylabel("perplexity in llama.cpp (WikiText-2 test)")
    ax.set_title("SmolLM2-135M: pruned vs quantized at equal file size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    bench.save_figure(fig, path, dpi=120)


def speed(work: Path, runs: int, prompt_len: int, new_tokens: int, out: Path) -> None:
    """Prompt and generation tokens/s in llama.cpp (2 threads, median of `runs`), speed-up vs the ideal ratio."""
    facts = json.loads((work / "facts.json").read_text())
    tokenizer = bench.load_tokenizer(SMOLLM2)
    prompt = token_windows(tokenizer, WIKITEXT.read_text(encoding="utf-8"), 1, prompt_len)[0]
    rows = []
    load = os.getloadavg()[0]  # the machine's load before the first run: the figures' conditions
    for dtype in SPEED_TYPES:
        for name in SPEED_MODELS:
            got = run_llama_cpp({"model": str(work / f"{name}.{dtype}.gguf"), "threads": 2,
                                 "speed": {"prompt": prompt, "new_tokens": new_tokens, "runs": runs}})
            rows.append({"model": name, "type": dtype, "params": facts[name]["params"], **got["speed"]})
            print(json.dumps(rows[-1]), flush=True)
    bench.add_speedups(rows, {"prompt": "prompt_tps", "gen": "gen_tps"}, lambda r: r["model"] == "dense", ("type",))
    meta = {"model": SMOLLM2, "threads": 2, "runs": runs, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
            "engine": got["llama_cpp"], "conditions": "CPU, 2 threads, median of the runs after one warm-up run; "
            f"load average {load:.2f} before the first run; {time.strftime('%Y-%m-%d', time.gmtime())}"}
    lines = ["# SmolLM2 in llama.cpp: speed of pruned exports", "",
             f"llama.cpp {got['llama_cpp']['release']} (node-llama-cpp 3.21.1), CPU, 2 threads, median of {runs} "
             f"runs after a warm-up run, load average {load:.2f} before the first run, "
             f"{time.strftime('%Y-%m-%d', time.gmtime())}; prompt {prompt_len} tokens in one batch, then {new_tokens} generated tokens. "
             "Ideal: dense parameters / the model's.", "",
             f"`python -m benchmarks llama_cpp speed --work W --runs {runs}` (run it alone: other processes on "
             "the cores distort it)",
             "", "| model | type | params | prompt tok/s | gen tok/s | prompt speed-up | gen speed-up | ideal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['type']} | {r['params'] / 1e6:.1f}M | {r['prompt_tps']:.0f} | "
                     f"{r['gen_tps']:.1f} | {r['prompt_speedup']:.2f}x | {r['gen_speedup']:.2f}x | "
                     f"{r['ideal_speedup']:.2f}x |")
    bench.write_results(out / "llama_cpp_speed", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Run one phase."""
    ap = bench.parser(__doc__, __file__)
    ap.add_argument("phase", choices=("build", "quality", "speed"))
    ap.add_argument("--work", required=True)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default=str(bench.RESULTS))
    args = ap.parse_args(argv)
    work, out = Path(args.work), Path(args.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.phase == "build":
        build(work)
    elif args.phase == "quality":
        quality(work, args.windows, args.window_len, out)
    else:
        speed(work, args.runs, args.prompt_len, args.new_tokens, out)


if __name__ == "__main__":
    main()
