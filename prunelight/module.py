"""The LightningModule: a Hugging Face causal LM that can be cut in place and then recovered."""

from __future__ import annotations

import logging
import math
import time
from typing import Literal

import lightning as L
import torch
from torch import nn

from prunelight.cut_state import CutState
from prunelight import distributed
from prunelight.distill import DistillationSettings, chunked_losses, describe_teacher, hidden_mse, next_token_targets
from prunelight.families import get_family, unwrap
from prunelight.metrics import TokenPerplexity
from prunelight.plan import PrunePlan
from prunelight.record import RunRecord
from prunelight import rng_state, sources
from prunelight.recovery import (LR_SCHEDULES, RECOVERY_MODES, LoRASettings, add_lora, check_mode, check_schedule,
                                 lr_factor, merge_lora)
from prunelight.surgery import apply_plan
from prunelight.teacher import Teacher
from prunelight.zero3 import hf_zero3_loading

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DtypeName = Literal[tuple(DTYPES)]  # type: ignore[valid-type]
RecoveryMode = Literal[RECOVERY_MODES]  # type: ignore[valid-type]
LRSchedule = Literal[LR_SCHEDULES]  # type: ignore[valid-type]


class PruneLM(L.LightningModule):
    """Wraps `AutoModelForCausalLM`; holds the prune plan and the recovery state so checkpoints resume."""

    def __init__(
        self,
        pretrained: str = "HuggingFaceTB/SmolLM2-135M",
        gguf_file: str | None = None,
        config: dict | None = None,
        dtype: DtypeName = "float32",
        attn_implementation: str | None = "sdpa",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        recovery: RecoveryMode = "lora",
        lora: LoRASettings | None = None,
        learning_rate: float = 2e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: LRSchedule = "constant",
        distillation: DistillationSettings | None = None,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        check_mode(recovery)
        check_schedule(lr_schedule)
        if isinstance(distillation, dict):  # load_from_checkpoint passes the stored hyper-parameters back
            distillation = DistillationSettings(**distillation)
        # Plain types only: Lightning restores checkpoints with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["lora", "distillation"])
        self.hparams["lora"] = (lora or LoRASettings()).as_dict()
        self.hparams["distillation"] = distillation.as_dict() if distillation else None
        self.pretrained, self.model_config = pretrained, config
        self.gguf_file = gguf_file  # a GGUF file inside the `pretrained` folder (prunelight.sources)
        self.dtype_name = dtype
        self.attn_implementation = attn_implementation
        self.gradient_checkpointing = gradient_checkpointing
        self.trust_remote_code = trust_remote_code
        self.recovery = recovery
        self.lora = lora or LoRASettings()
        self.learning_rate, self.weight_decay, self.warmup_steps = learning_rate, weight_decay, warmup_steps
        self.lr_schedule = lr_schedule
        self.model: nn.Module | None = None
        self.tokenizer = None
        self.cut_state = CutState()  # whether the model is cut: the one owner of that fact
        self.lora_active = False
        self.distillation = distillation
        # The teacher's source when `pretrained` becomes the cut folder (hand-off); one value, GGUF file included.
        self.dense_pretrained = sources.one_value(pretrained, gguf_file)
        self.frozen_teacher = Teacher(DTYPES[dtype], attn_implementation, trust_remote_code)  # a plain object
        self._rng_to_restore: list[dict] | dict | None = None  # a checkpoint's per-rank states (rng_state)
        self.record = RunRecord()
        self.val_ppl = TokenPerplexity()

    # --- model --------------------------------------------------------------------------------
    def source(self) -> sources.ModelSource:
        """Where `pretrained` (+ `gguf_file`) points: hub id, folder, GGUF file or package resource."""
        return sources.resolve_pretrained(self.pretrained, self.gguf_file)

    def load_config(self):
        """The model's config alone (no weights): a folder, hub id, GGUF header, or the test `config` dict."""
        from transformers import AutoConfig

        if self.model_config is not None:
            cfg = dict(self.model_config)
            return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        return sources.load_config(self.source(), trust_remote_code=self.trust_remote_code)

    def teacher_config(self):
        """The config of the named distillation teacher (`model.distillation.teacher`), or None (no weights read)."""
        d = self.distillation
        if d is None or not d.teacher or not d.uses_teacher:
            return None
        source = sources.resolve_pretrained(d.teacher, option="model.distillation.teacher")
        return sources.load_config(source, option="model.distillation.teacher", trust_remote_code=self.trust_remote_code)

    def check_pretrained(self):
        """Load the config and refuse an unsupported family before any weights or data are read."""
        config = self.load_config()
        get_family(config)
        return config

    def configure_model(self) -> None:
        """Load the model (once); called by the Trainer under the strategy's init context."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self._hf_ds_config = hf_zero3_loading(self._trainer)  # kept alive: transformers holds a weakref
        kwargs = dict(dtype=DTYPES[self.dtype_name], trust_remote_code=self.trust_remote_code)
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        config = self.check_pretrained()  # unsupported architectures fail here, before the weights load
        if self.model_config is not None:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            source = self.source()
            model = sources.load_model(source, config=config, **kwargs)  # GGUF: dequantized to `dtype`
            if not self.pretrained_is_pruned:  # after the DeepSpeed hand-off the record names the original source
                self.record.source = source.describe(self.dtype_name)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        model.train()  # from_pretrained returns eval mode; recovery must train with dropout active
        self.model = model
        if self.cut_state.pretrained_is_cut:
            self.start_recovery()  # the cut already happened; the optimizer must see the recovery parameters
        self.record.times_s["load"] = time.perf_counter() - t0
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "check_context"):
            dm.check_context(self.max_positions())

    def load_tokenizer(self):
        """The tokenizer saved with the pretrained model (None for config-built test models)."""
        if self.tokenizer is None and self.model_config is None:
            self.tokenizer = sources.load_tokenizer(self.source(), trust_remote_code=self.trust_remote_code)
        return self.tokenizer

    @property
    def base_model(self) -> nn.Module:
        """The transformers model without peft wrapping."""
        return unwrap(self.model)

    def max_positions(self) -> int | None:
        """The model's context length."""
        return getattr(self.base_model.config, "max_position_embeddings", None)

    # --- pruning and recovery -----------------------------------------------------------------
    @property
    def plan(self) -> PrunePlan | None:
        """The plan this process's model is cut to (None: dense)."""
        return self.cut_state.plan

    @property
    def pretrained_is_pruned(self) -> bool:
        """Whether `pretrained` already holds the cut weights (recovery after the DeepSpeed hand-off)."""
        return self.cut_state.pretrained_is_cut

    def apply_plan(self, plan: PrunePlan) -> None:
        """Cut the model to `plan` and remember it (checkpoints re-apply it on load)."""
        if self.plan is not None:
            raise RuntimeError("the model is already pruned; a second plan would use stale indices")
        apply_plan(self.base_model, plan)
        self.cut_state.mark_cut(plan)

    def start_recovery(self) -> None:
        """Prepare the cut model for recovery: LoRA adapters, full fine-tuning, or nothing to train."""
        if self.recovery == "lora" and not self.lora_active:
            if self.gradient_checkpointing:
                self.base_model.enable_input_require_grads()
            self.model = add_lora(self.model, self.lora)
            self.lora_active = True
        elif self.recovery == "full":
            for p in self.model.parameters():
                p.requires_grad_(True)
        elif self.recovery == "none":
            for p in self.model.parameters():
                p.requires_grad_(False)

    def merge_lora(self) -> None:
        """Fold LoRA into the base weights (idempotent)."""
        if self.lora_active:
            self.model = merge_lora(self.model)
            self.lora_active = False

    # --- training -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self._rng_to_restore is not None:
            # Resumed run: continue the RNG streams (LoRA dropout) exactly where the checkpoint left them.
            rng_state.restore(self._rng_to_restore)
            self._rng_to_restore = None
        distill = self.distillation is not None and self.plan is not None  # the teacher exists only after the cut
        if distill:
            loss = self._distillation_loss(batch)
        else:
            loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"training loss is {loss.item()} at step {self.global_step}: lower the learning rate "
                f"({self.learning_rate}) or use bf16/fp32 instead of fp16"
            )
        self.log("train_loss", loss, prog_bar=True)
        if self._trainer is not None and self.trainer.optimizers:  # the schedule, in the logger
            self.log("lr", float(self.trainer.optimizers[0].param_groups[0]["lr"]))
        return loss

    def _distillation_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """alpha * distill + (1 - alpha) * CE on one batch (prunelight.distill documents each term)."""
        d = self.distillation
        # No labels: transformers would compute the CE on fp32 logits of the whole batch; chunked_losses does it
        # in the distillation's chunks.
        out = self.model(input_ids=batch, use_cache=False, output_hidden_states=d.hidden and d.uses_teacher)
        logits = out.logits.reshape(-1, out.logits.shape[-1])
        targets = next_token_targets(batch) if d.uses_ce else None
        t_hidden, head = self._teacher_hidden(batch) if d.uses_teacher else (None, None)
        flat = None if t_hidden is None else t_hidden.reshape(-1, t_hidden.shape[-1])
        distill, ce = chunked_losses(logits, targets, flat, head, d.loss, d.temperature, d.chunk_tokens)
        if distill is not None and d.hidden:
            distill = distill + hidden_mse(out.hidden_states[-1], t_hidden)
        terms = {"train_ce": ce, "train_distill": distill}
        self.log_dict({k: v.detach() for k, v in terms.items() if v is not None})
        if distill is None:
            return ce  # alpha 0
        if ce is None:
            return distill  # alpha 1
        return d.alpha * distill + (1.0 - d.alpha) * ce

    def _teacher_hidden(self, batch: torch.Tensor) -> tuple[torch.Tensor, nn.Module]:
        """The teacher's last hidden state of `batch` (no gradients) and the head that turns it into its logits."""
        teacher = self.teacher()
        with torch.no_grad():
            hidden = teacher.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state
        # The head plus the family's logit transform (Gemma's soft-cap): the logits the teacher's forward returns.
        return hidden, get_family(teacher).logits_head(teacher)

    # --- the teacher (distillation) -------------------------------------------------------------
    def snapshot_teacher(self) -> None:
        """Keep a frozen copy of the dense model as the teacher; called by the cut just before the surgery."""
        if self.distillation is None or self.distillation.teacher or not self.distillation.uses_teacher:
            return  # a named teacher is loaded from its folder; alpha 0 needs none
        if self._trainer is not None and distributed.needs_fresh_engine(self._trainer.strategy):
            return  # the engine's weights are partitioned; the fresh engine loads the teacher from `pretrained`
        self.frozen_teacher.snapshot(self.base_model, self.distillation, self.device)

    def teacher(self) -> nn.Module:
        """The frozen teacher, loaded on first use (after a resume or the DeepSpeed hand-off: from its folder)."""
        return self.frozen_teacher.get(self.distillation, self.dense_pretrained, self.model_config is not None,
                                       self.base_model, self.device)

    def distillation_record(self) -> dict | None:
        """What the report says about the distillation: the teacher and the loss."""
        if self.distillation is None:
            return None
        held = self.frozen_teacher.dtype  # `auto` resolved where the teacher ran
        return {**self.distillation.as_dict(), "teacher": describe_teacher(self.distillation, self.dense_pretrained),
                **({"dtype": str(held).removeprefix("torch.")} if held is not None else {})}

    def on_before_optimizer_step(self, optimizer) -> None:
        for name, p in self.model.named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                raise FloatingPointError(f"NaN/inf gradient in {name} at step {self.global_step}")

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_ppl.update(self(batch), batch)
        self.log("val_ppl", self.val_ppl, prog_bar=True, on_epoch=True, on_step=False)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_ppl.update(self(batch), batch)
        self.log("test_ppl", self.val_ppl, on_epoch=True, on_step=False)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:  # "none" recovery: a no-op optimizer keeps the loop valid
            params = [nn.Parameter(torch.zeros(1, device=self.device))]
        opt = torch.optim.AdamW(params, lr=self.learning_rate, weight_decay=self.weight_decay)
        trainer, total = self._trainer, None
        # Only a decay needs the run's length (Lightning may load the training data early to estimate it).
        if self.lr_schedule != "constant" and trainer is not None and math.isfinite(trainer.estimated_stepping_batches):
            total = int(trainer.estimated_stepping_batches)

        def factor(step: int) -> float:
            # The schedule runs from where it was built (the cut rebuilds the optimizer; a resumed run restores
            # `step`) to the end of the fit, so its length is read from the trainer's step, not fixed here.
            steps = None if total is None else max(total - (trainer.global_step - step), 1)
            return lr_factor(self.lr_schedule, self.warmup_steps, step, steps)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def adopt_pruned(self, plan: PrunePlan | dict, record: RunRecord, dense: str | None = None) -> None:
        """Mark `pretrained` as the already-cut model of `plan` (recovery continuing in a fresh engine).

        `dense`: the original model, still the distillation teacher's source.
        """
        if self.model is not None:
            raise RuntimeError("adopt_pruned must be called before the model is loaded")
        self.cut_state = CutState.continuing(plan if isinstance(plan, PrunePlan) else PrunePlan.from_dict(plan))
        if dense is not None:
            self.dense_pretrained = dense
        self.record = record

    # --- checkpoints ----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_checkpoint_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        load_checkpoint_state(self, checkpoint)


# --- what a checkpoint carries beside the weights ----------------------------------------------------------------
# The plan (re-applied on load, so the saved state dict fits), whether `pretrained` is already cut, LoRA,
# reconstruction's biases, the run record and every rank's random states (`rng_state`). Under LoRA recovery of a plan
# cut from `pretrained` before training, only the trainable weights are stored: the frozen base is `pretrained` + plan.
CKPT_KEY = "prunelight"


def frozen_weights_reproducible(module: PruneLM) -> bool:
    """True when the frozen base weights equal `pretrained` cut by the plan, so checkpoints may omit them.

    Not after reconstruction: the refitted weights and added biases exist only in this process.
    """
    cal = module.record.calibration
    cut_before_training = module.cut_state.pretrained_is_cut or (cal is not None and cal.prune_step == 0)
    return (module.lora_active and module.model_config is None and cut_before_training
            and not module.cut_state.reconstructed)


def save_checkpoint_state(module: PruneLM, checkpoint: dict) -> None:
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


def load_checkpoint_state(module: PruneLM, checkpoint: dict) -> None:
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
