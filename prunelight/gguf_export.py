"""Write a (cut) model as one GGUF file that llama.cpp runs, with the `gguf` package.

Each family lists the llama.cpp architectures that can state its layers (`ModelFamily.gguf_archs`, its own first:
`qwen3`, `gemma3`, `gemma2`, `phi3`, `qwen2`, `llama`), and `gguf_layout` takes the first whose loader and graph
state the cut's shapes (`ARCHS`: what each architecture reads, from llama.cpp's src/models/<arch>.cpp of the release
node-llama-cpp 3.21.1 ships, and measured: docs/serving.md). Only `deci` (and `openelm`, without removed sub-blocks)
read `attention.head_count`, `attention.head_count_kv` and `feed_forward_length` per layer: every other graph sizes
its tensors from layer 0's entry, so a per-layer cut of a family with neither is refused (`check_gguf_shapes`).

What llama.cpp's converter (convert_hf_to_gguf.py) writes for each architecture is written the same way: tensor
names from the `gguf` package's name map of that architecture, Gemma's RMSNorm offset (+1 in every norm weight),
soft-caps, the sliding-window period and its rope base, Phi-3's fused qkv / gate_up and partial rotary dimension,
rotary order (q/k rows interleaved for `llama` / `deci`). The attention scale llama.cpp's graph uses is not always
the model's (Gemma's `query_pre_attn_scalar`; Gemma's 27B rule reads layer 0's head count), so the ratio is folded
into the q norm (or the q rows): the file computes transformers' scores whatever the cut did to the heads.

The tokenizer keys come from the source GGUF when the model came from one, else from the Hugging Face tokenizer
(prunelight/gguf_vocab.py). Quantized types (q8_0, q4_0) quantize every matrix along its input dimension in blocks,
so every input width must be a multiple of the block size: `check_gguf_widths` refuses that from the config.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from prunelight import __version__
from prunelight.atomic import atomic_path
from prunelight.errors import GgufExportError
from prunelight.serving import (
    ATTN_REMOVED,
    GROUPS_REMOVED,
    KV_PER_LAYER,
    LLAMA_CPP,
    MLP_PER_LAYER,
    MLP_REMOVED,
    PER_LAYER,
    UNIFORM,
    shape_features,
)
from prunelight.families import LayerShape, ModelFamily, get_family, unwrap
from prunelight.gguf_vocab import copy_tokenizer, write_tokenizer
from prunelight.sources import WRITER_KEY

log = logging.getLogger(__name__)


from prunelight.settings import GGUF_TYPES  # noqa: E402 - the settings own the choice list

_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0"}


# Channels of the all-zero MLP standing in for a removed one under a kept attention (`written_shapes`): one
# quantization block of every type written.
ZERO_MLP = 32


@dataclass(frozen=True)
class ArchFacts:
    """What one llama.cpp architecture's loader and graph state (llama.cpp v0.4.0, src/models/<arch>.cpp)."""

    states: frozenset[str]
    """Shape features (prunelight.serving) its tensors can hold: `per_layer` archs size each layer's tensors from
    the per-layer arrays, the others from layer 0's entry (another width is a load error)."""
    interleaved_rope: bool = False
    """LLAMA_ROPE_TYPE_NORM: rotates interleaved pairs, so q/k rows are reordered from transformers' half split."""
    full_rotary: bool = False
    """The loader insists rope.dimension_count == key_length (no partial rotary)."""
    query_is_hidden: bool = False
    """attn_q / attn_output are hidden x hidden: every query head must stay (qwen2, phi3)."""
    fused_qkv: bool = False
    """q, k and v rows in one attn_qkv tensor (the converter keeps Phi-3's fused; openelm reads only that)."""
    fused_gate_up: bool = False
    """gate then up rows in one ffn_up tensor (phi3)."""
    qkv_bias: bool = True
    """Reads optional q/k/v biases (every architecture built with create_tensor_qkv)."""
    o_bias: bool = False
    """Reads an optional attn_output.bias."""
    mlp_bias: bool = False
    """Reads optional ffn_gate / ffn_up / ffn_down biases."""
    tied_only: bool = False
    """Its head is token_embd (an output.weight would be a tensor too many)."""
    sliding_period: bool = False
    """States sliding-window layers as a period (`attention.sliding_window_pattern`: every p-th layer full, the last
    of each period); the others attend to the whole context."""
    swa_rope_base: bool = False
    """Reads rope.freq_base_swa (the sliding layers' own rotary base)."""
    rope_freqs: bool = False
    """Reads rope_freqs.weight (Llama-3 rope scaling)."""
    softcaps: tuple[str, ...] = ()
    """Config fields written as `<arch>.<field>` keys (attention / final logit soft-capping)."""
    always_attn_softcap: bool = False
    """The graph soft-caps attention scores whatever the file says (gemma2: 50 when absent)."""
    scale_by_hidden_over_heads_at: tuple[int, ...] = ()
    """Block counts at which the graph scales scores by (hidden / layer 0's heads)^-0.5 instead of head_dim^-0.5
    (Gemma's 27B rule, picked by the layer count)."""
    zero_mlp_for_removed: bool = False
    """A layer with feed_forward_length 0 is skipped whole, attention included (deci): a removed MLP under a kept
    attention is written as a zero MLP of `ZERO_MLP` channels."""


