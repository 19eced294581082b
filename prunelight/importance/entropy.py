"""Label-free Taylor importance: the loss is the entropy of the model's own next-token distribution.

No targets are read, so any text (or text the model generated) calibrates it. The same objective
is available to every gradient criterion through `criterion_args: {objective: entropy}`.
"""

from __future__ import annotations

from prunelight.importance.taylor import TaylorCriterion


class EntropyCriterion(TaylorCriterion):
    """First-order Taylor score of each unit's mask under the output-entropy objective."""

    name = "entropy"

    def __init__(self, objective: str = "entropy") -> None:
        super().__init__(objective)
