"""`prepare_run`: the run plan, made once before any weights or data load; the one place a run is checked.

Every refusal that needs neither weights nor data happens here, once per run: the settings against the export's
shape constraint, the run's facts (trainer, strategy, data: prune_step vs max_steps, DeepSpeed, ZeRO-3 with an
allocation whose measurement runs masked forwards, distillation under ZeRO-3), the model's config (min_groups /
min_channels vs its widths, a saved plan or scores vs the config, the shape's config check, the allocation's
feasibility and the shape's size checks on a weightless twin), the GGUF export (`export.gguf`) and the
distillation teacher's config (its vocabulary and hidden size). Settings alone were checked earlier still, in
`PruneSettings.__post_init__`.

The `RunPlan` it returns carries what the checks made (the budget, the allocation row and its options, the shape)
and is handed on: the CLI's `before_fit` makes it, `PruningCallback` and `prunelight.prune` take it, and
`cut.run_cut` cuts from it; none of them re-checks. Every refusal is one line naming the bad value and what is
allowed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from prunelight.allocation import Allocation, Budget, Shape, allocation_of, check_shape, precheck
from prunelight.allocation.shapes import SHAPES
from prunelight.families import get_family, unwrap
from prunelight import serving
from prunelight.export import check_vllm_shapes, vllm_layouts
from prunelight.gguf_export import GgufExportError, check_gguf_config, check_gguf_shapes, check_gguf_widths, gguf_layouts
from prunelight.importance import build_criterion
from prunelight.plan import PrunePlan
from prunelight.saved import SavedScores, read_saved_inputs
from prunelight.settings import GgufSettings, PruneSettings
from prunelight.zero3 import meta_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunFacts:
    """What the trainer, the module and the data say about the run (None: not known, e.g. the Python API)."""

    recovery: str | None = None  # model.recovery
    max_steps: int | None = None  # trainer.max_steps (None or < 0: no limit)
    deepspeed: bool = False  # the cut model continues in a fresh engine (DeepSpeed)
    zero_stage: int | None = None  # DeepSpeed's ZeRO stage (None: not DeepSpeed)
    world_size: int = 1
    num_samples: int | None = None  # data.num_samples
    has_calibration: bool | None = None  # prunelight.prune: whether calibration tokens were given
    has_scores: bool = False  # prunelight.prune(scores=...): unit scores handed in (the criterion reads no text)
    distillation: Any = None  # model.distillation (DistillationSettings), or None
    teacher_config: Any = None  # the config of model.distillation.teacher, when one is named
    gguf: GgufSettings | None = None  # export.gguf: the GGUF file the run will also write, or None
    export_format: str | None = None  # export.format (None: not known, e.g. scoring alone)


@dataclass(frozen=True)
class RunPlan:
    """What a run cuts with, checked once before anything loads: the settings, the shape, the row and the budget."""

    settings: PruneSettings
    shape: Shape
    row: Allocation  # the registry row of settings.allocation
    budget: Budget | None = None  # counted on the config's twin; None with a saved plan (it fixes the cut)
    facts: RunFacts | None = None
    saved_plan: PrunePlan | None = None  # prune.plan, read once and checked against the config
    saved_scores: SavedScores | None = None  # prune.scores, read once (its weights fingerprint is checked at the cut)

    @property
    def options(self) -> Any:
        """The allocation row's options (`prune.allocation_args`), or None for a row without options."""
        return self.settings.allocation_options

    def with_settings(self, **changes: Any) -> RunPlan:
        """The same plan with settings that change no budget (e.g. a smoke test's fewer calibration batches)."""
        return replace(self, settings=replace(self.settings, **changes))


