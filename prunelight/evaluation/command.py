"""`prunelight evaluate`: measure model folders, or the models of a finished run, and write the report."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch

from prunelight.data import TextSource
from prunelight.evaluation.figures import write_figures
from prunelight.evaluation.suite import EvaluationSettings, Evaluator
from prunelight.plan import PrunePlan
from prunelight.report import write_report

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _all_local(models: dict[str, str], settings: EvaluationSettings) -> bool:
    local_models = all(Path(p).expanduser().is_dir() for p in models.values())
    local_zs = not settings.zeroshot or settings.zeroshot_data_dir is not None
    local_ppl = not settings.perplexity or (
        settings.ppl_datasets is not None and all(s.path for s in settings.ppl_datasets.values()))
    return local_models and local_zs and local_ppl


def inherit_run_data(settings: EvaluationSettings, report: dict) -> EvaluationSettings:
    """Data choices left unset default to what the run itself measured, so `--run` re-measures the same sets.

    Perplexity sets come from the run's evaluation suite, else from its data module's local eval file;
    the zero-shot folder from the run's evaluation suite. Anything given explicitly is kept.
    """
    recorded = report.get("evaluation_settings") or {}
    changes: dict = {}
    if settings.ppl_datasets is None:
        if recorded.get("ppl_datasets"):
            changes["ppl_datasets"] = {k: TextSource(**v) for k, v in recorded["ppl_datasets"].items()}
        else:
            src = (report.get("eval") or {}).get("source")
            if src and (str(src).startswith("pkg://") or Path(src).expanduser().exists()):
                changes["ppl_datasets"] = {f"{Path(src).parent.name}/{Path(src).name}": TextSource(path=src)}
    if settings.zeroshot_data_dir is None and recorded.get("zeroshot_data_dir"):
        changes["zeroshot_data_dir"] = recorded["zeroshot_data_dir"]
    if changes:
        log.info("using the run's own evaluation data: %s", ", ".join(
            f"{k}={list(v) if isinstance(v, dict) else v}" for k, v in changes.items()))
    return dataclasses.replace(settings, **changes)


def _load(path: str, dtype: str, device: str):
    from prunelight import sources

    # A folder, hub id, GGUF file or pkg:// value: a run's dense model is named as its model.pretrained was.
    source = sources.resolve_pretrained(path, option="models")
    model = sources.load_model(source, "models", dtype=DTYPES[dtype]).to(device).eval()
    return model, sources.load_tokenizer(source, "models")


def evaluate(
    models: dict[str, str] | None = None,
    run: str | None = None,
    dense: bool = True,
    out_dir: str | None = None,
    evaluation: EvaluationSettings = EvaluationSettings(),
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Evaluate `models` (label -> folder or hub id) and/or the exported model of the finished `run` folder.

    With `run`, its model is labelled "recovered", the dense model it started from is added (unless
    dense=false), unset data choices default to the run's own (`inherit_run_data`), and the results are
    merged into the run's report (figures included).
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    models = dict(models or {})
    report: dict = {}
    plan = None
    if run is not None:
        run_dir = Path(run).expanduser()
        if not (run_dir / "report.json").is_file() or not (run_dir / "model").is_dir():
            raise FileNotFoundError(f"{run_dir} is not a finished prunelight run (needs report.json and model/)")
        report = json.loads((run_dir / "report.json").read_text())
        if (run_dir / "unit_scores.json").is_file():
            report["unit_scores"] = json.loads((run_dir / "unit_scores.json").read_text())
        if report.get("prune_plan"):
            plan = PrunePlan.from_dict(report["prune_plan"])
        if dense and report.get("model") not in (None, "config"):
            models = {"dense": report["model"], **models}
        models.setdefault("recovered", str(run_dir / "model"))
        out_dir = out_dir or str(run_dir)
        evaluation = inherit_run_data(evaluation, report)
    if not models:
        raise ValueError("nothing to evaluate: give --models '{name: folder}' and/or --run <finished run folder>")
    out = Path(out_dir or "runs/evaluate")
    if _all_local(models, evaluation):
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            os.environ.setdefault(var, "1")
    evaluator = None
    results = report.setdefault("evaluation", {})
    report.setdefault("model", next(iter(models.values())))
    times = report.setdefault("times_s", {})
    for name, path in models.items():
        t0 = time.perf_counter()
        model, tok = _load(path, dtype, device)
        evaluator = evaluator or Evaluator(evaluation, tok)
        results[name] = evaluator.evaluate(model, name, folder=path if Path(path).is_dir() else None)
        results[name]["path"] = path
        times[f"evaluation_{name}"] = time.perf_counter() - t0
        del model
    report["evaluation_settings"] = evaluation.as_dict()
    report["figures"] = write_figures(report, plan, out)
    write_report(report, out)
    log.info("wrote %s", out / "report.md")
    return out / "report.md"


def evaluate_main(args: list[str]) -> Path:
    """`prunelight evaluate ...` parsed by jsonargparse (supports --config YAML and --print_config)."""
    from jsonargparse import CLI

    logging.basicConfig(level=logging.INFO)
    return CLI(evaluate, args=args, as_positional=False)
