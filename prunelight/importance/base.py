"""The criterion interface: streaming per-unit statistics gathered by hooks during calibration.

A unit is one GQA group of a layer (kind "attn") or one MLP channel of a layer (kind "mlp").
Criteria reduce everything to one fp32 number per unit inside their hooks, so memory stays
O(units), never O(weights): no weight gradient is kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from prunelight.families import KINDS, ModelFamily, get_family, unwrap

OBJECTIVES = ("lm", "entropy")
UnitScores = dict[str, list[torch.Tensor]]  # kind -> one 1-D tensor of scores per layer


def all_reduce_per_layer(tensors: list[dict[str, torch.Tensor]],
                         reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Sum per-layer dicts of accumulators over processes in one collective, replacing them in place."""
    keys = [(i, k) for i, acc in enumerate(tensors) for k in sorted(acc)]
    if not keys:
        return
    sizes = [tensors[i][k].numel() for i, k in keys]
    flat = reduce_sum(torch.cat([tensors[i][k] for i, k in keys]))
    for (i, k), t in zip(keys, torch.split(flat, sizes)):
        tensors[i][k] = t


def check_objective(objective: str) -> str:
    """Validate a calibration objective name ("lm": next-token NLL, "entropy": output entropy, no labels)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown calibration objective {objective!r}; available: {', '.join(OBJECTIVES)}")
    return objective


class Criterion(ABC):
    """Base class: owns fp32 accumulators `stats[kind][layer]` and the hooks that fill them."""

    name: str = "base"
    needs_data: bool = True  # False: scores come from the weights alone
    needs_backward: bool = True  # False: forward hooks suffice (no gradient needed)
    loss: str = "lm"  # which calibration objective the backward pass uses: "lm" or "entropy"
    # Samples per forward/backward during calibration (None: the batch as given). Weight-gradient
    # criteria use 1 so |w*g| is taken per sample and the sums do not depend on how samples are batched.
    micro_batch_size: int | None = None

    def __init__(self) -> None:
        self.stats: UnitScores = {kind: [] for kind in KINDS}
        self.num_samples = 0
        self.num_batches = 0  # forward (+backward) passes, counted by run_calibration
        self._handles: list = []

    def grad_params(self, model: nn.Module) -> list[nn.Parameter]:
        """Parameters that must require grad during calibration (weight-gradient criteria; else none)."""
        return []

    # --- lifecycle --------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Create zeroed accumulators and register hooks on `model`."""
        family = get_family(model)
        shapes = family.layer_shapes(model)
        device = next(unwrap(model).parameters()).device
        self.stats = {
            "attn": [torch.zeros(s.num_key_value_heads, dtype=torch.float32, device=device) for s in shapes],
            "mlp": [torch.zeros(s.intermediate_size, dtype=torch.float32, device=device) for s in shapes],
        }
        self.num_samples = 0
        self.num_batches = 0
        self._register(model, family)

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        """Register hooks (subclasses that read activations override this)."""

    def detach(self) -> None:
        """Remove every hook this criterion registered."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def all_reduce(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the statistics over processes with `reduce_sum` (identity on one process)."""
        if not self.needs_data:
            return  # weight-only scores are already identical on every rank
        for kind in KINDS:
            if not self.stats[kind]:
                continue
            sizes = [t.numel() for t in self.stats[kind]]
            flat = reduce_sum(torch.cat(self.stats[kind]))
            self.stats[kind] = list(torch.split(flat, sizes))
        counts = reduce_sum(torch.tensor([float(self.num_samples), float(self.num_batches)], device=self._device()))
        self.num_samples, self.num_batches = int(counts[0].item()), int(counts[1].item())

    def _device(self) -> torch.device:
        for kind in KINDS:
            if self.stats[kind]:
                return self.stats[kind][0].device
        return torch.device("cpu")

    @abstractmethod
    def scores(self, model: nn.Module) -> UnitScores:
        """Final per-unit importance (higher = more important)."""


