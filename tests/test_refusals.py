"""Every size refusal is the run plan's: at boundary ratios, for every allocation row under every export format.

For each row and each export format it honours (and each GGUF type a run may ask for), the largest ratio that
`run_plan.prepare_run` accepts is found by bisection on the config alone, with every weight loader patched to fail.
A cut at that ratio must then go through (scoring, the row's measurement, allocation, repair, surgery) without any
refusal, and the ratio just above it is refused in one line before any weights load. So no user-facing refusal fires
after the weights load except those that need the data.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from prunelight.allocation import ALLOCATIONS
from prunelight.allocation.shapes import EXPORT_SHAPES
from prunelight.gguf_export import block_size
from prunelight.run_plan import RunFacts, prepare_run
from prunelight.settings import GGUF_TYPES, GgufSettings
from prunelight.testing import cut_with, settings_of, tiny_model

# Small enough to cut in about a second: 4 layers, 2 KV groups of 2 query heads, MLP width 64.
SIZES = dict(num_hidden_layers=4, intermediate_size=64, num_key_value_heads=2)
# The search and the calibrated probes on a budget a tiny model can afford; the model tuning off (it changes no shape).
ROW_ARGS = {"search": {"generations": 1, "offspring": 2, "stages": [4], "survivors": [2], "mlp_levels": 8,
                       "cv_ridges": [0.1, 1.0]}}
COMMON = dict(criterion="flap", model_tuning={"epochs": 0}, importance_batches=1)
# Settings that move a boundary: units every layer keeps, aligned widths, whole structures only.
VARIANTS = {
    "defaults": {},
    "empty_sub_blocks": {"min_groups": 0, "min_channels": 0},
    "aligned": {"align_channels": 16},
    "whole_structures": {"fill_width": False},
}


def _cases():
    for name, row in ALLOCATIONS.items():
        for fmt, shape in EXPORT_SHAPES.items():
            if shape not in row.by_shape:
                continue
            for variant, options in VARIANTS.items():
                if "fill_width" in options and name not in ("blockwise", "depth"):
                    continue
                if fmt != "auto" and (options.get("min_groups") == 0 or options.get("min_channels") == 0):
                    continue  # a stock or served layer keeps attention and an MLP: refused by the settings alone
                yield pytest.param(name, fmt, variant, id=f"{name}-{fmt}-{variant}")


def _settings(row: str, variant: str, ratio: float):
    return settings_of(ratio, allocation=row, allocation_args=ROW_ARGS.get(row, {}), **COMMON, **VARIANTS[variant])


@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: the run plan works from the config alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the run plan's refusal")

    monkeypatch.setattr("prunelight.sources.load_model", refuse)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)


def _accepted(config, row: str, variant: str, fmt: str, ratio: float, gguf: GgufSettings | None = None) -> bool:
    """Whether the run plan accepts the ratio; a refusal is one line naming a setting."""
    try:
        prepare_run(_settings(row, variant, ratio), EXPORT_SHAPES[fmt], config,
                    RunFacts(has_calibration=True, gguf=gguf))
    except ValueError as err:
        text = str(err)
        assert "\n" not in text and re.search(r"\b(prune|export)\.[\w.]+=", text), text  # one line naming the option
        return False
    return True


def _boundary(config, row: str, variant: str, fmt: str) -> tuple[float, float, float | None]:
    """The smallest accepted ratio of a grid, and the (largest accepted, smallest refused) ratio above it, refined by
    bisection (None: every ratio above is accepted)."""
    grid = [i / 40 for i in range(1, 40)]
    ok = [r for r in grid if _accepted(config, row, variant, fmt, r)]
    assert ok, f"{row}/{fmt}/{variant}: no ratio accepted"
    low = max(ok)
    refused = [r for r in grid if r > low]
    if not refused:
        return min(ok), low, None
    high = min(refused)
    for _ in range(10):
        mid = (low + high) / 2
        if _accepted(config, row, variant, fmt, mid):
            low = mid
        else:
            high = mid
    return min(ok), low, high


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 128, (4, 16), generator=g) for _ in range(2)]


@pytest.mark.parametrize("row, fmt, variant", list(_cases()))
def test_the_largest_ratio_the_run_plan_accepts_cuts_and_the_next_is_refused_before_weights(row, fmt, variant,
                                                                                            no_weights):
    config = tiny_model(**SIZES).config
    smallest, low, high = _boundary(config, row, variant, fmt)
    for ratio in sorted({smallest, low}):
        model = tiny_model(**SIZES)
        result = cut_with(model, _batches(), _settings(row, variant, ratio), EXPORT_SHAPES[fmt])
        assert result.cut and result.params_after < result.params_before  # cut, with no refusal on the way
    if high is not None:
        assert not _accepted(config, row, variant, fmt, high)


@pytest.mark.parametrize("dtype", [t for t in GGUF_TYPES if t not in ("f32", "f16", "bf16")])
@pytest.mark.parametrize("row", ["global", "search"])
def test_gguf_block_sizes_are_refused_before_weights_and_aligned_cuts_go_through(row, dtype, no_weights):
    """A quantized GGUF needs every width a multiple of its block: without alignment the run plan refuses it, with
    `align_channels` a multiple of the block the largest accepted ratio cuts (and its widths fit the blocks)."""
    config = tiny_model(**SIZES, hidden_size=64, head_dim=32).config
    gguf = GgufSettings(dtype=dtype)
    assert not _accepted(config, row, "defaults", "auto", 0.2, gguf)  # widths of one channel: refused
    block = block_size(dtype)
    aligned = dataclasses.replace(_settings(row, "defaults", 0.2), align_channels=block)
    run = prepare_run(aligned, EXPORT_SHAPES["auto"], config, RunFacts(has_calibration=True, gguf=gguf))
    result = cut_with(tiny_model(**SIZES, hidden_size=64, head_dim=32), _batches(), run.settings)
    assert all(len(lp.keep_channels) % block == 0 for lp in result.plan.layers)