_ALL = frozenset({UNIFORM, GROUPS_REMOVED, MLP_PER_LAYER, KV_PER_LAYER, ATTN_REMOVED, MLP_REMOVED})
ARCHS: dict[str, ArchFacts] = {
    "llama": ArchFacts(frozenset({UNIFORM, GROUPS_REMOVED}), interleaved_rope=True, full_rotary=True, o_bias=True,
                       mlp_bias=True, rope_freqs=True),
    "deci": ArchFacts(_ALL, interleaved_rope=True, full_rotary=True, o_bias=True, mlp_bias=True, rope_freqs=True,
                      zero_mlp_for_removed=True),
    "qwen2": ArchFacts(frozenset({UNIFORM}), query_is_hidden=True),
    "qwen3": ArchFacts(frozenset({UNIFORM, GROUPS_REMOVED})),
    "gemma2": ArchFacts(frozenset({UNIFORM, GROUPS_REMOVED}), tied_only=True, sliding_period=True, swa_rope_base=True,
                        softcaps=("attn_logit_softcapping", "final_logit_softcapping"), always_attn_softcap=True,
                        scale_by_hidden_over_heads_at=(46,)),
    "gemma3": ArchFacts(frozenset({UNIFORM, GROUPS_REMOVED}), sliding_period=True, swa_rope_base=True,
                        softcaps=("final_logit_softcapping",), scale_by_hidden_over_heads_at=(62,)),
    "phi3": ArchFacts(frozenset({UNIFORM}), query_is_hidden=True, fused_qkv=True, fused_gate_up=True),
    "openelm": ArchFacts(frozenset({UNIFORM, GROUPS_REMOVED, MLP_PER_LAYER, KV_PER_LAYER}), fused_qkv=True,
                         qkv_bias=False, tied_only=True),
}
_PER_LAYER_ARCHS = {"deci", "openelm"}  # the ones that read head_count / head_count_kv / feed_forward_length per layer


def _qtype(dtype: str):
    import gguf

    return getattr(gguf.GGMLQuantizationType, dtype.upper())


def block_size(dtype: str) -> int:
    """Values per quantization block of a GGUF type (1 for the float types)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[_qtype(dtype)][0]


def gguf_file_name(dtype: str) -> str:
    """The GGUF file's name beside the Hugging Face folder, e.g. model.Q8_0.gguf."""
    return f"model.{dtype.upper()}.gguf"


