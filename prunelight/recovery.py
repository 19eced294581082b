"""Recovery after the cut: LoRA adapters via peft, or full fine-tuning; merging before export; the learning-rate
schedules."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch import nn

from prunelight.families import get_family

RECOVERY_MODES = ("lora", "full", "none")
LR_SCHEDULES = ("constant", "cosine", "linear")


def check_schedule(schedule: str) -> None:
    """Refuse unknown learning-rate schedules early."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; use one of {', '.join(LR_SCHEDULES)}")


def lr_factor(schedule: str, warmup: int, step: int, steps: int | None) -> float:
    """The learning-rate multiplier at `step` of a schedule `steps` long: linear warmup over `warmup` steps, then
    `schedule` (cosine or linear to zero, or constant; constant also when `steps` is unknown)."""
    warmup = max(int(warmup), 0)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant" or steps is None or steps <= warmup:
        return 1.0
    done = min((step - warmup) / (steps - warmup), 1.0)  # 0 at the end of warmup, 1 after the last step
    return 0.5 * (1.0 + math.cos(math.pi * done)) if schedule == "cosine" else 1.0 - done


@dataclass
class LoRASettings:
    """peft LoRA hyper-parameters (peft sizes each adapter from the pruned in/out features)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: list[str] | None = None  # None: the model family's projections (ModelFamily.lora_targets)
    use_dora: bool = False  # DoRA (Liu et al., 2024): a trained magnitude per output row on top of the LoRA update

    def as_dict(self) -> dict:
        """JSON-able form (stored in checkpoints to re-wrap on resume)."""
        return asdict(self)


def check_mode(mode: str) -> None:
    """Refuse unknown recovery modes early."""
    if mode not in RECOVERY_MODES:
        raise ValueError(f"unknown recovery mode {mode!r}; available: {', '.join(RECOVERY_MODES)}")


def add_lora(model: nn.Module, settings: LoRASettings) -> nn.Module:
    """Wrap `model` with LoRA adapters; only adapter weights stay trainable."""
    from peft import LoraConfig, get_peft_model

    if settings.r <= 0:
        raise ValueError(f"LoRA rank r must be positive, got {settings.r}")
    targets = settings.target_modules
    if targets is None:
        targets = get_family(model).lora_targets
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(targets),
        use_dora=settings.use_dora,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold LoRA adapters into the base weights and return the plain transformers model."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model
