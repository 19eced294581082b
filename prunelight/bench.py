"""The benchmark scripts' shared harness: models and token data, the run's perplexity protocol, cuts through the
public API, result files and subprocess workers.

Every script in `scripts/` cuts only through `prunelight.prune` / `prunelight.score` / `prunelight.apply_plan`
(here in `Scorer` and `cut_copy`) or the `prunelight` command, so a figure measured by a script is the figure of the
cut a `prunelight fit` run makes; `tests/test_benchmarks.py` reads the scripts to keep it so.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelight.allocation import count_params  # noqa: F401 - the scripts' parameter count (tied weights once)
from prunelight.settings import PruneSettings

# The method presets (`configs/methods/*.yaml`, fragments over a base run) live beside the package in a checkout.
PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "methods"


def shared_path(*parts: str) -> str | None:
    """A path under the shared reference data ($PRUNELIGHT_SHARED, else ../shared), or None when it is absent."""
    from prunelight.testing import shared_dir

    root = shared_dir()
    return str(root.joinpath(*parts)) if root is not None else None


def set_threads(threads: int | None = None) -> int:
    """Torch's thread count: `threads`, else $OMP_NUM_THREADS, else torch's own; returns it."""
    n = threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or torch.get_num_threads()
    torch.set_num_threads(n)
    return n


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               **kwargs: Any) -> nn.Module:
    """A Hugging Face causal LM folder loaded in `dtype` on `device`, in eval mode (`kwargs` to from_pretrained).

    A GGUF file (a path or `pkg://` resource ending in .gguf) loads as `model.pretrained` does: dequantized, plain.
    """
    if is_gguf(path):
        from prunelight import sources

        return sources.load_model(sources.resolve_pretrained(str(path)), dtype=dtype, **kwargs).to(device).eval()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs).to(device).eval()


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (a path or `pkg://` resource ending in .gguf)."""
    return str(path).endswith(".gguf")


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file on disk that `path` names (a `pkg://` resource resolved), or None for a folder."""
    from prunelight import sources

    return sources.resolve_pretrained(str(path)).gguf_path if is_gguf(path) else None


def load_tokenizer(path: str | Path, **kwargs: Any):
    """The tokenizer of a model folder, hub id or GGUF file (a GGUF file carries its own)."""
    from prunelight import sources

    return sources.load_tokenizer(sources.resolve_pretrained(str(path)), **kwargs)


@dataclass
class TokenData:
    """Calibration windows and evaluation blocks, tokenized once ([n, seq_len] token ids each)."""

    calib: torch.Tensor
    eval: torch.Tensor

    def calibration_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The calibration windows in batches of `batch_size` rows."""
        return list(torch.split(self.calib, batch_size))

    def eval_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The evaluation blocks in batches of `batch_size` rows."""
        return list(torch.split(self.eval, batch_size))

    def save(self, path: str | Path) -> Path:
        """One file a worker process reads back with `TokenData.load`."""
        torch.save({"calib": self.calib, "eval": self.eval}, path)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> TokenData:
        """What `save` wrote."""
        data = torch.load(path)
        return cls(calib=data["calib"], eval=data["eval"])


def token_data(tokenizer: str | Path, calibration: str | Path, eval: str | Path, samples: int = 128,
               seq_len: int = 128, seed: int = 0, eval_tokens: int | None = None,
               eval_chars: int | None = None) -> TokenData:
    """Calibration windows and evaluation blocks made exactly as a run's data module makes them.

    `samples` windows of `seq_len` tokens of `calibration` (seed `seed`, a BOS per window where the tokenizer adds
    one); `eval` in `seq_len` blocks, at most `eval_tokens` tokens (None or 0: all), read from its first
    `eval_chars` characters when given.
    """
    from prunelight.data import PruneDataModule, TextSource

    blocks = eval_tokens // seq_len if eval_tokens else None
    if blocks == 0:
        raise ValueError(f"eval_tokens={eval_tokens} is shorter than one block of seq_len={seq_len}")
    with tempfile.TemporaryDirectory(prefix="prunelight-bench-") as tmp:
        if eval_chars:  # the run's own protocol on a prefix of the file: the prefix as a file of its own
            prefix = Path(tmp) / Path(eval).name
            prefix.write_text(Path(eval).read_text(encoding="utf-8")[:eval_chars], encoding="utf-8")
            eval = prefix
        dm = PruneDataModule(calibration=TextSource(path=str(calibration)), eval=TextSource(path=str(eval)),
                             tokenizer=str(tokenizer), num_samples=samples, seq_len=seq_len,
                             max_eval_blocks=blocks, seed=seed)
        dm.setup()
    return TokenData(calib=dm.calib_blocks, eval=dm.eval_blocks)


def perplexity(model: nn.Module, batches: Sequence[torch.Tensor]) -> dict[str, float]:
    """The run's perplexity protocol (`evaluation.perplexity`): token-weighted NLL over the blocks; ppl, nll, tokens."""
    from prunelight.evaluation.perplexity import evaluate_perplexity

    return evaluate_perplexity(model, batches)


