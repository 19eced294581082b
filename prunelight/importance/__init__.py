"""Importance criteria, selectable by name from YAML."""

from __future__ import annotations

from prunelight.importance.base import ActGradCriterion, Criterion, UnitScores
from prunelight.importance.magnitude import MagnitudeCriterion
from prunelight.importance.random import RandomCriterion
from prunelight.importance.taylor import TaylorCriterion

CRITERIA: dict[str, type[Criterion]] = {
    "taylor": TaylorCriterion,
    "magnitude": MagnitudeCriterion,
    "random": RandomCriterion,
}


def build_criterion(name: str, **kwargs) -> Criterion:
    """Instantiate a criterion by name; unknown names list the available ones."""
    if name not in CRITERIA:
        raise ValueError(f"unknown importance criterion {name!r}; available: {', '.join(sorted(CRITERIA))}")
    return CRITERIA[name](**kwargs)


__all__ = ["CRITERIA", "ActGradCriterion", "Criterion", "UnitScores", "build_criterion"]
