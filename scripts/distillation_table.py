"""Distillation vs plain next-token (CE) recovery on the reference job, at equal steps and data.

Runs `configs/reference.yaml` (20% FLAP cut with least-squares refit, LoRA recovery on Brown prose) once per
recovery loss with `--steps` steps (and once with recovery none, for the pruned row), then measures the dense, the
pruned and each recovered model the same way with `prunelight evaluate`: perplexity on WikiText-2 and PTB test at 128
and 512 tokens, on the first `--windows` windows of each (null: the whole sets). One thread per process:

    OMP_NUM_THREADS=1 python scripts/distillation_table.py --out /tmp/distill-runs --steps 200 --windows null
    python scripts/distillation_table.py --out /tmp/distill-runs --table-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> command-line options of the recovery
    "pruned": ["--model.recovery=none"],
    "ce": [],
    "kl_a0.5_T2": ["--model.distillation.alpha=0.5", "--model.distillation.temperature=2.0"],
    "kl_a1.0_T1": ["--model.distillation.alpha=1.0", "--model.distillation.temperature=1.0"],
}
DENSE = ROOT.parent / "shared" / "models" / "ref-llama-gqa"
SUITE = """evaluation:
  ppl_datasets:
    wikitext2: {{path: {shared}/data/wikitext2/test.txt}}
    ptb: {{path: {shared}/data/ptb/test.txt}}
  seq_lens: [128, 512]
  ppl_batch_size: 16
  max_windows: {windows}
  zeroshot: false
  efficiency: false
"""


def fit(name: str, out: Path, steps: int) -> int:
    """One reference run with recovery `name` (no evaluation inside the run)."""
    cmd = [sys.executable, "-m", "prunelight", "fit", "--config", str(ROOT / "configs" / "reference.yaml"),
           *SETTINGS[name], f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
           "--evaluation.data_eval=false", f"--export.out_dir={out / name}", "--trainer.enable_progress_bar=false"]
    with open(out / f"{name}.log", "w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def evaluate(name: str, folder: Path, out: Path) -> int:
    """`prunelight evaluate` of one model folder into out/eval_<name>."""
    cmd = [sys.executable, "-m", "prunelight", "evaluate", "--config", str(out / "suite.yaml"),
           f"--models={json.dumps({name: str(folder)})}", "--dense=false", f"--out_dir={out / ('eval_' + name)}"]
    with open(out / f"eval_{name}.log", "w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def table(out: Path) -> str:
    """The markdown table of perplexities per model (dense, pruned, then one row per recovery loss)."""
    rows, header = [], None
    for name in ["dense", *SETTINGS]:
        path = out / f"eval_{name}" / "report.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())["evaluation"][name]["perplexity"]
        header = header or [(r["dataset"], r["seq_len"]) for r in res]
        loss = ""
        run = out / name / "report.json"
        if name not in ("dense", "pruned") and run.exists():
            rec = json.loads(run.read_text())["recovery"]
            d = rec.get("distillation")
            loss = (f"{rec['steps']} LoRA steps, next-token CE" if not d else
                    f"{rec['steps']} LoRA steps, {d['alpha']} x {d['loss']} (T={d['temperature']}) + "
                    f"{1 - d['alpha']:.2g} x CE")
        rows.append(f"| {name} | {loss} | " + " | ".join(f"{r['ppl']:.2f}" for r in res) + " |")
    head = "| model | recovery | " + " | ".join(f"{d} @{n}" for d, n in header) + " |"
    return "\n".join([head, "|---|---|" + "---:|" * len(header), *rows]) + "\n"


def main() -> None:
    """Run the fits (in parallel, one thread each), evaluate every model, and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--windows", default="null", help="windows per dataset and length (null: all)")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        (args.out / "suite.yaml").write_text(SUITE.format(shared=DENSE.parent.parent, windows=args.windows))
        with ThreadPoolExecutor(len(SETTINGS) + 1) as pool:
            dense = pool.submit(evaluate, "dense", DENSE, args.out)
            codes = dict(zip(SETTINGS, pool.map(lambda n: fit(n, args.out, args.steps), SETTINGS)))
            print("fit exit codes:", codes, flush=True)
            codes = dict(zip(SETTINGS, pool.map(lambda n: evaluate(n, args.out / n / "model", args.out), SETTINGS)))
            print("evaluate exit codes:", codes, "dense:", dense.result(), flush=True)
    print(table(args.out))


if __name__ == "__main__":
    main()