def check_gguf_widths(dtype: str, config, align_channels: int, cuts_mlp: bool = True) -> None:
    """Refuse (one line) a GGUF type whose block size does not divide every width the export will have.

    From the config alone: the hidden size and a GQA group's query width fix every input width but the MLP's,
    which the cut rounds to `prune.align_channels` (`cuts_mlp`: a cut may change it).
    """
    size = block_size(dtype)
    if size == 1:
        return
    family = get_family(config)
    base = family.base_shape(config)
    # o_proj reads whole GQA groups' query heads: its input width is a multiple of one group's
    widths = {"hidden_size": config.hidden_size,
              "one GQA group's query width": base.num_attention_heads // base.num_key_value_heads
              * family.head_dim(config),
              "intermediate_size": base.intermediate_size}
    for what, n in widths.items():
        if n % size:
            raise GgufExportError(f"export.gguf.dtype={dtype} is not allowed for this model: its {what} ({n}) is not "
                                  f"a multiple of the {size}-value block; use f16, bf16 or f32")
    if cuts_mlp and align_channels % size:
        raise GgufExportError(f"export.gguf.dtype={dtype} needs every kept MLP width to be a multiple of its "
                              f"{size}-value block: prune.align_channels={align_channels} is not allowed; use "
                              f"prune.align_channels: {size} (or a multiple of it)")


@dataclass(frozen=True)
class GgufLayout:
    """What the file states: the llama.cpp architecture and each layer's shape."""

    arch: str
    shapes: list[LayerShape]
    per_layer: bool


# --- the config's rotary embedding, sliding layers and attention scale ---------------------------------------------
def _rope_params(config, layer_type: str = "full_attention") -> dict:
    """The rotary parameters (theta, scaling type and its numbers) of one layer type, whichever way the transformers
    version states them (`rope_parameters`, per layer type or not, or `rope_scaling` with `rope_theta`)."""
    params = {**(getattr(config, "rope_scaling", None) or {}), **(getattr(config, "rope_parameters", None) or {})}
    if isinstance(params.get(layer_type), dict):  # Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}
        params = params[layer_type]
    return params


def _rope(config, layer_type: str = "full_attention") -> tuple[float, str | None]:
    """(rope theta, rope scaling type or None) of one layer type."""
    params = _rope_params(config, layer_type)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None)) or 10000.0
    kind = params.get("rope_type") or params.get("type")
    return float(theta), None if kind == "default" else kind


def sliding_layers(config) -> list[bool]:
    """Per layer, whether it attends through a sliding window (`layer_types`, else `sliding_window` on every layer)."""
    types = getattr(config, "layer_types", None)
    if types:
        return [t == "sliding_attention" for t in types]
    return [getattr(config, "sliding_window", None) is not None] * config.num_hidden_layers


def sliding_period(sliding: list[bool]) -> int | None:
    """The period p llama.cpp's Gemma graphs state (layer i full iff i % p == p - 1; 1: every layer full) that gives
    these sliding layers, or None when no period does (layers were dropped from a periodic model)."""
    n = len(sliding)
    for p in range(1, n + 2):
        if all(s == (i % p < p - 1) for i, s in enumerate(sliding)):
            return p
    return None


def _hf_attention_scale(family: ModelFamily, config) -> float:
    """The scale transformers multiplies q . k by (the family's `attn_scale_field`, else head_dim^-0.5)."""
    value = getattr(config, family.attn_scale_field, None) if family.attn_scale_field else None
    return float(value or family.head_dim(config)) ** -0.5


