"""Transformers classes for models whose layers have different widths after pruning.

This file is self-contained (torch + transformers only) on purpose: `prunelight.export` copies it
next to the weights as `modeling_prunelight.py`, so a pruned folder loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` on a machine without
prunelight, and `import prunelight` registers the same classes so no remote code is needed there.

The config keeps the stock fields and adds `layer_shapes`: one
`{num_attention_heads, num_key_value_heads, intermediate_size}` per layer (0 = sub-block removed),
and `output_bias: true` when reconstruction gave every o_proj and down_proj a bias.
The model subclass builds the stock layers, then resizes each one in `__init__`, before any
weight is loaded, so the stock loading machinery (dtype, device maps, sharding, tied weights)
handles the rest unchanged.

The small helpers below write the transformers internals a resize touches (head counts, removed
sub-blocks, layer_idx, config fields); `prunelight.families` calls them at surgery, so they live once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import (
    Cache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma2Model,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma3TextModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
    Phi3Config,
    Phi3ForCausalLM,
    Phi3Model,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)


class RemovedAttention(nn.Module):
    """Stands in for an attention sub-block removed by pruning: adds nothing to the residual.

    It still appends a placeholder to its KV-cache slot, one tiny entry per token, so every slot of the
    cache reports the true sequence length: transformers reads it from one layer (layer 0, or the first
    full-attention layer, depending on the release) to place new tokens (positions, cache_position) and to
    size the attention mask of every layer, and no slot here can mislead it, whichever it asks.

    The cache is found by its type, not by its keyword: transformers 5.24 renamed the decoder layer's
    `past_key_values=` argument to `cache=` (a removed attention that read the old name silently stopped
    filling its slot, and layer 0's then read as empty). Any future name, or a positional pass, still works.
    """

    def __init__(self, layer_idx: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None)
        if cache is not None and self.layer_idx is not None:
            b, t = hidden_states.shape[:2]
            # One head of width 1 per token: a zero-size tensor would read as an empty cache (DynamicLayer's
            # get_seq_length returns 0 when keys.numel() == 0), and the batch dimension keeps beam search and
            # batch selection working. Cost: 2 * batch * seq values per removed attention.
            placeholder = hidden_states.new_zeros(b, 1, t, 1)
            cache.update(placeholder, placeholder, self.layer_idx)
        return torch.zeros_like(hidden_states), None


class RemovedMLP(nn.Module):
    """Stands in for an MLP sub-block removed by depth pruning: adds nothing to the residual."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def _linear_like(old: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    """A new Linear with the same dtype/device/bias as `old` and the given size (weights uninitialised)."""
    return nn.Linear(
        in_features,
        out_features,
        bias=old.bias is not None,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )


class AttentionConfigView:
    """The model's config as one resized attention module sees it: its own head counts, every other field
    read live from the model's config (so later changes there, e.g. the attention implementation, still apply).

    Phi-3's attention splits its fused qkv_proj output at `config.num_attention_heads * head_dim` on every
    forward; after pruning that width differs per layer, so each resized attention gets this view.
    """

    _OWN = ("num_attention_heads", "num_key_value_heads")

    def __init__(self, config, num_attention_heads: int, num_key_value_heads: int) -> None:
        self.__dict__["_base"] = config._base if isinstance(config, AttentionConfigView) else config
        self.__dict__["num_attention_heads"] = num_attention_heads
        self.__dict__["num_key_value_heads"] = num_key_value_heads

    def __getattr__(self, name: str):
        if name == "_base" or name.startswith("__"):  # copy/pickle probe dunders before __dict__ is filled
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._OWN:
            self.__dict__[name] = value
        else:
            setattr(self._base, name, value)


def set_attention_heads(attn: nn.Module, heads: int, kv: int, config_heads: bool = False) -> None:
    """Tell a resized attention module its head counts (transformers reads the q/kv ratio from it).

    `config_heads`: the module also reads its head count from `self.config` (Phi-3), so it gets an
    `AttentionConfigView` stating its own counts.
    """
    attn.num_key_value_groups = heads // kv
    attn.num_heads, attn.num_key_value_heads = heads, kv
    if config_heads:
        attn.config = AttentionConfigView(attn.config, heads, kv)


def set_mlp_width(mlp: nn.Module, inter: int) -> None:
    """Tell a resized MLP module its channel count."""
    mlp.intermediate_size = inter


def remove_attention(layer: nn.Module, name: str = "self_attn") -> None:
    """Replace a layer's attention by `RemovedAttention`, keeping its KV-cache slot (layer_idx)."""
    setattr(layer, name, RemovedAttention(getattr(getattr(layer, name), "layer_idx", None)))


def remove_mlp(layer: nn.Module, name: str = "mlp") -> None:
    """Replace a layer's MLP by `RemovedMLP`."""
    setattr(layer, name, RemovedMLP())


def renumber_layers(layers: nn.ModuleList, attn_name: str = "self_attn") -> None:
    """Set each attention's layer_idx to its position after layers were dropped."""
    for new_idx, layer in enumerate(layers):
        attn = getattr(layer, attn_name)
        # The KV cache is indexed by layer_idx; gaps would make DynamicCache grow past the config's layers.
        if hasattr(attn, "layer_idx"):
            attn.layer_idx = new_idx


def keep_config_layers(config, kept: list[int]) -> None:
    """Shrink the config's per-layer fields to the layers `kept` (original indices, in order)."""
    config.num_hidden_layers = len(kept)
    # DynamicCache(config=...) and the mask builders read layer_types per layer.
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in kept]


