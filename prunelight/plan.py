"""The prune plan: which GQA groups and MLP channels every layer keeps.

A plan is plain data (JSON-able) so it can live in Lightning checkpoints, in report.json, and be
re-applied on load to rebuild the pruned shapes before a state dict is restored.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerPlan:
    """Kept unit indices of one decoder layer, in the original numbering."""

    keep_groups: list[int]
    keep_channels: list[int]


@dataclass
class PrunePlan:
    """Kept units per layer plus the bookkeeping the report needs."""

    layers: list[LayerPlan]
    num_groups: list[int]  # original groups (KV heads) per layer
    num_channels: list[int]  # original MLP channels per layer
    meta: dict = field(default_factory=dict)
    drop_layers: list[int] = field(default_factory=list)  # whole layers removed , original indices

    @property
    def num_layers(self) -> int:
        """Decoder layers the plan covers."""
        return len(self.layers)

    def removed_counts(self) -> tuple[int, int]:
        """(GQA groups removed, MLP channels removed) over all layers."""
        drop = set(self.drop_layers)  # a dropped layer loses every unit, whatever its keep lists say
        kept = [(0, 0) if i in drop else (len(lp.keep_groups), len(lp.keep_channels))
                for i, lp in enumerate(self.layers)]
        groups = sum(n - k[0] for n, k in zip(self.num_groups, kept))
        chans = sum(n - k[1] for n, k in zip(self.num_channels, kept))
        return groups, chans

    def is_identity(self) -> bool:
        """True when the plan removes nothing."""
        return self.removed_counts() == (0, 0) and not self.drop_layers

    def to_dict(self) -> dict:
        """JSON-able form."""
        return {
            "layers": [{"keep_groups": lp.keep_groups, "keep_channels": lp.keep_channels} for lp in self.layers],
            "num_groups": self.num_groups,
            "num_channels": self.num_channels,
            "meta": self.meta,
            "drop_layers": list(self.drop_layers),
        }

    @classmethod
    def from_dict(cls, data: dict) -> PrunePlan:
        """Inverse of `to_dict`."""
        return cls(
            layers=[LayerPlan(list(d["keep_groups"]), list(d["keep_channels"])) for d in data["layers"]],
            num_groups=list(data["num_groups"]),
            num_channels=list(data["num_channels"]),
            meta=dict(data.get("meta", {})),
            drop_layers=[int(i) for i in data.get("drop_layers", [])],  # absent in plans from before whole layers could go
        )
