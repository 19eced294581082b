"""Adding an allocation is one module and one registry row (docs/architecture.md, "Add an allocation").

The toy allocations below are registered from this module (`registry.register`, as a row of `ROWS` would be)
and run end to end through `prunelight.prune` and a `prunelight fit`: the settings accept the name and check
the row's own options (`prune.allocation_args`), the run plan runs the row's pre-check before any data is
read, the row's own measurement runs once on the calibration batches after scoring, `allocate` finishes the
removal like any other, and the model is cut to the plan. No package file names them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

import prunelight
from prunelight.allocation import (
    Allocation,
    AllocationInputs,
    MeasureInputs,
    Removal,
    Shape,
    check_shape,
    registry,
)
from prunelight.allocation.width import global_width
from prunelight.families import get_family
from prunelight.settings import PruneSettings, SettingsError
from prunelight.testing import tiny_model


# --- the toy allocation: what a new module of prunelight/allocation/ would hold ----------------
def allocate_mlp_only(inp: AllocationInputs) -> Removal:
    """`mlp_only`: the global knapsack over MLP channels alone (attention keeps every group)."""
    return Removal(global_width(inp.scores, inp.budget, attn_share=0.0), extra={"toy": True})


def check_mlp_only(budget, settings, shape) -> None:
    """The MLP alone must be able to give the whole budget (model sizes only)."""
    if budget.target > budget.removable("mlp"):
        raise ValueError(f"prune.ratio={settings.ratio} is not allowed with allocation mlp_only: the MLP can give "
                         f"at most {budget.removable('mlp'):,} parameters")


TOY = Allocation("mlp_only", {Shape.FREE: allocate_mlp_only}, precheck=check_mlp_only)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.ALLOCATIONS, TOY.name, TOY)  # the one registration: a row of the registry
    return TOY


# --- a toy allocation with its own measurement and its own option ---------------------------------------
@dataclass
class SpareOptions:
    """`spare_busiest`'s options (`prune.allocation_args`)."""

    spare: int = 1
    """How many layers, the busiest by measured MLP input, keep every MLP channel."""

    def __post_init__(self) -> None:
        if isinstance(self.spare, bool) or not isinstance(self.spare, int) or self.spare < 0:
            raise ValueError(f"prune.allocation_args.spare={self.spare!r} is not allowed: must be an integer >= 0")


@dataclass
class Busy:
    """What `measure_busy` measured: the mean squared MLP input per layer, on the calibration batches."""

    energy: list[float]
    batches: int

    def as_dict(self) -> dict:
        """JSON-able, for the plan's meta."""
        return {"energy": self.energy, "batches": self.batches}


MEASURED: list[MeasureInputs] = []  # every call of the measurement, to count them


@torch.no_grad()
def measure_busy(inp: MeasureInputs) -> Busy:
    """Mean squared input of each layer's MLP over the calibration batches (forward hooks, one pass)."""
    MEASURED.append(inp)
    layers = inp.model.model.layers
    sums = [0.0] * len(layers)
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, args, i=i: sums.__setitem__(
        i, sums[i] + float(args[0].float().pow(2).mean()))) for i, layer in enumerate(layers)]
    try:
        for ids in inp.batches:
            inp.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return Busy([v / len(inp.batches) for v in sums], len(inp.batches))


def allocate_spare_busiest(inp: AllocationInputs) -> Removal:
    """MLP channels only, by the criterion's scores, never from the `spare` layers of highest measured energy."""
    busy = sorted(range(inp.budget.num_layers), key=lambda i: -inp.measured.energy[i])[:inp.options.spare]
    lim = {"attn": [0] * inp.budget.num_layers,
           "mlp": [0 if i in busy else n for i, n in enumerate(inp.budget.limits("mlp"))]}
    removed = global_width(inp.scores, inp.budget, lim=lim)
    return Removal(removed, extra={"spared": sorted(busy)}, exact=True)


SPARE = Allocation("spare_busiest", {Shape.FREE: allocate_spare_busiest}, measure=measure_busy, record_as="busy",
                   options=SpareOptions)


@pytest.fixture
def spare(monkeypatch):
    monkeypatch.setitem(registry.ALLOCATIONS, SPARE.name, SPARE)
    MEASURED.clear()
    return SPARE


def _calibration() -> torch.Tensor:
    return torch.randint(3, 128, (16, 16), generator=torch.Generator().manual_seed(0))


