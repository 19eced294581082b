"""Zero-shot multiple-choice accuracy with lm-eval's HFLM on the model object in memory.

Hub mode uses lm-eval's own task definitions by their official names. Local mode builds task
configs for the jsonl files of a data folder (formats in shared/README.md) that run through the
same lm-eval machinery: `dataset_path: json` with `data_files`, loglikelihood of each choice,
`acc` and (where lm-eval defines it) `acc_norm`.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# The seven tasks of the pruning literature, by their official lm-eval names.
TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
# lm-eval reports acc_norm for these (not for BoolQ or WinoGrande).
HAS_ACC_NORM = {"piqa", "hellaswag", "arc_easy", "arc_challenge", "openbookqa"}
LOCAL_TASK_VERSION = 1.0
LOCAL_SUFFIX = "_local"


def _answer_prompt(doc: dict) -> str:
    # The shared files carry "Passage:"/"Question:" prefixes already; lm-eval's templates end in "\nAnswer:".
    return doc["query"].rstrip("\n") + "\nAnswer:"


def _winogrande_gold(doc: dict) -> int:
    # An int from doc_to_text makes lm-eval score the one continuation under each context (partial scoring).
    return int(doc["gold"])


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_docs(dataset):
    # lm-eval's standard HellaSwag preprocessing: activity label + ctx_a + capitalised ctx_b, brackets removed.
    def one(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(one)


def local_task_config(task: str, data_dir: str | Path) -> dict:
    """An lm-eval task config (dict) that reads `<data_dir>/<task>.jsonl` offline."""
    if task not in TASKS:
        raise ValueError(f"unknown zero-shot task {task!r}; available: {', '.join(TASKS)}")
    path = Path(data_dir).expanduser() / f"{task}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"zero-shot data for {task!r} not found at {path}")
    metrics = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    if task in HAS_ACC_NORM:
        metrics.append({"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True})
    cfg = {
        "task": task + LOCAL_SUFFIX,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path.resolve())}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": _answer_prompt,
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "metric_list": metrics,
        "metadata": {"version": LOCAL_TASK_VERSION, "source": str(path.resolve())},
    }
    if task == "openbookqa":
        cfg["doc_to_text"] = "{{query}}"  # lm-eval's OpenBookQA prompt is the bare question stem
    elif task == "hellaswag":
        cfg["process_docs"] = _hellaswag_docs
        cfg["doc_to_text"] = "{{query}}"
    elif task == "winogrande":
        cfg.update(doc_to_text=_winogrande_gold, doc_to_choice="context_options", doc_to_target="continuation")
    return cfg


def _task_specs(tasks: list[str], data_dir: str | Path | None) -> list:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown zero-shot task(s) {unknown}; available: {', '.join(TASKS)}")
    if data_dir is None:
        return list(tasks)
    return [local_task_config(t, data_dir) for t in tasks]


def make_lm(model: nn.Module, tokenizer, batch_size: int = 32, max_length: int | None = None):
    """lm-eval's HFLM around the model and tokenizer objects (no reload, pruned shapes as they are)."""
    from lm_eval.models.huggingface import HFLM

    if tokenizer is None:
        raise ValueError("zero-shot evaluation needs the model's tokenizer")
    max_length = max_length or getattr(model.config, "max_position_embeddings", None)
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)


@torch.no_grad()
def evaluate_zeroshot(
    model: nn.Module,
    tokenizer,
    tasks: list[str] | tuple[str, ...] = TASKS,
    data_dir: str | Path | None = None,
    limit: float | None = None,
    batch_size: int = 32,
    log_samples: bool = False,
    max_length: int | None = None,
) -> dict:
    """Zero-shot acc / acc_norm per task and their averages, with lm-eval and task versions recorded."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    was_training = model.training
    model.eval()
    try:
        lm = make_lm(model, tokenizer, batch_size=batch_size, max_length=max_length)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=_task_specs(list(tasks), data_dir),
            num_fewshot=0,
            limit=limit,
            log_samples=log_samples,
            # Local configs need no index of lm-eval's thousands of built-in task files (slow to scan).
            task_manager=TaskManager(include_defaults=data_dir is None),
            bootstrap_iters=0,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
    finally:
        model.train(was_training)
    return summarize(out, list(tasks), data_dir, limit, log_samples)


def summarize(out: dict, tasks: list[str], data_dir, limit, log_samples: bool) -> dict:
    """Pick acc/acc_norm, sample counts and versions out of lm-eval's results dict."""
    import lm_eval

    per_task: dict = {}
    for task in tasks:
        name = task + LOCAL_SUFFIX if data_dir is not None else task
        res = out["results"][name]
        row = {"acc": res.get("acc,none")}
        if "acc_norm,none" in res:
            row["acc_norm"] = res["acc_norm,none"]
        n = out.get("n-samples", {}).get(name, {})
        row["samples"] = n.get("effective", n.get("original"))
        row["acc_stderr"] = acc_stderr(row["acc"], row["samples"])
        row["lm_eval_task"] = name
        row["version"] = out.get("versions", {}).get(name)
        if data_dir is not None:
            row["source"] = str((Path(data_dir).expanduser() / f"{task}.jsonl").resolve())
        if log_samples:
            row["samples_log"] = out.get("samples", {}).get(name)
        per_task[task] = row
    accs = [r["acc"] for r in per_task.values()]
    mixed = [r.get("acc_norm", r["acc"]) for r in per_task.values()]
    return {
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "mode": "local" if data_dir is not None else "hub",
        "data_dir": str(data_dir) if data_dir is not None else None,
        "limit": limit,
        "tasks": per_task,
        "average": {"acc": sum(accs) / len(accs), "acc_norm_else_acc": sum(mixed) / len(mixed),
                    "acc_stderr": mean_stderr([r["acc_stderr"] for r in per_task.values()])},
    }


def acc_stderr(acc: float | None, n: int | None) -> float | None:
    """Standard error of an accuracy over n rows, sqrt(p(1-p)/(n-1)): lm-eval's `mean_stderr` of 0/1 scores.

    Computed here because the run asks lm-eval for no bootstrap (bootstrap_iters=0), which also drops its stderr.
    """
    if acc is None or not n or n < 2:
        return None
    return math.sqrt(acc * (1.0 - acc) / (n - 1))


def mean_stderr(errors: list[float | None]) -> float | None:
    """Standard error of the unweighted mean of independent task accuracies (None if any is unknown)."""
    if not errors or any(e is None for e in errors):
        return None
    return math.sqrt(sum(e * e for e in errors)) / len(errors)
