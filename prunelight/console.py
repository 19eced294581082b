"""What a run shows its user: progress bars on long steps, the cut summary, and metrics for the Lightning loggers."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

# Not tqdm.auto: its asyncio wrapper calls iter() at construction, and an extra DataLoader iterator draws from
# the global RNG, which would shift LoRA's initialisation after the cut.
from tqdm import tqdm

log = logging.getLogger("prunelight")

# None: show bars when stderr is a terminal. A run sets it from the Trainer (rank 0, progress bar enabled).
_SHOW: ContextVar[bool | None] = ContextVar("prunelight_progress", default=None)


@contextlib.contextmanager
def show_progress(enabled: bool) -> Iterator[None]:
    """Turn prunelight's progress bars on or off for the enclosed steps."""
    token = _SHOW.set(enabled)
    try:
        yield
    finally:
        _SHOW.reset(token)


def progress(iterable: Iterable | None = None, desc: str = "", total: int | None = None, unit: str = "batch") -> tqdm:
    """A tqdm bar on stderr for one long step (calibration, layer importance, evaluation, export)."""
    show = _SHOW.get()
    disable = not sys.stderr.isatty() if show is None else not show
    return tqdm(iterable, desc=f"prunelight: {desc}", total=total, unit=unit, leave=False, disable=disable,
                file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


class _Stderr(logging.StreamHandler):
    """Writes each line to `sys.stderr` as it is then (the command run again in one process, e.g. under a test's
    capture, must not write to a stream an earlier run was given)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """Send prunelight's log lines to stderr (called by the command line, never at import)."""
    if any(getattr(h, "_prunelight", False) for h in log.handlers):
        return
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("[prunelight] %(message)s"))
    handler._prunelight = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def log_metrics(trainer: Any, metrics: dict[str, float | int | None]) -> None:
    """Send run-level numbers (params, perplexities, zero-shot averages) to every Lightning logger, from rank 0."""
    values = {k: float(v) for k, v in metrics.items() if v is not None}
    if not values or trainer is None or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(values, step=trainer.global_step)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _compact(values: list[int]) -> str:
    """'8x4, 2, 8x3' style run-length list: short even for 80 layers."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.append(f"{values[i]}x{j - i + 1}" if j > i else str(values[i]))
        i = j + 1
    return " ".join(out)


def cut_summary(plan_meta: dict, layers: list[dict], params_before: int, params_after: int,
                ppl: dict[str, float], criterion: str, allocation: str) -> str:
    """The lines printed after the cut: what was removed, the budget error, kept units per layer, perplexity."""
    removed = params_before - params_after
    kv = [layer["num_key_value_heads"] for layer in layers]
    heads = [layer["num_attention_heads"] for layer in layers]
    mlp = [layer["intermediate_size"] for layer in layers]
    lines = [
        f"cut with {criterion} / {allocation}: parameters {params_before:,} -> {params_after:,} "
        f"({100 * removed / params_before:.2f}% removed; target {plan_meta.get('params_target_removed', 0):,}, "
        f"budget error {plan_meta.get('budget_error_params', 0):+,})",
        f"  layers kept: {len(layers)}" + (f" (dropped {plan_meta['layers_dropped']})"
                                           if plan_meta.get("layers_dropped") else ""),
        f"  KV groups per layer:   {_compact(kv)}",
        f"  query heads per layer: {_compact(heads)}",
        f"  MLP channels per layer: {_compact(mlp)}",
    ]
    if ppl.get("dense") is not None or ppl.get("pruned") is not None:
        lines.append(f"  perplexity: dense {_fmt(ppl.get('dense'))} -> pruned {_fmt(ppl.get('pruned'))}")
    return "\n".join(lines)
