"""The run record: everything a run measured, one typed field per fact, grouped by phase.

It lives on the LightningModule (`PruneLM.record`), travels in checkpoints, and is written as
`report.json` (plus `unit_scores.json`) by the ExportCallback. `docs/architecture.md` lists the keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class CalibrationRecord:
    """How the units were scored and allocated (the calibrate, score and allocate phases)."""

    criterion: str
    allocation: str
    ratio: float
    settings: dict[str, Any]  # the whole `prune:` section as run
    samples: int
    seq_len: int | None
    source: str | None
    seed: int | None
    prune_step: int
    plan_source: str | None = None  # prune.plan: the saved plan applied (no scoring)
    scores_source: str | None = None  # prune.scores: the saved scores re-allocated (no scoring pass)
    target: dict[str, Any] | None = None  # a deployment target (prune.target_*) and what was met


@dataclass
class RecoveryRecord:
    """How the cut model was recovered."""

    mode: str
    steps: int
    lora: dict[str, Any] | None = None
    distillation: dict[str, Any] | None = None  # DistillationSettings plus the teacher as named; None: plain CE


@dataclass
class RunRecord:
    """One section per phase: load, calibrate/score/allocate, cut, recover, evaluate, export."""

    # load
    model: str | None = None  # the pretrained folder or hub id ("config" for test models built from a config)
    source: dict[str, Any] | None = None  # how it loaded: format (hub, folder, gguf), GGUF file, quantization, dtype
    # calibrate, score, allocate
    calibration: CalibrationRecord | None = None
    plan: dict[str, Any] | None = None  # PrunePlan.meta: budget figures, layer rates, split search
    unit_scores: dict[str, list[list[float]]] | None = None  # written to unit_scores.json, not report.json
    layer_importance: dict[str, list[float]] | None = None
    # cut
    params_before: int | None = None
    params_after: int | None = None
    layers: list[dict[str, int]] | None = None  # per-layer shapes after the cut
    prune_plan: dict[str, Any] | None = None  # kept units per layer (PrunePlan.to_dict without meta)
    reconstruction: dict[str, Any] | None = None  # prune.reconstruct figures: output error before/after per sub-block
    # recover
    recovery: RecoveryRecord | None = None
    # evaluate
    ppl: dict[str, float] = field(default_factory=dict)  # dense / pruned / recovered on data.eval
    ppl_detail: dict[str, dict[str, Any]] = field(default_factory=dict)
    eval: dict[str, Any] | None = None  # what `ppl` was measured on
    evaluation: dict[str, Any] = field(default_factory=dict)  # the full suite, per model state
    evaluation_settings: dict[str, Any] | None = None
    overlap: dict[str, Any] = field(default_factory=dict)
    # export
    export_dir: str | None = None
    export_format: str | None = None  # stock, nemotron_nas or prunelight: what config.json states
    engines_verified: list[str] = field(default_factory=list)  # engines the serving check runs this format in
    export_gguf: str | None = None  # the GGUF file export.gguf wrote (llama.cpp)
    report_dir: str | None = None
    figures: dict[str, str] | None = None
    notes: list[str] = field(default_factory=list)
    times_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; unset sections are left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == {} or value == []:
                continue
            out[f.name] = asdict(value) if hasattr(value, "__dataclass_fields__") else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """Inverse of `to_dict` (checkpoints, `prunelight evaluate --run`); unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("calibration"), dict):
            kwargs["calibration"] = CalibrationRecord(**kwargs["calibration"])
        if isinstance(kwargs.get("recovery"), dict):
            kwargs["recovery"] = RecoveryRecord(**kwargs["recovery"])
        return cls(**kwargs)
