"""Write a (cut) model as one GGUF file that llama.cpp runs, with the `gguf` package.

Every layer one shape: the family's own llama.cpp architecture (`ModelFamily.gguf_arch`). Per-layer widths
(heads, KV groups, MLP channels, removed attention or MLP): the family's per-layer architecture
(`ModelFamily.gguf_per_layer_arch`, `deci` for Llama layers), whose `attention.head_count`,
`attention.head_count_kv` and `feed_forward_length` are arrays with one entry per layer, 0 for a removed
sub-block. llama.cpp's `llama` architecture reads one number for every layer, so a per-layer model written
as `llama` would not load.

The tokenizer, its special tokens and the chat template are copied from the source GGUF when the model came
from one (every `tokenizer.*` key), else built from the Hugging Face tokenizer (byte-level BPE only).
Quantized types (q8_0, q4_0) quantize every matrix along its input dimension in blocks, so every input width
(hidden size, head_dim, each layer's MLP width) must be a multiple of the block size: `check_gguf_widths`
refuses that from the config before any weights load.
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from prunelight.atomic import atomic_path
from prunelight.families import LayerShape, ModelFamily, get_family, unwrap

log = logging.getLogger(__name__)


from prunelight.settings import GGUF_TYPES  # noqa: E402 - the settings own the choice list
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q4_0": "MOSTLY_Q4_0"}


# Channels of the all-zero MLP standing in for a removed one under a kept attention (`written_shapes`): one
# quantization block of every type written.
ZERO_MLP = 32


class GgufExportError(ValueError):
    """The model (or its tokenizer) cannot be written as a GGUF file llama.cpp runs."""


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


def check_gguf_config(config) -> None:
    """Refuse (one line) a model config llama.cpp's architectures for its family cannot state, weights unread."""
    family = get_family(config)
    if family.gguf_arch is None:
        from prunelight.families import MODEL_FAMILIES

        have = ", ".join(f.name for f in MODEL_FAMILIES.values() if f.gguf_arch)
        raise GgufExportError(f"export.gguf cannot write model_type {config.model_type!r}: GGUF export covers {have}")
    if getattr(config, "sliding_window", None) is not None:
        raise GgufExportError(f"export.gguf cannot state sliding_window={config.sliding_window} in llama.cpp's "
                              f"{family.gguf_arch} architecture; export a model without a sliding window")
    _theta, kind = _rope(config)
    if kind not in (None, "default", "llama3") or (kind == "llama3" and family.gguf_arch != "llama"):
        raise GgufExportError(f"export.gguf does not write rope scaling of type {kind!r} for {family.name}; it "
                              "covers plain rotary embeddings and Llama-3 scaling (rope_type llama3) of Llama layers")


def gguf_layout(model_or_config, shapes: list[LayerShape]) -> GgufLayout:
    """The llama.cpp architecture for these layer shapes, or a GgufExportError saying why there is none."""
    config = getattr(unwrap(model_or_config), "config", model_or_config)
    check_gguf_config(config)
    family = get_family(config)
    if getattr(config, "output_bias", False):
        raise GgufExportError("export.gguf does not write the o_proj/down_proj biases reconstruction added "
                              "(output_bias); use prune.reconstruct: least_squares or none")
    uniform = len(set(shapes)) == 1 and shapes[0].num_attention_heads > 0 and shapes[0].intermediate_size > 0
    if uniform:
        return GgufLayout(family.gguf_arch, shapes, False)
    if family.gguf_per_layer_arch is None:
        raise GgufExportError(f"export.gguf: llama.cpp's {family.gguf_arch} architecture needs one shape in every "
                              "layer, got per-layer widths; prune with export.format: stock for a uniform cut")
    return GgufLayout(family.gguf_per_layer_arch, shapes, True)


def _rope_params(config) -> dict:
    """The rotary parameters (theta, scaling type and its numbers) whichever way the transformers version states
    them (`rope_parameters`, or `rope_scaling` with `rope_theta`)."""
    return {**(getattr(config, "rope_scaling", None) or {}), **(getattr(config, "rope_parameters", None) or {})}


def _rope(config) -> tuple[float, str | None]:
    """(rope theta, rope scaling type or None) whichever way the transformers version states them."""
    params = _rope_params(config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None)) or 10000.0
    kind = params.get("rope_type") or params.get("type")
    return float(theta), kind


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


def written_shapes(shapes: list[LayerShape]) -> list[LayerShape]:
    """The layer shapes the file states: an MLP removed under a kept attention becomes a `ZERO_MLP`-channel MLP.

    llama.cpp's deci graph skips the rest of a layer whose feed_forward_length is 0, its attention's residual add
    included (made for Nemotron-Ultra's layers with neither), so a zero MLP stands in: its output is exactly 0.
    """
    return [LayerShape(s.num_attention_heads, s.num_key_value_heads, ZERO_MLP)
            if s.num_attention_heads and not s.intermediate_size else s for s in shapes]