def test_toy_allocation_runs_end_to_end(toy):
    model = tiny_model()
    before = sum(p.numel() for p in model.parameters())
    kv = [m.self_attn.k_proj.out_features for m in model.model.layers]
    model, plan = prunelight.prune(model, {"ratio": 0.2, "criterion": "magnitude", "allocation": "mlp_only",
                                           "reconstruct": "least_squares"}, _calibration())
    after = sum(p.numel() for p in model.parameters())
    assert plan.meta["allocation"] == "mlp_only" and plan.meta["toy"] is True
    assert after == before - plan.meta["params_removed"]
    assert plan.meta["groups_removed"] == 0 and plan.meta["channels_removed"] > 0
    assert [m.self_attn.k_proj.out_features for m in model.model.layers] == kv, "attention must keep every group"
    # `allocate` trued the removal up to within one MLP channel of the target, as for every allocation.
    c_cost = get_family(model).channel_param_cost(model.config)
    assert 0 <= plan.meta["budget_error_params"] < c_cost
    with torch.no_grad():
        assert torch.isfinite(model(_calibration()[:2]).logits).all()


def test_toy_allocation_checks_come_from_its_row(toy):
    with pytest.raises(ValueError, match="prune.ratio=0.9 is not allowed with allocation mlp_only"):
        prunelight.prune(tiny_model(), {"ratio": 0.9, "criterion": "magnitude", "allocation": "mlp_only",
                                        "reconstruct": "none"})  # the row's pre-check, before any scoring
    with pytest.raises(ValueError, match="prune.allocation='mlp_only' is not allowed with export.format=stock.*"
                                         "use one of global, uniform, depth"):
        check_shape(PruneSettings(allocation="mlp_only"), Shape.UNIFORM)  # it states no uniform-shape function
    with pytest.raises(SettingsError, match="prune.attn_mlp_split='1:3' is not allowed: a split applies to "
                                            "allocation global or layerwise"):
        PruneSettings(allocation="mlp_only", attn_mlp_split="1:3")  # the row does not say splits=True


def test_unregistered_allocation_is_refused_in_one_line():
    with pytest.raises(SettingsError, match=r"^prune.allocation='mlp_only' is not allowed: use one of global, "
                                            r"uniform, layerwise, blockwise, depth, calibrated, search$"):
        PruneSettings(allocation="mlp_only")


def _layer_widths(model) -> list[int]:
    return [layer.mlp.down_proj.in_features for layer in model.model.layers]


def test_an_allocation_with_its_own_measurement_and_option_runs_through_prune(spare):
    model = tiny_model(num_hidden_layers=4)
    widths = _layer_widths(model)
    settings = {"ratio": 0.1, "criterion": "magnitude", "allocation": "spare_busiest", "reconstruct": "none",
                "allocation_args": {"spare": 2}}
    model, plan = prunelight.prune(model, settings, _calibration())
    assert len(MEASURED) == 1, "the row's measurement runs once per cut"
    got = MEASURED[0]
    assert got.options == SpareOptions(spare=2) and got.batches and got.budget.target > 0
    assert set(got.scores) == {"attn", "mlp"} and got.state_dir is None  # the notebook API keeps no state
    energy = plan.meta["busy"]["energy"]
    busiest = sorted(range(4), key=lambda i: -energy[i])[:2]
    assert plan.meta["allocation"] == "spare_busiest" and plan.meta["spared"] == sorted(busiest)
    after = _layer_widths(model)
    assert [after[i] for i in busiest] == [widths[i] for i in busiest], "the spared layers keep every channel"
    assert sum(after) < sum(widths) and plan.meta["groups_removed"] == 0


def test_the_rows_option_is_checked_once_when_the_settings_are_made(spare):
    from prunelight.settings import PruneSettings

    with pytest.raises(SettingsError, match=r"^prune.allocation_args.spar=1 is not allowed: allocation "
                                            r"'spare_busiest' takes spare$"):
        PruneSettings(allocation="spare_busiest", allocation_args={"spar": 1})
    with pytest.raises(SettingsError, match=r"^prune.allocation_args.spare=-1 is not allowed: must be an integer"):
        PruneSettings(allocation="spare_busiest", allocation_args={"spare": -1})
    with pytest.raises(SettingsError, match=r"^prune.allocation_args=\{'spare': 1\} is not allowed: allocation "
                                            r"'uniform' takes no options"):
        PruneSettings(allocation="uniform", allocation_args={"spare": 1})
    assert PruneSettings(allocation="spare_busiest").allocation_options == SpareOptions()


