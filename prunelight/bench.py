"""The benchmarks' and scripts' shared harness: models and token data, the run's perplexity protocol, cuts through
the public API, result files, subprocess workers, and small documented wrappers of what they need beyond it.

`benchmarks/` and `scripts/` reach the package only through `prunelight` (`prune` / `score` / `apply_plan` /
`PruneSettings`, cut here in `Scorer` and `cut_copy`), this module and `prunelight.testing` / `prunelight.llama_cpp`,
so a figure a benchmark measures is the figure of the cut a `prunelight fit` run makes, and a change of the package's
internals changes this module, not them; `tests/test_benchmarks.py` reads their imports to keep it so.
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

from prunelight.allocation import count_params  # noqa: F401 - the benchmarks' parameter count (tied weights once)
from prunelight.settings import GGUF_TYPES, PruneSettings  # noqa: F401 - GGUF_TYPES: the types write_gguf takes

# The method presets (`configs/methods/*.yaml`, fragments over a base run) and the results folder live beside the
# package in a checkout.
PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "methods"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "benchmarks"


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


def write_text(path: str | Path, text: str) -> Path:
    """`text` written atomically to `path` (its folder made); returns the path."""
    from prunelight.atomic import atomic_write_text

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return Path(path)


def parser(doc: str | None, file: str) -> argparse.ArgumentParser:
    """The argument parser of a benchmark or script: its docstring as the help, named as it is run."""
    path = Path(file)
    prog = f"python -m benchmarks {path.stem}" if path.parent.name == "benchmarks" else f"python scripts/{path.name}"
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """A matplotlib figure written to `path` (write-then-rename) and closed; returns the path."""
    path = Path(path)
    tmp = path.with_suffix(".tmp" + path.suffix)
    fig.savefig(tmp, dpi=dpi)
    pyplot().close(fig)
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------------------------------------------
# What benchmarks and scripts need beyond the public API, each wrapped once here so that they never import the
# package's internals (which move): registries, measurements the run's report makes, export and GGUF writing.

def criteria() -> list[str]:
    """The registered importance criteria (`prune.criterion` choices), in registry order."""
    from prunelight.importance import CRITERIA

    return list(CRITERIA)


def allocations() -> list[str]:
    """The registered allocations (`prune.allocation` choices), rows registered at run time included."""
    from prunelight.allocation import ALLOCATIONS

    return list(ALLOCATIONS)


def peak_memory(device: str | torch.device = "cpu") -> Any:
    """The report's peak-memory measurement over a `with` block (`.peak` and `.rise` in bytes or None, `.kind`)."""
    from prunelight.evaluation.efficiency import PeakMemory

    return PeakMemory(torch.device(device))


@dataclass(frozen=True)
class CriterionNeeds:
    """What a criterion's scoring pass needs, which decides the plain pass it is compared with."""

    data: bool  # calibration text (False: scores from the weights alone)
    backward: bool  # a backward pass
    weight_grads: bool  # weight gradients (else activation gradients only)
    micro_batch_size: int | None  # rows per forward when it splits batches


def criterion_needs(name: str) -> CriterionNeeds:
    """The needs of the criterion registered as `name`."""
    from prunelight.importance import build_criterion
    from prunelight.testing import tiny_model

    crit = build_criterion(name)
    return CriterionNeeds(crit.needs_data, crit.needs_backward, bool(crit.grad_params(tiny_model("llama"))),
                          crit.micro_batch_size)


def scoring_pass(model: nn.Module, batches: Sequence[torch.Tensor], criterion: str,
                 all_weight_grads: bool = False) -> None:
    """One importance pass of `criterion` over `batches`, as a run scores units (the unit scores `prunelight.score`
    returns, without layer measures); `all_weight_grads` makes every weight require grad and keep its gradient for
    the whole pass, as a training-style backward does (the naive reference of the scoring-cost table)."""
    from prunelight.calibration import run_calibration
    from prunelight.importance import build_criterion

    crit = build_criterion(criterion)
    if all_weight_grads:
        own = crit.grad_params
        crit.grad_params = lambda m: list(dict.fromkeys([*own(m), *m.parameters()]))
    run_calibration(model, batches if crit.needs_data else [], crit)
    for p in model.parameters():
        p.grad = None


