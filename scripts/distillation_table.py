"""Distillation vs plain next-token (CE) recovery on the reference job, at equal steps and data.

Runs `configs/reference.yaml` (200 LoRA steps on Brown prose after the 20% FLAP cut) once per recovery loss, each
measured by the evaluation suite (perplexity on WikiText-2 and PTB test at 128 and 512 tokens), and writes the table:

    OMP_NUM_THREADS=1 python scripts/distillation_table.py --out /tmp/distill-runs   # runs, then the table
    python scripts/distillation_table.py --out /tmp/distill-runs --table-only          # table from finished runs
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
SETTINGS = {  # name -> command-line options of the recovery loss
    "ce": [],
    "kl_a0.5_T2": ["--model.distillation.alpha=0.5", "--model.distillation.temperature=2.0"],
    "kl_a1.0_T1": ["--model.distillation.alpha=1.0", "--model.distillation.temperature=1.0"],
}
SUITE = """evaluation:
  data_eval: false
  suite:
    ppl_datasets:
      wikitext2: {path: ../shared/data/wikitext2/test.txt}
      ptb: {path: ../shared/data/ptb/test.txt}
    seq_lens: [128, 512]
    ppl_batch_size: 16
    zeroshot: false
    efficiency: false
"""


def run(name: str, out: Path) -> int:
    """One reference run with recovery loss `name`; its log beside its folder."""
    overlay = out / "suite.yaml"
    cmd = [sys.executable, "-m", "prunelight", "fit", "--config", str(ROOT / "configs" / "reference.yaml"),
           "--config", str(overlay), *SETTINGS[name], f"--export.out_dir={out / name}",
           "--trainer.enable_progress_bar=false"]
    with open(out / f"{name}.log", "w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def table(out: Path) -> str:
    """The markdown table of perplexities per recovery loss (dense and pruned from the CE run)."""
    rows, header = [], None
    for name in SETTINGS:
        path = out / name / "report.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        records = report["evaluation"]
        cols = [(r["dataset"], r["seq_len"]) for r in records["recovered"]["perplexity"]]
        header = header or cols
        if not rows:
            for state in ("dense", "pruned"):
                rows.append(f"| {state} | | " + " | ".join(f"{r['ppl']:.2f}" for r in records[state]["perplexity"]) + " |")
        rec = report["recovery"]
        d = rec.get("distillation")
        loss = "next-token CE" if not d else f"{d['alpha']} x {d['loss']} (T={d['temperature']}) + {1 - d['alpha']:.2g} x CE"
        rows.append(f"| recovered: {name} | {loss} | "
                    + " | ".join(f"{r['ppl']:.2f}" for r in records["recovered"]["perplexity"]) + " |")
    head = "| model | recovery loss | " + " | ".join(f"{d} {n}" for d, n in header) + " |"
    return "\n".join([head, "|---|---|" + "---:|" * len(header), *rows]) + "\n"


def main() -> None:
    """Run the settings (in parallel, one thread each) and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--only", nargs="*", default=list(SETTINGS))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        (args.out / "suite.yaml").write_text(SUITE)
        with ThreadPoolExecutor(len(args.only)) as pool:
            codes = dict(zip(args.only, pool.map(lambda n: run(n, args.out), args.only)))
        print("exit codes:", codes)
    print(table(args.out))


if __name__ == "__main__":
    main()
