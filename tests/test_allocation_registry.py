"""Adding an allocation is one function and one registry row (docs/architecture.md, "Add an allocation").

The toy allocation below is registered in one place (`registry.ALLOCATIONS`, as a row of `ROWS` would be) and
then runs end to end through `prunelight.prune`: the settings accept its name, `check_run` runs its pre-check
before any data is read, `allocate` finishes its removal like any other, and the model is cut to the plan.
"""

from __future__ import annotations

import pytest
import torch

import prunelight
from prunelight.allocation import Allocation, AllocationInputs, Removal, Shape, check_shape, registry
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
                                            r"uniform, layerwise, blockwise, depth, calibrated$"):
        PruneSettings(allocation="mlp_only")
