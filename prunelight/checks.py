"""The run plan's checks: every refusal that needs neither weights nor data, each one line.

`run_plan.prepare_run` runs them once per run, before any weights or data load: the run's facts against the
settings (`check_facts`: prune_step vs max_steps / recovery, DeepSpeed, ZeRO-3 partitions, a Python call without
calibration text), min_groups / min_channels vs the config's widths, the DeepSpeed criterion and the distillation
teacher's config. Settings alone are checked earlier still, in `PruneSettings.__post_init__`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from prunelight.allocation import Allocation
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.settings import GgufSettings, PruneSettings

if TYPE_CHECKING:  # the run plan imports these checks
    from prunelight.run_plan import RunFacts


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
    from prunelight.gguf_export import check_gguf_config, check_gguf_widths

    check_gguf_config(config)
    if settings.reconstruct == "bias":
        raise ValueError("export.gguf is not allowed with prune.reconstruct=bias: it does not write the "
                         "o_proj/down_proj biases the compensation adds; use reconstruct: least_squares or none")
    check_gguf_widths(gguf.dtype, config, settings.align_channels)
