"""Multi-process helpers: rank shares, cross-rank sums, and the DeepSpeed (ZeRO) side of the cut.

Data parallel (DDP): every rank scores its share of the calibration samples, the per-unit
statistics are summed with the strategy's all-reduce, and every rank applies the same plan.

DeepSpeed ZeRO: the engine partitions (stage 3) parameters, so weights are read one module at a
time inside `deepspeed.zero.GatheredParameters`. The cut never happens inside the running engine:
the pruned model is gathered layer by layer, written from rank 0 as a Hugging Face folder, and the
recovery continues in a freshly set-up engine loaded from that folder (see `cli.PrunelightCLI`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelight.families import get_family, unwrap
from prunelight.importance.base import Criterion, UnitScores
from prunelight.plan import PrunePlan

ZERO_STAGES = (0, 1, 2, 3)
DS_PRECISIONS = ("bf16", "fp16", "fp32")


# --- ranks and reductions ---------------------------------------------------------------------
def strategy_sum(trainer, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function summing a tensor over all ranks with the Trainer's strategy (identity on one process)."""

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        if trainer.world_size == 1:
            return t
        # Collectives need the communication device (CUDA for NCCL); results come back where they were.
        return trainer.strategy.reduce(t.to(device), reduce_op="sum").to(t.device)

    return reduce_sum


# --- strategy kinds ---------------------------------------------------------------------------
def is_deepspeed(strategy) -> bool:
    """True for Lightning's DeepSpeedStrategy (without importing deepspeed when it is absent)."""
    try:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    except ImportError:  # pragma: no cover - Lightning always ships the class
        return False
    return isinstance(strategy, DeepSpeedStrategy)


def zero_stage(strategy) -> int | None:
    """The ZeRO stage of a DeepSpeed strategy, None for other strategies."""
    if not is_deepspeed(strategy):
        return None
    return int(strategy.config.get("zero_optimization", {}).get("stage", 0))


def needs_fresh_engine(strategy) -> bool:
    """Whether the cut model must continue in a newly set-up strategy instead of being re-wrapped in place.

    A DeepSpeed engine owns flat, partitioned copies of the parameters and their optimizer state;
    reshaping modules under it is unsupported, so recovery restarts from the written pruned model.
    """
    return is_deepspeed(strategy)


def uses_checkpoint_io(strategy) -> bool:
    """False for strategies that write checkpoints themselves (DeepSpeed writes sharded folders)."""
    return not is_deepspeed(strategy)


def hf_zero3_loading(trainer):
    """Under ZeRO-3, tell transformers so `from_pretrained` loads weights into partitioned parameters.

    Returns the `HfDeepSpeedConfig` that transformers holds only weakly: keep it alive for as long
    as the model may be loaded. None for every other strategy.
    """
    if trainer is None or zero_stage(trainer.strategy) != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(trainer.strategy.config)


# --- ZeRO-3 parameter gathering ---------------------------------------------------------------
def is_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter that ZeRO-3 has partitioned across ranks."""
    return hasattr(param, "ds_id")


@contextlib.contextmanager
def gathered(module: nn.Module, modifier_rank: int | None = None) -> Iterator[nn.Module]:
    """Make `module`'s own and child parameters whole for the duration (no-op for ordinary parameters).

    Every rank must enter this together (it is a collective under ZeRO-3).
    """
    params = [p for p in module.parameters() if is_partitioned(p)]
    if not params:
        yield module
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield module


def _top_level_parts(model: nn.Module) -> list[nn.Module]:
    """The modules to gather one at a time: each decoder layer, then every other direct parameter holder."""
    base = unwrap(model)
    layers = list(get_family(base).layers(base))
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    others = []
    for module in base.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in in_layers]
        if own:
            others.append(module)
    return layers + others


def gathered_state_dict(model: nn.Module, to_cpu: bool = True, keep: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict of a (possibly ZeRO-3) model, gathered one module at a time.

    `keep=False` on non-zero ranks takes part in the collectives but stores nothing, so only
    rank 0 pays the host memory of the full copy.
    """
    base = unwrap(model)
    names = {id(m): n for n, m in base.named_modules()}
    layer_ids = {id(m) for m in get_family(base).layers(base)}
    out: dict[str, torch.Tensor] = {}
    for part in _top_level_parts(base):
        prefix = names[id(part)]
        with gathered(part):
            if not keep:
                continue
            for name, p in part.named_parameters(recurse=id(part) in layer_ids):
                t = p.detach()
                out[f"{prefix}.{name}" if prefix else name] = t.to("cpu", copy=True) if to_cpu else t.clone()
    if keep:  # persistent buffers are never partitioned; non-persistent ones (rotary tables) are not state
        for mod_name, module in base.named_modules():
            for name, b in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    key = f"{mod_name}.{name}" if mod_name else name
                    out[key] = b.detach().cpu() if to_cpu else b.detach().clone()
    return out


