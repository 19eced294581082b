"""What a Lightning checkpoint of `PruneLM` carries beside the weights, and how the module is rebuilt from it.

The plan (re-applied on load, so the saved state dict fits), whether `pretrained` is already cut, LoRA,
reconstruction's biases, the run record and every rank's random states (`rng_state`). Under LoRA recovery of a
plan cut from `pretrained` before training, only the trainable weights are stored: the frozen base is
`pretrained` + plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from prunelight import rng_state
from prunelight.cut_state import CutState
from prunelight.families import get_family
from prunelight.plan import PrunePlan
from prunelight.record import RunRecord
from prunelight.recovery import LoRASettings

if TYPE_CHECKING:
    from prunelight.module import PruneLM

CKPT_KEY = "prunelight"


def frozen_weights_reproducible(module: PruneLM) -> bool:
    """True when the frozen base weights equal `pretrained` cut by the plan, so checkpoints may omit them.

    Not after reconstruction: the refitted weights and added biases exist only in this process.
    """
    cal = module.record.calibration
    cut_before_training = module.cut_state.pretrained_is_cut or (cal is not None and cal.prune_step == 0)
    return (module.lora_active and module.model_config is None and cut_before_training
            and not module.cut_state.reconstructed)


def save(module: PruneLM, checkpoint: dict) -> None:
    """Add the module's state to `checkpoint` (Lightning's on_save_checkpoint)."""
    weights = "all"
    if frozen_weights_reproducible(module) and "state_dict" in checkpoint:
        # LoRA recovery: the frozen base is `pretrained` + plan; store only what trains.
        keep = {f"model.{k}" for k in trainable_keys(module.model)}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        weights = "trainable"
    cut = module.cut_state
    checkpoint[CKPT_KEY] = {
        "plan": cut.plan.to_dict() if cut.plan else None,
        "pretrained_is_pruned": cut.pretrained_is_cut,
        "lora": module.lora.as_dict() if module.lora_active else None,
        "weights": weights,
        "report": module.record.to_dict(),
        "reconstructed": cut.reconstructed,
        "output_bias": bool(getattr(module.base_model.config, "output_bias", False)),
        "dense_pretrained": module.dense_pretrained,
        # Every rank's own streams: on_save_checkpoint runs on all ranks, rank 0 alone writes the file.
        "rng": rng_state.gather(),
    }


def load(module: PruneLM, checkpoint: dict) -> None:
    """Rebuild the pruned (and LoRA-wrapped) structure so the saved state dict fits (on_load_checkpoint)."""
    state = checkpoint.get(CKPT_KEY) or {}
    module.dense_pretrained = state.get("dense_pretrained", module.dense_pretrained)
    module._rng_to_restore = state.get("rng")  # this rank's entry, set at the first training step after setup draws
    if state.get("pretrained_is_pruned") and module.model is None:
        module.cut_state = CutState.continuing(PrunePlan.from_dict(state["plan"]))
    module.configure_model()
    if state.get("plan") and module.plan is None:
        module.apply_plan(PrunePlan.from_dict(state["plan"]))
    base = module.base_model
    if state.get("output_bias") and not getattr(base.config, "output_bias", False):
        get_family(base).add_output_biases(base)  # reconstruction's biases, before LoRA wraps
    module.cut_state.reconstructed = bool(state.get("reconstructed", False))
    if state.get("lora") and not module.lora_active:
        module.lora = LoRASettings(**state["lora"])
        module.recovery = "lora"
        module.start_recovery()
    if state.get("report"):
        module.record = RunRecord.from_dict(state["report"])
    if state.get("weights") == "trainable" and "state_dict" in checkpoint:
        # The omitted frozen weights are the ones just rebuilt from `pretrained` + plan.
        own = module.state_dict()
        checkpoint["state_dict"] = {**own, **checkpoint["state_dict"]}


def trainable_keys(module: nn.Module) -> set[str]:
    """State-dict keys of the parameters that train (LoRA adapters), as `module.state_dict()` names them."""
    return {name for name, p in module.named_parameters() if p.requires_grad}
