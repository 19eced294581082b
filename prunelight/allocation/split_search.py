"""The attention:MLP budget split: parse "x:y", and search it on calibration perplexity.

The search walks a coarse grid of attention shares from a start point in both directions, stopping
a direction once the score has risen `patience` times in a row, then tries a finer grid around the
best coarse point. Scores come from the caller (calibration-text NLL of the masked model), never
from the evaluation split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from prunelight.families import get_family, unwrap
from prunelight.plan import PrunePlan
from prunelight.validate import integer, number

ARGS = "prune.allocation_args.split_search"


@dataclass
class SplitSearch:
    """The search for the attention share of the budget when `attn_mlp_split: auto` (an option of every allocation
    that takes a split: `prune.allocation_args: {split_search: {...}}`)."""

    step: float = 0.1
    """Coarse grid step of the attention share."""
    fine_step: float = 0.025
    """Fine grid step around the best coarse point (less than `step`)."""
    patience: int = 2
    """A direction stops after this many rises in calibration NLL in a row."""

    def __post_init__(self) -> None:
        number(f"{ARGS}.step", self.step, 0.0, 0.5, True, False)
        number(f"{ARGS}.fine_step", self.fine_step, 0.0, self.step, True, True)
        integer(f"{ARGS}.patience", self.patience, 1)


def split_search_of(value: SplitSearch | dict | None) -> SplitSearch:
    """A `SplitSearch` from itself, its dict (YAML) or None (the defaults)."""
    return value if isinstance(value, SplitSearch) else SplitSearch(**(value or {}))


def parse_split(split: str | None) -> float | None:
    """'x:y' -> the attention share x / (x + y); None or 'auto' pass through as None."""
    if split is None or split == "auto":
        return None
    if isinstance(split, int) and not isinstance(split, bool):
        # YAML 1.1 reads an unquoted 1:3 as the base-60 number 63.
        raise ValueError(f"attn_mlp_split is the number {split}: an unquoted x:y in YAML is read as a base-60 number; "
                         "quote it, e.g. attn_mlp_split: \"1:3\"")
    parts = str(split).split(":")
    try:
        x, y = (float(p) for p in parts)
    except ValueError:
        x = y = -1.0
    if len(parts) != 2 or x < 0 or y < 0 or x + y <= 0:
        raise ValueError(
            f"attn_mlp_split must be 'x:y' with x, y >= 0 and x + y > 0 (e.g. '1:3'), or 'auto'; got {split!r}"
        )
    return x / (x + y)


def search_split(
    score: Callable[[float], float],
    start: float,
    low: float = 0.0,
    high: float = 1.0,
    step: float = 0.1,
    fine_step: float = 0.025,
    patience: int = 2,
) -> tuple[float, list[tuple[float, float]]]:
    """Best attention share in [low, high] under `score` (lower is better), and every (share, score) tried (the grid
    was checked once, by `SplitSearch`)."""
    if not low <= high:
        raise ValueError(f"no feasible attention share: the range [{low:.3f}, {high:.3f}] is empty")
    seen: dict[float, float] = {}

    def f(s: float) -> float:
        key = round(min(max(s, low), high), 6)
        if key not in seen:
            seen[key] = float(score(key))
        return seen[key]

    start = min(max(start, low), high)
    base = f(start)
    for direction in (1, -1):
        last, rising, k = base, 0, 1
        while True:
            s = start + direction * k * step
            if s < low - 1e-9 or s > high + 1e-9:
                break
            v = f(s)
            rising = rising + 1 if v > last else 0
            last, k = v, k + 1
            if rising >= patience:
                break
    best = min(seen, key=lambda s: (seen[s], s))
    n_fine = int(round(step / fine_step))
    for k in range(1, n_fine):
        for s in (best - k * fine_step, best + k * fine_step):
            if low - 1e-9 <= s <= high + 1e-9:
                f(s)
    best = min(seen, key=lambda s: (seen[s], s))
    return best, sorted(seen.items())


@contextlib.contextmanager
def masked(model: nn.Module, plan: PrunePlan) -> Iterator[None]:
    """Run `model` as if `plan` were applied, without changing any weight (input masks on o_proj / down_proj)."""
    base = unwrap(model)
    family = get_family(base)
    num_units = {"attn": plan.num_groups, "mlp": plan.num_channels}
    handles = []

    def mask_hook(mask):
        return lambda module, args: (args[0] * mask.to(args[0].dtype),)

    try:
        for i, (layer_owned, lp) in enumerate(zip(family.owned_by_layer(base), plan.layers)):
            dropped = i in plan.drop_layers
            keep = {"attn": lp.keep_groups, "mlp": lp.keep_channels}
            for owned in layer_owned:
                # The module whose input columns read the units' outputs: masking its input silences them.
                if not owned.spec.reads_unit_output:
                    continue
                kept = [] if dropped else keep[owned.kind]
                if len(kept) == num_units[owned.kind][i]:
                    continue
                mask = torch.zeros(owned.module.in_features, device=owned.param.device)
                if kept:
                    mask[owned.spec.indices(kept).to(mask.device)] = 1
                handles.append(owned.module.register_forward_pre_hook(mask_hook(mask)))
        yield
    finally:
        for h in handles:
            h.remove()