def gathered_scores(model: nn.Module, criterion: Criterion) -> UnitScores:
    """Weight-only criterion scores (e.g. magnitude) with one decoder layer gathered at a time.

    The criterion sees the model with a one-layer layer list, so it reads only that layer's weights.
    """
    base = unwrap(model)
    family = get_family(base)
    layers = family.layers(base)
    parent, attr = _layers_parent(base, family.layers_path)
    out: UnitScores = {"attn": [], "mlp": []}
    try:
        for layer in list(layers):
            with gathered(layer):
                setattr(parent, attr, nn.ModuleList([layer]))
                one = criterion.scores(base)
                setattr(parent, attr, layers)
            for kind in out:
                out[kind].append(one[kind][0].detach().float().cpu())
    finally:
        setattr(parent, attr, layers)
    return out


def _layers_parent(base: nn.Module, path: str) -> tuple[nn.Module, str]:
    *head, last = path.split(".")
    parent = base
    for part in head:
        parent = getattr(parent, part)
    return parent, last


def gathered_pruned_copy(model: nn.Module, plan: PrunePlan, keep: bool = True) -> nn.Module | None:
    """A CPU copy of `model` cut to `plan`, built from weights gathered one module at a time.

    Used under DeepSpeed, where the engine's own modules must not be reshaped: rank 0 (`keep=True`)
    receives the copy, the other ranks only take part in the gathers and get None.
    """
    from transformers import AutoModelForCausalLM

    from prunelight.surgery import apply_plan

    base = unwrap(model)
    state = gathered_state_dict(base, to_cpu=True, keep=keep)
    if not keep:
        return None
    config = copy.deepcopy(base.config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=base.dtype)
    skeleton.load_state_dict(state, strict=False, assign=True)
    if getattr(base.config, "tie_word_embeddings", False):
        skeleton.tie_weights()
    missing = [n for n, p in skeleton.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"gathered weights do not cover the model: missing {missing[:5]}")
    _fill_meta_buffers(skeleton, base)
    apply_plan(skeleton, plan)
    return skeleton.eval()


def shape_twin(model: nn.Module) -> nn.Module:
    """A weightless (meta-device) copy of `model`'s architecture: true shapes and parameter counts.

    Under ZeRO-3 the engine's parameters are empty placeholders, so allocation counts on this twin.
    """
    from transformers import AutoModelForCausalLM

    base = unwrap(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=base.dtype)


def make_plan_sharded(
    model: nn.Module,
    batches,
    ratio: float,
    criterion: str = "taylor",
    criterion_args: dict | None = None,
    allocation: str = "global",
    allocation_args: dict | None = None,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    max_batches: int | None = None,
) -> tuple[PrunePlan, UnitScores]:
    """`pipeline.make_plan` for a model whose weights may be ZeRO-3 partitioned.

    Activation-gradient criteria run as usual (their hooks never read weights); weight-only
    criteria read one gathered layer at a time; the allocation counts parameters on a meta twin.
    """
    from prunelight.allocation import allocate
    from prunelight.allocation.split_search import parse_split
    from prunelight.calibration import run_calibration
    from prunelight.importance import build_criterion
    from prunelight.pipeline import _PIPELINE_KEYS

    args = dict(allocation_args or {})
    own = {k: args.pop(k) for k in _PIPELINE_KEYS if k in args}
    # These run extra forward passes on masked (written-to) weights: not possible on partitioned ones.
    unsupported = [
        name for name, bad in (
            (f"allocation={allocation}", allocation in ("layerwise", "depth")),
            ("attn_mlp_split=auto", own.get("attn_mlp_split") == "auto"),
            ("block_importance=removal", own.get("block_importance") == "removal"),
            ("report_layer_importance", bool(own.get("report_layer_importance"))),
        ) if bad
    ]
    if unsupported:
        raise ValueError(f"not available with ZeRO-3 partitioned weights: {', '.join(unsupported)}; "
                         "use DeepSpeed stage 2 or DDP for these options")
    share = parse_split(own.get("attn_mlp_split"))
    if share is not None:
        args["attn_share"] = share
    crit = build_criterion(criterion, **(criterion_args or {}))
    if crit.needs_data:
        scores = run_calibration(model, batches, crit, reduce_sum, max_batches)
    else:
        scores = gathered_scores(model, crit)
    plan = allocate(shape_twin(model), scores, ratio, allocation, **args)
    plan.meta.update(criterion=criterion, criterion_args=dict(criterion_args or {}), samples=crit.num_samples)
    return plan, scores


