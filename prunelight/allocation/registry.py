"""The allocation registry: every `prune.allocation` choice is one `Allocation` row here.

A row names the allocation function per shape constraint it honours (`Shape.FREE`: per-layer widths,
`Shape.UNIFORM`: one shape for a stock config, `Shape.SERVED`: the Nemotron-NAS layout vLLM serves) and
states what the allocation needs (layer importance, sub-block removal measures, its own measurement), which
options it honours (split, KV-cache target, its own `prune.allocation_args`) and its cheap pre-check (model sizes
only). Everything else reads these facts: the
settings' choices and checks, the run plan (`prepare_run`), the scoring pass, saved-scores checks, the benchmarks. To add an
allocation, write its function in a module of this package and add its row to `ROWS` (or call `register`
from elsewhere, as tests do).
"""

from __future__ import annotations

from prunelight.allocation.base import Allocation, Shape
from prunelight.allocation.calibrated import (
    CalibratedOptions,
    allocate_calibrated,
    calibrated_scores,
    measure_calibrated,
)
from prunelight.allocation.layerwise import LayerwiseOptions, allocate_layerwise, check_layerwise
from prunelight.allocation.search import (
    SearchOptions,
    allocate_search,
    check_search,
    collect_search,
    cut_search,
    measure_search,
)
from prunelight.allocation.served import allocate_depth_served, allocate_served
from prunelight.allocation.stock import allocate_uniform_shape
from prunelight.allocation.structural import (
    BlockwiseOptions,
    DepthOptions,
    allocate_blockwise,
    allocate_depth,
    allocate_depth_uniform,
    depth_drop,
    check_blockwise,
    check_depth,
)
from prunelight.allocation.width import (
    GlobalOptions,
    allocate_global,
    allocate_uniform,
    check_removable,
    check_uniform,
)

ROWS = (
    Allocation("global", {Shape.FREE: allocate_global, Shape.UNIFORM: allocate_uniform_shape,
                          Shape.SERVED: allocate_served}, splits=True, kv_target=True, options=GlobalOptions,
               precheck=check_removable),
    Allocation("uniform", {Shape.FREE: allocate_uniform, Shape.UNIFORM: allocate_uniform_shape,
                           Shape.SERVED: allocate_served}, kv_target=True, kv_per_layer=True, precheck=check_uniform),
    Allocation("layerwise", {Shape.FREE: allocate_layerwise}, layer_importance=True, splits=True,
               options=LayerwiseOptions, precheck=check_layerwise),
    Allocation("blockwise", {Shape.FREE: allocate_blockwise}, options=BlockwiseOptions,
               block_removal=lambda settings: settings.allocation_options.block_importance == "removal",
               precheck=check_blockwise),
    Allocation("depth", {Shape.FREE: allocate_depth, Shape.UNIFORM: allocate_depth_uniform,
                         Shape.SERVED: allocate_depth_served}, layer_importance=True, drops=depth_drop,
               options=DepthOptions, precheck=check_depth),
    # Global on the loss scale: the scores are rescaled by measured probes once (`rescale`), so a stock or served
    # layout, a split and a KV-cache target run global's own functions on calibrated costs; FREE adds the caps.
    Allocation("calibrated", {Shape.FREE: allocate_calibrated, Shape.UNIFORM: allocate_uniform_shape,
                              Shape.SERVED: allocate_served}, splits=True, kv_target=True,
               measure=measure_calibrated, record_as="probes", options=CalibratedOptions, zero3=False,
               rescale=calibrated_scores, precheck=check_removable),
    # Widths by the measured KL of whole candidates: a levels database and an evolutionary search (search.py);
    # under stock every uniform shape is measured, under nemotron_nas the search starts from the served layouts.
    Allocation("search", {Shape.FREE: allocate_search, Shape.UNIFORM: allocate_search, Shape.SERVED: allocate_search},
               measure=measure_search, collect=collect_search, record_as="search", options=SearchOptions,
               cut=cut_search, zero3=False,
               precheck=check_search),
)

ALLOCATIONS: dict[str, Allocation] = {row.name: row for row in ROWS}


def register(row: Allocation) -> Allocation:
    """Add (or replace) an allocation row; `PruneSettings` accepts its name from then on (the CLI's --help list is
    fixed at import, so a CLI choice belongs in `ROWS`)."""
    ALLOCATIONS[row.name] = row
    return row


def allocation_of(name: str) -> Allocation:
    """The registry row of `prune.allocation` `name`."""
    try:
        return ALLOCATIONS[name]
    except KeyError:
        raise ValueError(f"prune.allocation={name!r} is not allowed: use one of {', '.join(ALLOCATIONS)}") from None


def names_with(flag: str) -> tuple[str, ...]:
    """The allocations whose row has `flag` set (e.g. "splits", "kv_target", "layer_importance")."""
    return tuple(name for name, row in ALLOCATIONS.items() if getattr(row, flag))


def honouring(shape: Shape) -> tuple[str, ...]:
    """The allocations that have a function for `shape`."""
    return tuple(name for name, row in ALLOCATIONS.items() if shape in row.by_shape)
