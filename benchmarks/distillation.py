"""Recovery settings compared (distillation vs next-token CE, rates, ranks) at equal steps and data, one job.

`--job reference` runs `configs/reference.yaml` (20% FLAP cut with least-squares refit, LoRA recovery on Brown
prose) once per recovery loss with `--steps` steps (and once with recovery none, for the pruned row), then measures
the dense, the pruned and each recovered model the same way with `prunelight evaluate`: perplexity on WikiText-2 and
PTB test at 128 and 512 tokens, on the first `--windows` windows of each (null: the whole sets).
`--job smollm2` does the same with `configs/smollm2.yaml` (the real model from ../shared, its default cut) at
256-token training windows, perplexity at 512 tokens, and zero-shot accuracy on the seven local sets
(`--zeroshot-limit` rows each). One thread per process:

    OMP_NUM_THREADS=1 python -m benchmarks distillation --out /tmp/distill-runs --steps 200 --windows null
    OMP_NUM_THREADS=1 python -m benchmarks distillation --job smollm2 --out /tmp/distill-smollm2 --steps 200 \
        --windows 32 --zeroshot-limit 100
    python -m benchmarks distillation --out /tmp/distill-runs --table-only
    (--only kl_a0.5_T2 redoes one run and keeps the others' results in --out; the dense row is measured once)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prunelight import bench

WRITES = ("the table on stdout, runs under --out (results/distillation.md, results/benchmarks/recovery_smollm2.md; "
          "docs/benchmarks.md, \"Recovery on SmolLM2\")")
ROOT = Path(__file__).resolve().parents[1]
# $PRUNELIGHT_SHARED, else ../shared (bench.shared_path owns the lookup); a missing folder is reported in main()
SHARED = Path(bench.shared_path() or ROOT.parent / "shared")
SETTINGS = {  # name -> command-line options of the recovery
    "pruned": ["--model.recovery=none"],
    "ce": [],
    "kl_a0.5_T2": ["--model.distillation.alpha=0.5", "--model.distillation.temperature=2.0"],
    "kl_a1.0_T1": ["--model.distillation.alpha=1.0", "--model.distillation.temperature=1.0"],
    # the job's LoRA learning rate (the package default, 2e-4) against others: a faster rate fits the recovery
    # text better and WikiText-2 worse (results/benchmarks/recovery_smollm2.md)
    "ce_lr1.25e-4": ["--model.learning_rate=0.000125"],
    "ce_lr2.5e-4": ["--model.learning_rate=0.00025"],
    "ce_lr5e-4": ["--model.learning_rate=0.0005"],  # the job's rate until 2026-11-29
    "ce_lr1e-3": ["--model.learning_rate=0.001"],
    "ce_dora": ["--model.lora.use_dora=true"],
    "ce_dropout0": ["--model.lora.dropout=0.0"],
    # cosine decay to zero from twice the job's rate (the same mean rate as the constant 2e-4)
    "ce_cosine_lr4e-4": ["--model.learning_rate=0.0004", "--model.lr_schedule=cosine"],
    # the package's default distillation mix (alpha 0.5, T 1) at the job's rate
    "kl_a0.5_T1": ["--model.distillation.alpha=0.5", "--model.distillation.temperature=1.0"],
    # pure distillation at 2e-3 (4x the job's rate of 5e-4 when it was measured): when the adapters move faster
    "kl_a1.0_T1_lr2e-3": ["--model.distillation.alpha=1.0", "--model.distillation.temperature=1.0",
                          "--model.learning_rate=0.002"],
    # what a bigger trainable part buys at equal tokens: LoRA r=64 (alpha 2r, as r=8 has) and full fine-tuning
    # (at 1e-4, a fifth of LoRA's rate of 5e-4 when measured: every weight moves, as fine-tuning a pretrained model
    # of this size does)
    "ce_r64": ["--model.lora.r=64", "--model.lora.alpha=128"],
    "kl_r64": ["--model.lora.r=64", "--model.lora.alpha=128", "--model.distillation.alpha=1.0",
               "--model.distillation.temperature=1.0"],
    "ce_full": ["--model.recovery=full", "--model.learning_rate=0.0001"],
    "ce_full_lr2e-5": ["--model.recovery=full", "--model.learning_rate=0.00002"],
    "ce_full_lr1e-5": ["--model.recovery=full", "--model.learning_rate=0.00001"],
    # the same recovery on text of the evaluation's kind: WikiText-2 valid (the calibration file, never the test
    # file) instead of the job's general prose; how much of what recovery leaves is the text's domain
    "ce_wikitext2": [f"--data.train.path={SHARED / 'data' / 'wikitext2' / 'valid.txt'}"],
    "kl_full": ["--model.recovery=full", "--model.learning_rate=0.0001", "--model.distillation.alpha=1.0",
                "--model.distillation.temperature=1.0"],
}
SUITE = """evaluation:
  ppl_datasets:
    wikitext2: {{path: {shared}/data/wikitext2/test.txt}}
    ptb: {{path: {shared}/data/ptb/test.txt}}
  seq_lens: {seq_lens}
  ppl_batch_size: 4
  max_windows: {windows}
  zeroshot: {zeroshot}
  zeroshot_data_dir: {shared}/data/zeroshot
  limit: {limit}
  zeroshot_batch_size: 8
  efficiency: false