def paper_blocks(tokenizer: str | Path, eval: str | Path, seq_len: int, windows: int | None = None) -> torch.Tensor:
    """The papers' perplexity windows ([n, seq_len] ids): `eval` rows joined by blank lines, the tokenizer's default
    special tokens once, non-overlapping `seq_len` windows (the first `windows` of them)."""
    from prunelight.data import TextSource, pack_blocks, tokenize_source

    ids = tokenize_source(load_tokenizer(tokenizer), TextSource(path=str(eval), protocol="paper"))
    return pack_blocks(ids, seq_len)[:windows]


def shape_settings(ratio: float, **overrides: Any) -> PruneSettings:
    """A cut for speed and serving checks, where the shapes matter and not which units go: weight magnitude (no
    calibration text), global allocation, no repair; `overrides` (align_channels, min_groups, ...) on top."""
    return PruneSettings(**{"ratio": ratio, "criterion": "magnitude", "allocation": "global", "reconstruct": "none",
                            **overrides})


def speed_rows(model: nn.Module, batch_sizes: Sequence[int], label: str = "", **options: Any) -> list[dict[str, Any]]:
    """The report's speed measurement (`measure_speed`: prefill of a random prompt, then decode steps with the KV
    cache; `options` are its prompt_len, new_tokens, repeats, warmup) at each batch size, one row each."""
    from prunelight.evaluation.efficiency import measure_speed

    rows = []
    for bs in batch_sizes:
        rows.append(measure_speed(model, batch_size=bs, **options))
        print(f"[speed] {label} batch {bs}: prefill {rows[-1]['prefill_tokens_per_s']:,.0f} tok/s, decode "
              f"{rows[-1]['decode_tokens_per_s']:,.1f} tok/s", flush=True)
    return rows


def add_speedups(rows: list[dict[str, Any]], rates: dict[str, str], is_base, same: Sequence[str] = ()
                 ) -> list[dict[str, Any]]:
    """Per row, against the base row (`is_base(row)`) with equal `same` fields: `ideal_speedup` (base params /
    params) and, for each `rates` name -> key, `<name>_speedup` (rate / base rate) and `<name>_vs_ideal`. A row
    without a base is left as it is."""
    base = {tuple(r[k] for k in same): r for r in rows if is_base(r)}
    for r in rows:
        b = base.get(tuple(r[k] for k in same))
        if b is None:
            continue
        r["ideal_speedup"] = b["params"] / r["params"]
        for name, key in rates.items():
            r[f"{name}_speedup"] = r[key] / b[key]
            r[f"{name}_vs_ideal"] = r[f"{name}_speedup"] / r["ideal_speedup"]
    return rows


def layer_shapes(model: nn.Module) -> list[dict[str, int]]:
    """Per decoder layer, read from the modules: attention heads, KV heads and MLP channels (0: sub-block removed)."""
    from prunelight.families import get_family

    return [s.as_dict() for s in get_family(model).layer_shapes(model)]


def export(model: nn.Module, folder: str | Path, tokenizer: Any = None, format: str = "auto") -> Path:
    """`model` written as a Hugging Face folder, as a run's export writes it (`export.format` = `format`)."""
    from prunelight.export import export_pretrained

    return export_pretrained(model, folder, tokenizer, format=format)


def export_format(folder: str | Path) -> str:
    """The export format of a written folder, from its config.json: stock, nemotron_nas or prunelight."""
    from prunelight.export import format_of

    config = json.loads((Path(folder) / "config.json").read_text())
    return format_of(argparse.Namespace(**config))