def preset_settings(preset: str | None = None, **overrides: Any) -> PruneSettings:
    """PruneSettings of a method preset (`configs/methods/<preset>.yaml`'s `prune:` section), then `overrides`."""
    import yaml

    prune: dict[str, Any] = {}
    if preset:
        if not PRESETS_DIR.is_dir():
            raise FileNotFoundError(f"method preset {preset!r}: the presets are read from {PRESETS_DIR}, which "
                                    "only a prunelight checkout has")
        path = PRESETS_DIR / f"{preset}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
            raise ValueError(f"method preset {preset!r} is not allowed: use one of {known}")
        prune = yaml.safe_load(path.read_text())["prune"]
    prune.update(overrides)
    return PruneSettings(**prune)


# The benchmark tables' method per allocation: each allocation runs with the `prune:` settings of its method preset,
# so a cell measures what `prunelight fit --config ... --config configs/methods/X.yaml` does.
ALLOCATION_PRESETS = {"global": "taylor", "layerwise": "layerwise", "blockwise": "blockwise", "depth": "depth"}
# Blockwise ranks sub-blocks by the criterion's own unit scores in the tables, so they compare criteria rather than
# the preset's removal measure.
TABLE_OVERRIDES = {"blockwise": {"block_importance": "units"}}


def cell_settings(allocation: str, criterion: str, ratio: float, criterion_args: dict | None = None,
                  **extra: Any) -> PruneSettings:
    """The PruneSettings of one benchmark table cell: the allocation's preset, the tables' overrides, then `extra`."""
    overrides = {**TABLE_OVERRIDES.get(allocation, {}), **extra}
    return preset_settings(ALLOCATION_PRESETS.get(allocation), **overrides, allocation=allocation,
                           criterion=criterion, criterion_args=dict(criterion_args or {}), ratio=ratio)


