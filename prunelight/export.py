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


def export_config(model: nn.Module):
    """The config to save: stock when every layer has the same shape (and stock validation accepts it), else pruned.

    A model whose o_proj/down_proj gained biases (`output_bias`, reconstruction) always gets the pruned type:
    the stock config can state an o_proj bias only together with q/k/v biases.
    """
    base = unwrap(model)
    family = get_family(base)
    shapes = family.layer_shapes(base)
    data = base.config.to_dict()
    data["head_dim"] = family.head_dim(base.config)
    for key in ("layer_shapes", "auto_map", "model_type", "architectures", "transformers_version"):
        data.pop(key, None)
    uniform = len(set(shapes)) == 1 and shapes[0].num_attention_heads > 0 and shapes[0].intermediate_size > 0
    if uniform and not data.get("output_bias"):
        try:
            return family.config_class(**{**data, **shapes[0].as_dict()}, architectures=[family.model_class.__name__])
        except Exception as err:  # noqa: BLE001 - huggingface_hub raises its own validation error class
            # e.g. transformers' LlamaConfig insists hidden_size % num_attention_heads == 0.
            log.warning("uniform shapes do not pass stock %s validation (%s); saving a prunelight config",
                        family.config_class.__name__, err)
    remote = REMOTE_CODE_FILE.removesuffix(".py")
    return family.pruned_config_class(
        **data,
        layer_shapes=[s.as_dict() for s in shapes],
        architectures=[family.pruned_model_class.__name__],
        auto_map={
            "AutoConfig": f"{remote}.{family.pruned_config_class.__name__}",
            "AutoModelForCausalLM": f"{remote}.{family.pruned_model_class.__name__}",
        },
    )


def export_pretrained(model: nn.Module, out_dir: str | Path, tokenizer=None) -> Path:
    """Write safetensors weights, config, tokenizer (and the modeling file when shapes differ) atomically."""
    base = unwrap(model)
    if hasattr(base, "peft_config") or any("lora_" in n for n, _ in base.named_parameters()):
        raise ValueError("merge LoRA adapters before export (prunelight.recovery.merge_lora)")
    config = export_config(base)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        with modeling.config_swapped(base, config):
            base.save_pretrained(tmp, safe_serialization=True)
        if getattr(config, "layer_shapes", None):
            shutil.copyfile(Path(modeling.__file__), tmp / REMOTE_CODE_FILE)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out_dir
