"""The run's settings, one typed owner each: `prune:`, `evaluation:` and `export:` sections of the CLI and YAML.

Every option and its default is written once, here. Each value is checked in `__post_init__`, so a
bad value fails before any model or data is loaded, with one line naming the option, the value and
what is allowed. Checks against the model's config, the run and the export's shape constraint are
`run_plan.prepare_run`'s (also before any weights or data load).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal

from prunelight.allocation.base import Allocation, Shape
from prunelight.allocation.registry import ALLOCATIONS as ALLOCATION_ROWS
from prunelight.allocation.registry import allocation_of, names_with
from prunelight.allocation.shapes import EXPORT_SHAPES, shape_of_format
from prunelight.allocation.split_search import parse_split
from prunelight.allocation.targets import TARGET_OPTIONS, parse_target
from prunelight.evaluation.suite import EvaluationSettings
from prunelight.importance import CRITERIA, build_criterion
from prunelight.layer_importance import LAYER_IMPORTANCE
from prunelight.reconstruct import RECONSTRUCTIONS
from prunelight.validate import SettingsError
from prunelight.validate import bad as _bad
from prunelight.validate import choice as _choice
from prunelight.validate import integer as _integer
from prunelight.validate import number as _number

log = logging.getLogger(__name__)

# Choice lists are owned by the modules that implement them; Literal[...] makes `--help` list them.
ALLOCATIONS = tuple(ALLOCATION_ROWS)  # the registry's rows at import (allocation/registry.py): the CLI's choices
EXPORT_FORMATS = tuple(EXPORT_SHAPES)  # export.py writes the folder; allocation/shapes.py: each one's shape constraint

CriterionName = Literal[tuple(CRITERIA)]  # type: ignore[valid-type]
AllocationName = Literal[ALLOCATIONS]  # type: ignore[valid-type]
LayerImportanceName = Literal[LAYER_IMPORTANCE]  # type: ignore[valid-type]
ExportFormat = Literal[EXPORT_FORMATS]  # type: ignore[valid-type]
# GGUF types the `gguf` package writes (prunelight/gguf_export.py; Q4_K and the other k-quants it cannot quantize).
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
GgufType = Literal[GGUF_TYPES]  # type: ignore[valid-type]
ReconstructionName = Literal[RECONSTRUCTIONS]  # type: ignore[valid-type]


def allocation_options_help() -> str:
    """Every allocation row's own options with their defaults and the first sentence of their docstrings: the help of
    `prune.allocation_args` (`prunelight fit --help`), made from the rows' option dataclasses."""
    import docstring_parser  # a dependency of the CLI's help only

    rows = []
    for name, row in ALLOCATION_ROWS.items():
        if row.options is None:
            rows.append(f"{name}: no options.")
            continue
        docs = {p.arg_name: (p.description or "") for p in docstring_parser.parse_from_object(row.options).params}
        opts = []
        for f in fields(row.options):
            default = f.default if f.default is not MISSING else f.default_factory()
            shown = json.dumps(asdict(default) if is_dataclass(default) else default, default=str)
            first = " ".join(docs.get(f.name, "").split()).split(". ")[0].rstrip(".")
            opts.append(f"{f.name}={shown}" + (f" ({first})" if first else ""))
        rows.append(f"{name}: {'; '.join(opts)}.")
    return " ".join(rows)


def refresh_allocation_choices() -> None:
    """The `prune.allocation` choices of a parser built from now on: the registry's rows now (a row registered after
    import, by a plugin or a test, becomes a CLI choice; the CLI calls this before building its parser)."""
    global AllocationName
    AllocationName = Literal[tuple(ALLOCATION_ROWS)]  # type: ignore[valid-type]


def _row_options(row, args: dict[str, Any] | None) -> Any:
    """The row's options instance from `prune.allocation_args` (defaults when empty), or None for a row without."""
    args = dict(args or {})
    if row.options is None:
        if args:
            raise _bad("prune.allocation_args", args, f"allocation {row.name!r} takes no options; leave it empty")
        return None
    allowed = [f.name for f in fields(row.options)]
    unknown = [k for k in args if k not in allowed]
    if unknown:
        raise _bad(f"prune.allocation_args.{unknown[0]}", args[unknown[0]],
                   f"allocation {row.name!r} takes {', '.join(allowed)}")
    try:
        return row.options(**args)
    except (TypeError, ValueError) as err:
        raise SettingsError(str(err)) from None


