"""Serving check: every export format prunelight writes is served by vLLM with greedy output equal to transformers'.

For each folder: greedy continuations of a fixed prompt set from transformers (prunelight imported, float32,
on the folder as written) and from vLLM (its own environment, `prunelight.vllm`, float32, eager) on
the same folder; the continuations must be equal token for token, and the largest difference of the chosen
tokens' log-probabilities is printed. Writes a JSON summary.

    # tiny models built from configs (stock, nemotron_nas, nemotron_nas with removed sub-blocks), ~4 min:
    python scripts/serve_check.py --tiny --vllm-python ~/vllm-venv/bin/python
    # a tiny stock export of every supported family (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3):
    python scripts/serve_check.py --tiny-families --vllm-python ~/vllm-venv/bin/python
    # SmolLM2 (a float32 HF folder), pruned 20% to stock and nemotron_nas (magnitude, no calibration), ~6 min:
    python scripts/serve_check.py --prune /path/to/smollm2-f32 --vllm-python ~/vllm-venv/bin/python
    # folders a run wrote:
    python scripts/serve_check.py --folder runs/x/model --vllm-python ~/vllm-venv/bin/python

Exit status 1 when any folder's continuations differ (or vLLM fails to serve it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout runs without installing prunelight

import prunelight  # noqa: E402
from prunelight import bench  # noqa: E402
from prunelight.testing import FAMILIES, tiny_model, tiny_tokenizer  # noqa: E402

TEXT_PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
                "The three primary colors are"]
MAX_TOKENS = 16


def transformers_greedy(folder: str | Path, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy tokens and their log-probabilities from transformers on `folder` (float32, full recompute per step)."""
    model = bench.load_model(folder)
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq, toks, lps, gaps = list(ids), [], [], []
            for _ in range(max_tokens):
                logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
                top = torch.topk(logp, 2)
                tok = int(top.indices[0])
                toks.append(tok)
                lps.append(float(logp[tok]))
                gaps.append(float(top.values[0] - top.values[1]))
                seq.append(tok)
            out.append({"tokens": toks, "logprobs": lps, "top2_gap": gaps})
    return out


def vllm_greedy(folder: str | Path, prompts: list[list[int]], max_tokens: int, vllm_python: str,
                max_model_len: int = 512, log: Path | None = None) -> dict:
    """vLLM's greedy tokens and log-probabilities on `folder`, from its own environment (a subprocess)."""
    from prunelight.vllm import run_vllm

    # One process (engine core and worker in the caller): the same model code and kernels, without the two extra
    # process starts that each import vLLM again (43 s -> 22 s per folder on 2 cores). The speed benchmark keeps
    # vLLM's default layout.
    return run_vllm(vllm_python, {"folder": str(folder), "prompts": prompts, "max_tokens": max_tokens,
                                  "max_model_len": max_model_len}, log, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def compare(ref: list[dict], eng: list[dict]) -> dict:
    """Equal continuations?, the largest |log-prob difference| over the common prefix, and the first divergence."""
    equal, worst, first = True, 0.0, None
    for p, (a, b) in enumerate(zip(ref, eng)):
        n = 0
        while n < min(len(a["tokens"]), len(b["tokens"])) and a["tokens"][n] == b["tokens"][n]:
            n += 1
        worst = max([worst] + [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])])
        if n < len(a["tokens"]) or len(a["tokens"]) != len(b["tokens"]):
            equal = False
            first = first or {"prompt": p, "step": n, "transformers_top2_gap": a["top2_gap"][n]}
    return {"equal": equal, "max_abs_logprob_diff": worst, "first_divergence": first}


def check_folder(folder: str | Path, prompts: list[list[int]], vllm_python: str, max_model_len: int = 512,
                 max_tokens: int = MAX_TOKENS, log_dir: Path | None = None) -> dict:
    """transformers vs vLLM on one folder: the comparison plus what was served."""
    ref = transformers_greedy(folder, prompts, max_tokens)
    log = (log_dir / f"vllm_{Path(folder).name}.log") if log_dir else None
    eng = vllm_greedy(folder, prompts, max_tokens, vllm_python, max_model_len, log)
    res = {"folder": str(folder), "format": bench.export_format(folder), "architecture": eng["architecture"],
           "engine": eng["engine"], "prompts": len(prompts), "new_tokens": max_tokens,
           **compare(ref, eng["outputs"]), "vllm_load_s": round(eng["load_s"], 1)}
    print(f"{res['format']:>13} {Path(folder).name:<22} {'EQUAL' if res['equal'] else 'DIFFER'}  "
          f"max |logprob diff| {res['max_abs_logprob_diff']:.2e}  ({res['engine']}, {res['architecture'][0]})",
          flush=True)
    return res


def _cut(model, fmt: str, ratio: float, min_groups: int = 1):
    """Cut `model` in place for `fmt` from weight-magnitude scores (no calibration text), as a run would."""
    # the format's shape constraint, as export.format sets it
    return prunelight.prune(model, bench.shape_settings(ratio, min_groups=min_groups), export_format=fmt)[0]


