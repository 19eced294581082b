"""How much each decoder layer (or sub-block) matters, measured on calibration text.

Three layer measures, higher = more important:
- `removal`: calibration perplexity increase when the layer is skipped (its output = its input);
- `activation_change`: mean relative change ||out - in|| / ||in|| of a token's hidden state across the layer;
- `block_influence`: mean 1 - cos(in, out) over tokens (ShortGPT's Block Influence).
`subblock_removal` scores attention and MLP sub-blocks separately by the perplexity increase when skipped.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from prunelight.console import progress
from prunelight.families import get_family, unwrap
from prunelight.evaluation.perplexity import evaluate_perplexity

LAYER_IMPORTANCE = ("removal", "activation_change", "block_influence")


def check_layer_importance(name: str) -> None:
    """Refuse an unknown layer-importance measure."""
    if name not in LAYER_IMPORTANCE:
        raise ValueError(f"unknown layer importance {name!r}; available: {', '.join(LAYER_IMPORTANCE)}")


def _batches(batches: Sequence[torch.Tensor], max_batches: int | None) -> list[torch.Tensor]:
    out = list(batches)[: max_batches if max_batches is not None else None]
    if not out:
        raise ValueError("layer importance needs at least one calibration batch")
    return out


def _hidden(x):
    return x[0] if isinstance(x, tuple) else x


@torch.no_grad()
def _change_stats(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per layer: mean (1 - cosine) and mean relative L2 change between input and output hidden states."""
    base = unwrap(model)
    layers = get_family(base).layers(base)
    cos_sum = [0.0] * len(layers)
    rel_sum = [0.0] * len(layers)
    count = [0] * len(layers)
    handles = []

    def hook(i):
        def fn(module, args, kwargs, output):
            x = (args[0] if args else kwargs["hidden_states"]).float()
            y = _hidden(output).float()
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            rel = (y - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)
            cos_sum[i] += float((1 - cos).sum())
            rel_sum[i] += float(rel.sum())
            count[i] += cos.numel()

        return fn

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(hook(i), with_kwargs=True))
    was_training = base.training
    base.eval()
    device = next(base.parameters()).device
    try:
        decoder = base.get_decoder()  # the layers' inputs and outputs only: no logits
        for ids in progress(batches, "layer importance (block influence, activation change)"):
            decoder(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        base.train(was_training)
    return [c / n for c, n in zip(cos_sum, count)], [r / n for r, n in zip(rel_sum, count)]


@contextlib.contextmanager
def skipped(modules: Sequence[nn.Module], mode: str) -> Iterator[None]:
    """Within the block, each module is bypassed: `layer` returns its input, `residual` adds zero to the residual."""
    handles = []

    def layer_hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        return (x, *output[1:]) if isinstance(output, tuple) else x

    def zero_hook(module, args, kwargs, output):
        return (torch.zeros_like(output[0]), *output[1:]) if isinstance(output, tuple) else torch.zeros_like(output)

    for m in modules:
        handles.append(m.register_forward_hook(layer_hook if mode == "layer" else zero_hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _nll(model: nn.Module, batches: list[torch.Tensor]) -> float:
    return evaluate_perplexity(model, batches)["nll"]


def _removal(model: nn.Module, batches: list[torch.Tensor], modules: Sequence[nn.Module], mode: str) -> list[float]:
    """Perplexity increase on `batches` when each module alone is bypassed (inf-safe)."""
    base_ppl = math.exp(_nll(model, batches))
    out = []
    for m in progress(modules, f"{mode} removal importance", unit=mode):
        with skipped([m], mode):
            nll = _nll(model, batches)
        out.append(math.exp(min(nll, 80.0)) - base_ppl)
    return out


def layer_importance(
    model: nn.Module, batches: Sequence[torch.Tensor], method: str = "block_influence", max_batches: int | None = None
) -> list[float]:
    """One importance value per decoder layer (higher = more important) measured on calibration `batches`."""
    check_layer_importance(method)
    batches = _batches(batches, max_batches)
    base = unwrap(model)
    if method == "removal":
        return _removal(base, batches, list(get_family(base).layers(base)), "layer")
    influence, change = _change_stats(base, batches)
    return influence if method == "block_influence" else change


def layer_importances(
    model: nn.Module, batches: Sequence[torch.Tensor], methods: Sequence[str], max_batches: int | None = None
) -> dict[str, list[float]]:
    """Several measures at once; block influence and activation change share one forward pass."""
    for m in methods:
        check_layer_importance(m)
    batches = _batches(batches, max_batches)
    base = unwrap(model)
    out: dict[str, list[float]] = {}
    if {"block_influence", "activation_change"} & set(methods):
        influence, change = _change_stats(base, batches)
        out.update(block_influence=influence, activation_change=change)
    if "removal" in methods:
        out["removal"] = _removal(base, batches, list(get_family(base).layers(base)), "layer")
    return {m: out[m] for m in methods}


def subblock_removal(
    model: nn.Module, batches: Sequence[torch.Tensor], max_batches: int | None = None
) -> dict[str, list[float | None]]:
    """Perplexity increase when each attention / MLP sub-block alone is skipped (None where already removed)."""
    batches = _batches(batches, max_batches)
    base = unwrap(model)
    family = get_family(base)
    out: dict[str, list[float | None]] = {}
    for kind, getter in (("attn", family.attn), ("mlp", family.mlp)):
        mods = [getter(layer) for layer in family.layers(base)]
        present = [m for m in mods if m is not None]
        vals = iter(_removal(base, batches, present, "residual"))
        out[kind] = [None if m is None else next(vals) for m in mods]
    return out
