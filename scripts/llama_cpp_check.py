"""llama.cpp check: the GGUF files prunelight writes run in llama.cpp with transformers' output on the same weights.

SmolLM2-135M-Instruct (the shared Q4_1 GGUF, dequantized to float32) dense, a uniform 20% cut, a per-layer 20%
cut (prunelight's global allocation of FLAP scores, channels aligned to 32: a GQA group gone in some layers), and
that cut plus a no-op attention (layer 3) and a no-op MLP (layer 7); units ranked by FLAP on 16 x 128 tokens of
the shipped calibration text, no reconstruction. Each is written as GGUF in every type (`prunelight.bench.write_gguf`,
as `export.gguf` writes it) and run in llama.cpp (node-llama-cpp, 2 threads):

- greedy 16 tokens on 4 prompts, compared with transformers on the file's own weights (each matrix rounded
  through the GGUF type and back): equal for F32 (asserted); for F16 equal up to near ties (asserted: where the
  continuations part, transformers' two tokens are within NEAR_TIE = 0.02 nats, a tie within the F16-rounded
  activations llama.cpp multiplies F16 weights with);
- perplexity over WikiText-2 test windows, compared with transformers on the float32 model: within 1% for F16
  and F32 and within 3% for Q8_0 (asserted); BF16 and Q4_0 reported.

    PRUNELIGHT_LLAMA_NODE=/path/to/npm-prefix python scripts/llama_cpp_check.py            # all cases, all types
    python scripts/llama_cpp_check.py --cases dense,noop --types f16,q8_0 --windows 2      # a subset

Writes results/benchmarks/llama_cpp_check.{json,md}; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout runs without installing prunelight

import prunelight  # noqa: E402
from prunelight import bench  # noqa: E402
from prunelight.llama_cpp import (  # noqa: E402
    NEAR_TIE, SMOLLM2, WIKITEXT, calibration_batches, engine_missing, greedy_agreement, hf_greedy,
    hf_perplexity, run_llama_cpp, token_windows)
from prunelight.testing import sized_plan  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
           "The three primary colors are"]
NEW_TOKENS = 16
PPL_TOLERANCE = {"f32": 0.01, "f16": 0.01, "q8_0": 0.03}  # relative, llama.cpp vs transformers (float32)
GREEDY_EQUAL = ("f32", "f16")
CASES = ("dense", "uniform20", "perlayer20", "noop")


def flap_cut(model, tokenizer, samples: int = 16, seq_len: int = 128):
    """FLAP scores and prunelight's global 20% plan (channels aligned to 32) on the first calibration windows
    (`prunelight.score`, then `prunelight.prune` of a copy from those scores: `model` is not cut)."""
    batches = calibration_batches(tokenizer, samples, seq_len)
    settings = prunelight.PruneSettings(criterion="flap", allocation="global", ratio=0.2, reconstruct="none",
                                        align_channels=32)
    scores = prunelight.score(model, settings, batches)
    _, plan = prunelight.prune(copy.deepcopy(model), settings, batches, scores=scores)
    return scores.unit_scores, plan


def case_plan(model, case: str, scores, global_plan):
    """The plan of a case (None: dense): units ranked by FLAP, widths sized by hand or by the global allocation."""
    shapes = bench.layer_shapes(model)
    if case == "dense":
        return None
    if case == "uniform20":  # every layer keeps its 3 groups and 1024 of 1536 channels: 19.7% of the parameters
        return sized_plan(model, [s["num_key_value_heads"] for s in shapes], [1024] * len(shapes), scores)
    if case == "perlayer20":  # prunelight's global allocation: per-layer widths, a GQA group gone in some layers
        return global_plan
    # the global plan, plus a no-op attention (layer 3) and a no-op MLP (layer 7)
    groups = [len(lp.keep_groups) for lp in global_plan.layers]
    chans = [len(lp.keep_channels) for lp in global_plan.layers]
    groups[3], chans[7] = 0, 0
    return sized_plan(model, groups, chans, scores)


def rounded(model, dtype: str):
    """A copy of `model` whose matrices are rounded through the GGUF type and back: the file's own weights."""
    import gguf

    if dtype == "f32":
        return model
    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim == 2:
                a = p.detach().float().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).copy()))
    return out