def _check_tuning(tuning: LayerTuning | ModelTuning, prefix: str) -> None:
    """The checks the layer and model tunings share: `epochs`, `lr` (a number, or auto where the tuning has a rule)
    and `holdout_sequences`."""
    _integer(f"{prefix}.epochs", tuning.epochs, 0)
    if not (isinstance(tuning, ModelTuning) and tuning.lr == "auto"):
        _number(f"{prefix}.lr", tuning.lr, 0.0, 1.0, True, True)
        tuning.lr = float(tuning.lr)
    _integer(f"{prefix}.holdout_sequences", tuning.holdout_sequences, 1)


# The spellings of options that moved into `prune.allocation_args`, read for one release.
DEPRECATED_OPTIONS = ("layerwise", "split_search", "fill_width", "block_importance")


def _moved_options(settings: PruneSettings, row: Allocation) -> dict[str, Any]:
    """`allocation_args` with the deprecated top-level spellings moved in (one line each; the deprecated fields are
    cleared, and a key given in both keeps `allocation_args`' value); a moved option the row does not take is dropped,
    as it was ignored before."""
    args = dict(settings.allocation_args or {})
    takes = {f.name for f in fields(row.options)} if row.options is not None else set()
    for name in DEPRECATED_OPTIONS:
        value = getattr(settings, name)
        if value is None:
            continue
        setattr(settings, name, None)
        given = dict(value) if name == "layerwise" else {name: value}
        if name == "layerwise" and not isinstance(value, dict):
            raise _bad("prune.layerwise", value, "a mapping of the layerwise options; write them in "
                       "prune.allocation_args")
        kept = {k: v for k, v in given.items() if k in takes}
        for k, v in kept.items():
            args.setdefault(k, v)
        where = f"prune.allocation_args: {{{', '.join(f'{k}: {json.dumps(v)}' for k, v in given.items())}}}"
        log.warning("prune.%s is deprecated and goes in the next release: write %s%s", name, where,
                    "" if kept else f" (allocation {row.name!r} does not take it: ignored)")
    return args


@dataclass
class LayerTuning:
    """After the repair, each cut decoder layer trained to reproduce the dense layer's outputs on the calibration
    batches (`prunelight/layer_tuning.py`; docs/methods.md, "Layer tuning")."""

    epochs: int = 0
    """Passes over the training batches per cut layer (0, the default: no tuning, since `model_tuning` gains as much
    after it on SmolLM2 for less time; 5 was the default before it); the epoch of least held-out error is kept."""
    lr: float = 3e-4
    """Adam's learning rate."""
    holdout_sequences: int = 16
    """Calibration sequences (whole batches, the last ones) kept out of training to choose each layer's epoch."""

    def validate(self, prefix: str) -> None:
        """Check every field (called by PruneSettings)."""
        _check_tuning(self, prefix)


@dataclass
class ModelTuning:
    """After the repair (and the layer tuning, when on), the whole cut decoder trained toward the dense model's
    next-token distributions (KL) on the calibration batches (`prunelight/model_tuning.py`; docs/methods.md, "Model
    tuning")."""

    epochs: int = 2
    """Passes over the training batches (0: no tuning); the weights of least held-out KL are kept (docs/methods.md,
    "Model tuning")."""
    lr: float | str = "auto"
    """Adam's learning rate; auto: 0.0173 / hidden_size (the width scaling of Adam's rate for hidden weights: 3e-5 at
    SmolLM2's 576, the rate measured best there, 4.2e-6 at Llama-3-8B's 4096)."""
    holdout_sequences: int = 16
    """Calibration sequences (whole batches, the last ones) kept out of training to choose the weights."""
    checks_per_epoch: int = 2
    """Times per epoch the held-out KL is measured; the first check that does not lower it stops the tuning, so a model
    the tuning does not help costs a fraction of an epoch."""

    def validate(self, prefix: str) -> None:
        """Check every field (called by PruneSettings)."""
        _check_tuning(self, prefix)
        _integer(f"{prefix}.checks_per_epoch", self.checks_per_epoch, 1)


