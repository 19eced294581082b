"""`Teacher`: the frozen dense model that distillation compares the cut student with.

Snapshotted from the dense model just before the cut, or loaded on first use from its folder (after a
resume or the DeepSpeed hand-off: `model.distillation.teacher`, else the dense `pretrained`). It is held
by a plain object, not a registered submodule: outside the student's state_dict(), parameters(), the
optimizer and Lightning's .train().
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from prunelight.distill import DistillationSettings
from prunelight import sources
from prunelight.families import unwrap

log = logging.getLogger(__name__)


class Teacher:
    """The frozen teacher of one run, held in `model.distillation.dtype`; loaded with the student's attention kernel."""

    def __init__(self, model_dtype: torch.dtype, attn_implementation: str | None, trust_remote_code: bool) -> None:
        # model_dtype: the student's, which `distillation.dtype: model` and `auto` (off a bf16 GPU) resolve to
        self.model_dtype, self.attn_implementation = model_dtype, attn_implementation
        self.trust_remote_code = trust_remote_code
        self.model: nn.Module | None = None

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the teacher is held in (None before it is snapshotted or loaded)."""
        return None if self.model is None else next(self.model.parameters()).dtype

    def snapshot(self, dense: nn.Module, settings: DistillationSettings, device: torch.device) -> None:
        """Keep a frozen copy of the dense model (called just before the surgery; once)."""
        if self.model is None:
            self._set(copy.deepcopy(unwrap(dense)), settings.teacher_dtype(self.model_dtype, device), device)

    def get(self, settings: DistillationSettings, dense_source: str | None, built_from_config: bool,
            student: nn.Module, device: torch.device) -> nn.Module:
        """The frozen teacher on `device`, loaded on first use (checked against the `student`)."""
        if self.model is None:
            dtype = settings.teacher_dtype(self.model_dtype, device)
            self._set(self._load(settings, dense_source, built_from_config, student, dtype), dtype, device)
        if self.model.device != device:
            self.model.to(device)
        return self.model

    def _set(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        model = unwrap(model).to(device=device, dtype=dtype).eval()
        model.requires_grad_(False)
        self.model = model

    def _load(self, settings: DistillationSettings, dense_source: str | None, built_from_config: bool,
              student: nn.Module, dtype: torch.dtype) -> nn.Module:
        source = settings.teacher or dense_source
        option = "model.distillation.teacher" if settings.teacher else "model.pretrained"
        if source is None or (built_from_config and not settings.teacher):
            raise ValueError("model.distillation.teacher=null cannot be rebuilt for a model built from `config`: "
                             "give model.distillation.teacher a folder")
        kwargs = dict(dtype=dtype, trust_remote_code=self.trust_remote_code)
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        # A hub id, a folder, a GGUF file or a pkg:// resource, resolved as `model.pretrained` is.
        # A named teacher's vocabulary and hidden size were checked from its config by the run plan.
        model = sources.load_model(sources.resolve_pretrained(source, option=option), option, **kwargs)
        log.info("distillation teacher loaded from %s", source)
        return model