def ensure_bias(parent: nn.Module, name: str) -> nn.Linear:
    """`parent.<name>` (a Linear) with a bias: a zero bias is registered in place when it has none."""
    linear = getattr(parent, name)
    if linear.bias is None:
        w = linear.weight
        linear.bias = nn.Parameter(torch.zeros(linear.out_features, device=w.device, dtype=w.dtype),
                                   requires_grad=w.requires_grad)
    return linear


def add_output_biases(layer: nn.Module) -> None:
    """Give a decoder layer's o_proj and down_proj a bias (reconstruction writes into it; see `output_bias`)."""
    if not isinstance(layer.self_attn, RemovedAttention):
        ensure_bias(layer.self_attn, "o_proj")
    if not isinstance(layer.mlp, RemovedMLP):
        ensure_bias(layer.mlp, "down_proj")


def set_output_bias(config) -> None:
    """State in the config that every o_proj and down_proj has a bias (the stock config cannot say so)."""
    config.output_bias = True


def record_layer_shapes(config, head_dim: int, shapes: list[dict]) -> None:
    """Store per-layer shapes in the config, with head_dim explicit (hidden / heads no longer gives it)."""
    if not getattr(config, "head_dim", None):
        config.head_dim = head_dim
    config.layer_shapes = shapes


@contextlib.contextmanager
def config_swapped(model: nn.Module, config) -> Iterator[None]:
    """Give `model` another config for the duration (save_pretrained writes the model's own config)."""
    saved = model.config
    model.config = config
    try:
        yield
    finally:
        model.config = saved


def resize_decoder_layer(layer: nn.Module, shape: dict, head_dim: int, fused: bool = False) -> None:
    """Rebuild one decoder layer's projections at `shape` (weights are loaded afterwards).

    `fused`: Phi-3's layout, qkv_proj = [query rows | K rows | V rows] and gate_up_proj = [gate | up], with
    the attention reading its query width from its config (see `AttentionConfigView`).
    """
    heads, kv, inter = shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"]
    attn = layer.self_attn
    if heads == 0:
        remove_attention(layer)
    elif not isinstance(attn, RemovedAttention):
        hidden = attn.o_proj.out_features
        if fused:
            attn.qkv_proj = _linear_like(attn.qkv_proj, hidden, (heads + 2 * kv) * head_dim)
        else:
            attn.q_proj = _linear_like(attn.q_proj, hidden, heads * head_dim)
            attn.k_proj = _linear_like(attn.k_proj, hidden, kv * head_dim)
            attn.v_proj = _linear_like(attn.v_proj, hidden, kv * head_dim)
        attn.o_proj = _linear_like(attn.o_proj, heads * head_dim, hidden)
        set_attention_heads(attn, heads, kv, config_heads=fused)
    mlp = layer.mlp
    if inter == 0:
        remove_mlp(layer)
    elif not isinstance(mlp, RemovedMLP):
        hidden = mlp.down_proj.out_features
        if fused:
            mlp.gate_up_proj = _linear_like(mlp.gate_up_proj, hidden, 2 * inter)
        else:
            mlp.gate_proj = _linear_like(mlp.gate_proj, hidden, inter)
            mlp.up_proj = _linear_like(mlp.up_proj, hidden, inter)
        mlp.down_proj = _linear_like(mlp.down_proj, inter, hidden)
        set_mlp_width(mlp, inter)


