"""Per-architecture facts: where the attention and MLP modules live, which tensor slices a unit owns,
and how a layer is cut.

Everything that differs between Llama, Mistral, Qwen2/3, Gemma 2/3 and Phi-3 is stated here once; the rest of the
package asks a family instead of branching on model names. `ModelFamily.unit_layout` is the one
statement of ownership: surgery, masking, importance criteria and parameter costs all derive from it.
Hugging Face internals (head counts on attention modules, layer_idx, config fields) are written by
`prunelight.modeling` only; the family calls it with its own module names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from prunelight import modeling
from prunelight.modeling import RemovedAttention, RemovedMLP

KINDS = ("attn", "mlp")
# Which activation feeds a tensor (used by Wanda): the attention input, o_proj input, MLP input, down_proj input.
INPUTS = ("attn_in", "o_in", "mlp_in", "down_in")


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
class OwnedSlice:
    """One tensor of a layer whose rows (axis 0) or columns (axis 1) are split into equal per-unit blocks.

    Unit u owns indices [offset + u * block, offset + (u + 1) * block) along `axis`; a bias is a tensor
    with one column. `offset` > 0 places the slice inside a fused projection (Phi-3's qkv_proj holds the
    query rows, then the K rows, then the V rows; its gate_up_proj the gate rows, then the up rows).
    """

    kind: str  # "attn" (unit = GQA group) | "mlp" (unit = channel)
    module: str  # projection attribute on the sub-block, e.g. "q_proj"
    axis: int  # 0: units own row blocks (or bias entries); 1: units own column blocks
    units: int
    block: int  # rows (axis 0) or columns (axis 1) per unit
    width: int  # length of the other axis (1 for a bias)
    input: str  # which activation this tensor multiplies (see INPUTS)
    is_bias: bool = False
    offset: int = 0  # where the units' rows (or columns) start along `axis` in the tensor

    @property
    def span(self) -> int:
        """Length along `axis` of the part of the tensor the units own."""
        return self.units * self.block

    def owned_part(self, t: torch.Tensor) -> torch.Tensor:
        """The units' part of a tensor shaped like the owned one (a view; the whole tensor when not fused)."""
        return t if t.shape[self.axis] == self.span else t.narrow(self.axis, self.offset, self.span)

    @property
    def param_name(self) -> str:
        """Attribute of the projection holding this tensor."""
        return "bias" if self.is_bias else "weight"

    @property
    def unit_cost(self) -> int:
        """Parameters one unit owns in this tensor."""
        return self.block * self.width

    @property
    def reads_unit_output(self) -> bool:
        """True for the weight whose input columns read the unit's output (o_proj / down_proj).

        Zeroing these columns silences the unit exactly; it is how masking emulates a cut.
        """
        return self.axis == 1 and not self.is_bias

    def indices(self, units: list[int]) -> torch.Tensor:
        """Indices along `axis` of the given units' blocks, unit after unit in the order given."""
        idx = [self.offset + u * self.block + d for u in units for d in range(self.block)]
        return torch.tensor(idx, dtype=torch.long)

    def unit_blocks(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like the owned one (or like its owned part) as [units, everything a unit owns]."""
        t = self.owned_part(t)
        return t.reshape(self.units, -1) if self.axis == 0 else t.t().reshape(self.units, -1)


@dataclass(frozen=True, eq=False)
class OwnedTensor:
    """An `OwnedSlice` bound to the live module of one layer."""

    spec: OwnedSlice
    layer: int
    module: nn.Module
    param: nn.Parameter

    @property
    def kind(self) -> str:
        """The unit kind: "attn" or "mlp"."""
        return self.spec.kind

    @property
    def axis(self) -> int:
        """0: units own rows (or bias entries); 1: columns."""
        return self.spec.axis

    @property
    def units(self) -> int:
        """Number of units sharing the tensor."""
        return self.spec.units

    @property
    def input(self) -> str:
        """The activation the tensor multiplies (see INPUTS)."""
        return self.spec.input

    @property
    def is_bias(self) -> bool:
        """Whether the tensor is a bias."""
        return self.spec.is_bias

    def to_units(self, elementwise: torch.Tensor) -> torch.Tensor:
        """Sum a tensor shaped like `param` (or like its owned part) over each unit's share: -> [units] fp32."""
        t = self.spec.owned_part(elementwise.float())
        if self.axis == 0:
            return t.reshape(self.units, -1).sum(1)
        return t.reshape(t.shape[0], self.units, -1).sum((0, 2))


def _sliced_linear(old: nn.Linear, rows: torch.Tensor | None, cols: torch.Tensor | None) -> nn.Linear:
    """A new Linear holding old.weight[rows][:, cols] (and the matching bias rows)."""
    weight = old.weight.detach()
    if rows is not None:
        weight = weight.index_select(0, rows.to(weight.device))
    if cols is not None:
        weight = weight.index_select(1, cols.to(weight.device))
    new = nn.Linear(
        weight.shape[1], weight.shape[0], bias=old.bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        new.weight.copy_(weight)
        if old.bias is not None:
            bias = old.bias.detach()
            new.bias.copy_(bias.index_select(0, rows.to(bias.device)) if rows is not None else bias)
    new.weight.requires_grad_(old.weight.requires_grad)
    if new.bias is not None:
        new.bias.requires_grad_(old.bias.requires_grad)
    return new


class LogitsHead(nn.Module):
    """The LM head followed by the family's logit transform: hidden states -> the logits the model's forward returns."""

    def __init__(self, head: nn.Module, softcap: float | None = None) -> None:
        super().__init__()
        self.head, self.softcap = head, softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.softcap is None:
            return logits
        # The same operations, in the same order, as transformers' Gemma 2/3 forward: equal logits bit for bit.
        return torch.tanh(logits / self.softcap) * self.softcap


@dataclass(frozen=True)
class ModelFamily:
    """Module names, stock classes, unit ownership and layer surgery for one model family."""

    name: str
    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]
    pruned_config_class: type[PretrainedConfig]
    pruned_model_class: type[PreTrainedModel]
    attn_bias: str  # "config" (read config.attention_bias), "qkv" (q/k/v biased, o not), "none"
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
    # Fused projections (Phi-3): q/k/v names are one module whose rows are all query heads, then the K
    # heads, then the V heads; gate/up names one module whose rows are the gate rows, then the up rows.
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # The attention reads its query width from config.num_attention_heads at every forward (Phi-3), so a
    # resized attention gets its own view of the config (`modeling.set_attention_heads`).
    attn_heads_from_config: bool = False
    attn_norm_name: str = "input_layernorm"
    mlp_norm_name: str = "post_attention_layernorm"
    final_logit_softcapping: bool = False
    """The causal LM soft-caps its logits (cap * tanh(logits / cap), cap = config.final_logit_softcapping, no cap when
    that is null) after the LM head, so logits built from the decoder's output must apply it too (`logits_head`)."""
    pruned_decoder_class: type[PreTrainedModel] | None = None
    """The decoder alone at per-layer widths (`AutoModel` of the prunelight type): what vLLM's Transformers backend
    builds from the folder's remote code, with its own LM head on top."""
    nemotron_nas: bool = False
    """Its layers are Llama layers (RMSNorm, q/k/v/o and gate/up/down projections, biases as `attention_bias` /
    `mlp_bias` state them), so `export.format: nemotron_nas` can state them in vLLM's DeciLM layout."""
    vllm_head_dim_from_hidden: bool = False
    """vLLM 0.32.0's own class for the family takes head_dim = hidden / heads, ignoring config.head_dim (Qwen2):
    its stock export is served only while every query head stays; other cuts go through the prunelight type."""
    vllm_note: str | None = None
    """A known difference between vLLM and transformers for this family, stated in the report and model card."""
    extra_model_types: tuple[str, ...] = ()
    """Other config.model_type values whose models are this family's (Llama: `nemotron-nas`, the served layout
    prunelight writes, reloaded as NemotronNasForCausalLM, a LlamaForCausalLM)."""
    gguf_archs: tuple[str, ...] = ()
    """llama.cpp architectures (GGUF `general.architecture`) that can state this family's layers, in preference
    order: its own first (`export.gguf`, prunelight/gguf_export.py, whose `ARCHS` says what each one's loader and
    graph state); a cut goes to the first that states its shapes. Empty: no GGUF export."""
    gguf_norm_offset: float = 0.0
    """Added to every RMSNorm weight written: Gemma's norms multiply by (1 + weight), llama.cpp's by the weight."""
    attn_scale_field: str | None = None
    """The config field whose inverse square root scales attention scores (Gemma: `query_pre_attn_scalar`); None:
    head_dim^-0.5."""
    final_norm_path: str = "model.norm"
    stock_fallback: str | None = None
    """The family (MODEL_FAMILIES key) whose stock config states this family's uniform shapes when its own config
    refuses them (LlamaConfig needs hidden_size % num_attention_heads == 0; MistralConfig takes any explicit
    head_dim). Used by `export.format: stock`; None: no fallback."""

    @property
    def model_types(self) -> tuple[str, ...]:
        """config.model_type of the stock and the pruned (prunelight_*) classes, and any `extra_model_types`."""
        return self.config_class.model_type, self.pruned_config_class.model_type, *self.extra_model_types

    @property
    def lora_targets(self) -> list[str]:
        """The projections LoRA adapts by default: every attention and MLP linear (a fused one once)."""
        names = [self.q_name, self.k_name, self.v_name, self.o_name, self.gate_name, self.up_name, self.down_name]
        return list(dict.fromkeys(names))

    # --- logits -----------------------------------------------------------------------------
    def logit_softcap(self, config) -> float | None:
        """The soft cap the model's forward applies to the LM head's output (None: the head's output is the logits)."""
        return getattr(config, "final_logit_softcapping", None) if self.final_logit_softcapping else None

    def logits_head(self, model: nn.Module) -> LogitsHead:
        """A module turning the decoder's last hidden state into the logits `model(...)` returns (per chunk too)."""
        base = unwrap(model)
        return LogitsHead(base.get_output_embeddings(), self.logit_softcap(base.config))

    # --- navigation -------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layer list of a causal LM (peft wrappers are unwrapped)."""
        module = unwrap(model)
        for part in self.layers_path.split("."):
            module = getattr(module, part)
        return module

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm after the last decoder layer (before the LM head)."""
        module = unwrap(model)
        for part in self.final_norm_path.split("."):
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
        """The q, k and v projections of an attention module (the same fused module three times for Phi-3)."""
        return getattr(attn, self.q_name), getattr(attn, self.k_name), getattr(attn, self.v_name)

    def o(self, attn: nn.Module) -> nn.Linear:
        """The output projection of an attention module (its input is the per-head context)."""
        return getattr(attn, self.o_name)

    def gate_up_down(self, mlp: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The gate, up and down projections of a gated MLP (gate and up are one fused module for Phi-3)."""
        return getattr(mlp, self.gate_name), getattr(mlp, self.up_name), getattr(mlp, self.down_name)

    def sub_block(self, layer: nn.Module, kind: str) -> nn.Module | None:
        """The attention ("attn") or MLP ("mlp") sub-block of a layer, None if it was removed."""
        return self.attn(layer) if kind == "attn" else self.mlp(layer)

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
                # o_proj reads every query head; a fused qkv_proj holds query rows then 2 x KV rows.
                heads = self.o(attn).in_features // hd
                k_rows = self.qkv(attn)[1].out_features
                kv = (k_rows // hd - heads) // 2 if self.fused_qkv else k_rows // hd
            inter = 0 if mlp is None else self.gate_up_down(mlp)[2].in_features
            shapes.append(LayerShape(heads, kv, inter))
        return shapes

    def has_attn_bias(self, config) -> tuple[bool, bool]:
        """(q/k/v have bias, o has bias)."""
        if self.attn_bias == "qkv":
            return True, False
        b = self.attn_bias == "config" and bool(getattr(config, "attention_bias", False))
        return b, b

    def has_mlp_bias(self, config) -> bool:
        """Whether gate/up/down carry biases."""
        return self.mlp_bias == "config" and bool(getattr(config, "mlp_bias", False))

    # --- output biases (reconstruction): o_proj and down_proj, the projections reading the units -------
    def output_bias(self, layer: nn.Module, kind: str) -> nn.Parameter:
        """The bias of a sub-block's output projection (o_proj / down_proj), created as zeros if it has none."""
        block = self.sub_block(layer, kind)
        return modeling.ensure_bias(block, self.o_name if kind == "attn" else self.down_name).bias

    def add_output_biases(self, model: nn.Module) -> None:
        """Give every remaining o_proj and down_proj a bias and, unless the config already states both, record
        `output_bias` in it so export (prunelight config type) and reload build them."""
        config = unwrap(model).config
        for layer in self.layers(model):
            for kind in KINDS:
                if self.sub_block(layer, kind) is not None:
                    self.output_bias(layer, kind)
        if not (self.has_attn_bias(config)[1] and self.has_mlp_bias(config)):
            modeling.set_output_bias(config)

    # --- ownership: the one statement of which slices a unit owns ----------------------------
    def unit_layout(self, config, shape: LayerShape) -> list[OwnedSlice]:
        """Every tensor slice the units of a layer of `shape` own, attention first, in a fixed order.

        A GQA group owns its query rows, one K and one V head's rows (plus their biases) and the
        o_proj columns that read its query heads; with GQA query head i reads KV head i // rep
        (transformers' repeat_kv), so group g's query heads are g*rep ... g*rep + rep - 1. An MLP
        channel owns one gate row, one up row (plus biases) and one down_proj column. Shared biases
        (o_proj, down_proj) belong to no unit. A removed sub-block (0 units) owns nothing.
        """
        hidden, hd = config.hidden_size, self.head_dim(config)
        out: list[OwnedSlice] = []
        n_kv = shape.num_key_value_heads
        if n_kv:
            rep = shape.num_attention_heads // n_kv
            qkv_bias, _ = self.has_attn_bias(config)
            # In a fused qkv_proj the K rows start after every query row, the V rows after every K row.
            q_rows, kv_rows = n_kv * rep * hd, n_kv * hd
            starts = (0, q_rows, q_rows + kv_rows) if self.fused_qkv else (0, 0, 0)
            for name, rows, start in zip((self.q_name, self.k_name, self.v_name), (rep * hd, hd, hd), starts):
                out.append(OwnedSlice("attn", name, 0, n_kv, rows, hidden, "attn_in", offset=start))
                if qkv_bias:
                    out.append(OwnedSlice("attn", name, 0, n_kv, rows, 1, "attn_in", is_bias=True, offset=start))
            out.append(OwnedSlice("attn", self.o_name, 1, n_kv, rep * hd, hidden, "o_in"))
        n_c = shape.intermediate_size
        if n_c:
            mlp_bias = self.has_mlp_bias(config)
            # Cutting the gate and up halves of a fused gate_up_proj by the same channels keeps them equal,
            # which Phi-3's chunk(2) needs.
            for name, start in zip((self.gate_name, self.up_name), (0, n_c) if self.fused_gate_up else (0, 0)):
                out.append(OwnedSlice("mlp", name, 0, n_c, 1, hidden, "mlp_in", offset=start))
                if mlp_bias:
                    out.append(OwnedSlice("mlp", name, 0, n_c, 1, 1, "mlp_in", is_bias=True, offset=start))
            out.append(OwnedSlice("mlp", self.down_name, 1, n_c, 1, hidden, "down_in"))
        return out

    def unit_param_cost(self, config, kind: str) -> int:
        """Parameters one unit of `kind` owns in an unpruned layer of `config`."""
        return sum(s.unit_cost for s in self.unit_layout(config, self.base_shape(config)) if s.kind == kind)

    def group_param_cost(self, config) -> int:
        """Parameters owned by one GQA group: its query heads, one K and V head, and o_proj columns."""
        return self.unit_param_cost(config, "attn")

    def channel_param_cost(self, config) -> int:
        """Parameters owned by one MLP channel: a gate row, an up row and a down column."""
        return self.unit_param_cost(config, "mlp")

    def owned_by_layer(self, model: nn.Module) -> list[list[OwnedTensor]]:
        """Per decoder layer, `unit_layout` bound to the layer's live projections."""
        config = unwrap(model).config
        out = []
        for i, (layer, shape) in enumerate(zip(self.layers(model), self.layer_shapes(model))):
            bound = []
            for s in self.unit_layout(config, shape):
                module = getattr(self.sub_block(layer, s.kind), s.module)
                param = getattr(module, s.param_name)
                if param is None:  # the config promised a bias the module does not have
                    raise ValueError(f"layer {i}: {s.module} has no {s.param_name} although the config states one")
                bound.append(OwnedTensor(s, i, module, param))
            out.append(bound)
        return out

    def owned_tensors(self, model: nn.Module) -> list[OwnedTensor]:
        """Every unit-owned weight and bias of the decoder layers, in layer order."""
        return [t for layer in self.owned_by_layer(model) for t in layer]

    def input_modules(self, model: nn.Module) -> list[dict[str, nn.Module]]:
        """Per layer, the module whose forward input is each activation of INPUTS (absent when removed)."""
        out = []
        for layer in self.owned_by_layer(model):
            mods: dict[str, nn.Module] = {}
            for t in layer:
                mods.setdefault(t.input, t.module)
            out.append(mods)
        return out

    # --- surgery: how a layer is cut --------------------------------------------------------
    def cut_sub_block(self, layer: nn.Module, config, shape: LayerShape, kind: str, keep: list[int]) -> None:
        """Keep only units `keep` (in this order) of one sub-block; an empty `keep` removes it."""
        if not keep:
            self._remove_sub_block(layer, kind)
            return
        block = self.sub_block(layer, kind)
        # A fused module has several slices along one axis: their kept indices are gathered in layout order
        # (q, k, v rows; gate, up rows), so the cut module keeps the fused layout.
        rows: dict[str, list[torch.Tensor]] = {}
        cols: dict[str, list[torch.Tensor]] = {}
        for s in self.unit_layout(config, shape):
            if s.kind == kind and not s.is_bias:  # a bias follows its weight's rows
                (rows if s.axis == 0 else cols).setdefault(s.module, []).append(s.indices(keep))
        for name in dict.fromkeys([*rows, *cols]):
            r, c = rows.get(name), cols.get(name)
            setattr(block, name, _sliced_linear(getattr(block, name), None if r is None else torch.cat(r),
                                                None if c is None else torch.cat(c)))
        if kind == "attn":
            rep = shape.num_attention_heads // shape.num_key_value_heads
            # Attention reshapes with -1 heads; only the q/kv ratio is read, and whole groups keep it.
            modeling.set_attention_heads(block, rep * len(keep), len(keep), config_heads=self.attn_heads_from_config)
        else:
            modeling.set_mlp_width(block, len(keep))

    def _remove_sub_block(self, layer: nn.Module, kind: str) -> None:
        if kind == "attn":
            modeling.remove_attention(layer, self.attn_name)
        else:
            modeling.remove_mlp(layer, self.mlp_name)

    def drop_layers(self, model: nn.Module, indices: list[int]) -> None:
        """Delete whole decoder layers and renumber the rest so config, KV cache and masks stay consistent."""
        layers = self.layers(model)
        gone = set(indices)
        kept = [i for i in range(len(layers)) if i not in gone]
        new = nn.ModuleList([layers[i] for i in kept])
        modeling.renumber_layers(new, self.attn_name)
        self.set_layers(model, new)
        modeling.keep_config_layers(unwrap(model).config, kept)

    def set_layers(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """Install `layers` as the model's decoder layer list (config and layer_idx are left alone)."""
        parent_path, _, name = self.layers_path.rpartition(".")
        parent = unwrap(model)
        for part in parent_path.split(".") if parent_path else []:
            parent = getattr(parent, part)
        setattr(parent, name, layers)

    def record_shapes(self, config, shapes: list[LayerShape]) -> None:
        """Write the per-layer shapes (and an explicit head_dim) into the config."""
        modeling.record_layer_shapes(config, self.head_dim(config), [s.as_dict() for s in shapes])


LLAMA = ModelFamily(
    "llama", LlamaConfig, LlamaForCausalLM, modeling.PrunedLlamaConfig, modeling.PrunedLlamaForCausalLM,
    pruned_decoder_class=modeling.PrunedLlamaModel, attn_bias="config", mlp_bias="config", stock_fallback="mistral",
    nemotron_nas=True,
    extra_model_types=(modeling.NemotronNasConfig.model_type,),
    gguf_archs=("llama", "deci"),
)
MISTRAL = ModelFamily(
    "mistral", MistralConfig, MistralForCausalLM, modeling.PrunedMistralConfig, modeling.PrunedMistralForCausalLM,
    pruned_decoder_class=modeling.PrunedMistralModel, attn_bias="none", mlp_bias="none",
    nemotron_nas=True,  # with sliding_window: null (export checks)
    gguf_archs=("llama", "deci"),  # llama.cpp's converter writes Mistral as llama
)
QWEN2 = ModelFamily(
    "qwen2", Qwen2Config, Qwen2ForCausalLM, modeling.PrunedQwen2Config, modeling.PrunedQwen2ForCausalLM,
    pruned_decoder_class=modeling.PrunedQwen2Model, attn_bias="qkv", mlp_bias="none", vllm_head_dim_from_hidden=True,
    # llama.cpp's own qwen2 architecture sizes attn_q as hidden x hidden (every query head kept), so a cut removing
    # GQA groups is written as llama / deci, whose graphs add optional q/k/v biases (Qwen2's rotary is Llama's)
    gguf_archs=("qwen2", "llama", "deci"),
)

# Qwen3 and Gemma 3: q_norm / k_norm are one RMSNorm over head_dim shared by every head: nothing to slice.
QWEN3 = ModelFamily(
    "qwen3", Qwen3Config, Qwen3ForCausalLM, modeling.PrunedQwen3Config, modeling.PrunedQwen3ForCausalLM,
    pruned_decoder_class=modeling.PrunedQwen3Model, attn_bias="config", mlp_bias="none",
    # vLLM 0.32.0's Qwen3 builds o_proj without a bias; transformers adds one when attention_bias is true (no
    # published Qwen3 sets it): such a model differs in vLLM even unpruned (checked on a tiny dense model).
    vllm_note="with attention_bias: true vLLM 0.32.0 drops o_proj's bias (its outputs differ from transformers' "
              "even unpruned); Qwen3 checkpoints as published have attention_bias: false",
    # llama.cpp's openelm reads per-layer heads / KV heads / FFN widths with Qwen3's q/k norms, SiLU MLP and
    # half-split rotary, its head being the token embedding (tied Qwen3: 0.6B, 1.7B, 4B)
    gguf_archs=("qwen3", "openelm"),
)
# Gemma 2 / 3: the sandwich norms act on hidden_size, soft-capping on scores/logits, the attention scale on
# query_pre_attn_scalar: none depends on the number of heads or channels, so the generic cut is exact.
GEMMA2 = ModelFamily(
    "gemma2", Gemma2Config, Gemma2ForCausalLM, modeling.PrunedGemma2Config, modeling.PrunedGemma2ForCausalLM,
    pruned_decoder_class=modeling.PrunedGemma2Model, attn_bias="config", mlp_bias="none", final_logit_softcapping=True,
    gguf_archs=("gemma2",), gguf_norm_offset=1.0, attn_scale_field="query_pre_attn_scalar",
)
GEMMA3_TEXT = ModelFamily(
    "gemma3_text", Gemma3TextConfig, Gemma3ForCausalLM, modeling.PrunedGemma3TextConfig,
    modeling.PrunedGemma3ForCausalLM, pruned_decoder_class=modeling.PrunedGemma3TextModel, attn_bias="config",
    mlp_bias="none", final_logit_softcapping=True,
    gguf_archs=("gemma3",), gguf_norm_offset=1.0, attn_scale_field="query_pre_attn_scalar",
)
PHI3 = ModelFamily(
    "phi3", Phi3Config, Phi3ForCausalLM, modeling.PrunedPhi3Config, modeling.PrunedPhi3ForCausalLM,
    pruned_decoder_class=modeling.PrunedPhi3Model, attn_bias="none", mlp_bias="none", q_name="qkv_proj",
    k_name="qkv_proj", v_name="qkv_proj",
    gate_name="gate_up_proj", up_name="gate_up_proj", fused_qkv=True, fused_gate_up=True,
    attn_heads_from_config=True,
    # llama.cpp's phi3 keeps every query head (attn_q is hidden x hidden); split into q/k/v and gate/up, Phi-3's
    # layers are Llama's, so llama / deci state the rest when the rotary embedding covers the whole head
    gguf_archs=("phi3", "llama", "deci"),
)

MODEL_FAMILIES: dict[str, ModelFamily] = {
    a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3_TEXT, PHI3)
}


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


def linear_head(model: nn.Module) -> bool:
    """Whether the logits are the float32 LM head's output itself (no soft cap): a KL from the dense model then keeps
    hidden-size floats per token instead of the vocabulary's (the search's fitness, the model tuning)."""
    base = unwrap(model)
    head = base.get_output_embeddings()
    return (get_family(base).logit_softcap(base.config) is None and isinstance(head, nn.Linear)
            and head.weight.dtype == torch.float32)


def linear_dense_side(head: LogitsHead, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a KL from the dense model keeps of its next-token distribution p through a linear head z = W h + b
    (`linear_head`): per position h, logsumexp(z) and Wᵀp; then KL(p || q) = lse(z_q) - lse(z) - (h_q - h) · Wᵀp."""
    logits = head(hidden).float()  # fp32: bf16 log-probabilities alone put ~2e-4 nats between the model and itself
    lse = torch.logsumexp(logits, dim=-1)
    return hidden, lse, (logits - lse.unsqueeze(-1)).exp_() @ head.head.weight
