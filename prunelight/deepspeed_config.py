"""A DeepSpeed config dict for `DeepSpeedStrategy(config=...)`, checked before any engine starts."""

from __future__ import annotations

from typing import Any

ZERO_STAGES = (0, 1, 2, 3)
DS_PRECISIONS = ("bf16", "fp16", "fp32")


def deepspeed_config(
    stage: int = 3,
    precision: str = "bf16",
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    gradient_clipping: float | None = 1.0,
    activation_checkpointing: bool = False,
    bucket_size: int = 200_000_000,
) -> dict[str, Any]:
    """A DeepSpeed config dict for `DeepSpeedStrategy(config=...)`, checked before any engine starts.

    Batch sizes are left to Lightning (it fills `train_micro_batch_size_per_gpu` from the loader).
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if precision not in DS_PRECISIONS:
        raise ValueError(f"DeepSpeed precision must be one of {DS_PRECISIONS}, got {precision!r}")
    if offload_parameters and stage != 3:
        raise ValueError(f"offload_parameters needs ZeRO stage 3 (only there are parameters partitioned), got {stage}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": bucket_size,
        "allgather_bucket_size": bucket_size,
    }
    if stage == 3:
        # Sharded checkpoints; the pruned model is exported through `gathered_state_dict` instead.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if gradient_clipping:
        cfg["gradient_clipping"] = float(gradient_clipping)
    if activation_checkpointing:
        cfg["activation_checkpointing"] = {"partition_activations": stage == 3, "contiguous_memory_optimization": False}
    return cfg
