"""Compare the method presets on equal terms: same model, ratio, calibration and evaluation data, no recovery.

Reads each preset's `prune:` section from configs/methods/*.yaml, builds the plan with
`prunelight.pipeline.make_plan` (exactly what `prunelight fit` does), cuts a copy of the model and
prints parameters removed, pruned perplexity and wall times. Run from the repository root, alone:

    python scripts/compare_methods.py --eval-blocks 256          # reference model in ../shared
    python scripts/compare_methods.py --samples 8 --eval-blocks 4 --importance-batches 1   # smoke check
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM

from prunelight.allocation import count_params
from prunelight.data import PruneDataModule, TextSource
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.pipeline import make_plan
from prunelight.settings import PruneSettings
from prunelight.surgery import apply_plan
from prunelight.testing import shared_dir

ROOT = Path(__file__).resolve().parents[1]


def preset_settings(name: str, ratio: float | None, importance_batches: int | None) -> PruneSettings:
    """The `prune:` section of configs/methods/<name>.yaml (a fragment over a base config), with overrides."""
    prune = yaml.safe_load((ROOT / "configs" / "methods" / f"{name}.yaml").read_text())["prune"]
    prune["report_layer_importance"] = []  # only what the allocation needs: the table times the plan
    if ratio is not None:
        prune["ratio"] = ratio
    if importance_batches is not None:
        prune["importance_batches"] = importance_batches
    return PruneSettings(**prune)


def main() -> None:
    """Print one row per method."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = shared_dir()
    p.add_argument("--model", default=str(shared / "models" / "ref-llama-gqa") if shared else None)
    p.add_argument("--calibration", default=str(shared / "data" / "wikitext2" / "valid.txt") if shared else None)
    p.add_argument("--eval", default=str(shared / "data" / "wikitext2" / "test.txt") if shared else None)
    p.add_argument("--methods", nargs="+", default=["taylor", "layerwise", "blockwise", "depth"])
    p.add_argument("--ratio", type=float, default=None, help="override every preset's ratio")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-blocks", type=int, default=None, help="cap on 128-token evaluation blocks (default: all)")
    p.add_argument("--importance-batches", type=int, default=None)
    args = p.parse_args()
    if not args.model:
        p.error("--model is required when ../shared is absent")

    dm = PruneDataModule(TextSource(path=args.calibration), TextSource(path=args.eval), tokenizer=args.model,
                         num_samples=args.samples, seq_len=args.seq_len, calibration_batch_size=16,
                         eval_batch_size=16, max_eval_blocks=args.eval_blocks)
    dm.setup()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    dense = evaluate_perplexity(model, dm.eval_dataloader())["ppl"]
    print(f"dense: {count_params(model):,} params, ppl {dense:.2f} ({time.perf_counter() - t0:.1f} s)")
    print("| method | allocation | ratio | params removed | layers dropped | pruned ppl | plan s | eval s |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for name in args.methods:
        settings = preset_settings(name, args.ratio, args.importance_batches)
        ratio = settings.ratio
        work = copy.deepcopy(model)
        t0 = time.perf_counter()
        plan, _ = make_plan(work, dm.calibration_batches(), settings)
        t_plan = time.perf_counter() - t0
        apply_plan(work, plan)
        t0 = time.perf_counter()
        ppl = evaluate_perplexity(work, dm.eval_dataloader())["ppl"]
        t_eval = time.perf_counter() - t0
        print(f"| {name} | {plan.meta['allocation']} | {ratio} | {plan.meta['params_removed']:,} "
              f"({100 * plan.meta['removed_fraction_total']:.1f}%) | {plan.drop_layers or '-'} | {ppl:.2f} | "
              f"{t_plan:.1f} | {t_eval:.1f} |")


if __name__ == "__main__":
    main()
