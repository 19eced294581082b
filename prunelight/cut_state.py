"""`CutState`: the one owner of whether (and how) the run's model is cut; checkpoints and the hand-off carry it."""

from __future__ import annotations

from dataclasses import dataclass

from prunelight.plan import PrunePlan


@dataclass
class Handoff:
    """The cut model written for recovery in a fresh engine (DeepSpeed cannot reshape its own)."""

    folder: str
    plan: PrunePlan


@dataclass
class CutState:
    """Whether the model is cut, to which plan, and what that means for rebuilding it from `pretrained`."""

    plan: PrunePlan | None = None
    """The plan the model in this process is cut to (None: dense, or cut in another engine)."""
    reconstructed: bool = False
    """prune.reconstruct changed the cut weights: they are not `pretrained` + plan."""
    pretrained_is_cut: bool = False
    """`pretrained` already holds the cut weights (recovery continuing after the hand-off)."""
    handoff: Handoff | None = None
    """Set when the cut model was written for a fresh engine; the CLI continues from it."""

    @property
    def done(self) -> bool:
        """Whether the cut happened (in this process, or written for the fresh engine)."""
        return self.plan is not None or self.handoff is not None

    def mark_cut(self, plan: PrunePlan, reconstructed: bool = False) -> None:
        """Record that the model was cut to `plan` in place."""
        if self.plan is not None:
            raise RuntimeError("the model is already pruned; a second plan would use stale indices")
        self.plan, self.reconstructed = plan, reconstructed

    def hand_off(self, plan: PrunePlan, folder: str) -> None:
        """Record that the cut model was written to `folder` for a fresh engine."""
        self.handoff = Handoff(folder, plan)

    @classmethod
    def continuing(cls, plan: PrunePlan) -> CutState:
        """`pretrained` is the already-cut model of `plan`."""
        return cls(plan=plan, pretrained_is_cut=True)