def test_an_allocation_with_its_own_measurement_runs_in_a_cli_fit(spare, tmp_path, monkeypatch):
    from prunelight.cli import cli_main
    from prunelight.testing import make_tiny_checkpoint, tiny_fit_args, write_tiny_corpus

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", num_hidden_layers=4)
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cli = cli_main(tiny_fit_args(ckpt, files, "--prune.allocation=spare_busiest", "--prune.ratio=0.1",
                                 "--prune.criterion=magnitude", "--prune.reconstruct=none",
                                 '--prune.allocation_args={"spare": 3}', "--trainer.fast_dev_run=true",
                                 "--trainer.enable_progress_bar=false", "--export.out_dir=runs/toy"))
    assert len(MEASURED) == 1 and MEASURED[0].options == SpareOptions(spare=3)
    assert MEASURED[0].state_dir is not None  # a run offers its output folder for resumable state
    plan = json.loads((tmp_path / "runs" / "toy" / "fast_dev_run" / "plan.json").read_text())
    meta = plan["meta"] if "meta" in plan else plan["plan"]["meta"]
    assert meta["allocation"] == "spare_busiest" and len(meta["spared"]) == 3
    assert cli.model.plan is not None and sum(_layer_widths(cli.model.base_model)) < 4 * 96


# --- a toy allocation with its own repair: the row's cut step ------------------------------------------------------
CUTS: list = []  # every call of the cut step


@dataclass
class Shrink:
    """What `measure_shrink` measured: the factor the cut step scales each cut MLP's output projection by."""

    factor: float

    def as_dict(self) -> dict:
        """JSON-able, for the plan's meta."""
        return {"factor": self.factor}


def measure_shrink(inp: MeasureInputs) -> Shrink:
    """A stand-in measurement: the factor grows with the calibration tokens (so the test sees it was read)."""
    return Shrink(1.0 - 1.0 / (2 + sum(b.numel() for b in inp.calibration)))


def cut_shrunk(inp) -> dict | None:
    """The row's cut step: the plan cut as the surgery cuts it, then each cut layer's down_proj scaled by the
    measured factor (its own repair); None (nothing cut) when the run asks for no repair, so the usual cut runs."""
    CUTS.append(inp)
    if inp.settings.reconstruct == "none":
        return None
    prunelight.apply_plan(inp.model, inp.plan)
    with torch.no_grad():
        for i, lp in enumerate(inp.plan.layers):
            if len(lp.keep_channels) < inp.plan.num_channels[i]:
                inp.model.model.layers[i].mlp.down_proj.weight.mul_(inp.measured.factor)
    return {"method": "shrink", "factor": inp.measured.factor, "time_s": 0.0}


SHRINK = Allocation("mlp_shrunk", {Shape.FREE: allocate_mlp_only}, measure=measure_shrink, record_as="shrink",
                    cut=cut_shrunk, precheck=check_mlp_only)


@pytest.fixture
def shrunk(monkeypatch):
    monkeypatch.setitem(registry.ALLOCATIONS, SHRINK.name, SHRINK)
    CUTS.clear()
    return SHRINK


def test_an_allocation_with_its_own_cut_step_repairs_the_model_itself(shrunk):
    """The row's cut step receives the plan and what the row measured, cuts the model (here: the plain cut with
    down_proj scaled), and its figures are the run's repair; with `reconstruct: none` it declines and the usual cut
    runs. No package file names it."""
    settings = {"ratio": 0.1, "criterion": "magnitude", "allocation": "mlp_shrunk", "reconstruct": "least_squares",
                "model_tuning": {"epochs": 0}}
    model = tiny_model(num_hidden_layers=3)
    plain = tiny_model(num_hidden_layers=3)
    from prunelight.testing import cut_with

    result = cut_with(model, list(_calibration().split(8)), PruneSettings(**settings))
    assert len(CUTS) == 1 and CUTS[0].plan is result.plan and isinstance(CUTS[0].measured, Shrink)
    factor = CUTS[0].measured.factor
    assert result.reconstruction == {"method": "shrink", "factor": factor, "time_s": 0.0}
    assert result.plan.meta["shrink"] == {"factor": factor} and 0.99 < factor < 1.0
    prunelight.apply_plan(plain, result.plan)  # the same cut, repaired by hand as the step repairs it
    with torch.no_grad():
        for i, lp in enumerate(result.plan.layers):
            if len(lp.keep_channels) < result.plan.num_channels[i]:
                plain.model.layers[i].mlp.down_proj.weight.mul_(factor)
        ids = _calibration()[:2]
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)

    declined = cut_with(tiny_model(num_hidden_layers=3), list(_calibration().split(8)),
                        PruneSettings(**{**settings, "reconstruct": "none"}))
    assert len(CUTS) == 2 and declined.reconstruction is None and declined.cut  # the usual cut ran instead
