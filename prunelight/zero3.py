"""DeepSpeed ZeRO-3: partitioned parameters are read one module at a time inside `GatheredParameters`.

The engine's modules are never reshaped: the pruned (or LoRA-merged) model is rebuilt as a CPU copy
from weights gathered layer by layer, on rank 0 only, and written as a Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from prunelight.distributed import zero_stage
from prunelight.families import get_family, unwrap
from prunelight.importance.base import Criterion, UnitScores
from prunelight.plan import PrunePlan


def hf_zero3_loading(trainer):
    """Under ZeRO-3, tell transformers so `from_pretrained` loads weights into partitioned parameters.

    Returns the `HfDeepSpeedConfig` that transformers holds only weakly: keep it alive for as long
    as the model may be loaded. None for every other strategy.
    """
    if trainer is None or zero_stage(trainer.strategy) != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(trainer.strategy.config)


@contextlib.contextmanager
def hf_zero3_paused() -> Iterator[None]:
    """Hide the run's `HfDeepSpeedConfig` from transformers for the duration (nothing to hide: a no-op).

    While it is alive, transformers builds every model under `deepspeed.zero.Init` and re-initializes its weights
    from gathered partitions; a meta-device skeleton then fails ("Cannot copy out of meta tensor", seen on an H200
    under ZeRO-3). Skeletons hold no weights, so they need neither.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)  # transformers' own global, weakly held
    held = ref() if ref is not None else None
    if held is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(held)


def meta_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """A weightless (meta-device) transformers model of `config`: true shapes and parameter counts, nothing loaded."""
    from transformers import AutoModelForCausalLM  # transformers' model registry is slow to import

    with hf_zero3_paused(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), **({"dtype": dtype} if dtype else {}))


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
    out: UnitScores = {"attn": [], "mlp": []}
    try:
        for layer in list(layers):
            with gathered(layer):
                family.set_layers(base, nn.ModuleList([layer]))
                one = criterion.scores(base)
                family.set_layers(base, layers)
            for kind in out:
                out[kind].append(one[kind][0].detach().float().cpu())
    finally:
        family.set_layers(base, layers)
    return out


def gathered_pruned_copy(model: nn.Module, plan: PrunePlan, keep: bool = True) -> nn.Module | None:
    """A CPU copy of `model` cut to `plan`, built from weights gathered one module at a time.

    Used under DeepSpeed, where the engine's own modules must not be reshaped: rank 0 (`keep=True`)
    receives the copy, the other ranks only take part in the gathers and get None.
    """
    from prunelight.surgery import apply_plan

    base = unwrap(model)
    state = gathered_state_dict(base, to_cpu=True, keep=keep)
    if not keep:
        return None
    skeleton = meta_model(base.config, base.dtype)
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
    base = unwrap(model)
    return meta_model(base.config, base.dtype)


def gathered_merged_copy(model: nn.Module, lora=None, keep: bool = True) -> nn.Module | None:
    """A plain CPU transformers model with LoRA merged, built from weights gathered one module at a time.

    For export under ZeRO-3, where merging in place would write into partitioned placeholders.
    `lora` is the `LoRASettings` the model was wrapped with (None: no adapters). Only rank 0
    (`keep=True`) receives the copy; the other ranks take part in the gathers and get None.
    """
    from prunelight.recovery import add_lora, merge_lora

    base = unwrap(model)
    state = gathered_state_dict(base, to_cpu=True, keep=keep)
    if not keep:
        return None
    skeleton = meta_model(base.config, base.dtype)
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