def prepare_run(settings: PruneSettings, shape: Shape = Shape.FREE, config=None,
                run: RunFacts | None = None, model: nn.Module | None = None) -> RunPlan:
    """Refuse settings that this shape constraint, the run and (given its `config`) the model cannot meet; the plan.

    The budget is counted on a weightless twin of `config`, or on `model` when one is already loaded (the Python
    API; its config is then the model's). Without either, the plan has no budget (a Trainer built in Python:
    `PruningCallback.setup` makes the plan again with the module's config, still before the weights load).
    """
    if model is not None:
        config = unwrap(model).config
    row = allocation_of(settings.allocation)
    if config is not None and run is not None and run.export_format is not None and not settings.plan:
        settings, shape = serving_constraint(settings, shape, config, run.export_format, run.gguf)
    check_shape(settings, shape)  # the allocation honours the shape (the one the export's targets serve)
    if run is not None:
        check_facts(settings, row, run)
    if config is None:
        return RunPlan(settings, shape, row, facts=run)
    if run is not None and run.distillation is not None and run.teacher_config is not None:
        check_teacher_config(run.distillation, config, run.teacher_config)
    check_widths(settings, config)
    if run is not None:
        check_gguf_export(settings, run.gguf, config)
    saved_plan, saved_scores = read_saved_inputs(settings, config)  # prune.plan / prune.scores fit the model
    twin = model if model is not None else meta_model(config)
    if run is not None and run.deepspeed:
        check_deepspeed_criterion(settings, twin)
    budget = None
    if settings.plan:  # a saved plan fixes the cut: no budget applies, only the shape's config check
        if SHAPES[shape].check_config is not None:
            SHAPES[shape].check_config(config)
    else:
        budget = precheck(twin, settings, shape)  # the shape's config check, the row's and the shape's size checks
    return RunPlan(settings, shape, row, budget, run, saved_plan, saved_scores)


def check_deepspeed_criterion(settings: PruneSettings, model: nn.Module) -> None:
    """DeepSpeed reduces and frees weight gradients in its own hooks: scores must come from activations."""
    if settings.plan or settings.scores:
        return  # nothing is scored here
    if build_criterion(settings.criterion, **settings.criterion_args).grad_params(model):
        raise ValueError(f"prune.criterion={settings.criterion!r} is not allowed under DeepSpeed: it reads weight "
                         "gradients, which DeepSpeed partitions; use an activation-gradient criterion (taylor, "
                         "fisher, entropy) or a weight-only one (magnitude)")


def check_facts(s: PruneSettings, row: Allocation, run: RunFacts) -> None:
    """The settings against what the trainer, the module and the data say about the run."""
    step = s.prune_step
    if step and run.max_steps is not None and run.max_steps >= 0 and step >= run.max_steps:
        raise ValueError(f"prune.prune_step={step} is not allowed: the run stops at trainer.max_steps="
                         f"{run.max_steps}; use a step below it")
    if step and run.recovery == "none":
        raise ValueError(f"prune.prune_step={step} is not allowed with model.recovery=none (nothing trains before "
                         "or after the cut); use prune_step: 0")
    if run.deepspeed:
        if step:
            raise ValueError(f"prune.prune_step={step} is not allowed under DeepSpeed: the cut happens before "
                             "recovery; use prune_step: 0")
        if s.reconstruct != "none":
            raise ValueError(f"prune.reconstruct={s.reconstruct} is not allowed under DeepSpeed: the cut model is "
                             "written from gathered weights without calibration activations; use reconstruct: none, "
                             "or DDP")
        if run.zero_stage == 3 and not s.plan:
            check_partitioned(s, row)
        if run.zero_stage == 3 and run.distillation is not None:
            raise ValueError("model.distillation is not allowed under DeepSpeed ZeRO-3: the teacher would be a full "
                             "unpartitioned copy on every GPU; use DDP or ZeRO stage 1/2, or model.distillation: null")
        if run.num_samples is not None and run.num_samples % run.world_size and not (s.plan or s.scores):
            # ZeRO-3 gathers weights collectively in every forward: all ranks must run the same number of batches.
            raise ValueError(f"data.num_samples={run.num_samples} must be a multiple of the number of processes "
                             f"({run.world_size}) under DeepSpeed")
    if run.has_calibration is False:
        if s.reconstruct != "none":
            raise ValueError(f"prune.reconstruct={s.reconstruct!r} needs calibration batches; pass calibration= "
                             "or set reconstruct='none'")
        if not (s.plan or s.scores or run.has_scores) and build_criterion(s.criterion, **s.criterion_args).needs_data:
            raise ValueError(f"prune.criterion={s.criterion!r} scores units on calibration text; pass calibration= "
                             "(token ids) or use a weight-only criterion such as magnitude")
        if not s.plan and row.measure is not None:
            raise ValueError(f"prune.allocation={s.allocation!r} measures on calibration text; pass "
                             "calibration= (token ids) or use allocation global")


