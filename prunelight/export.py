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
from prunelight.serving import (
    ATTN_REMOVED,
    GROUPS_REMOVED,
    KV_PER_LAYER,
    MLP_PER_LAYER,
    MLP_REMOVED,
    UNIFORM,
    served_formats,
)
from prunelight.settings import EXPORT_FORMATS

log = logging.getLogger(__name__)

REMOTE_CODE_FILE = "modeling_prunelight.py"


LICENSE_PATTERNS = ("LICENSE*", "LICENCE*", "NOTICE*", "USE_POLICY*")


class StockExportError(ValueError):
    """`export.format: stock` asked for a model no stock config of a served family can state."""


class NasExportError(ValueError):
    """`export.format: nemotron_nas` asked for a model the Nemotron-NAS (DeciLM) layout cannot state."""


# Engines the exports were checked in: scripts/serve_check.py serves tiny stock exports of every family, tiny and
# SmolLM2 nemotron_nas exports, in vLLM and compares greedy continuations with transformers on the same folder
# (results/benchmarks/serve_check.md; CI's vLLM step). Which family/format pairs passed is a family fact.
VLLM_VERSION = "vLLM 0.32.0"
NOT_RUN = "llama.cpp (convert_hf_to_gguf.py), TGI and TensorRT-LLM"
TRANSFORMERS_LOAD = {
    "stock": "transformers (plain, no trust_remote_code)",
    "nemotron_nas": "transformers (prunelight imported, or trust_remote_code)",
    "prunelight": "transformers (prunelight imported, or trust_remote_code)",
}


def engines_verified(config) -> list[str]:
    """What an exported folder with this `config.json` config was verified in by prunelight's own checks."""
    fmt, family = format_of(config), get_family(config)  # a stock fallback (Llama -> Mistral) is its own family
    engines = [TRANSFORMERS_LOAD[fmt]]
    shapes = getattr(config, "layer_shapes", None) or []
    removed_attn = any(not s.get("num_attention_heads", 1) for s in shapes)
    narrow = fmt == "stock" and family.vllm_head_dim_from_hidden and _query_width(config) != config.hidden_size
    if fmt in served_formats(family.name, "vllm") and not (fmt == "prunelight" and removed_attn) and not narrow:
        arch = ", ".join(getattr(config, "architectures", None) or [family.model_class.__name__])
        how = "; its Transformers backend, trust_remote_code" if fmt == "prunelight" else ""
        note = f"; {family.vllm_note}" if family.vllm_note else ""
        engines.insert(0, f"{VLLM_VERSION} ({arch}{how}: greedy output equal to transformers'{note})")
    return engines


def _query_width(config) -> int:
    """Query heads x head_dim of a (stock) config: vLLM's Qwen2 serves it only when that is the hidden size."""
    return config.num_attention_heads * get_family(config).head_dim(config)


class VllmExportError(ValueError):
    """A cut with shape features no layout vLLM serves can state (for this model config)."""


def vllm_layouts(config) -> dict[str, frozenset[str]]:
    """Per export format vLLM 0.32.0 serves for this model config, the shape features (prunelight.serving) a cut
    may have in it: a cut is servable when its features are a subset of one of them.

    `stock`: one shape in every layer (every family; Qwen2 keeping every query head). `nemotron_nas` (vLLM's DeciLM, Llama layers without a sliding
    window): per-layer MLP widths, removed attention (never the first layer's) or MLP, one GQA group count.
    `prunelight` (vLLM's Transformers backend on the folder's remote code, layers sized by `per_layer_config`):
    per-layer MLP widths and GQA groups, removed MLPs; a removed attention has no attention module for vLLM to
    serve, so it is refused.
    """
    family = get_family(config)
    out = {"stock": frozenset({UNIFORM, GROUPS_REMOVED})}
    if family.vllm_head_dim_from_hidden:  # removing a group breaks head_dim = hidden / heads
        out["stock"] = frozenset({UNIFORM})
        if _query_width(config) != config.hidden_size:
            out = {}
    if getattr(config, "output_bias", False):  # a stock config cannot state o_proj/down_proj biases
        out = {}
    if family.nemotron_nas and getattr(config, "sliding_window", None) is None and not getattr(config, "output_bias",
                                                                                                False):
        out["nemotron_nas"] = frozenset({UNIFORM, GROUPS_REMOVED, MLP_PER_LAYER, ATTN_REMOVED, MLP_REMOVED})
    if family.pruned_decoder_class is not None and not getattr(config, "output_bias", False):
        out["prunelight"] = frozenset({UNIFORM, GROUPS_REMOVED, MLP_PER_LAYER, KV_PER_LAYER, MLP_REMOVED})
    return out