class Scorer:
    """Scores for many cuts from few scoring passes, each the run's own (`prunelight.score`).

    One pass per criterion (with its options and calibration-batch cap) gives the unit scores; a layer measure
    or sub-block removal a cut's allocation needs is measured once per (measure, importance batches), by a
    weight-only pass of the same settings, and added. The scores a call returns are those a run with its
    settings would have measured, so `cut_copy(..., scores=scorer(settings))` is that run's cut.
    """

    def __init__(self, model: nn.Module, calibration: Sequence[torch.Tensor]) -> None:
        self.model, self.calibration = model, list(calibration)
        self._units: dict[tuple, Any] = {}
        self._layers: dict[tuple, list[float]] = {}
        self._blocks: dict[Any, dict[str, list[float]]] = {}
        self.seconds: dict[str, float] = {}  # criterion -> seconds of its (first) scoring pass
        self.measure_seconds: dict[str, float] = {}  # layer measure -> seconds of the pass that added it

    def __call__(self, settings: PruneSettings) -> Any:
        """The scores a run with `settings` measures (unit scores, and the measures its allocation needs)."""
        import prunelight
        from prunelight.allocation import allocation_of
        from prunelight.pipeline import layer_measures

        key = (settings.criterion, json.dumps(settings.criterion_args, sort_keys=True, default=str),
               settings.max_calibration_batches)
        if key not in self._units:
            t0 = time.perf_counter()
            first = prunelight.score(self.model, dataclasses.replace(settings, report_layer_importance=[]),
                                     self.calibration)
            self.seconds.setdefault(settings.criterion, time.perf_counter() - t0)
            self._units[key] = first
            self._keep(settings, first)
        window = settings.importance_batches or settings.max_calibration_batches  # the batches measures read
        needs = layer_measures(settings, report=False)
        block = allocation_of(settings.allocation).block_removal(settings)
        missing = [m for m in needs if (window, m) not in self._layers]
        if missing or (block and window not in self._blocks):
            # the measures do not depend on the criterion: a weight-only pass measures them without re-scoring
            extra = dataclasses.replace(settings, criterion="magnitude", criterion_args={},
                                        report_layer_importance=missing)
            t0 = time.perf_counter()
            self._keep(settings, prunelight.score(self.model, extra, self.calibration))
            self.measure_seconds.update(dict.fromkeys(missing, time.perf_counter() - t0))
        base = self._units[key]
        return prunelight.Scores(unit_scores=base.unit_scores, key={},
                                 layer_importance={m: self._layers[(window, m)] for m in needs},
                                 block_importance=self._blocks.get(window) if block else None,
                                 provenance=dict(base.provenance))

    def _keep(self, settings: PruneSettings, scores: Any) -> None:
        window = settings.importance_batches or settings.max_calibration_batches
        for name, values in scores.layer_importance.items():
            self._layers.setdefault((window, name), values)
        if scores.block_importance:
            self._blocks.setdefault(window, scores.block_importance)


def zeroshot_result(model: nn.Module, tokenizer: Any, data_dir: str | Path, limit: int, batch_size: int = 16
                    ) -> dict[str, Any]:
    """Zero-shot acc per task on the first `limit` rows, with binomial standard errors and the mean's."""
    from prunelight.evaluation.zeroshot import TASKS, evaluate_zeroshot

    t0 = time.perf_counter()
    res = evaluate_zeroshot(model, tokenizer, tasks=list(TASKS), data_dir=data_dir, limit=limit,
                            batch_size=batch_size)
    tasks = {}
    for task, r in res["tasks"].items():
        n = int(r["samples"] or limit)
        acc = float(r["acc"])
        tasks[task] = {"acc": acc, "stderr": (acc * (1 - acc) / max(n - 1, 1)) ** 0.5, "n": n,
                       **({"acc_norm": r["acc_norm"]} if "acc_norm" in r else {})}
    k = len(tasks)
    mean = sum(t["acc"] for t in tasks.values()) / k
    se = sum(t["stderr"] ** 2 for t in tasks.values()) ** 0.5 / k
    return {"tasks": tasks, "average": mean, "average_stderr": se, "limit": limit,
            "lm_eval": res["lm_eval_version"], "seconds": time.perf_counter() - t0}


