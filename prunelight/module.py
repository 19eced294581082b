"""The LightningModule: a Hugging Face causal LM that can be cut in place and then recovered."""

from __future__ import annotations

import copy
import logging
import random
import time
from typing import Literal

import lightning as L
import torch
from torch import nn

from prunelight.distill import DistillationSettings, describe_teacher, hidden_mse, logit_distillation
from prunelight.families import get_family, unwrap
from prunelight.metrics import TokenPerplexity
from prunelight.plan import PrunePlan
from prunelight.record import RunRecord
from prunelight.settings import PruneSettings
from prunelight import sources
from prunelight.recovery import RECOVERY_MODES, LoRASettings, add_lora, check_mode, merge_lora
from prunelight.surgery import apply_plan
from prunelight.zero3 import hf_zero3_loading

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DtypeName = Literal[tuple(DTYPES)]  # type: ignore[valid-type]
RecoveryMode = Literal[RECOVERY_MODES]  # type: ignore[valid-type]
CKPT_KEY = "prunelight"


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
        distillation: DistillationSettings | None = None,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        check_mode(recovery)
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
        self.model: nn.Module | None = None
        self.tokenizer = None
        self.plan: PrunePlan | None = None
        self.reconstructed = False  # True once prune.reconstruct changed the cut weights (not `pretrained` + plan)
        self.pretrained_is_pruned = False  # True when `pretrained` already holds the cut weights (DeepSpeed hand-off)
        self.handoff: dict | None = None  # set by PruningCallback when recovery must restart in a fresh engine
        self.lora_active = False
        self.distillation = distillation
        # The teacher's source when `pretrained` becomes the cut folder (hand-off); one value, GGUF file included.
        self.dense_pretrained = sources.one_value(pretrained, gguf_file)
        # Not a registered submodule: outside state_dict(), parameters(), the optimizer and Lightning's .train().
        object.__setattr__(self, "_teacher", None)
        self._rng_to_restore: dict | None = None
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

    def check_pretrained(self):
        """Load the config and refuse an unsupported family before any weights or data are read."""
        config = self.load_config()
        get_family(config)
        return config

    def check_settings(self, settings: PruneSettings, config) -> None:
        """Pruning settings that the model's widths cannot satisfy, refused before weights load."""
        family = get_family(config)
        shape = family.base_shape(config)
        for option, keep, have, what in (
            ("prune.min_groups", settings.min_groups, shape.num_key_value_heads, "KV groups"),
            ("prune.min_channels", settings.min_channels, shape.intermediate_size, "MLP channels"),
        ):
            if keep > have:
                raise ValueError(f"{option}={keep} is not allowed: the model's layers have {have} {what}; "
                                 f"use at most {have}")

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
        if self.pretrained_is_pruned:
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
    def apply_plan(self, plan: PrunePlan) -> None:
        """Cut the model to `plan` and remember it (checkpoints re-apply it on load)."""
        if self.plan is not None:
            raise RuntimeError("the model is already pruned; a second plan would use stale indices")
        apply_plan(self.base_model, plan)
        self.plan = plan

    def apply_plan_reconstructed(self, plan: PrunePlan, batches, settings: PruneSettings, reduce_sum=None) -> dict:
        """Cut the model to `plan` and repair it on calibration `batches` (prune.reconstruct); returns its figures."""
        from prunelight.reconstruct import cut_and_reconstruct

        if self.plan is not None:
            raise RuntimeError("the model is already pruned; a second plan would use stale indices")
        figures = cut_and_reconstruct(self.base_model, plan, batches, settings, reduce_sum)
        self.plan = plan
        self.reconstructed = settings.reconstruct != "none"
        return figures

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
            _restore_rng_states(self._rng_to_restore)
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
        return loss

    def _distillation_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """alpha * distill + (1 - alpha) * CE on one batch (prunelight.distill documents each term)."""
        d = self.distillation
        out = self.model(input_ids=batch, labels=batch, use_cache=False, output_hidden_states=d.hidden)
        teacher = self.teacher()
        with torch.no_grad():
            t_hidden = teacher.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state
        logits = out.logits
        term = logit_distillation(logits.reshape(-1, logits.shape[-1]), t_hidden.reshape(-1, t_hidden.shape[-1]),
                                  teacher.get_output_embeddings(), d.loss, d.temperature, d.chunk_tokens)
        if d.hidden:
            term = term + hidden_mse(out.hidden_states[-1], t_hidden)
        self.log_dict({"train_ce": out.loss.detach(), "train_distill": term.detach()})
        return d.alpha * term + (1.0 - d.alpha) * out.loss

    # --- the teacher (distillation) -------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.distillation is None or self._trainer is None:
            return
        from prunelight.distributed import zero_stage

        if zero_stage(self._trainer.strategy) == 3:
            raise ValueError("model.distillation is not allowed under DeepSpeed ZeRO-3: the teacher would be a full "
                             "unpartitioned copy on every GPU; use DDP or ZeRO stage 1/2, or model.distillation: null")

    def snapshot_teacher(self) -> None:
        """Keep a frozen copy of the dense model as the teacher; called by the cut just before the surgery."""
        from prunelight.distributed import needs_fresh_engine

        if self.distillation is None or self.distillation.teacher or self._teacher is not None:
            return
        if self._trainer is not None and needs_fresh_engine(self._trainer.strategy):
            return  # the engine's weights are partitioned; the fresh engine loads the teacher from `pretrained`
        self._set_teacher(copy.deepcopy(self.base_model))

    def teacher(self) -> nn.Module:
        """The frozen teacher, loaded on first use (after a resume or the DeepSpeed hand-off: from its folder)."""
        if self._teacher is None:
            self._set_teacher(self._load_teacher())
        if self._teacher.device != self.device:
            self._teacher.to(self.device)
        return self._teacher

    def _set_teacher(self, model: nn.Module) -> None:
        model = unwrap(model).to(device=self.device, dtype=DTYPES[self.dtype_name]).eval()
        model.requires_grad_(False)
        object.__setattr__(self, "_teacher", model)

    def _load_teacher(self) -> nn.Module:
        source = self.distillation.teacher or self.dense_pretrained
        option = "model.distillation.teacher" if self.distillation.teacher else "model.pretrained"
        if source is None or (self.model_config is not None and not self.distillation.teacher):
            raise ValueError("model.distillation.teacher=null cannot be rebuilt for a model built from `config`: "
                             "give model.distillation.teacher a folder")
        kwargs = dict(dtype=DTYPES[self.dtype_name], trust_remote_code=self.trust_remote_code)
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        model = sources.load_model(sources.resolve_pretrained(source, option=option), option, **kwargs)
        want, have = self.base_model.config.vocab_size, model.config.vocab_size
        if want != have:
            raise ValueError(f"model.distillation.teacher={source!r} is not allowed: its vocabulary has {have} "
                             f"tokens, the model's {want}; use a teacher with the same tokenizer")
        if self.distillation.hidden and model.config.hidden_size != self.base_model.config.hidden_size:
            raise ValueError(f"model.distillation.hidden=True is not allowed with teacher {source!r}: hidden sizes "
                             f"differ ({model.config.hidden_size} vs {self.base_model.config.hidden_size})")
        log.info("distillation teacher loaded from %s", source)
        return model

    def distillation_record(self) -> dict | None:
        """What the report says about the distillation: the teacher and the loss."""
        if self.distillation is None:
            return None
        return {**self.distillation.as_dict(), "teacher": describe_teacher(self.distillation, self.dense_pretrained)}

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
        warmup = max(self.warmup_steps, 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def adopt_pruned(self, plan: dict, record: RunRecord, dense: str | None = None) -> None:
        """Mark `pretrained` as the already-cut model of `plan` (recovery continuing in a fresh engine).

        `dense`: the original model, still the distillation teacher's source.
        """
        if self.model is not None:
            raise RuntimeError("adopt_pruned must be called before the model is loaded")
        self.plan = PrunePlan.from_dict(plan)
        if dense is not None:
            self.dense_pretrained = dense
        self.pretrained_is_pruned = True
        self.record = record

    # --- checkpoints ----------------------------------------------------------------------------
    def _frozen_weights_reproducible(self) -> bool:
        """True when the frozen base weights equal `pretrained` cut by the plan, so checkpoints may omit them.

        Not after reconstruction: the refitted weights and added biases exist only in this process.
        """
        cal = self.record.calibration
        cut_before_training = self.pretrained_is_pruned or (cal is not None and cal.prune_step == 0)
        return self.lora_active and self.model_config is None and cut_before_training and not self.reconstructed

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        weights = "all"
        if self._frozen_weights_reproducible() and "state_dict" in checkpoint:
            # LoRA recovery: the frozen base is `pretrained` + plan; store only what trains.
            keep = {f"model.{k}" for k in trainable_keys(self.model)}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
            weights = "trainable"
        checkpoint[CKPT_KEY] = {
            "plan": self.plan.to_dict() if self.plan else None,
            "pretrained_is_pruned": self.pretrained_is_pruned,
            "lora": self.lora.as_dict() if self.lora_active else None,
            "weights": weights,
            "report": self.record.to_dict(),
            "reconstructed": self.reconstructed,
            "output_bias": bool(getattr(self.base_model.config, "output_bias", False)),
            "dense_pretrained": self.dense_pretrained,
            "rng": _rng_states(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Rebuild the pruned (and LoRA-wrapped) structure so the saved state dict fits.
        state = checkpoint.get(CKPT_KEY) or {}
        self.dense_pretrained = state.get("dense_pretrained", self.dense_pretrained)
        self._rng_to_restore = state.get("rng")  # applied at the first training step, after all setup draws
        if state.get("pretrained_is_pruned") and self.model is None:
            self.plan = PrunePlan.from_dict(state["plan"])
            self.pretrained_is_pruned = True
        self.configure_model()
        if state.get("plan") and self.plan is None:
            self.apply_plan(PrunePlan.from_dict(state["plan"]))
        if state.get("output_bias") and not getattr(self.base_model.config, "output_bias", False):
            get_family(self.base_model).add_output_biases(self.base_model)  # reconstruction's biases, before LoRA wraps
        self.reconstructed = bool(state.get("reconstructed", False))
        if state.get("lora") and not self.lora_active:
            self.lora = LoRASettings(**state["lora"])
            self.recovery = "lora"
            self.start_recovery()
        if state.get("report"):
            self.record = RunRecord.from_dict(state["report"])
        if state.get("weights") == "trainable" and "state_dict" in checkpoint:
            # The omitted frozen weights are the ones just rebuilt from `pretrained` + plan.
            own = self.state_dict()
            checkpoint["state_dict"] = {**own, **checkpoint["state_dict"]}


def trainable_keys(module: nn.Module) -> set[str]:
    """State-dict keys of the parameters that train (LoRA adapters), as `module.state_dict()` names them."""
    return {name for name, p in module.named_parameters() if p.requires_grad}


def _rng_states() -> dict:
    """The global random states a training step draws from (torch CPU/CUDA, Python, NumPy)."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # Plain types: Lightning loads checkpoints with weights_only=True, which refuses NumPy arrays.
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng_states(states: dict) -> None:
    """Inverse of `_rng_states` (a CUDA state is restored only where CUDA runs)."""
    import numpy as np

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