def check_case(model, source_gguf, prompts, windows, types, folder: Path, threads: int = 2) -> list[dict]:
    """Write `model` as GGUF in each type, run it in llama.cpp, compare with transformers; one row per type."""
    rows = []
    ppl_float = hf_perplexity(model, windows)
    for dtype in types:
        t0 = time.perf_counter()
        path = bench.write_gguf(model, folder / f"m.{dtype}.gguf", dtype, source_gguf=source_gguf)
        write_s = time.perf_counter() - t0
        got = run_llama_cpp({"model": str(path), "threads": threads,
                             "greedy": {"prompts": prompts, "new_tokens": NEW_TOKENS},
                             "perplexity": {"windows": windows}})
        same = rounded(model, dtype)
        want = hf_greedy(same, prompts, NEW_TOKENS)
        ppl_same = hf_perplexity(same, windows)
        ppl_cpp = got["perplexity"]["ppl"]
        rel = abs(ppl_cpp / ppl_float - 1)
        agree = greedy_agreement(same, prompts, got["greedy"], want)
        greedy_ok = agree["equal"] if dtype == "f32" else agree["equal_up_to_near_ties"]
        ok = (greedy_ok or dtype not in GREEDY_EQUAL) and rel <= PPL_TOLERANCE.get(dtype, float("inf"))
        rows.append({"type": dtype, "file_mb": path.stat().st_size / 2**20, "write_s": write_s,
                     "greedy_equal": agree["equal"], "greedy_tokens_equal": agree["tokens_equal"],
                     "greedy_divergence_gaps": agree["divergence_gaps"],
                     "ppl_llama_cpp": ppl_cpp, "ppl_transformers_float32": ppl_float,
                     "ppl_transformers_same_weights": ppl_same, "rel_diff": rel, "ok": ok,
                     "llama_cpp": got["llama_cpp"]})
        path.unlink()
        del same
    return rows


def main() -> int:
    """Run the check and write results/benchmarks/llama_cpp_check.{json,md}."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--types", default=",".join(bench.GGUF_TYPES))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--text", default=str(WIKITEXT))
    ap.add_argument("--out", default=str(bench.RESULTS / "llama_cpp_check"))
    args = ap.parse_args()
    why = engine_missing()
    if why:
        print(f"llama.cpp check skipped: {why}")
        return 0
    dense = bench.load_model(args.model, dtype=torch.float32)
    tokenizer = bench.load_tokenizer(args.model)
    source_gguf = bench.gguf_file(args.model)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    text = Path(args.text).read_text(encoding="utf-8")
    windows = token_windows(tokenizer, text, args.windows, args.window_len)
    scores, global_plan = flap_cut(dense, tokenizer)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            model = copy.deepcopy(dense)
            plan = case_plan(model, case, scores, global_plan)
            if plan is not None:
                prunelight.apply_plan(model, plan)
            shapes = [tuple(s.values()) for s in bench.layer_shapes(model)]
            for row in check_case(model, source_gguf, prompts, windows, args.types.split(","), Path(tmp)):
                row.update(case=case, params=sum(p.numel() for p in model.parameters()),
                           per_layer=len(set(shapes)) > 1)
                results.append(row)
                print(json.dumps(row))
            del model
    meta = {"model": args.model, "text": Path(args.text).name, "windows": args.windows, "window_len": args.window_len,
            "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "tolerance": PPL_TOLERANCE, "greedy_equal": GREEDY_EQUAL}
    lines = [f"# llama.cpp check ({results[0]['llama_cpp']['repo']} {results[0]['llama_cpp']['release']} via "
             f"node-llama-cpp 3.21.1)", "",
             f"`python scripts/llama_cpp_check.py` on {args.model}: greedy {NEW_TOKENS} tokens on {len(PROMPTS)} prompts "
             f"vs transformers on the file's own weights; perplexity over {args.windows} x {args.window_len} tokens of "
             f"{Path(args.text).name} vs transformers float32 (tolerance {PPL_TOLERANCE}).", "",
             f"Greedy: tokens equal of {len(PROMPTS) * NEW_TOKENS}; where a continuation parts, transformers' "
             f"log-probability gap between its token and llama.cpp's (a near tie below {NEAR_TIE} nats).", "",
             "| case | params | type | MB | greedy tokens equal | gaps at partings | ppl llama.cpp | "
             "ppl transformers fp32 | rel. diff | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['params'] / 1e6:.1f}M | {r['type']} | {r['file_mb']:.0f} | "
                     f"{r['greedy_tokens_equal']}/{len(PROMPTS) * NEW_TOKENS} | "
                     f"{', '.join(f'{g:.4f}' for g in r['greedy_divergence_gaps']) or '-'} | "
                     f"{r['ppl_llama_cpp']:.3f} | {r['ppl_transformers_float32']:.3f} | {100 * r['rel_diff']:.2f}% | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    bench.write_results(args.out, {"meta": meta, "rows": results}, "\n".join(lines) + "\n")
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} passed; written to {args.out}.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