def gathered_merged_copy(model: nn.Module, lora=None, keep: bool = True) -> nn.Module | None:
    """A plain CPU transformers model with LoRA merged, built from weights gathered one module at a time.

    For export under ZeRO-3, where merging in place would write into partitioned placeholders.
    `lora` is the `LoRASettings` the model was wrapped with (None: no adapters). Only rank 0
    (`keep=True`) receives the copy; the other ranks take part in the gathers and get None.
    """
    from transformers import AutoModelForCausalLM

    from prunelight.recovery import add_lora, merge_lora

    base = unwrap(model)
    state = gathered_state_dict(base, to_cpu=True, keep=keep)
    if not keep:
        return None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=base.dtype)
    plain = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    skeleton.load_state_dict(plain, strict=False, assign=True)
    if getattr(base.config, "tie_word_embeddings", False):
        skeleton.tie_weights()
    _fill_meta_buffers(skeleton, base)
    if lora is None:
        return skeleton
    wrapped = add_lora(skeleton, lora)  # the same adapters, created on CPU, then given the trained values
    unwrap(wrapped).load_state_dict(state, strict=True)
    return merge_lora(wrapped)


def _fill_meta_buffers(skeleton: nn.Module, base: nn.Module) -> None:
    """Copy non-persistent buffers (rotary inverse frequencies), which no state dict carries."""
    ref = dict(base.named_buffers())
    for name, buf in list(skeleton.named_buffers()):
        if buf.is_meta:
            owner = skeleton.get_submodule(name.rsplit(".", 1)[0]) if "." in name else skeleton
            owner.register_buffer(name.rsplit(".", 1)[-1], ref[name].detach().cpu().clone(), persistent=False)


# --- DeepSpeed configuration ------------------------------------------------------------------
def deepspeed_config(
    stage: int = 3,
    precision: str = "bf16",
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    gradient_clipping: float | None = 1.0,
    activation_checkpointing: bool = False,
    bucket_size: int = 200_000_000,
) -> dict[str, Any]:
    """A DeepSpeed config dict for `DeepSpeedStrategy(config=...)`, checked before any engine starts.

    Batch sizes are left to Lightning (it fills `train_micro_batch_size_per_gpu` from the loader).
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if precision not in DS_PRECISIONS:
        raise ValueError(f"DeepSpeed precision must be one of {DS_PRECISIONS}, got {precision!r}")
    if offload_parameters and stage != 3:
        raise ValueError(f"offload_parameters needs ZeRO stage 3 (only there are parameters partitioned), got {stage}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": bucket_size,
        "allgather_bucket_size": bucket_size,
    }
    if stage == 3:
        # Sharded checkpoints; the pruned model is exported through `gathered_state_dict` instead.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if gradient_clipping:
        cfg["gradient_clipping"] = float(gradient_clipping)
    if activation_checkpointing:
        cfg["activation_checkpointing"] = {"partition_activations": stage == 3, "contiguous_memory_optimization": False}
    return cfg


# --- checkpoints ------------------------------------------------------------------------------
def trainable_keys(module: nn.Module) -> set[str]:
    """State-dict keys of the parameters that train (LoRA adapters), as `module.state_dict()` names them."""
    return {name for name, p in module.named_parameters() if p.requires_grad}


def write_pruned_model(model: nn.Module, out_dir: str | Path, tokenizer=None) -> Path:
    """Write a pruned model as a Hugging Face folder (atomic; call on rank 0 only)."""
    from prunelight.export import export_pretrained

    return Path(export_pretrained(model, Path(out_dir), tokenizer=tokenizer))