@dataclass
class PruneSettings:
    """What to remove and how: criterion, allocation and budget (the `prune:` section)."""

    ratio: float = 0.2
    """Fraction of all the model's parameters to remove, in (0, 1)."""
    criterion: CriterionName = "flap"
    """Importance criterion that scores every GQA group and MLP channel (docs/criteria.md). The default, FLAP's
    fluctuation metric, was the most robust on both reference models (README, "Choosing the default")."""
    criterion_args: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of the criterion (e.g. {p: 1} for magnitude, {seed: 1} for random)."""
    allocation: AllocationName = "search"
    """How the budget is spread over layers: search (every sub-block's width chosen by the measured KL of whole
    candidate models, from a levels database of OBS-chosen, refitted units: the only one never worse than the
    uniform cut on the real model and the reference models, docs/benchmarks.md), calibrated (global on scores put
    on one scale by one measured probe removal per sub-block), global (one knapsack on the raw scores), uniform,
    layerwise, blockwise or depth."""
    attn_mlp_split: str | None = None
    """Share of the budget taken from attention vs MLP, "x:y" (e.g. "1:3"), "auto" (searched), or null (free)."""
    prune_step: int = 0
    """Training step at which the cut happens (0: before recovery starts)."""
    min_groups: int = 1
    """GQA groups every layer keeps (0 lets global allocation remove a layer's whole attention)."""
    min_channels: int = 1
    """MLP channels every layer keeps."""
    align_channels: int = 1
    """Kept MLP channels are rounded to a multiple of this (64/128 suit GPU kernels; 1 disables)."""
    max_calibration_batches: int | None = None
    """Use at most this many calibration batches for scoring (null: all)."""
    importance_batches: int | None = 2
    """Calibration batches the measures read: layer importance, the split search and the calibrated allocation's
    probes (2: 16 sequences at the default batch size, which bounds the probes' cost at about two forwards of 16
    sequences per layer whatever the calibration set; null: every scoring batch)."""
    layer_importance: LayerImportanceName = "block_influence"
    """Layer importance measure for layerwise and depth."""
    report_layer_importance: list[LayerImportanceName] = field(
        default_factory=lambda: ["block_influence", "activation_change"])
    """Layer importance measures to record in the report and plot."""
    allocation_args: dict[str, Any] = field(default_factory=dict)
    """The allocation's own options, made into its row's options dataclass and checked there; the options of every
    allocation, with their defaults, are listed below (e.g. {generations: 24} for search, {fill_width: false} for
    blockwise)."""
    reconstruct: ReconstructionName = "least_squares"
    """Repair after the cut, from the calibration batches: none; bias (FLAP: the removed units' mean
    contribution added to the o_proj/down_proj bias); least_squares (refit the kept o_proj/down_proj columns);
    obs (structured OBS: the plan's counts kept, the units chosen greedily by the error left after the
    inverse-Hessian update, the same refit).
    Not available under DeepSpeed (docs/methods.md, Reconstruction)."""
    reconstruct_ridge: float = 1e-2
    """least_squares damping λ as a fraction of the mean diagonal of X_KᵀX_K (SparseGPT's percdamp convention);
    it shrinks the refit toward the cut weights, so the calibration error never rises."""
    layer_tuning: LayerTuning = field(default_factory=LayerTuning)
    """After the repair (any `reconstruct` but none), each cut layer trained on the calibration batches to give the
    dense layer's outputs, stopped on held-out calibration sequences; off by default ({epochs: 5} turns it on)."""
    model_tuning: ModelTuning = field(default_factory=ModelTuning)
    """After the repair and the layer tuning, the whole cut decoder trained toward the dense model's next-token
    distributions on the calibration batches, stopped on held-out calibration sequences; {epochs: 0} turns it off.
    Skipped (and said so) where its float32 weights and Adam moments do not fit in half the free memory."""
    target_params: int | str | None = None
    """Instead of `ratio`: parameters to keep at most, e.g. "6.5B", "350M", "1.2e9" or an integer."""
    target_memory: str | None = None
    """Instead of `ratio`: weight memory of all parameters at a dtype, e.g. "16GiB@bf16", "900MB@fp32"."""
    target_kv_cache: str | None = None
    """Instead of `ratio`: KV-cache bytes per token at a dtype, e.g. "64KiB@bf16"; only GQA groups are removed."""
    plan: str | None = None
    """Apply a saved plan (a plan.json, report.json or Lightning .ckpt) with no scoring; it wins over the
    ratio, criterion, allocation and, with a cross-validated ridge, reconstruct_ridge (docs/methods.md, "Plans and
    scores that travel")."""
    scores: str | None = None
    """Re-allocate from a saved scores.pt (made with this criterion on this model) with no scoring pass."""
    layerwise: dict[str, Any] | None = None
    """Deprecated (removed in the next release): the layerwise allocation's options are
    `prune.allocation_args` ({rate_strategy, alpha, importance_scale, freeze_top_n, rate_range})."""
    split_search: dict[str, Any] | None = None
    """Deprecated (removed in the next release): `prune.allocation_args: {split_search: {...}}`."""
    fill_width: bool | None = None
    """Deprecated (removed in the next release): `prune.allocation_args: {fill_width: ...}` (blockwise, depth)."""
    block_importance: str | None = None
    """Deprecated (removed in the next release): `prune.allocation_args: {block_importance: ...}` (blockwise)."""

    def __post_init__(self) -> None:
        _number("prune.ratio", self.ratio, 0.0, 1.0, True, True)
        self.ratio = float(self.ratio)
        self._parse_targets()
        _choice("prune.criterion", self.criterion, tuple(CRITERIA))
        try:
            build_criterion(self.criterion, **dict(self.criterion_args or {}))
        except ValueError as err:
            raise _bad("prune.criterion_args", self.criterion_args, str(err)) from None
        self.criterion_args = dict(self.criterion_args or {})
        _choice("prune.allocation", self.allocation, tuple(ALLOCATION_ROWS))  # rows registered later too
        row = allocation_of(self.allocation)
        if self.attn_mlp_split is not None:
            if isinstance(self.attn_mlp_split, int) and not isinstance(self.attn_mlp_split, bool):
                raise _bad("prune.attn_mlp_split", self.attn_mlp_split,
                           'an unquoted x:y in YAML is read as a base-60 number; quote it, e.g. "1:3"')
            try:
                parse_split(self.attn_mlp_split)
            except ValueError:
                raise _bad("prune.attn_mlp_split", self.attn_mlp_split,
                           "use 'x:y' with x, y >= 0 and x + y > 0 (e.g. '1:3'), 'auto', or null") from None
            if not row.splits:
                raise _bad("prune.attn_mlp_split", self.attn_mlp_split,
                           f"a split applies to allocation {' or '.join(names_with('splits'))}, "
                           f"not {self.allocation!r}")
        for name in ("prune_step", "min_groups", "min_channels"):
            _integer(f"prune.{name}", getattr(self, name), 0)
        _integer("prune.align_channels", self.align_channels, 1)
        _integer("prune.max_calibration_batches", self.max_calibration_batches, 1, optional=True)
        _integer("prune.importance_batches", self.importance_batches, 1, optional=True)
        _choice("prune.layer_importance", self.layer_importance, LAYER_IMPORTANCE)
        self.allocation_args = _moved_options(self, row)
        self._allocation_options = _row_options(row, self.allocation_args)
        if isinstance(self.layer_tuning, dict):
            self.layer_tuning = LayerTuning(**self.layer_tuning)
        self.layer_tuning.validate("prune.layer_tuning")
        if isinstance(self.model_tuning, dict):
            self.model_tuning = ModelTuning(**self.model_tuning)
        self.model_tuning.validate("prune.model_tuning")
        self.report_layer_importance = list(dict.fromkeys(self.report_layer_importance or []))
        for name in self.report_layer_importance:
            _choice("prune.report_layer_importance", name, LAYER_IMPORTANCE)
        _choice("prune.reconstruct", self.reconstruct, RECONSTRUCTIONS)
        _number("prune.reconstruct_ridge", self.reconstruct_ridge, 0.0, math.inf, True, True)
        self.reconstruct_ridge = float(self.reconstruct_ridge)

    def _parse_targets(self) -> None:
        """A deployment target replaces the ratio; at most one, and none with a saved plan."""
        given = [name for name in TARGET_OPTIONS if getattr(self, name) is not None]
        if len(given) > 1:
            raise _bad(f"prune.{given[1]}", getattr(self, given[1]),
                       f"prune.{given[0]} is set too; give one target (or none, to use prune.ratio)")
        self._target = None
        if given:
            name = given[0]
            try:
                self._target = parse_target(name.removeprefix("target_"), getattr(self, name))
            except ValueError as err:
                raise _bad(f"prune.{name}", getattr(self, name), str(err)) from None
            if name == "target_kv_cache" and self.allocation in ALLOCATION_ROWS \
                    and not ALLOCATION_ROWS[self.allocation].kv_target:
                raise _bad(f"prune.{name}", getattr(self, name),
                           "a KV-cache target removes GQA groups only, with allocation "
                           f"{' or '.join(names_with('kv_target'))}, "
                           f"not {self.allocation!r}")
            if name == "target_kv_cache" and self.attn_mlp_split is not None:
                raise _bad(f"prune.{name}", getattr(self, name),
                           "a KV-cache target takes everything from attention; leave prune.attn_mlp_split null")
        for name in ("plan", "scores"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise _bad(f"prune.{name}", value, "must be a file path or null")
        if self.plan is not None:
            if self.scores is not None:
                raise _bad("prune.scores", self.scores, "prune.plan is set too: a saved plan needs no scores")
            if given:
                raise _bad(f"prune.{given[0]}", getattr(self, given[0]),
                           "prune.plan is set: a saved plan fixes the cut (no budget applies)")
        if self.scores is not None and self.attn_mlp_split == "auto":
            raise _bad("prune.attn_mlp_split", "auto", "with prune.scores there is no calibration pass to search the "
                       "split on; use a fixed split such as '1:3' (the scores' run records the share it found)")

    @property
    def target(self):
        """The parsed deployment target (`allocation.targets.Target`), or None when `ratio` is the budget."""
        return self._target

    @property
    def row(self) -> Allocation:
        """The registry row of `allocation` (what it needs, honours and checks)."""
        return allocation_of(self.allocation)

    @property
    def allocation_options(self) -> Any:
        """The allocation row's options made from `allocation_args` (None for a row without options)."""
        return self._allocation_options

    @property
    def attn_share(self) -> float | None:
        """The attention share of the budget for a fixed "x:y" split (None: free or searched)."""
        return parse_split(self.attn_mlp_split)

    def as_dict(self) -> dict:
        """JSON-able form (report, checkpoints)."""
        return asdict(self)


@dataclass
class RunEvaluation:
    """How dense, pruned and recovered models are measured: the same data and settings for all three."""

    data_eval: bool = True
    """Perplexity on the data module's `eval` text for each model (the run's headline numbers)."""
    max_eval_batches: int | None = None
    """Use at most this many `eval` batches (null: the whole eval text)."""
    suite: EvaluationSettings | None = None
    """The full evaluation (perplexity sets, zero-shot tasks, efficiency), or null to skip it."""
    dense_cache: str | None = None
    """A folder of dense-model results: the dense evaluation is read from it when the model and these settings
    match a stored key, and stored there otherwise (`prunelight sweep` sets it; null: always measure)."""

    def __post_init__(self) -> None:
        _integer("evaluation.max_eval_batches", self.max_eval_batches, 1, optional=True)
        if self.dense_cache is not None and not str(self.dense_cache).strip():
            raise _bad("evaluation.dense_cache", self.dense_cache, "a folder path, or null")


@dataclass
class GgufSettings:
    """`export.gguf`: also write the model as one GGUF file llama.cpp runs (<out_dir>/model.<TYPE>.gguf)."""

    dtype: GgufType = "f16"
    """Weight type of the matrices (norms stay f32). q8_0 / q4_0 quantize in 32-value blocks, so every width must be
    a multiple of 32: set prune.align_channels to 32 (or a multiple)."""

    def __post_init__(self) -> None:
        _choice("export.gguf.dtype", self.dtype, GGUF_TYPES)


@dataclass
class ExportSettings:
    """Where the run writes its results (the `export:` section); the one place the output folder is named."""

    out_dir: str = "runs/prunelight"
    """Output folder: model/, report.json, report.md, figures, and Lightning's logs and checkpoints."""
    model: bool = True
    """Write the merged, pruned model as a Hugging Face folder (<out_dir>/model)."""
    figures: bool = True
    """Write the report's PNG figures."""
    format: ExportFormat = "auto"
    """Model folder type. auto: the cut keeps the richest shapes some engine serves for the family (docs/serving.md;
    the run says which engines will load it) and the folder is a stock config when every layer has one shape, else
    the Nemotron-NAS layout when it states the shapes, else the prunelight type. prunelight: per-layer shapes with no
    engine's constraint (vLLM's Transformers backend serves most; transformers loads it with trust_remote_code). stock: the cut keeps one shape in every layer (MLP-only pruning allowed, whole layers
    may go) and the folder is the family's stock config (every supported family; vLLM serves each in the serving
    check: README, "Deployable export"). nemotron_nas: the cut keeps MLP widths free per layer and one GQA group count in
    every layer that keeps attention, and the folder is the Nemotron-NAS layout vLLM serves as DeciLMForCausalLM
    (Llama-like families; README, "Serving")."""
    gguf: GgufSettings | None = None
    """Also write a GGUF file beside the model folder (`{dtype: f16}`; llama.cpp's `llama` architecture for one
    shape in every layer, `deci` for per-layer widths), or null for none."""

    def __post_init__(self) -> None:
        if isinstance(self.gguf, dict):
            self.gguf = GgufSettings(**self.gguf)
        if not str(self.out_dir).strip():
            raise _bad("export.out_dir", self.out_dir, "must be a folder path")
        _choice("export.format", self.format, EXPORT_FORMATS)

    @property
    def shape(self) -> Shape:
        """The layer-shape constraint this format puts on the cut (allocation/shapes.py)."""
        return shape_of_format(self.format)