def write_gguf(model: nn.Module, path: str | Path, dtype: str = "f16", source_gguf: str | Path | None = None) -> Path:
    """`model` written as one GGUF file of type `dtype` (one of GGUF_TYPES), as `export.gguf` writes it; the
    tokenizer keys from `source_gguf`, the file the model was loaded from."""
    from prunelight.gguf_export import write_gguf as write

    return write(model, path, dtype, source_gguf=source_gguf)


def add_lora(model: nn.Module, r: int, dropout: float = 0.0) -> nn.Module:
    """`model` wrapped with LoRA adapters of rank `r` (alpha 2r) on its family's projections, as recovery adds
    them; only the adapters are trainable (`.unload()` gives the model back)."""
    from prunelight.recovery import LoRASettings
    from prunelight.recovery import add_lora as add

    return add(model, LoRASettings(r=r, alpha=2 * r, dropout=dropout))


@dataclass(frozen=True)
class Architecture:
    """A model's counts for on-paper memory, made as a run makes them (its `Budget` at a ratio, the family's LoRA
    targets) on a weightless meta-device copy: nothing is loaded, so a 70B config costs nothing."""

    params: int  # every parameter, tied embeddings once
    params_removed: int  # what a run's cut at the ratio removes
    unit_params: int  # parameters of the decoder layers' GQA groups and MLP channels (what width pruning counts)
    units: int  # scored units: one per GQA group and per MLP channel
    layer_params: int  # every parameter of the first decoder layer
    layers: int
    hidden: int
    vocab: int
    heads: int  # the first layer's query heads, KV heads and MLP channels
    kv_heads: int
    head_dim: int
    intermediate: int
    lora_shapes: list[tuple[int, int]]  # (uncut, cut) side of every LoRA-adapted linear of every layer


def architecture(config: Any, ratio: float) -> Architecture:
    """The counts of a transformers `config` with `ratio` of its parameters removed."""
    from prunelight.allocation import make_budget
    from prunelight.families import get_family
    from prunelight.zero3 import meta_model

    model = meta_model(config)
    budget = make_budget(model, PruneSettings(ratio=ratio))
    family = get_family(model)
    first = family.layer_shapes(model)[0]
    targets = set(family.lora_targets)
    cut_inputs = {family.o_name, family.down_name}  # these lose input columns; the others lose output rows
    shapes = [(m.out_features, m.in_features) if short in cut_inputs else (m.in_features, m.out_features)
              for layer in family.layers(model) for n, m in layer.named_modules()
              if isinstance(m, nn.Linear) and (short := n.rsplit(".", 1)[-1]) in targets]
    return Architecture(
        params=budget.total, params_removed=budget.target,
        unit_params=sum(budget.layer_units(i) for i in range(budget.num_layers)),
        units=sum(budget.n_groups) + sum(budget.n_chans), layer_params=budget.layer_total(0),
        layers=budget.num_layers, hidden=config.hidden_size, vocab=config.vocab_size,
        heads=first.num_attention_heads, kv_heads=first.num_key_value_heads, head_dim=budget.head_dim,
        intermediate=first.intermediate_size, lora_shapes=shapes)


def add_data_arguments(parser: argparse.ArgumentParser, model: bool = True, samples: int | None = None) -> None:
    """--model (the reference model) and --calibration / --eval (WikiText-2 valid / test), defaulting to the shared
    reference data when it is there; with `samples`, the windows too: --samples (that default), --seq-len,
    --batch-size (calibration), --eval-batch-size and --seed."""
    if samples is not None:
        parser.add_argument("--samples", type=int, default=samples, help="calibration windows")
        parser.add_argument("--seq-len", type=int, default=128, help="tokens per window")
        parser.add_argument("--batch-size", type=int, default=8, help="calibration windows per batch")
        parser.add_argument("--eval-batch-size", type=int, default=16, help="evaluation windows per batch")
        parser.add_argument("--seed", type=int, default=0, help="which calibration windows")
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
        # the worker imports the prunelight its parent runs (a checkout need not be installed)
        package_root = str(Path(__file__).resolve().parents[1])
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, full_env.get("PYTHONPATH")) if p)
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
