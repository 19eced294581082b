"""Per-architecture facts: where the attention and MLP modules live and how GQA is laid out.

Everything that differs between Llama, Mistral and Qwen2 is stated here once; the rest of the
package asks an family instead of branching on model names.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from prunelight.modeling import RemovedAttention, RemovedMLP


@dataclass(frozen=True)
class LayerShape:
    """Width of one decoder layer: attention heads, KV heads and MLP channels (0 = sub-block removed)."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    def as_dict(self) -> dict[str, int]:
        """Plain dict for JSON (config.json, report.json)."""
        return {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
        }


@dataclass(frozen=True)
class ModelFamily:
    """Module names and tensor ownership for one model family."""

    name: str
    model_types: tuple[str, ...]
    attn_bias: str  # "config" (read config.attention_bias), "qkv" (q/k/v biased, o not)
    mlp_bias: str  # "config" (read config.mlp_bias) or "none"
    layers_path: str = "model.layers"
    attn_name: str = "self_attn"
    mlp_name: str = "mlp"
    q_name: str = "q_proj"
    k_name: str = "k_proj"
    v_name: str = "v_proj"
    o_name: str = "o_proj"
    gate_name: str = "gate_proj"
    up_name: str = "up_proj"
    down_name: str = "down_proj"

    # --- navigation -------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layer list of a causal LM (peft wrappers are unwrapped)."""
        module = unwrap(model)
        for part in self.layers_path.split("."):
            module = getattr(module, part)
        return module

    def attn(self, layer: nn.Module) -> nn.Module | None:
        """The attention sub-block of a decoder layer, None if it was removed."""
        attn = getattr(layer, self.attn_name, None)
        return None if isinstance(attn, RemovedAttention) else attn

    def mlp(self, layer: nn.Module) -> nn.Module | None:
        """The MLP sub-block of a decoder layer, None if it was removed."""
        mlp = getattr(layer, self.mlp_name, None)
        return None if isinstance(mlp, RemovedMLP) else mlp

    def qkv(self, attn: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The q, k and v projections of an attention module."""
        return getattr(attn, self.q_name), getattr(attn, self.k_name), getattr(attn, self.v_name)

    def o(self, attn: nn.Module) -> nn.Linear:
        """The output projection of an attention module (its input is the per-head context)."""
        return getattr(attn, self.o_name)

    def gate_up_down(self, mlp: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The gate, up and down projections of a gated MLP."""
        return getattr(mlp, self.gate_name), getattr(mlp, self.up_name), getattr(mlp, self.down_name)

    # --- geometry ---------------------------------------------------------------------------
    def head_dim(self, config) -> int:
        """Per-head width; explicit in the config when present, else hidden / heads."""
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def base_shape(self, config) -> LayerShape:
        """The unpruned layer shape stated by a config."""
        return LayerShape(
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            config.intermediate_size,
        )

    def layer_shapes(self, model: nn.Module) -> list[LayerShape]:
        """Current per-layer shapes, read from the modules themselves (the truth after surgery)."""
        config = unwrap(model).config
        hd = self.head_dim(config)
        shapes = []
        for layer in self.layers(model):
            attn, mlp = self.attn(layer), self.mlp(layer)
            if attn is None:
                heads = kv = 0
            else:
                q, k, _ = self.qkv(attn)
                heads, kv = q.out_features // hd, k.out_features // hd
            inter = 0 if mlp is None else self.gate_up_down(mlp)[0].out_features
            shapes.append(LayerShape(heads, kv, inter))
        return shapes

    def has_attn_bias(self, config) -> tuple[bool, bool]:
        """(q/k/v have bias, o has bias)."""
        if self.attn_bias == "qkv":
            return True, False
        b = bool(getattr(config, "attention_bias", False))
        return b, b

    def has_mlp_bias(self, config) -> bool:
        """Whether gate/up/down carry biases."""
        return self.mlp_bias == "config" and bool(getattr(config, "mlp_bias", False))

    def group_param_cost(self, config) -> int:
        """Parameters owned by one GQA group: its query heads, one K and V head, and o_proj columns."""
        hd, h = self.head_dim(config), config.hidden_size
        shape = self.base_shape(config)
        rep = shape.num_attention_heads // shape.num_key_value_heads
        qkv_bias, _ = self.has_attn_bias(config)
        cost = (rep + 2) * hd * h + rep * hd * h
        if qkv_bias:
            cost += (rep + 2) * hd
        return cost

    def channel_param_cost(self, config) -> int:
        """Parameters owned by one MLP channel: a gate row, an up row and a down column."""
        cost = 3 * config.hidden_size
        if self.has_mlp_bias(config):
            cost += 2
        return cost


LLAMA = ModelFamily("llama", ("llama", "prunelight_llama"), attn_bias="config", mlp_bias="config")
MISTRAL = ModelFamily("mistral", ("mistral", "prunelight_mistral"), attn_bias="config", mlp_bias="none")
QWEN2 = ModelFamily("qwen2", ("qwen2", "prunelight_qwen2"), attn_bias="qkv", mlp_bias="none")

MODEL_FAMILIES: dict[str, ModelFamily] = {a.name: a for a in (LLAMA, MISTRAL, QWEN2)}


def supported_model_types() -> list[str]:
    """Every config.model_type prunelight can prune."""
    return sorted(t for a in MODEL_FAMILIES.values() for t in a.model_types)


def unwrap(model: nn.Module) -> nn.Module:
    """The underlying transformers model of a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def get_family(model_or_config) -> ModelFamily:
    """The family for a model or config; a clear error for unsupported architectures."""
    config = getattr(unwrap(model_or_config), "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    for family in MODEL_FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise ValueError(
        f"unsupported architecture model_type={model_type!r}; prunelight supports: {', '.join(supported_model_types())}"
    )