class _PrunedMixin:
    """Resizes every layer to `config.layer_shapes` (and adds the `output_bias` biases) right after the stock
    constructor, before any weight is loaded. Mixed into the causal LM (layers under `.model`) and into the decoder
    alone (`AutoModel`, which vLLM's Transformers backend builds, putting its own head on top)."""

    _fused = False  # Phi-3's fused qkv_proj / gate_up_proj (see `resize_decoder_layer`)

    def _resize_to_layer_shapes(self) -> None:
        shapes = getattr(self.config, "layer_shapes", None)
        layers = self.model.layers if isinstance(getattr(self, "model", None), nn.Module) else self.layers
        if shapes:
            if len(shapes) != len(layers):
                raise ValueError(f"config.layer_shapes has {len(shapes)} entries for {len(layers)} layers")
            head_dim = self.config.head_dim
            for layer, shape in zip(layers, shapes):
                resize_decoder_layer(layer, shape, head_dim, fused=self._fused)
        if getattr(self.config, "output_bias", False):
            for layer in layers:
                add_output_biases(layer)


class PrunedLlamaConfig(LlamaConfig):
    model_type = "prunelight_llama"
    layer_shapes: list | None = None
    output_bias: bool = False

    def validate_architecture(self):
        # Per-layer head counts need not divide hidden_size: head_dim is explicit.
        if not self.head_dim:
            raise ValueError("a pruned config needs an explicit head_dim")


class PrunedMistralConfig(MistralConfig):
    model_type = "prunelight_mistral"
    layer_shapes: list | None = None
    output_bias: bool = False


class PrunedQwen2Config(Qwen2Config):
    model_type = "prunelight_qwen2"
    layer_shapes: list | None = None
    output_bias: bool = False


def _explicit_head_dim(config) -> None:
    """Stock validation wants hidden_size % num_attention_heads == 0; a pruned config states head_dim instead."""
    if not getattr(config, "head_dim", None):
        raise ValueError("a pruned config needs an explicit head_dim")


class PrunedQwen3Config(Qwen3Config):
    model_type = "prunelight_qwen3"
    layer_shapes: list | None = None
    output_bias: bool = False


class PrunedGemma2Config(Gemma2Config):
    model_type = "prunelight_gemma2"
    layer_shapes: list | None = None
    output_bias: bool = False

    def validate_architecture(self):
        _explicit_head_dim(self)


class PrunedGemma3TextConfig(Gemma3TextConfig):
    model_type = "prunelight_gemma3_text"
    layer_shapes: list | None = None
    output_bias: bool = False

    def validate_architecture(self):
        _explicit_head_dim(self)


class PrunedPhi3Config(Phi3Config):
    model_type = "prunelight_phi3"
    layer_shapes: list | None = None
    output_bias: bool = False


class PrunedLlamaForCausalLM(_PrunedMixin, LlamaForCausalLM):
    config_class = PrunedLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedMistralForCausalLM(_PrunedMixin, MistralForCausalLM):
    config_class = PrunedMistralConfig

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedQwen2ForCausalLM(_PrunedMixin, Qwen2ForCausalLM):
    config_class = PrunedQwen2Config

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedQwen3ForCausalLM(_PrunedMixin, Qwen3ForCausalLM):
    config_class = PrunedQwen3Config

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedGemma2ForCausalLM(_PrunedMixin, Gemma2ForCausalLM):
    config_class = PrunedGemma2Config

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedGemma3ForCausalLM(_PrunedMixin, Gemma3ForCausalLM):
    config_class = PrunedGemma3TextConfig

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedPhi3ForCausalLM(_PrunedMixin, Phi3ForCausalLM):
    config_class = PrunedPhi3Config
    _fused = True

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


# The decoders alone, for `AutoModel`: vLLM's Transformers backend builds the decoder from the folder's remote code and
# serves its layers at their own widths when the config states them per layer (`per_layer_config`, export.py).
class PrunedLlamaModel(_PrunedMixin, LlamaModel):
    config_class = PrunedLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedMistralModel(_PrunedMixin, MistralModel):
    config_class = PrunedMistralConfig

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedQwen2Model(_PrunedMixin, Qwen2Model):
    config_class = PrunedQwen2Config

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedQwen3Model(_PrunedMixin, Qwen3Model):
    config_class = PrunedQwen3Config

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedGemma2Model(_PrunedMixin, Gemma2Model):
    config_class = PrunedGemma2Config

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedGemma3TextModel(_PrunedMixin, Gemma3TextModel):
    config_class = PrunedGemma3TextConfig

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


class PrunedPhi3Model(_PrunedMixin, Phi3Model):
    config_class = PrunedPhi3Config
    _fused = True

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()


def per_layer_config(shapes: list[dict], config_fields: dict) -> dict:
    """transformers' heterogeneous-config overrides (`per_layer_config`, {layer: {field: value}}) for the layers whose
    head counts or MLP width differ from the config's own: what vLLM reads to size each layer's attention."""
    overrides = {}
    for i, shape in enumerate(shapes):
        diff = {k: v for k, v in shape.items() if v != config_fields.get(k)}
        if diff:
            overrides[str(i)] = diff
    return overrides