def zeroshot_table(entries: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Markdown lines of a zero-shot table, one row per (label, `zeroshot_result`): acc per task and the average in %,
    ± binomial standard error, the average with acc_norm where defined, and a note on how the errors are made."""
    tasks = list(entries[0][1]["tasks"])
    lines = ["| model | " + " | ".join(tasks) + " | average | average, acc_norm where defined |",
             "|---|" + "---:|" * (len(tasks) + 2)]
    for label, z in entries:
        norm = [t.get("acc_norm", t["acc"]) for t in z["tasks"].values()]
        lines.append(f"| {label} | " + " | ".join(f"{100 * z['tasks'][t]['acc']:.1f} ± "
                                                  f"{100 * z['tasks'][t]['stderr']:.1f}" for t in tasks)
                     + f" | **{100 * z['average']:.1f} ± {100 * z['average_stderr']:.1f}** | "
                     f"{100 * sum(norm) / len(norm):.1f} |")
    return lines + ["", f"acc per task (acc_norm only in the last column), lm-eval {entries[0][1]['lm_eval']} on the "
                    "local sets of ../shared/data/zeroshot; standard error sqrt(acc (1 - acc) / (n - 1)) per task, "
                    f"and sqrt(sum of the tasks' variances) / {len(tasks)} for the average."]


def cut_copy(model: nn.Module, settings: PruneSettings, calibration: Sequence[torch.Tensor] | None = None,
             scores: Any = None, export_format: str = "auto") -> tuple[nn.Module, Any, float]:
    """A cut copy of `model` (the run's cut: `prunelight.prune`), its plan and the seconds the cut took."""
    import prunelight

    pruned = copy.deepcopy(model)
    t0 = time.perf_counter()
    _, plan = prunelight.prune(pruned, settings, list(calibration or []), scores=scores, export_format=export_format)
    return pruned, plan, time.perf_counter() - t0


def machine(device: str = "cpu") -> dict[str, Any]:
    """Where the figures were measured: device, threads, torch version and the UTC date."""
    desc = device if device != "cpu" else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)"
    return {"device": desc, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def write_results(stem: str | Path, data: dict[str, Any], markdown: str | None = None) -> Path:
    """`<stem>.json` (and `<stem>.md` when given), each written atomically; returns the JSON path."""
    from prunelight.atomic import atomic_write_json, atomic_write_text

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    path = stem.parent / f"{stem.name}.json"
    atomic_write_json(path, data)
    if markdown is not None:
        atomic_write_text(stem.parent / f"{stem.name}.md", markdown)
    return path


def add_data_arguments(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """--model (the reference model) and --calibration / --eval (WikiText-2 valid / test), defaulting to the shared
    reference data when it is there."""
    if model:
        parser.add_argument("--model", default=shared_path("models", "ref-llama-gqa"),
                            help="a Hugging Face model folder (default: the shared reference model)")
    parser.add_argument("--calibration", default=shared_path("data", "wikitext2", "valid.txt"),
                        help="calibration text (default: the shared WikiText-2 valid)")
    parser.add_argument("--eval", default=shared_path("data", "wikitext2", "test.txt"),
                        help="evaluation text (default: the shared WikiText-2 test)")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, worker=None,
               flag: str = "--worker") -> argparse.Namespace | None:
    """Parse a script's options and set torch's threads from its --threads; in a worker process (started by
    `run_worker` with `flag`) run `worker(args)`, write its answer and return None."""
    if worker is not None:
        add_worker_arguments(parser, flag)
    args = parser.parse_args(argv)
    set_threads(getattr(args, "threads", None))
    if worker is not None and getattr(args, flag.lstrip("-").replace("-", "_")):
        answer_worker(args, worker(args))
        return None
    return args


def add_worker_arguments(parser: argparse.ArgumentParser, flag: str = "--worker") -> None:
    """The hidden options a script's worker process is started with: `flag` (what to run), --data-file (what
    the parent prepared, e.g. `TokenData.save`) and --worker-out (where `run_worker` reads the answer)."""
    parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--data-file", help=argparse.SUPPRESS)


def answer_worker(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """A worker's answer, written (atomically) where `run_worker` reads it."""
    from prunelight.atomic import atomic_write_json

    atomic_write_json(args.worker_out, result)


def run_worker(args: Sequence[str], threads: int | None = None, timeout: float | None = None,
               env: dict[str, str] | None = None, capture: bool = True) -> dict[str, Any]:
    """Run `python <args> --worker-out FILE` in a fresh process and return the JSON it wrote there.

    The worker gets OMP_NUM_THREADS=`threads` (when given) and `env`. A failure is returned as `{"error": ...}`
    (the last line of its stderr, or the timeout), so one failed worker never voids a long benchmark.
    """
    with tempfile.TemporaryDirectory(prefix="prunelight-worker-") as tmp:
        out = Path(tmp) / "out.json"
        full_env = {**os.environ, **(env or {})}
        if threads:
            full_env["OMP_NUM_THREADS"] = str(threads)
        try:
            proc = subprocess.run([sys.executable, *map(str, args), "--worker-out", str(out)], env=full_env,
                                  capture_output=capture, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout:.0f} s"}
        if proc.returncode == 0 and out.exists():
            return json.loads(out.read_text())
        lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"worker exited with status {proc.returncode}"}