def check_vllm_shapes(config, features) -> None:
    """Refuse (one line, before any weights load) a cut with these shape features (prunelight.serving names: what
    the allocation may produce) that no layout vLLM serves states for this model config."""
    features = frozenset(features)
    layouts = vllm_layouts(config)
    if any(features <= states for states in layouts.values()):
        return
    family = get_family(config)
    lacking = "; ".join(f"{fmt} lacks {', '.join(sorted(features - states))}" for fmt, states in layouts.items())
    without_removal = features - {ATTN_REMOVED}
    hint = ("keep an attention in every layer (prune.min_groups: 1)"
            if ATTN_REMOVED in features and any(without_removal <= states for states in layouts.values())
            else "cut with one shape in every layer (export.format: stock)")
    together = " together" if len(features) > 1 else ""
    raise VllmExportError(f"vLLM cannot serve a {family.name} cut with {', '.join(sorted(features))}{together}: no "
                          f"layout states it for this model ({lacking or 'it has no layout'}); {hint}")


NAS_ARCHITECTURE = "DeciLMForCausalLM"


def _config_dict(base: nn.Module, family) -> dict:
    data = base.config.to_dict()
    data["head_dim"] = family.head_dim(base.config)
    # Per-layer shape fields are restated from the layers (a model loaded from a served folder has block_configs).
    for key in ("layer_shapes", "block_configs", "auto_map", "model_type", "architectures", "transformers_version",
                "per_layer_config", "allow_global_per_layer_attribute_access"):
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


def nas_refusal(family, config, shapes) -> str | None:
    """Why the Nemotron-NAS layout cannot state these layer shapes (None: it can). See `nas_config`."""
    if not family.nemotron_nas:
        return f"it states Llama layers only, not model_type {config.model_type!r}"
    if getattr(config, "sliding_window", None) is not None:
        return f"its attention has no sliding window (the model has sliding_window={config.sliding_window})"
    if getattr(config, "output_bias", False):
        return "it cannot state the o_proj/down_proj biases reconstruction added (use prune.reconstruct: least_squares)"
    kept = sorted({(s.num_attention_heads, s.num_key_value_heads) for s in shapes if s.num_attention_heads})
    if len(kept) != 1:
        return (f"every layer that keeps attention has the same query and KV heads, got (heads, KV) {kept or 'none'} "
                "(prune with export.format: nemotron_nas set so the allocation keeps one group count)")
    if not shapes[0].num_attention_heads:
        return "vLLM's DeciLM model needs attention in the first layer"
    return None


