"""Recovery after the cut: LoRA adapters via peft, or full fine-tuning; merging before export."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

RECOVERY_MODES = ("lora", "full", "none")


@dataclass
class LoRASettings:
    """peft LoRA hyper-parameters (peft sizes each adapter from the pruned in/out features)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

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
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold LoRA adapters into the base weights and return the plain transformers model."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model
