"""`obs`: units ranked by structured OBS, the output error their greedy removal adds after the optimal repair.

Forward hooks keep, per layer, the Gram G = Σ x xᵀ of the o_proj and down_proj inputs over the calibration tokens
(fp32; no backward pass, no labels). `scores` then runs `obs.greedy_removal` on every sub-block: units are removed
one at a time, each time the unit whose removal, after the least-squares update of the remaining o_proj /
down_proj columns, adds the least output error (damping λ = `ridge` x mean diag G, as `prune.reconstruct:
least_squares`). A unit's score is the running maximum of that added error at the step it went, per calibration
token (`obs.order_scores`): within a sub-block the k lowest are exactly the greedy prefix, and across sub-blocks
and kinds a unit costs the squared output error (in residual-stream units) its removal adds, per parameter once
an allocation divides by the unit's cost. Pair it with `prune.reconstruct: least_squares` (the same refit as the
greedy's final update) or `obs` (which re-selects inside each sub-block at the cut).

Memory: one G per projection and layer, held until `scores`: Σ_layers (o_in² + down_in²) x 4 B (SmolLM2-135M:
30 x (576² + 1536²) x 4 B = 323 MB; Llama-3-8B: 32 x (4096² + 14336²) x 4 B = 28 GB, where the streamed
reconstruction `obs`, one layer at a time, is the practical choice). Time: about d³/3 fp64 multiply-adds per
projection of input width d for the full removal order.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import KINDS, ModelFamily, get_family, unwrap
from prunelight.importance.base import Criterion, UnitScores, all_reduce_per_layer
from prunelight.obs import damping, greedy_removal, order_scores

UNIT_INPUT = {"attn": "o_in", "mlp": "down_in"}
_CHUNK_ELEMENTS = 1 << 22


def unit_columns(family: ModelFamily, config, shape, kind: str) -> torch.Tensor:
    """[units, block] the input columns of the output projection each unit of `kind` owns."""
    spec = next(s for s in family.unit_layout(config, shape) if s.kind == kind and s.reads_unit_output)
    return spec.indices(list(range(spec.units))).view(spec.units, -1)


class ObsCriterion(Criterion):
    """Greedy structured OBS order of each sub-block's units from the Gram of its output projection's inputs."""

    name = "obs"
    needs_backward = False

    def __init__(self, ridge: float = 1e-2) -> None:
        super().__init__()
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge > 0:
            raise ValueError(f"criterion_args.ridge={ridge!r} is not allowed: a number > 0 (e.g. 0.01)")
        self.ridge = float(ridge)

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        self.grams: list[dict[str, torch.Tensor]] = []
        self.tokens = torch.zeros(1, dtype=torch.float64, device=next(unwrap(model).parameters()).device)
        for mods in family.input_modules(model):
            acc = {}
            for kind, key in UNIT_INPUT.items():
                if key in mods:
                    m = mods[key]
                    acc[kind] = torch.zeros(m.in_features, m.in_features, device=m.weight.device)
                    first = not self._handles  # the first hooked projection counts the tokens
                    self._handles.append(m.register_forward_pre_hook(self._hook(acc[kind], first)))
            self.grams.append(acc)

    def _hook(self, gram: torch.Tensor, count: bool):
        def pre_hook(module, args):
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])
            if count:
                self.tokens += x.shape[0]
            for chunk in torch.split(x, max(1, _CHUNK_ELEMENTS // x.shape[-1])):
                c = chunk.float()
                gram.addmm_(c.T, c)

        return pre_hook

    def all_reduce(self, reduce_sum) -> None:
        super().all_reduce(reduce_sum)
        flat = [{f"{k}": v.view(-1) for k, v in acc.items()} for acc in self.grams]
        all_reduce_per_layer(flat, reduce_sum)
        for acc, red in zip(self.grams, flat):
            for k in list(acc):
                acc[k] = red[k].view_as(acc[k])
        self.tokens = reduce_sum(self.tokens)

    @torch.no_grad()
    def scores(self, model: nn.Module) -> UnitScores:
        base = unwrap(model)
        family = get_family(base)
        shapes = family.layer_shapes(base)
        tokens = max(float(self.tokens), 1.0)
        out: UnitScores = {kind: [torch.zeros_like(t) for t in self.stats[kind]] for kind in KINDS}
        for i, mods in enumerate(family.input_modules(base)):
            for kind, key in UNIT_INPUT.items():
                n = out[kind][i].numel()
                if key not in mods or not n:
                    continue
                gram = self.grams[i][kind]
                cols = unit_columns(family, base.config, shapes[i], kind)
                res = greedy_removal(_weight(mods[key]), gram, cols, n - 1, damping(gram, self.ridge))
                out[kind][i] = (order_scores(res.order, res.delta, n) / tokens).float().to(out[kind][i].device)
        return out


def _weight(module: nn.Linear) -> torch.Tensor:
    """The projection weight, gathered first when ZeRO-3 has partitioned it (every rank calls this)."""
    from prunelight.zero3 import gathered  # lazy: zero3 imports importance.base

    with gathered(module):
        return module.weight.detach().float().clone()