def check_partitioned(settings: PruneSettings, row: Allocation) -> None:
    """Options that run extra forward passes on masked (written-to) weights cannot run on ZeRO-3 partitions."""
    unsupported = [
        name for name, bad in (
            # layer importance measures removals by masked forwards too
            (f"prune.allocation={settings.allocation}", row.layer_importance or not row.zero3),
            ("prune.attn_mlp_split=auto", settings.attn_mlp_split == "auto"),
            ("prune.allocation_args.block_importance=removal", row.block_removal(settings)),  # read by blockwise only
        ) if bad
    ]
    if unsupported:
        hint = " (prune.allocation: global needs no masked forwards)" if not row.zero3 else ""
        raise ValueError(f"not available with ZeRO-3 partitioned weights: {', '.join(unsupported)}; "
                         f"use DeepSpeed stage 2 or DDP for these options{hint}")


def check_teacher_config(distillation: Any, config, teacher_config) -> None:
    """A named distillation teacher must share the model's vocabulary (and, with `hidden`, its hidden size)."""
    source = distillation.teacher
    want, have = config.vocab_size, teacher_config.vocab_size
    if want != have:
        raise ValueError(f"model.distillation.teacher={source!r} is not allowed: its vocabulary has {have} "
                         f"tokens, the model's {want}; use a teacher with the same tokenizer")
    if distillation.hidden and teacher_config.hidden_size != config.hidden_size:
        raise ValueError(f"model.distillation.hidden=True is not allowed with teacher {source!r}: hidden sizes "
                         f"differ ({teacher_config.hidden_size} vs {config.hidden_size})")


def check_widths(settings: PruneSettings, config) -> None:
    """min_groups / min_channels against the model's widths."""
    shape = get_family(config).base_shape(config)
    for option, keep, have, what in (
        ("prune.min_groups", settings.min_groups, shape.num_key_value_heads, "KV groups"),
        ("prune.min_channels", settings.min_channels, shape.intermediate_size, "MLP channels"),
    ):
        if keep > have:
            raise ValueError(f"{option}={keep} is not allowed: the model's layers have {have} {what}; "
                             f"use at most {have}")


def check_gguf_export(settings: PruneSettings, gguf: GgufSettings | None, config) -> None:
    """`export.gguf` against the model's config and the cut's settings, before any weights load (one line each)."""
    if gguf is None:
        return
    check_gguf_config(config)
    if settings.reconstruct == "bias":
        raise ValueError("export.gguf is not allowed with prune.reconstruct=bias: it does not write the "
                         "o_proj/down_proj biases the compensation adds; use reconstruct: least_squares or none")
    check_gguf_widths(gguf.dtype, config, settings.align_channels)


def engine_layouts(config, engine: str) -> dict[str, frozenset[str]]:
    """Per format `engine` serves this model config in, the shape features a cut may have: a cut is servable
    when its features are a subset of one of them (llama.cpp: per GGUF architecture; vLLM: per export format)."""
    if engine == "llama.cpp":
        try:
            return gguf_layouts(config)
        except GgufExportError:
            return {}
    if engine == "vllm":
        return vllm_layouts(config)
    raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(serving.ENGINES)}")


def check_servable(config, engine: str, features) -> None:
    """Refuse (one line, before any weights load) a cut with these shape features that `engine` cannot serve for
    this model config, naming the family and what the engine cannot state."""
    if engine == "llama.cpp":
        check_gguf_config(config)
        check_gguf_shapes(config, features)
    elif engine == "vllm":
        check_vllm_shapes(config, features)
    else:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(serving.ENGINES)}")


