"""`check_run`: every refusal that needs neither weights nor data, run once before any of them load.

Called by the CLI's `before_fit` (with the model's config: sizes, saved files, the allocation's and the
shape's size checks on a weightless twin), by `prunelight.prune`, and by `PruningCallback.setup` with
the run facts alone (a Trainer built in Python skips the CLI). Settings alone are checked earlier still,
in `PruneSettings.__post_init__`. Every refusal is one line naming the bad value and what is allowed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from prunelight.allocation import Shape, allocation_of, check_shape, precheck
from prunelight.allocation.shapes import SHAPES
from prunelight.families import get_family
from prunelight.importance import build_criterion
from prunelight.saved import check_saved_inputs
from prunelight.settings import GgufSettings, PruneSettings


@dataclass(frozen=True)
class RunFacts:
    """What the trainer, the module and the data say about the run (None: not known, e.g. the Python API)."""

    recovery: str | None = None  # model.recovery
    max_steps: int | None = None  # trainer.max_steps (None or < 0: no limit)
    deepspeed: bool = False  # the cut model continues in a fresh engine (DeepSpeed)
    world_size: int = 1
    num_samples: int | None = None  # data.num_samples
    has_calibration: bool | None = None  # prunelight.prune: whether calibration tokens were given


def check_run(settings: PruneSettings, shape: Shape = Shape.FREE, config=None, run: RunFacts | None = None) -> None:
    """Refuse settings that this shape constraint, the run and (given its `config`) the model cannot meet."""
    check_shape(settings, shape)
    if run is not None:
        _check_facts(settings, run)
    if config is None:
        return
    rule = SHAPES[shape]
    if rule.check_config is not None:
        rule.check_config(config)  # the shape's family / attention refusals, also for a saved plan
    _check_widths(settings, config)
    check_saved_inputs(settings, config)  # prune.plan / prune.scores fit the model
    twin = shape_twin_of(config)
    if run is not None and run.deepspeed:
        check_deepspeed_criterion(settings, twin)
    if not settings.plan:  # a saved plan fixes the cut: no budget applies
        precheck(twin, settings, shape)  # the allocation's and the shape's model-size checks


def shape_twin_of(config) -> nn.Module:
    """A weightless (meta-device) model of `config`: true shapes and parameter counts, nothing loaded."""
    from transformers import AutoModelForCausalLM  # transformers' model registry is slow to import

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def check_deepspeed_criterion(settings: PruneSettings, model: nn.Module) -> None:
    """DeepSpeed reduces and frees weight gradients in its own hooks: scores must come from activations."""
    if settings.plan or settings.scores:
        return  # nothing is scored here
    if build_criterion(settings.criterion, **settings.criterion_args).grad_params(model):
        raise ValueError(f"prune.criterion={settings.criterion!r} is not allowed under DeepSpeed: it reads weight "
                         "gradients, which DeepSpeed partitions; use an activation-gradient criterion (taylor, "
                         "fisher, entropy) or a weight-only one (magnitude)")


def _check_facts(s: PruneSettings, run: RunFacts) -> None:
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
        if run.num_samples is not None and run.num_samples % run.world_size and not (s.plan or s.scores):
            # ZeRO-3 gathers weights collectively in every forward: all ranks must run the same number of batches.
            raise ValueError(f"data.num_samples={run.num_samples} must be a multiple of the number of processes "
                             f"({run.world_size}) under DeepSpeed")
    if run.has_calibration is False:
        if s.reconstruct != "none":
            raise ValueError(f"prune.reconstruct={s.reconstruct!r} needs calibration batches; pass calibration= "
                             "or set reconstruct='none'")
        if not (s.plan or s.scores) and build_criterion(s.criterion, **s.criterion_args).needs_data:
            raise ValueError(f"prune.criterion={s.criterion!r} scores units on calibration text; pass calibration= "
                             "(token ids) or use a weight-only criterion such as magnitude")
        if not s.plan and allocation_of(s.allocation).probes:
            raise ValueError(f"prune.allocation={s.allocation!r} measures probe removals on calibration text; pass "
                             "calibration= (token ids) or use allocation global")


def _check_widths(settings: PruneSettings, config) -> None:
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