def nas_config(model: nn.Module):
    """The Nemotron-NAS config (vLLM's `DeciLMForCausalLM`) of a pruned Llama-like model, or a NasExportError.

    One `block_configs` entry per layer: attention `{no_op, n_heads_in_group}` (query heads are the global
    `num_attention_heads`, so every layer keeping attention keeps the same groups count), ffn `{no_op,
    intermediate_size}` (free per layer). Norms, biases (`attention_bias`, `mlp_bias`), rope and tied embeddings
    are the Llama config's own fields.
    """
    base = unwrap(model)
    family = get_family(base)
    shapes = family.layer_shapes(base)
    why = nas_refusal(family, base.config, shapes)
    if why:
        raise NasExportError(f"export.format=nemotron_nas cannot state this model: {why}")
    heads, kv = next((s.num_attention_heads, s.num_key_value_heads) for s in shapes if s.num_attention_heads)
    blocks = [{"attention": {"no_op": not s.num_attention_heads,
                             "n_heads_in_group": heads // kv if s.num_attention_heads else None},
               "ffn": {"no_op": not s.intermediate_size, "intermediate_size": s.intermediate_size or None}}
              for s in shapes]
    data = _config_dict(base, family)
    llama_fields = set(modeling.NemotronNasConfig().to_dict())
    data = {k: v for k, v in data.items() if k in llama_fields}  # e.g. Mistral's sliding_window (null) goes
    remote = REMOTE_CODE_FILE.removesuffix(".py")
    return modeling.NemotronNasConfig(
        **{**data, "num_attention_heads": heads, "num_key_value_heads": kv,
           "intermediate_size": max(s.intermediate_size for s in shapes)},
        block_configs=blocks, architectures=[NAS_ARCHITECTURE],
        auto_map={"AutoConfig": f"{remote}.NemotronNasConfig",
                  "AutoModelForCausalLM": f"{remote}.NemotronNasForCausalLM"},
    )


def format_of(config) -> str:
    """Which export format a saved config is: stock, nemotron_nas or prunelight."""
    if getattr(config, "block_configs", None):
        return "nemotron_nas"
    return "prunelight" if getattr(config, "layer_shapes", None) else "stock"


def export_config(model: nn.Module, format: str = "auto"):
    """The config to save. `stock`: a stock config of a served family or an error (see `stock_config`).

    `nemotron_nas`: the served per-layer layout (see `nas_config`) or an error. `prunelight`: the prunelight type
    (see `prunelight_config`), also for shapes a stock config would state.
    `auto`: stock when every layer has the same shape and the family's own stock validation accepts it,
    else nemotron_nas when that layout states the shapes (a served format whenever the plan allows one),
    else the prunelight type (per-layer `layer_shapes`, loaded with the bundled modeling file). A model whose
    o_proj/down_proj gained biases (`output_bias`, reconstruction) always gets the prunelight type: the stock
    config can state an o_proj bias only together with q/k/v biases.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"export.format={format!r} is not allowed: use one of {', '.join(EXPORT_FORMATS)}")
    if format == "stock":
        return stock_config(model)
    if format == "nemotron_nas":
        return nas_config(model)
    if format == "prunelight":  # per-layer shapes whatever they are (vLLM's Transformers backend serves most)
        return prunelight_config(model)
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
            log.warning("uniform shapes do not pass stock %s validation (%s); trying nemotron_nas",
                        family.config_class.__name__, err)
    why = nas_refusal(family, base.config, shapes)
    if why is None:
        return nas_config(base)
    log.info("export: the Nemotron-NAS layout cannot state these shapes (%s); saving a prunelight config", why)
    return prunelight_config(base)


def prunelight_config(model: nn.Module):
    """The prunelight type: the family's config plus `layer_shapes`, loaded with the bundled modeling file.

    vLLM serves it through its Transformers backend (trust_remote_code): `AutoModel` builds the decoder at its
    per-layer widths, and transformers' heterogeneous-config overrides (`per_layer_config`: each layer's head counts
    and MLP width where they differ from the config's own, the dense model's) size each layer's attention in vLLM
    (without them vLLM gives every layer the config's head counts and crashes). The stock modules read the config's
    widths while being built and are resized right after, so their global reading is allowed
    (`allow_global_per_layer_attribute_access`).
    """
    base = unwrap(model)
    family = get_family(base)
    shapes = [s.as_dict() for s in family.layer_shapes(base)]
    data = _config_dict(base, family)
    remote = REMOTE_CODE_FILE.removesuffix(".py")
    auto_map = {
        "AutoConfig": f"{remote}.{family.pruned_config_class.__name__}",
        "AutoModelForCausalLM": f"{remote}.{family.pruned_model_class.__name__}",
    }
    if family.pruned_decoder_class is not None:
        auto_map["AutoModel"] = f"{remote}.{family.pruned_decoder_class.__name__}"
    overrides = modeling.per_layer_config(shapes, data)
    extra = {"per_layer_config": overrides, "allow_global_per_layer_attribute_access": True} if overrides else {}
    if overrides:
        _quiet_global_reads()
    return family.pruned_config_class(
        **data,
        layer_shapes=shapes,
        architectures=[family.pruned_model_class.__name__],
        auto_map=auto_map,
        **extra,
    )


def _not_a_global_read_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Reading global config value for per-layer attribute")


def _quiet_global_reads() -> None:
    """Drop transformers' warning on reading a heterogeneous config's global widths: it is meant for code that assumes
    one shape per layer, and prunelight's modules are resized to their layer's shape right after being built."""
    log_ = logging.getLogger("transformers.integrations.heterogeneity.configuration_utils")
    if _not_a_global_read_warning not in log_.filters:
        log_.addFilter(_not_a_global_read_warning)


def _without_noop_norms(model: nn.Module) -> dict:
    """The state dict less the pre-norms of removed attention / MLP sub-blocks (the DeciLM layout has none)."""
    family = get_family(model)
    gone = []
    for i, layer in enumerate(family.layers(model)):
        for kind, norm in (("attn", family.attn_norm_name), ("mlp", family.mlp_norm_name)):
            if family.sub_block(layer, kind) is None:
                gone.append(f"{family.layers_path}.{i}.{norm}.")
    return {k: v for k, v in model.state_dict().items() if not k.startswith(tuple(gone))}


def license_files(folder: str | Path | None) -> list[Path]:
    """The base model's license files (LICENSE*, NOTICE*, USE_POLICY*) in a local folder; [] for a hub id."""
    if folder is None or not Path(folder).is_dir():
        return []
    found = {p for pattern in LICENSE_PATTERNS for p in Path(folder).glob(pattern) if p.is_file()}
    return sorted(found)


def export_pretrained(model: nn.Module, out_dir: str | Path, tokenizer=None, format: str = "auto",
                      card: str | None = None, license_from: str | Path | None = None, config=None) -> Path:
    """Write safetensors weights, config, tokenizer (and the modeling file when shapes differ) atomically.

    `format` as in `export_config`; `card` is written as README.md and the license files of a local
    `license_from` folder are copied, inside the same atomic folder write. `config`: `export_config(model,
    format)` already made by the caller (its layout choice is then said once per run, not once per call).
    """
    base = unwrap(model)
    if hasattr(base, "peft_config") or any("lora_" in n for n, _ in base.named_parameters()):
        raise ValueError("merge LoRA adapters before export (prunelight.recovery.merge_lora)")
    config = export_config(base, format) if config is None else config
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        architectures = list(config.architectures)
        kwargs = {}
        if format_of(config) == "nemotron_nas":  # a no-op sub-block has no norm in that layout
            kwargs["state_dict"] = _without_noop_norms(base)
        with modeling.config_swapped(base, config):
            base.save_pretrained(tmp, safe_serialization=True, **kwargs)
        # save_pretrained names the in-memory class; engines pick their implementation by `architectures`.
        config.architectures = architectures
        config.save_pretrained(tmp)
        if getattr(config, "auto_map", None):
            shutil.copyfile(Path(modeling.__file__), tmp / REMOTE_CODE_FILE)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for path in license_files(license_from):
            shutil.copyfile(path, tmp / path.name)
        if card is not None:
            (tmp / "README.md").write_text(card, encoding="utf-8")
    return out_dir
