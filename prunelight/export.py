"""Export a pruned model as a Hugging Face folder that `from_pretrained` loads at its pruned shapes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from torch import nn

from prunelight import modeling
from prunelight.families import get_family, unwrap
from prunelight.atomic import atomic_dir

log = logging.getLogger(__name__)

REMOTE_CODE_FILE = "modeling_prunelight.py"


def _stock_model_type(config) -> str:
    return config.model_type.removeprefix("prunelight_")


def export_config(model: nn.Module):
    """The config to save: stock when every layer has the same shape (and stock validation accepts it), else pruned."""
    base = unwrap(model)
    family = get_family(base)
    shapes = family.layer_shapes(base)
    data = base.config.to_dict()
    data["head_dim"] = family.head_dim(base.config)
    data.pop("layer_shapes", None)
    data.pop("auto_map", None)
    stock_type = _stock_model_type(base.config)
    pruned_cls, model_cls = modeling.PRUNED_CLASSES[stock_type]
    stock_cls = pruned_cls.__mro__[1]
    for key in ("model_type", "architectures", "transformers_version"):
        data.pop(key, None)
    if len(set(shapes)) == 1 and shapes[0].num_attention_heads > 0 and shapes[0].intermediate_size > 0:
        try:
            config = stock_cls(**{**data, **shapes[0].as_dict()})
            config.architectures = [model_cls.__mro__[2].__name__]
            return config
        except Exception as err:  # noqa: BLE001 - huggingface_hub raises its own validation error class
            # e.g. transformers' LlamaConfig insists hidden_size % num_attention_heads == 0.
            log.warning("uniform shapes do not pass stock %s validation (%s); saving a prunelight config", stock_cls.__name__, err)
    config = pruned_cls(**data, layer_shapes=[s.as_dict() for s in shapes])
    config.architectures = [model_cls.__name__]
    config.auto_map = {
        "AutoConfig": f"{REMOTE_CODE_FILE[:-3]}.{pruned_cls.__name__}",
        "AutoModelForCausalLM": f"{REMOTE_CODE_FILE[:-3]}.{model_cls.__name__}",
    }
    return config


def export_pretrained(model: nn.Module, out_dir: str | Path, tokenizer=None) -> Path:
    """Write safetensors weights, config, tokenizer (and the modeling file when shapes differ) atomically."""
    base = unwrap(model)
    if hasattr(base, "peft_config") or any("lora_" in n for n, _ in base.named_parameters()):
        raise ValueError("merge LoRA adapters before export (prunelight.recovery.merge_lora)")
    config = export_config(base)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        saved_config = base.config
        base.config = config
        try:
            base.save_pretrained(tmp, safe_serialization=True)
        finally:
            base.config = saved_config
        if getattr(config, "layer_shapes", None):
            shutil.copyfile(Path(modeling.__file__), tmp / REMOTE_CODE_FILE)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out_dir