class ActGradCriterion(Criterion):
    """Criteria built from a * dL/da at each unit's output (o_proj input per group, down_proj input per channel).

    These hooks see activations and their gradients only, so they work with frozen weights, under
    gradient checkpointing, and under DeepSpeed ZeRO where weight gradients are partitioned.
    """

    needs_backward = True

    def __init__(self, objective: str = "lm") -> None:
        super().__init__()
        self.loss = check_objective(objective)

    @abstractmethod
    def reduce_samples(self, per_sample: torch.Tensor) -> torch.Tensor:
        """[batch, units] per-sample sums of a*g -> [units] contribution of this batch."""

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        # Under gradient checkpointing saved tensors are packed by checkpoint's hooks: reading them in the
        # forward would recompute, so the activation is held instead (see `_grad_hook`).
        self._recompute = not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
        for i, mods in enumerate(family.input_modules(model)):
            # The inputs of o_proj / down_proj are the units' outputs, laid out unit after unit.
            for kind, key in (("attn", "o_in"), ("mlp", "down_in")):
                if key in mods:
                    units = self.stats[kind][i].numel()
                    self._handles.append(mods[key].register_forward_pre_hook(self._grad_hook(kind, i, units)))

    def _grad_hook(self, kind: str, layer: int, units: int):
        def pre_hook(module, args):
            x = args[0]
            if not x.requires_grad:
                return
            # The closure never holds `x`: x's graph node owns this hook, so capturing x would form a cycle
            # (node -> hook -> x -> node) that keeps every batch's activations alive until Python's cyclic GC
            # happens to run (memory grew by one batch of activations per batch).
            held = self._factors(x) or [x.detach()]

            def on_grad(g: torch.Tensor) -> None:
                # x = f1 * f2 (SwiGLU's down_proj input) is rebuilt from the factors autograd saves anyway, so
                # the pass keeps no activation of its own: bitwise the same product, one layer at a time.
                rebuilt = len(held) == 2
                a = held[0] * held[1] if rebuilt else held[0]
                held.clear()  # free as soon as used (the factors go with the Mul node right after)
                if rebuilt and a.dtype == torch.float32 and g.dtype == torch.float32:
                    ag = a.mul_(g)  # our own fresh tensor: no second activation-sized temporary
                else:
                    ag = a.float() * g.float()
                self.stats[kind][layer] += self.reduce_products(ag, units)

            x.register_hook(on_grad)

        return pre_hook

    def _factors(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The two tensors an elementwise product `x` was made of, as its Mul node saved them; else None.

        Holding `x` itself would keep one activation per layer alive from the forward to the backward (on
        ref-llama-gqa at 8 x 128 tokens, 24 MiB of the frozen floor's ~280 MiB); the factors are saved by
        autograd for the product's own backward whether or not a criterion is attached.
        """
        node = x.grad_fn
        if not getattr(self, "_recompute", False) or type(node).__name__ != "MulBackward0":
            return None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return None  # saved tensors are packed by someone's hooks: reading them now is not free
        try:
            f1, f2 = node._saved_self, node._saved_other
        except (AttributeError, RuntimeError):
            return None
        if not (isinstance(f1, torch.Tensor) and isinstance(f2, torch.Tensor)) or f1.shape != x.shape \
                or f2.shape != x.shape or f1.dtype != x.dtype or f2.dtype != x.dtype:
            return None
        return [f1, f2]

    def reduce_products(self, ag: torch.Tensor, units: int) -> torch.Tensor:
        """[batch, tokens, width] products a*g (a fresh fp32 tensor) -> [units] contribution of this batch.

        Default: per sample, sum over tokens and over the unit's channels, then `reduce_samples`.
        """
        ag = ag.sum(dim=1)  # sum over tokens: [batch, width]
        per_sample = ag.view(ag.shape[0], units, -1).sum(-1)  # [batch, units]
        return self.reduce_samples(per_sample)

    def scores(self, model: nn.Module) -> UnitScores:
        return {kind: [t.clone() for t in self.stats[kind]] for kind in KINDS}