class BlockFields(dict):
    """One entry of a Nemotron-NAS `block_configs` list (or its `attention` / `ffn` part): a plain dict, so it saves
    as JSON, whose keys also read as attributes (`block.attention.no_op`), as vLLM's DeciLM model reads them."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _fields(value):
    return BlockFields({k: _fields(v) for k, v in value.items()}) if isinstance(value, dict) else value


class NemotronNasConfig(PrunedLlamaConfig):
    """The Nemotron-NAS (DeciLM) layout: Llama layers where each layer's attention and MLP may differ.

    `block_configs`: one `{attention: {no_op, n_heads_in_group}, ffn: {no_op, intermediate_size}}` per layer;
    query heads are `num_attention_heads` in every layer that keeps attention, KV heads num_attention_heads //
    n_heads_in_group. vLLM serves it as `DeciLMForCausalLM`; transformers loads it with this class (prunelight
    imported, or trust_remote_code through the folder's `auto_map`).
    """

    model_type = "nemotron-nas"
    block_configs: list | None = None

    def __post_init__(self, **kwargs):
        self.block_configs = [_fields(b) for b in (self.block_configs or [])]
        if self.block_configs:
            self.layer_shapes = [nas_layer_shape(b, self.num_attention_heads) for b in self.block_configs]
        super().__post_init__(**kwargs)

    def to_dict(self):
        out = super().to_dict()
        out.pop("layer_shapes", None)  # derived from block_configs
        return out

    def validate(self):
        """LlamaConfig's checks but its architecture one: the kept query heads need not divide hidden_size (head_dim
        is explicit). `@strict` runs the decorated class's own validator list, so overriding
        `validate_architecture` alone would not take it out."""
        for validator in getattr(LlamaConfig, "__class_validators__", []):
            if validator.__name__ != "validate_architecture":
                validator(self)
        if not self.head_dim:
            raise ValueError("a nemotron-nas config needs an explicit head_dim")


def nas_layer_shape(block, num_attention_heads: int) -> dict:
    """The `layer_shapes` entry (heads, KV heads, MLP width; 0 = removed) of one Nemotron-NAS block config."""
    attn, ffn = block["attention"], block["ffn"]
    odd = [f"{part}.{k}" for part, fields in (("attention", attn), ("ffn", ffn)) for k, v in fields.items()
           if k not in ("no_op", "n_heads_in_group", "intermediate_size") and v not in (None, False)]
    if odd:  # e.g. replace_with_linear, ffn_mult, sparsify of other Nemotron-NAS checkpoints
        raise ValueError(f"block_configs field(s) {', '.join(odd)} are not supported here (prunelight writes no_op, "
                         "n_heads_in_group and intermediate_size); load such a checkpoint with trust_remote_code")
    heads = 0 if attn.get("no_op") else num_attention_heads
    kv = 0 if attn.get("no_op") else num_attention_heads // int(attn["n_heads_in_group"])
    inter = 0 if ffn.get("no_op") else int(ffn["intermediate_size"])
    return {"num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter}


class NemotronNasForCausalLM(_PrunedMixin, LlamaForCausalLM):
    """A Nemotron-NAS folder in transformers: the pruned Llama of its `layer_shapes`; a no-op sub-block has no norm
    in this layout, so its pre-norm becomes an identity (its output was never read)."""

    config_class = NemotronNasConfig

    def __init__(self, config):
        super().__init__(config)
        self._resize_to_layer_shapes()
        for layer in self.model.layers:
            if isinstance(layer.self_attn, RemovedAttention):
                layer.input_layernorm = nn.Identity()
            if isinstance(layer.mlp, RemovedMLP):
                layer.post_attention_layernorm = nn.Identity()


PRUNED_MODELS = (
    PrunedLlamaForCausalLM, PrunedMistralForCausalLM, PrunedQwen2ForCausalLM, PrunedQwen3ForCausalLM,
    PrunedGemma2ForCausalLM, PrunedGemma3ForCausalLM, PrunedPhi3ForCausalLM, NemotronNasForCausalLM,
)


def register_auto_classes() -> None:
    """Make AutoConfig / AutoModelForCausalLM resolve the pruned model types in this process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for model_cls in PRUNED_MODELS:
        config_cls = model_cls.config_class
        try:
            AutoConfig.register(config_cls.model_type, config_cls)
            AutoModelForCausalLM.register(config_cls, model_cls)
        except ValueError:  # already registered (module re-imported)
            pass