def _llama_cpp_attention_scale(facts: ArchFacts, config, hd: int, shapes: list[LayerShape]) -> float:
    """The scale llama.cpp's graph multiplies q . k by for the file written (float32, as it computes it)."""
    if len(shapes) in facts.scale_by_hidden_over_heads_at:
        return float(np.float32(1.0) / np.sqrt(np.float32(config.hidden_size // shapes[0].num_attention_heads)))
    return float(np.float32(1.0) / np.sqrt(np.float32(hd)))


# --- which architecture: the config-level and shape-level refusals -------------------------------------------------
def _config_refusal(arch: str, family: ModelFamily, config) -> str | None:
    """Why llama.cpp's `arch` cannot state this model config at all (None: it can), one short clause."""
    facts = ARCHS[arch]
    qkv_bias, o_bias = family.has_attn_bias(config)
    if qkv_bias and not facts.qkv_bias:
        return "q/k/v biases"
    if o_bias and not facts.o_bias:
        return "an o_proj bias (attention_bias: true)"
    if family.has_mlp_bias(config) and not facts.mlp_bias:
        return "MLP biases"
    if getattr(config, "output_bias", False):
        return "the o_proj/down_proj biases reconstruction added (use prune.reconstruct: least_squares or none)"
    if facts.tied_only and not getattr(config, "tie_word_embeddings", False):
        return "an LM head of its own (its head is the token embedding)"
    hd = family.head_dim(config)
    if facts.full_rotary and _rotary_dims(config, hd) != hd:
        return f"partial rotary embeddings ({_rotary_dims(config, hd)} of {hd} dims)"
    sliding = sliding_layers(config)
    if any(sliding):
        window = config.sliding_window
        if not facts.sliding_period:
            if window < config.max_position_embeddings:
                return f"a sliding window (sliding_window={window}; it attends to the whole context)"
        elif sliding_period(sliding) is None:
            return ("these sliding-window layers (it states a period, every p-th layer full; layer_types "
                    f"{['sliding' if s else 'full' for s in sliding]} have none)")
    _theta, kind = _rope(config)
    if kind not in (None, "linear", "llama3") or (kind == "llama3" and not facts.rope_freqs):
        return f"rope scaling of type {kind!r}"
    if any(sliding) and _rope(config, "sliding_attention")[1] is not None:  # llama.cpp leaves sliding layers unscaled
        return f"rope scaling on its sliding-window layers ({_rope(config, 'sliding_attention')[1]!r})"
    if facts.always_attn_softcap and not getattr(config, "attn_logit_softcapping", None):
        return "attention without soft-capping (it always soft-caps scores)"
    if "attn_logit_softcapping" not in facts.softcaps and getattr(config, "attn_logit_softcapping", None):
        return f"attention soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})"
    if "final_logit_softcapping" not in facts.softcaps and family.logit_softcap(config):
        return f"final logit soft-capping ({family.logit_softcap(config)})"
    return None


def _rotary_dims(config, hd: int) -> int:
    """How many of each head's dims the rotary embedding turns (partial_rotary_factor, Phi-4-mini)."""
    factor = _rope_params(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return int(hd * (factor or 1.0))


def _shape_refusal(arch: str, config, hd: int, features: frozenset[str], shapes: list[LayerShape] | None) -> str | None:
    """Why `arch` cannot state a cut with these shape features (and, when known, these shapes)."""
    facts = ARCHS[arch]
    missing = sorted(features - facts.states)
    if missing:
        return f"states {', '.join(sorted(facts.states))} only"
    if facts.query_is_hidden and shapes is not None:
        widths = sorted({s.num_attention_heads * hd for s in shapes if s.num_attention_heads})
        if widths != [config.hidden_size]:
            return f"query widths {widths} other than the hidden size {config.hidden_size} (it keeps every query head)"
    return None


def _family_archs(config) -> tuple[ModelFamily, tuple[str, ...]]:
    family = get_family(config)
    if not family.gguf_archs:
        from prunelight.families import MODEL_FAMILIES

        have = ", ".join(f.name for f in MODEL_FAMILIES.values() if f.gguf_archs)
        raise GgufExportError(f"export.gguf cannot write model_type {config.model_type!r}: GGUF export covers {have}")
    return family, family.gguf_archs


def _usable_archs(config) -> list[str]:
    """The family's llama.cpp architectures that can state this config, in preference order; refuses (one line,
    naming the family's own architecture and why) when none can."""
    family, archs = _family_archs(config)
    usable = [a for a in archs if _config_refusal(a, family, config) is None]
    if not usable:
        why = _config_refusal(archs[0], family, config)
        others = f" (nor {', '.join(archs[1:])})" if len(archs) > 1 else ""
        raise GgufExportError(f"export.gguf cannot write this {family.name} model: llama.cpp's {archs[0]} "
                              f"architecture{others} cannot state {why}")
    return usable


def check_gguf_config(config) -> None:
    """Refuse (one line) a model config no llama.cpp architecture of its family can state, weights unread."""
    _usable_archs(config)


def gguf_layouts(config) -> dict[str, frozenset[str]]:
    """Per llama.cpp architecture of the family that can state this model config, the shape features
    (prunelight.serving) a cut exported with `export.gguf` may have in it: a cut is servable when its features are a
    subset of one of them."""
    family = get_family(config)
    hd = family.head_dim(config)
    base = family.base_shape(config)
    out = {}
    for arch in _usable_archs(config):
        facts = ARCHS[arch]
        states = set(facts.states)
        if facts.query_is_hidden:
            if base.num_attention_heads * hd != config.hidden_size:
                continue  # even the dense model's query width is not the hidden size
            states.discard(GROUPS_REMOVED)  # removing a group makes the query narrower than the hidden size
            states.discard(KV_PER_LAYER)
        out[arch] = frozenset(states)
    return out


def check_gguf_shapes(config, features) -> None:
    """Refuse (one line, before any weights load) a cut with these shape features (prunelight.serving names: what
    the allocation may produce) that no llama.cpp architecture of the family states for this config."""
    family = get_family(config)
    features = frozenset(features)
    layouts = gguf_layouts(config)
    if any(features <= states for states in layouts.values()):
        return
    best = max(layouts.values(), key=len)
    stated = "; ".join(f"{arch}: {', '.join(sorted(states))}" for arch, states in layouts.items())
    raise GgufExportError(f"export.gguf cannot write a {family.name} cut with {', '.join(sorted(features - best))}: "
                          f"llama.cpp's architectures for this model state only ({stated}); cut with one shape in "
                          "every layer (export.format: stock) or export without export.gguf")


def gguf_layout(model_or_config, shapes: list[LayerShape]) -> GgufLayout:
    """The llama.cpp architecture for these layer shapes, or a GgufExportError saying why there is none."""
    config = getattr(unwrap(model_or_config), "config", model_or_config)
    family, archs = _family_archs(config)
    hd = family.head_dim(config)
    features = shape_features(family.base_shape(config), shapes)
    usable = _usable_archs(config)
    for arch in usable:
        if _shape_refusal(arch, config, hd, features, shapes) is None:
            return GgufLayout(arch, shapes, arch in _PER_LAYER_ARCHS and bool(features & PER_LAYER))
    why = [f"{arch}: {_shape_refusal(arch, config, hd, features, shapes)}" for arch in usable]
    why += [f"{a} cannot state {_config_refusal(a, family, config)}" for a in archs if a not in usable]
    missing = sorted(features - ARCHS[usable[0]].states)
    raise GgufExportError(f"export.gguf cannot write this {family.name} cut: llama.cpp's {usable[0]} architecture "
                          f"cannot state {', '.join(missing) or 'its query widths'} ({'; '.join(why)}); cut with "
                          "export.format: stock for one shape in every layer")


# --- tensors -----------------------------------------------------------------------------------------------------
def llama3_rope_freqs(config) -> torch.Tensor | None:
    """llama.cpp's `rope_freqs.weight` for Llama-3 rope scaling (None for other rotary embeddings): per frequency
    of head_dim / 2, the divisor of the rotary frequency (1 for short wavelengths, `factor` for long ones, smoothly
    between), as transformers' llama3 rotary embedding scales its inverse frequencies."""
    theta, kind = _rope(config)
    if kind != "llama3":
        return None
    p = _rope_params(config)
    dim = get_family(config).head_dim(config)
    factor, low, high = float(p["factor"]), float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old = float(p.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    divisor = 1 / ((1 - smooth) / factor + smooth)
    divisor = torch.where(wavelen < old / high, torch.ones_like(divisor), divisor)
    divisor = torch.where(wavelen > old / low, torch.full_like(divisor, factor), divisor)
    return divisor.to(torch.float32)


def _rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from Hugging Face's half-split rotary order into llama.cpp's interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def written_shapes(shapes: list[LayerShape], arch: str = "deci") -> list[LayerShape]:
    """The layer shapes the file states: for `deci`, an MLP removed under a kept attention becomes a
    `ZERO_MLP`-channel MLP.

    llama.cpp's deci graph skips the rest of a layer whose feed_forward_length is 0, its attention's residual add
    included (made for Nemotron-Ultra's layers with neither), so a zero MLP stands in: its output is exactly 0.
    """
    if not ARCHS[arch].zero_mlp_for_removed:
        return shapes
    return [LayerShape(s.num_attention_heads, s.num_key_value_heads, ZERO_MLP)
            if s.num_attention_heads and not s.intermediate_size else s for s in shapes]


def _attention_parts(family: ModelFamily, attn: nn.Module, shape: LayerShape, hd: int, facts: ArchFacts,
                     q_scale: float, fold_into_norm: bool) -> dict[str, torch.Tensor]:
    """q/k/v/o weights and biases of one attention, split (or fused) as `facts` reads them, q/k rows in its rotary
    order, the attention-scale ratio in the q rows unless it goes into the q norm."""
    q, k, v = family.qkv(attn)
    parts: dict[str, dict[str, torch.Tensor]] = {"q": {}, "k": {}, "v": {}}
    rows = {"q": shape.num_attention_heads * hd, "k": shape.num_key_value_heads * hd,
            "v": shape.num_key_value_heads * hd}
    for p in ("weight", "bias"):
        if family.fused_qkv:
            t = getattr(q, p)
            if t is None:
                continue
            t = t.detach()
            start = 0
            for name in ("q", "k", "v"):
                parts[name][p] = t[start:start + rows[name]]
                start += rows[name]
        else:
            for name, proj in zip(("q", "k", "v"), (q, k, v)):
                if getattr(proj, p) is not None:
                    parts[name][p] = getattr(proj, p).detach()
    if q_scale != 1.0 and not fold_into_norm:  # scale the scores through q (rotation and scaling commute)
        parts["q"] = {p: t * q_scale for p, t in parts["q"].items()}
    if facts.interleaved_rope:
        heads = {"q": shape.num_attention_heads, "k": shape.num_key_value_heads}
        for name, n in heads.items():
            parts[name] = {p: _rotary_rows(t, n) for p, t in parts[name].items()}
    out: dict[str, torch.Tensor] = {}
    for p in ("weight", "bias"):
        if facts.fused_qkv:
            if p in parts["q"]:
                out[f"self_attn.qkv_proj.{p}"] = torch.cat([parts[n][p] for n in ("q", "k", "v")])
        else:
            for name in ("q", "k", "v"):
                if p in parts[name]:
                    out[f"self_attn.{name}_proj.{p}"] = parts[name][p]
    o = family.o(attn)
    out["self_attn.o_proj.weight"] = o.weight.detach()
    if o.bias is not None:
        out["self_attn.o_proj.bias"] = o.bias.detach()
    return out


def _mlp_parts(family: ModelFamily, mlp: nn.Module, facts: ArchFacts) -> dict[str, torch.Tensor]:
    """gate/up/down weights and biases, gate and up fused (gate rows first) or split as `facts` reads them."""
    gate, up, down = family.gate_up_down(mlp)
    out: dict[str, torch.Tensor] = {}
    for p in ("weight", "bias"):
        if getattr(gate, p) is None:
            continue
        if family.fused_gate_up:
            g, u = getattr(gate, p).detach().chunk(2, dim=0)  # Phi-3: gate rows, then up rows
        else:
            g, u = getattr(gate, p).detach(), getattr(up, p).detach()
        if facts.fused_gate_up:
            out[f"mlp.gate_up_proj.{p}"] = torch.cat([g, u])
        else:
            out[f"mlp.gate_proj.{p}"], out[f"mlp.up_proj.{p}"] = g, u
    out.update({f"mlp.down_proj.{p}": getattr(down, p).detach() for p in ("weight", "bias")
                if getattr(down, p) is not None})
    return out


def _layer_tensors(family: ModelFamily, layer: nn.Module, shape: LayerShape, config, arch: str, name_map,
                   index: int, q_scale: float) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors under llama.cpp's names (`blk.N.*`), as `shape` states it: transformers' names,
    split or fused as the architecture reads the projections, renamed with the `gguf` package's map for `arch`
    (the converter's)."""
    facts = ARCHS[arch]
    hd = family.head_dim(config)
    attn, mlp = family.attn(layer), family.mlp(layer)
    own = {family.attn_name: attn, family.mlp_name: mlp}
    fold_into_norm = attn is not None and hasattr(attn, "q_norm")
    hf: dict[str, torch.Tensor] = {}
    if attn is not None:
        hf.update(_attention_parts(family, attn, shape, hd, facts, q_scale, fold_into_norm))
    if mlp is not None:
        hf.update(_mlp_parts(family, mlp, facts))
    # Norms (and any other parameter outside the projections): their own names; a removed sub-block's go with it.
    projections = {id(m) for block in own.values() if block is not None for m in block.children()
                   if isinstance(m, nn.Linear)}
    for name, module in layer.named_modules():
        if not name or id(module) in projections or list(module.children()):
            continue
        for pname, param in module.named_parameters(recurse=False):
            t = param.detach()
            if name.endswith("norm"):
                t = t + family.gguf_norm_offset  # Gemma's RMSNorm multiplies by (1 + weight)
                if name.endswith("q_norm") and q_scale != 1.0:
                    t = t * q_scale
            hf[f"{name}.{pname}"] = t
    out = {}
    for key, t in hf.items():
        stem, _, part = key.rpartition(".")
        gguf_name = name_map.get_name(f"{family.layers_path}.{index}.{stem}")
        if gguf_name is None:
            raise GgufExportError(f"export.gguf: llama.cpp's {arch} architecture has no tensor for "
                                  f"{family.name}'s layer parameter {key}")
        kind = gguf_name.split(".", 2)[2]
        if (attn is None and kind.startswith(("attn_", "post_attention"))) or \
                (mlp is None and kind.startswith(("ffn_", "post_ffw"))):
            continue  # the norm of a removed sub-block: the architecture reads none
        out[f"{gguf_name}.{part}"] = t
    if mlp is None and shape.intermediate_size:  # the zero MLP of `written_shapes`
        hidden = config.hidden_size
        blk = f"blk.{index}"
        out[f"{blk}.ffn_norm.weight"] = torch.ones(hidden)
        out[f"{blk}.ffn_gate.weight"] = out[f"{blk}.ffn_up.weight"] = torch.zeros(shape.intermediate_size, hidden)
        out[f"{blk}.ffn_down.weight"] = torch.zeros(hidden, shape.intermediate_size)
    return out


def _write_tensor(writer, name: str, t: torch.Tensor, dtype: str) -> None:
    """Matrices in `dtype`; norms, biases and other vectors in F32 (as llama.cpp's converter keeps them)."""
    import gguf

    a = t.detach().to(torch.float32).cpu().numpy()
    a = np.ascontiguousarray(a)
    if a.ndim < 2 or dtype == "f32":
        writer.add_tensor(name, a)
    elif dtype == "f16":
        writer.add_tensor(name, a.astype(np.float16))
    else:
        qtype = _qtype(dtype)
        writer.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def _add_metadata(w, config, layout: GgufLayout, shapes: list[LayerShape], dtype: str, name: str | None) -> None:
    """The architecture's keys: sizes (per-layer arrays for a per-layer layout), rotary, norm epsilon, the
    architecture's soft-caps and sliding-window period, file type."""
    import gguf

    family = get_family(config)
    facts = ARCHS[layout.arch]
    hd = family.head_dim(config)
    theta, kind = _rope(config)
    per_layer = (lambda f: [getattr(s, f) for s in shapes]) if layout.per_layer else (lambda f: getattr(shapes[0], f))
    w.add_name(name or getattr(config, "_name_or_path", None) or "prunelight export")
    w.add_string(WRITER_KEY, __version__)
    w.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[dtype]))
    if block_size(dtype) > 1:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(len(shapes))
    w.add_feed_forward_length(per_layer("intermediate_size"))
    w.add_head_count(per_layer("num_attention_heads"))
    w.add_head_count_kv(per_layer("num_key_value_heads"))
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(_rotary_dims(config, hd))
    w.add_rope_freq_base(theta)
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(_rope_params(config)["factor"]))
    original = _rope_params(config).get("original_max_position_embeddings")
    if original and layout.arch == "phi3":  # the converter writes Phi-3's (its longrope switch point)
        w.add_rope_scaling_orig_ctx_len(int(original))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    for key in facts.softcaps:
        value = getattr(config, key, None)
        if value:
            w.add_float32(f"{layout.arch}.{key}", float(value))
    sliding = sliding_layers(config)
    if facts.sliding_period and any(sliding):
        w.add_sliding_window(int(config.sliding_window))
        # a scalar period: the Gemma loaders ignore an array here and would fall back to their default (2 or 6)
        w.add_uint32(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=layout.arch), sliding_period(sliding))
        if facts.swa_rope_base:
            w.add_rope_freq_base_swa(_rope(config, "sliding_attention")[0])
    elif layout.arch == "phi3":
        w.add_sliding_window(0)  # the converter's "no window" for Phi-3 (the graph ignores windows anyway)


def _attention_q_scale(family: ModelFamily, config, facts: ArchFacts, shapes: list[LayerShape]) -> float:
    """The factor q is multiplied by so that llama.cpp's scale times it is transformers' (1.0 almost always)."""
    hd = family.head_dim(config)
    ratio = _hf_attention_scale(family, config) / _llama_cpp_attention_scale(facts, config, hd, shapes)
    return 1.0 if abs(ratio - 1.0) < 1e-7 else ratio


def write_gguf(model: nn.Module, path: str | Path, dtype: str = "f16", tokenizer=None,
               source_gguf: str | Path | None = None, name: str | None = None) -> Path:
    """Write `model` (merged, no LoRA) as one GGUF file at `path` (write-then-rename) and return the path.

    The tokenizer keys come from `source_gguf` when given (the model was loaded from it), else from `tokenizer`.
    """
    import gguf


    if dtype not in GGUF_TYPES:
        raise GgufExportError(f"export.gguf.dtype={dtype!r} is not allowed: use one of {', '.join(GGUF_TYPES)}")
    base = unwrap(model)
    family, config = get_family(base), base.config
    layout = gguf_layout(base, family.layer_shapes(base))
    facts = ARCHS[layout.arch]
    shapes = written_shapes(layout.shapes, layout.arch)
    hd = family.head_dim(config)
    size = block_size(dtype)
    bad = sorted({w for s in shapes for w in (s.intermediate_size, s.num_attention_heads * hd) if w % size}
                 | ({config.hidden_size} if config.hidden_size % size else set()))
    if bad:
        raise GgufExportError(f"export.gguf.dtype={dtype}: input widths {bad} are not multiples of its {size}-value "
                              f"block; cut with prune.align_channels: {size} (or use f16, bf16, f32)")
    if tokenizer is None and source_gguf is None:
        raise GgufExportError("export.gguf needs the model's tokenizer (or the GGUF file it came from)")
    q_scale = _attention_q_scale(family, config, facts, layout.shapes)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[layout.arch.upper()], len(shapes))
    path = Path(path)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), layout.arch)
        _add_metadata(w, config, layout, shapes, dtype, name)
        if source_gguf is not None:
            copy_tokenizer(w, Path(source_gguf))
        else:
            write_tokenizer(w, tokenizer, config.vocab_size)
        _write_tensor(w, "token_embd.weight", base.get_input_embeddings().weight, dtype)
        freqs = llama3_rope_freqs(config)
        if freqs is not None:  # llama.cpp divides each rotary frequency by its entry (Llama-3 scaling)
            _write_tensor(w, "rope_freqs.weight", freqs, dtype)
        for i, (layer, shape) in enumerate(zip(family.layers(base), shapes)):
            for key, t in _layer_tensors(family, layer, shape, config, layout.arch, name_map, i, q_scale).items():
                _write_tensor(w, key, t, dtype)
        _write_tensor(w, "output_norm.weight", family.final_norm(base).weight.detach() + family.gguf_norm_offset,
                      dtype)
        if not getattr(config, "tie_word_embeddings", False):  # tied: llama.cpp reads token_embd for the head
            _write_tensor(w, "output.weight", base.get_output_embeddings().weight, dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    log.info("GGUF (%s, %s) written to %s", layout.arch, dtype, path)
    return path


def gguf_engines(layout_arch: str) -> str:
    """The engine line of the report and model card for a GGUF this module wrote."""
    return (f"{LLAMA_CPP} (GGUF, {layout_arch}: greedy output equal to transformers' on the file's weights, F16 "
            "up to near ties; perplexity within 1% for F16 and 3% for Q8_0)")