"""


@dataclass(frozen=True)
class Job:
    """One subject: its run config, the dense model `prunelight evaluate` measures, and what to measure."""

    config: str
    dense: Path
    options: list[str] = field(default_factory=list)
    seq_lens: str = "[128, 512]"
    zeroshot: bool = False


JOBS = {
    "reference": Job("reference.yaml", SHARED / "models" / "ref-llama-gqa"),
    "smollm2": Job("smollm2.yaml", SHARED / "models" / "smollm2-135m-instruct-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf",
                   ["--data.seq_len=256"], "[512]", True),
}


def fit(job: Job, name: str, out: Path, steps: int, plan: Path | None = None) -> int:
    """One run of `job` with recovery `name` (no evaluation inside the run); `plan` re-applies a saved cut."""
    reuse = [f"--prune.plan={plan}"] if plan is not None and name != "pruned" else []
    cmd = [sys.executable, "-m", "prunelight", "fit", "--config", str(ROOT / "configs" / job.config), *job.options,
           *SETTINGS[name], *reuse, f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
           "--evaluation.data_eval=false", f"--export.out_dir={out / name}", "--trainer.enable_progress_bar=false"]
    with open(out / f"{name}.log", "w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def evaluate(name: str, folder: Path, out: Path) -> int:
    """`prunelight evaluate` of one model folder into out/eval_<name>."""
    cmd = [sys.executable, "-m", "prunelight", "evaluate", "--config", str(out / "suite.yaml"),
           f"--models={json.dumps({name: str(folder)})}", "--dense=false", f"--out_dir={out / ('eval_' + name)}"]
    with open(out / f"eval_{name}.log", "w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def _zeroshot_cells(res: dict) -> list[str]:
    """Accuracy (with its standard error) per task and the average, as table cells."""
    zs = res.get("zeroshot") or {}
    tasks = zs.get("tasks") or {}
    cells = [f"{100 * t['acc']:.1f} ± {100 * (t.get('acc_stderr') or 0):.1f}" for t in tasks.values()]
    avg = zs.get("average") or {}
    return [*cells, f"**{100 * avg['acc']:.1f}** ± {100 * (avg.get('acc_stderr') or 0):.1f}"] if avg else cells


def _option(name: str, key: str) -> str | None:
    """The value a setting passes for `--key`, or None when it leaves the job's own."""
    return next((o.split("=", 1)[1] for o in SETTINGS[name] if o.startswith(f"--{key}=")), None)


