"""Importance criteria, selectable by name from YAML (`criterion` + `criterion_args`)."""

from __future__ import annotations

import inspect

from prunelight.importance.base import ActGradCriterion, Criterion, UnitScores
from prunelight.importance.entropy import EntropyCriterion
from prunelight.importance.fisher import FisherCriterion
from prunelight.importance.flap import FlapCriterion, WandaSPCriterion
from prunelight.importance.llm_pruner import TaylorElementCriterion, TaylorMixCriterion, TaylorSecondCriterion
from prunelight.importance.magnitude import MagnitudeCriterion, MagnitudeL1Criterion
from prunelight.importance.obs import ObsCriterion
from prunelight.importance.random import RandomCriterion
from prunelight.importance.second_order import SecondOrderCriterion
from prunelight.importance.taylor import TaylorCriterion
from prunelight.importance.taylor_weight import TaylorWeightCriterion
from prunelight.importance.wanda import WandaCriterion
from prunelight.importance.weight_grad import WeightGradCriterion

CRITERIA: dict[str, type[Criterion]] = {
    "taylor": TaylorCriterion,
    "taylor_weight": TaylorWeightCriterion,
    "taylor_element": TaylorElementCriterion,
    "taylor_second": TaylorSecondCriterion,
    "taylor_mix": TaylorMixCriterion,
    "fisher": FisherCriterion,
    "second_order": SecondOrderCriterion,
    "wanda": WandaCriterion,
    "wanda_sp": WandaSPCriterion,
    "flap": FlapCriterion,
    "entropy": EntropyCriterion,
    "obs": ObsCriterion,
    "magnitude": MagnitudeCriterion,
    "magnitude_l1": MagnitudeL1Criterion,
    "random": RandomCriterion,
}


def build_criterion(name: str, **kwargs) -> Criterion:
    """Instantiate a criterion by name; unknown names or arguments give a clear error."""
    if name not in CRITERIA:
        raise ValueError(f"unknown importance criterion {name!r}; available: {', '.join(sorted(CRITERIA))}")
    cls = CRITERIA[name]
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        allowed = [p for p in inspect.signature(cls).parameters]
        raise ValueError(
            f"bad criterion_args {kwargs!r} for criterion {name!r} ({err}); it accepts: {', '.join(allowed) or 'none'}"
        ) from err
    return cls(**kwargs)


__all__ = ["CRITERIA", "ActGradCriterion", "Criterion", "UnitScores", "WeightGradCriterion", "build_criterion"]
