"""Export a pruned model as a Hugging Face folder that `from_pretrained` loads at its pruned shapes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from torch import nn

from prunelight import modeling
from prunelight.atomic import atomic_dir
from prunelight.errors import one_line
from prunelight.families import MODEL_FAMILIES, get_family, unwrap
from prunelight.settings import EXPORT_FORMATS

log = logging.getLogger(__name__)

REMOTE_CODE_FILE = "modeling_prunelight.py"


LICENSE_PATTERNS = ("LICENSE*", "LICENCE*", "NOTICE*", "USE_POLICY*")


class StockExportError(ValueError):
    """`export.format: stock` asked for a model no stock config of a served family can state."""


def _config_dict(base: nn.Module, family) -> dict:
    data = base.config.to_dict()
    data["head_dim"] = family.head_dim(base.config)
    for key in ("layer_shapes", "auto_map", "model_type", "architectures", "transformers_version"):
        data.pop(key, None)
    return data


def stock_config(model: nn.Module):
    """The stock config of a served family for a model with equal layer shapes, or a StockExportError saying why not.

    Tried in order: the model's own family, then its `stock_fallback` family (Llama shapes LlamaConfig refuses,
    e.g. 28 heads of hidden 4096, become MistralConfig with `sliding_window: null` and an explicit head_dim).
    Fields the fallback does not declare are dropped after checking that they change nothing (biases).
    """
    base = unwrap(model)
    family = get_family(base)
    shapes = family.layer_shapes(base)
    if len(set(shapes)) != 1 or not shapes[0].num_attention_heads or not shapes[0].intermediate_size:
        raise StockExportError(f"export.format=stock needs the same heads, KV heads and MLP width in every layer, got "
                               f"{sorted({tuple(s.as_dict().values()) for s in shapes})} (heads, kv, mlp); prune with "
                               "export.format: stock set so the allocation keeps shapes uniform")
    data = {**_config_dict(base, family), **shapes[0].as_dict()}
    if data.get("output_bias"):
        raise StockExportError("export.format=stock cannot state the o_proj/down_proj biases reconstruction added "
                               "(output_bias); use prune.reconstruct: least_squares or none")
    errors = []
    for fam in [family] + ([MODEL_FAMILIES[family.stock_fallback]] if family.stock_fallback else []):
        fields = data
        if fam is not family:
            lost = _lost_biases(family, fam, base.config)
            if lost:
                errors.append(f"{fam.config_class.__name__} cannot state {', '.join(lost)}")
                continue
            declared = set(fam.config_class().to_dict())
            fields = {k: v for k, v in data.items() if k in declared}
            if "sliding_window" in declared:
                fields["sliding_window"] = None  # Llama attends to the whole context
        try:
            config = fam.config_class(**fields, architectures=[fam.model_class.__name__])
        except Exception as err:  # noqa: BLE001 - huggingface_hub raises its own validation error class
            errors.append(f"{fam.config_class.__name__}: {one_line(err)}")
            continue
        if fam is not family:
            log.info("stock export: %s refuses these shapes; writing the equivalent %s", family.config_class.__name__,
                     fam.config_class.__name__)
        return config
    raise StockExportError(f"export.format=stock: no stock config accepts shape {shapes[0].as_dict()} "
                           f"({'; '.join(errors)}); use export.format: auto (prunelight config type)")


def _lost_biases(family, fallback, config) -> list[str]:
    """Biases the model has that the fallback family's modules do not build."""
    have_qkv, have_o = family.has_attn_bias(config)
    can_qkv, can_o = fallback.has_attn_bias(config)
    lost = [name for name, have, can in (("q/k/v biases", have_qkv, can_qkv), ("o_proj bias", have_o, can_o),
                                         ("MLP biases", family.has_mlp_bias(config), fallback.has_mlp_bias(config)))
            if have and not can]
    return lost


def export_config(model: nn.Module, format: str = "auto"):
    """The config to save. `stock`: a stock config of a served family or an error (see `stock_config`).

    `auto`: stock when every layer has the same shape and the family's own stock validation accepts it,
    else the prunelight type (per-layer `layer_shapes`, loaded with the bundled modeling file). A model whose
    o_proj/down_proj gained biases (`output_bias`, reconstruction) always gets the prunelight type: the stock
    config can state an o_proj bias only together with q/k/v biases.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"export.format={format!r} is not allowed: use one of {', '.join(EXPORT_FORMATS)}")
    if format == "stock":
        return stock_config(model)
    base = unwrap(model)
    family = get_family(base)
    shapes = family.layer_shapes(base)
    data = _config_dict(base, family)
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


def license_files(folder: str | Path | None) -> list[Path]:
    """The base model's license files (LICENSE*, NOTICE*, USE_POLICY*) in a local folder; [] for a hub id."""
    if folder is None or not Path(folder).is_dir():
        return []
    found = {p for pattern in LICENSE_PATTERNS for p in Path(folder).glob(pattern) if p.is_file()}
    return sorted(found)


def export_pretrained(model: nn.Module, out_dir: str | Path, tokenizer=None, format: str = "auto",
                      card: str | None = None, license_from: str | Path | None = None) -> Path:
    """Write safetensors weights, config, tokenizer (and the modeling file when shapes differ) atomically.

    `format` as in `export_config`; `card` is written as README.md and the license files of a local
    `license_from` folder are copied, inside the same atomic folder write.
    """
    base = unwrap(model)
    if hasattr(base, "peft_config") or any("lora_" in n for n, _ in base.named_parameters()):
        raise ValueError("merge LoRA adapters before export (prunelight.recovery.merge_lora)")
    config = export_config(base, format)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        architectures = list(config.architectures)
        with modeling.config_swapped(base, config):
            base.save_pretrained(tmp, safe_serialization=True)
        # save_pretrained names the in-memory class; engines pick their implementation by `architectures`.
        config.architectures = architectures
        config.save_pretrained(tmp)
        if getattr(config, "layer_shapes", None):
            shutil.copyfile(Path(modeling.__file__), tmp / REMOTE_CODE_FILE)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for path in license_files(license_from):
            shutil.copyfile(path, tmp / path.name)
        if card is not None:
            (tmp / "README.md").write_text(card, encoding="utf-8")
    return out_dir