def _layer_tensors(family: ModelFamily, layer: nn.Module, shape: LayerShape, hidden: int) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors under llama.cpp's names (without the `blk.N.` prefix), as `shape` states it."""
    out: dict[str, torch.Tensor] = {}
    attn, mlp = family.attn(layer), family.mlp(layer)
    if attn is not None:
        q, k, v = family.qkv(attn)
        out["attn_norm.weight"] = getattr(layer, family.attn_norm_name).weight
        for name, proj, heads in (("attn_q", q, shape.num_attention_heads), ("attn_k", k, shape.num_key_value_heads)):
            for part in ("weight", "bias"):
                t = getattr(proj, part)
                if t is not None:
                    out[f"{name}.{part}"] = _rotary_rows(t.detach(), heads) if family.gguf_rope_permute else t
        for name, proj in (("attn_v", v), ("attn_output", family.o(attn))):
            out.update({f"{name}.{p}": getattr(proj, p) for p in ("weight", "bias") if getattr(proj, p) is not None})
    if mlp is not None:
        out["ffn_norm.weight"] = getattr(layer, family.mlp_norm_name).weight
        for name, proj in zip(("ffn_gate", "ffn_up", "ffn_down"), family.gate_up_down(mlp)):
            out.update({f"{name}.{p}": getattr(proj, p) for p in ("weight", "bias") if getattr(proj, p) is not None})
    elif shape.intermediate_size:  # the zero MLP of `written_shapes`
        out["ffn_norm.weight"] = torch.ones(hidden)
        out["ffn_gate.weight"] = out["ffn_up.weight"] = torch.zeros(shape.intermediate_size, hidden)
        out["ffn_down.weight"] = torch.zeros(hidden, shape.intermediate_size)
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


def _copy_tokenizer(writer, source_gguf: Path) -> None:
    """Every `tokenizer.*` key of the source GGUF (vocabulary, merges, special ids, chat template), as stored."""
    import gguf

    reader = gguf.GGUFReader(str(source_gguf))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


# llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`) for a family's byte-level BPE tokenizer; `default` otherwise
_PRE_TOKENIZERS = {"qwen2": "qwen2"}


def _hf_tokenizer(writer, tokenizer, vocab_size: int, pre: str = "default") -> None:
    """The vocabulary, merges, special ids and chat template of a byte-level BPE Hugging Face tokenizer."""
    import gguf
    from gguf.vocab import BpeVocab, SpecialVocab

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        try:
            vocab = BpeVocab(Path(tmp))
        except (FileNotFoundError, ValueError) as err:
            raise GgufExportError(f"export.gguf writes byte-level BPE tokenizers only (or a GGUF source's own); "
                                  f"this tokenizer is not one ({err})") from None
        tokens, types = [], []
        for text, _score, kind in vocab.all_tokens():
            tokens.append(text if isinstance(text, str) else text.decode("utf-8"))
            types.append(kind)
        special = SpecialVocab(Path(tmp), load_merges=True, n_vocab=len(tokens))
    if len(tokens) < vocab_size:  # embedding rows past the tokenizer's vocabulary (padding)
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_types(types[:vocab_size])
    special.add_to_gguf(writer, quiet=True)


def _add_metadata(w, config, layout: GgufLayout, shapes: list[LayerShape], dtype: str, name: str | None) -> None:
    """The architecture's keys: sizes (per-layer arrays for a per-layer layout), rotary, norm epsilon, file type."""
    import gguf

    hd = get_family(config).head_dim(config)
    theta, _ = _rope(config)
    per_layer = (lambda f: [getattr(s, f) for s in shapes]) if layout.per_layer else (lambda f: getattr(shapes[0], f))
    w.add_name(name or getattr(config, "_name_or_path", None) or "prunelight export")
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
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)


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
    shapes = written_shapes(layout.shapes)
    hd = family.head_dim(config)
    size = block_size(dtype)
    bad = sorted({w for s in shapes for w in (s.intermediate_size, s.num_attention_heads * hd) if w % size}
                 | ({config.hidden_size} if config.hidden_size % size else set()))
    if bad:
        raise GgufExportError(f"export.gguf.dtype={dtype}: input widths {bad} are not multiples of its {size}-value "
                              f"block; cut with prune.align_channels: {size} (or use f16, bf16, f32)")
    if tokenizer is None and source_gguf is None:
        raise GgufExportError("export.gguf needs the model's tokenizer (or the GGUF file it came from)")
    path = Path(path)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), layout.arch)
        _add_metadata(w, config, layout, shapes, dtype, name)
        if source_gguf is not None:
            _copy_tokenizer(w, Path(source_gguf))
        else:
            _hf_tokenizer(w, tokenizer, config.vocab_size, _PRE_TOKENIZERS.get(family.name, "default"))
        _write_tensor(w, "token_embd.weight", base.get_input_embeddings().weight, dtype)
        freqs = llama3_rope_freqs(config)
        if freqs is not None:  # llama.cpp divides each rotary frequency by its entry (Llama-3 scaling)
            _write_tensor(w, "rope_freqs.weight", freqs, dtype)
        for i, (layer, shape) in enumerate(zip(family.layers(base), shapes)):
            for key, t in _layer_tensors(family, layer, shape, config.hidden_size).items():
                _write_tensor(w, f"blk.{i}.{key}", t, dtype)
        _write_tensor(w, "output_norm.weight", family.final_norm(base).weight, dtype)
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


# What scripts/llama_cpp_check.py ran the exports in (results/benchmarks/llama_cpp_check.md; CI's llama.cpp step).
LLAMA_CPP = "llama.cpp v0.4.0 (prebuilt in node-llama-cpp 3.21.1)"