def table(out: Path) -> str:
    """The markdown table of perplexities (and zero-shot) per model (dense, pruned, then one row per recovery loss)."""
    rows, header, zs_header = [], None, []
    for name in ["dense", *SETTINGS]:
        path = out / f"eval_{name}" / "report.json"
        if not path.exists():
            continue
        full = json.loads(path.read_text())["evaluation"][name]
        res = full["perplexity"]
        header = header or [(r["dataset"], r["seq_len"]) for r in res]
        zs_header = zs_header or ([*((full.get("zeroshot") or {}).get("tasks") or {}), "zero-shot avg"]
                                  if full.get("zeroshot") else [])
        loss = ""
        run = out / name / "report.json"
        if name not in ("dense", "pruned") and run.exists():
            rec = json.loads(run.read_text())["recovery"]
            d = rec.get("distillation")
            lora = rec.get("lora") or {}
            how = (f"{'DoRA' if lora.get('use_dora') else 'LoRA'} r={lora['r']}"
                   if rec.get("mode", "lora") == "lora" and lora.get("r")
                   else "LoRA" if rec.get("mode", "lora") == "lora" else "full fine-tuning")
            loss = (f"{rec['steps']} steps {how}, next-token CE" if not d else
                    f"{rec['steps']} steps {how}, {d['alpha']} x {d['loss']} (T={d['temperature']}) + "
                    f"{1 - d['alpha']:.2g} x CE")
            lr, sched = _option(name, "model.learning_rate"), _option(name, "model.lr_schedule")
            drop = _option(name, "model.lora.dropout")
            loss += (f", lr {lr}" if lr else "") + (f", {sched} schedule" if sched else "")
            loss += f", LoRA dropout {drop}" if drop else ""
        cells = [f"{r['ppl']:.2f}" for r in res] + _zeroshot_cells(full)
        rows.append(f"| {name} | {loss} | " + " | ".join(cells) + " |")
    cols = [f"{d} @{n}" for d, n in header or []] + zs_header
    head = "| model | recovery | " + " | ".join(cols) + " |"
    return "\n".join([head, "|---|---|" + "---:|" * len(cols), *rows]) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the fits (in parallel, one thread each), evaluate every model, and print the table."""
    ap = bench.parser(__doc__, __file__)
    ap.add_argument("--job", choices=sorted(JOBS), default="reference")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--windows", default="null", help="windows per dataset and length (null: all)")
    ap.add_argument("--zeroshot-limit", default="null", help="rows per zero-shot set (null: all; smollm2 job only)")
    ap.add_argument("--only", default=None, help=f"comma list of the runs to (re)do, of {', '.join(SETTINGS)}")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=None, help="runs at a time (default: all at once)")
    ap.add_argument("--reuse-cut", action="store_true",
                    help="cut once (the pruned run) and re-apply its plan.json in the other runs (same cut, no "
                         "scoring or probes per run)")
    args = ap.parse_args(argv)
    names = list(SETTINGS) if args.only is None else [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        sys.exit(f"--only {args.only!r}: unknown {unknown}; use some of {', '.join(SETTINGS)}")
    job = JOBS[args.job]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        if not job.dense.exists():
            sys.exit(f"the dense model {job.dense} is absent: set PRUNELIGHT_SHARED to the shared data folder")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        (args.out / "suite.yaml").write_text(SUITE.format(
            shared=SHARED, windows=args.windows, seq_lens=job.seq_lens, zeroshot=str(job.zeroshot).lower(),
            limit=args.zeroshot_limit))
        plan = None
        with ThreadPoolExecutor(args.jobs or len(names) + 1) as pool:
            # the dense row is measured once per --out (a second pass with --only keeps it)
            has_dense = (args.out / "eval_dense" / "report.json").exists()
            dense = pool.submit(evaluate, "dense", job.dense, args.out) if not has_dense else None
            if args.reuse_cut:
                plan = args.out / "pruned" / "plan.json"
                if not plan.exists():
                    print("fit pruned (the cut the other runs re-apply):", fit(job, "pruned", args.out, args.steps),
                          flush=True)
            todo = [n for n in names if not (plan is not None and n == "pruned")]
            codes = dict(zip(todo, pool.map(lambda n: fit(job, n, args.out, args.steps, plan), todo)))
            print("fit exit codes:", codes, flush=True)
            codes = dict(zip(names, pool.map(lambda n: evaluate(n, args.out / n / "model", args.out), names)))
            print("evaluate exit codes:", codes, "dense:", dense.result() if dense else "kept", flush=True)
    print(table(args.out))


if __name__ == "__main__":
    main()