def serving_constraint(settings: PruneSettings, shape: Shape, config, export_format: str,
                       gguf: GgufSettings | None) -> tuple[PruneSettings, Shape]:
    """The shapes the export's targets serve for this model, as the cut's constraint (one line saying which engines
    will load the result): with `export.gguf` the richest llama.cpp layout; with `auto` the richest layout of any
    engine (`serving.SERVING`, read for this config by `engine_layouts`); `stock` / `nemotron_nas` keep their own
    shape; `prunelight` none. Per-layer widths a target cannot state make the cut one shape in every layer; a removed
    GQA group it cannot state keeps attention whole; a removed sub-block it cannot state is refused in one line."""
    fam = get_family(config)
    family = fam.name
    layouts = {engine: engine_layouts(config, engine) for engine in serving.ENGINES}  # read once, for the log line too
    if export_format == "prunelight" and gguf is None:
        log.info("export.format=prunelight: per-layer shapes, no engine's constraint; %s", _loaders(layouts, None))
        return settings, shape
    options = {(engine, via): states for engine in (("llama.cpp",) if gguf is not None else serving.ENGINES)
               for via, states in layouts[engine].items()}
    if shape is not Shape.FREE:  # stock / nemotron_nas: the format's own shape, within what the GGUF states
        fixed = _SHAPE_FEATURES[shape]
        options = {k: fixed & v for k, v in options.items()} if gguf is not None else {("format", export_format): fixed}
    if not options:
        return settings, shape  # nothing serves this model: the export's own refusals say so
    (engine, via), allowed = max(options.items(), key=lambda kv: (len(kv[1]), kv[0][0] == "llama.cpp"))
    target = "export.gguf" if gguf is not None else f"export.format={export_format}"
    for feature, option in ((serving.ATTN_REMOVED, "min_groups"), (serving.MLP_REMOVED, "min_channels")):
        if feature not in allowed and getattr(settings, option) == 0:
            raise ValueError(f"prune.{option}=0 is not allowed with {target}: it lets a layer lose a whole sub-block "
                             f"({feature}), which no engine the export targets serves for {family}; use "
                             f"prune.{option}: 1, or export.format: prunelight (transformers with trust_remote_code)")
    if not allowed & {serving.MLP_PER_LAYER, serving.KV_PER_LAYER} and shape is Shape.FREE:
        shape = Shape.UNIFORM
        log.info("%s for %s: %s %s states one shape in every layer, so the cut keeps one", target, family, engine, via)
    if serving.GROUPS_REMOVED not in allowed:
        keep = fam.base_shape(config).num_key_value_heads
        if settings.min_groups < keep:
            log.info("%s for %s: %s %s states no removed GQA group, so the cut takes MLP channels only "
                     "(prune.min_groups=%d)", target, family, engine, via, keep)
            settings = replace(settings, min_groups=keep)
    if shape is Shape.FREE:
        log.info("%s for %s: the cut keeps the shapes %s serves (%s: %s); %s", target, family, engine, via,
                 ", ".join(sorted(allowed)), _loaders(layouts, allowed))
    return settings, shape


# A shape constraint's features (what its cuts may hold), to meet a target's.
_SHAPE_FEATURES = {Shape.UNIFORM: frozenset({serving.UNIFORM, serving.GROUPS_REMOVED}),
                   Shape.SERVED: frozenset({serving.UNIFORM, serving.GROUPS_REMOVED, serving.MLP_PER_LAYER,
                                            serving.ATTN_REMOVED, serving.MLP_REMOVED})}


def _loaders(layouts: dict[str, dict[str, frozenset[str]]], features: frozenset[str] | None) -> str:
    """Which engines load a cut with up to these features (all of the family's per-layer ones when None); an engine
    that states only some of them is named with the features its cut must not have."""
    names = []
    for engine, formats in layouts.items():
        if features is None:
            fits = [(via, frozenset()) for via, states in formats.items() if serving.MLP_PER_LAYER in states]
        else:
            fits = [(via, features - states) for via, states in formats.items() if serving.MLP_PER_LAYER in states
                    or features <= states]
        if fits:
            via, missing = min(fits, key=lambda kv: len(kv[1]))
            names.append(f"{engine} ({via}" + (f", if the cut has no {', '.join(sorted(missing))})" if missing else ")"))
    return "engines that load it: " + (", ".join(names) if names else "none; transformers with trust_remote_code")