def tiny_folders(out: Path) -> list[Path]:
    """Tiny Llama exports: stock, nemotron_nas (allocated), nemotron_nas with a removed attention and MLP."""
    # head_dim 32: vLLM's CPU attention kernels take 32, 64, 80, 96, 112, 128... (not the tests' usual 16)
    def make(seed=0):
        return tiny_model("llama", seed=seed, num_hidden_layers=4, head_dim=32, initializer_range=0.2,
                          tie_word_embeddings=True)

    tok = tiny_tokenizer()
    folders = [bench.export(_cut(make(), "stock", 0.3), out / "tiny_stock", tok, format="stock"),
               bench.export(_cut(make(), "nemotron_nas", 0.35, min_groups=0), out / "tiny_nemotron_nas", tok,
                            format="nemotron_nas")]
    m = make()
    n = m.config.intermediate_size
    kept = [([1], list(range(0, n, 2))), ([], list(range(50))), ([1], []), ([1], list(range(n)))]
    prunelight.apply_plan(m, {"layers": [{"keep_groups": g, "keep_channels": c} for g, c in kept],
                              "num_groups": [2] * 4, "num_channels": [n] * 4})
    folders.append(bench.export(m, out / "tiny_nemotron_nas_noop", tok, format="nemotron_nas"))
    return folders


def family_folders(out: Path) -> list[Path]:
    """A tiny model of every supported family, cut 30% for `export.format: stock` and exported."""
    tok, folders = tiny_tokenizer(), []
    for name in FAMILIES:
        # head_dim 32: a size vLLM's CPU attention kernels take; 4 query / 2 KV heads keep a GQA ratio to cut.
        # attention_bias false as published checkpoints have it (vLLM's Qwen3 has no o_proj bias: vllm_note).
        model = tiny_model(name, seed=0, num_hidden_layers=4, head_dim=32, initializer_range=0.2,
                           attention_bias=False)
        folders.append(bench.export(_cut(model, "stock", 0.3), out / f"tiny_{name}_stock", tok, format="stock"))
    return folders


def tiny_prompts(n: int = 4, length: int = 6, vocab: int = 128) -> list[list[int]]:
    """Fixed token-id prompts for the tiny models."""
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def pruned_folders(source: str, out: Path, ratio: float) -> list[Path]:
    """`source` pruned by `ratio` for stock and nemotron_nas, exported (tokenizer copied)."""
    tok = bench.load_tokenizer(source)
    folders = []
    for fmt in ("stock", "nemotron_nas"):
        model = bench.load_model(source)
        folders.append(bench.export(_cut(model, fmt, ratio), out / f"{Path(source).name}_{fmt}", tok, format=fmt))
    return folders


def main(argv: list[str] | None = None) -> int:
    """Run the check on the folders asked for; write the summary JSON; non-zero exit if any differ."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=os.environ.get("PRUNELIGHT_VLLM_PYTHON"), required="PRUNELIGHT_VLLM_PYTHON" not in os.environ)
    ap.add_argument("--tiny", action="store_true", help="build, prune and export tiny Llama models")
    ap.add_argument("--tiny-families", action="store_true", help="a tiny stock export of every supported family")
    ap.add_argument("--prune", action="append", default=[], help="a float32 HF folder to prune (stock, nemotron_nas)")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--folder", action="append", default=[], help="an exported folder to check as it is")
    ap.add_argument("--work", default=None, help="where pruned folders and vLLM logs go (default: a temp folder)")
    ap.add_argument("--out", default=None, help="summary JSON path")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="serve_check_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    if args.tiny:
        for f in tiny_folders(work):
            results.append(check_folder(f, tiny_prompts(), args.vllm_python, max_model_len=128, log_dir=work))
    if args.tiny_families:
        for f in family_folders(work):
            try:
                results.append(check_folder(f, tiny_prompts(), args.vllm_python, max_model_len=128, log_dir=work))
            except Exception as exc:  # one family vLLM refuses must not hide the others' results
                print(f"{'stock':>13} {f.name:<22} NOT SERVED  {str(exc).splitlines()[-1][:200]}", flush=True)
                results.append({"folder": str(f), "format": "stock", "equal": False, "served": False,
                                "error": str(exc)[-2000:], "max_abs_logprob_diff": float("nan")})
    for source in args.prune:
        prompts = [bench.load_tokenizer(source)(p)["input_ids"] for p in TEXT_PROMPTS]
        for f in [Path(source), *pruned_folders(source, work, args.ratio)]:
            results.append(check_folder(f, prompts, args.vllm_python, log_dir=work))
    for f in args.folder:
        prompts = [bench.load_tokenizer(f)(p)["input_ids"] for p in TEXT_PROMPTS]
        results.append(check_folder(f, prompts, args.vllm_python, log_dir=work))
    summary = {"results": results, "all_equal": all(r["equal"] for r in results)}
    if args.out:
        bench.write_results(Path(args.out).with_suffix(""), summary)
    print(f"serve check: {sum(r['equal'] for r in results)} of {len(results)} folder(s) equal; largest |logprob diff| "
          f"{max((r['max_abs_logprob_diff'] for r in results), default=0):.2e}")
    return 0 if summary["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
