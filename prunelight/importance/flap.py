"""FLAP's structured criteria (An et al. 2024, "Fluctuation-based Adaptive Structured Pruning for LLMs").

Both score only the weights that read a unit's output: the o_proj input columns (a GQA group owns the
columns of its query heads) and the down_proj input columns (one per MLP channel). Forward hooks on
those two inputs keep, per input feature j, the token count n, sum_t X_j and sum_t X_j^2 in fp64
(O(hidden + intermediate) per layer); no backward pass and no labels. Checked against
github:CASIA-IVA-Lab/FLAP, lib/prune.py (`prune_wanda_sp`, `prune_flap`, `metrics`, `compress`) and
lib/layerwrapper.py (`WrappedGPT`, `BiasGPT`).

`wanda_sp` (FLAP's structured Wanda baseline): column score c_j = mean_i |W_ij| * ||X_j||_2, the mean
over W's rows as in FLAP's `W_metric.mean(axis=0)`; a head is the sum of its channels' c_j
(`reshape(-1, 128).sum(dim=1)`), so a GQA group is the sum over its query heads' columns; an MLP channel is
its one column. ||X_j||_2 is over every calibration token (FLAP's `scaler_row` is that squared norm
divided by the number of samples, a constant factor that changes no ranking).

`flap` (WIFV, FLAP's default metric): per column, the fluctuation v_j * ||W_{:, j}||_2^2 with v_j the
unbiased sample variance of X_j over all calibration tokens. FLAP's code squares the attention metric
before aggregating (`metrics[...](...) ** 2` for o_proj only); that is kept. Then, as FLAP's default
structure "AL-AM" (adaptive over layers and modules), each layer's attention columns and each layer's
MLP channels are standardised separately (subtract the mean, divide by the unbiased std over that
layer's columns), a head is the mean of its standardised channels (so a GQA group is the mean over its
query heads' columns) and a channel is its own standardised value. FLAP then removes units by this score
across the whole model, each unit weighted by its parameter count. Our `global` allocation ranks units by
score / parameters, so `flap` returns the standardised score times the unit's parameter count: `global`
then removes units in exactly FLAP's AL-AM order (and `uniform` / per-layer quotas see the same ranking
within a layer). With `standardize: false` the raw FLAP metric is returned instead, aggregated as FLAP's
per-layer structures (UL-UM) do: a head is the sum of its channels' squared metric.
Standardised scores sum to zero per layer and kind, so they carry no sub-block importance: use
`standardize: false` (or `block_importance: removal`) with the `blockwise` allocation.

Exact variance rather than FLAP's running estimate: FLAP's `BiasGPT.add_batch` skips the first sample's
tokens and updates with an aliased running mean; here n, sum X and sum X^2 are exact sums, so the variance
does not depend on batching and adds up over processes.

Bias compensation (FLAP's `compress(..., bias=True)`: b += W[:, removed] @ mean(X_removed)) needs the mean
input per o_proj / down_proj input feature: after calibration, `criterion.input_means()` gives it.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelight.families import KINDS, ModelFamily, get_family, unwrap
from prunelight.importance.base import Criterion, UnitScores, all_reduce_per_layer

# The activation read by the unit-owned input columns of each kind: o_proj input, down_proj input.
UNIT_INPUT = {"attn": "o_in", "mlp": "down_in"}
_CHUNK_ELEMENTS = 1 << 22  # elements per fp64 chunk of a hook's working copy (32 MiB)


class InputMomentsCriterion(Criterion):
    """Base: fp64 count, sum and sum of squares of each o_proj / down_proj input feature over calibration tokens."""

    needs_backward = False

    def _register(self, model: nn.Module, family: ModelFamily) -> None:
        # moments[layer][kind] = [n, sum_t X_j (width), sum_t X_j^2 (width)] in one fp64 vector (one all_reduce).
        self.moments: list[dict[str, torch.Tensor]] = []
        for mods in family.input_modules(model):
            acc = {}
            for kind, key in UNIT_INPUT.items():
                if key not in mods:
                    continue  # sub-block removed
                module = mods[key]
                acc[kind] = torch.zeros(2 * module.in_features + 1, dtype=torch.float64, device=module.weight.device)
                self._handles.append(module.register_forward_pre_hook(self._hook(acc[kind])))
            self.moments.append(acc)

    @staticmethod
    def _hook(acc: torch.Tensor):
        def pre_hook(module, args):
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])
            width = x.shape[-1]
            # fp64 chunks of bounded size: an fp32 mean would carry a rounding error of eps32 * |mean| into
            # the variance (first order, via the spread of chunk means), far too much when |mean| >> std.
            for chunk in torch.split(x, max(1, _CHUNK_ELEMENTS // width)):
                c = chunk.to(torch.float64, copy=True)  # a copy even in fp64: centred in place below
                s1 = c.sum(0)
                mean = s1 / c.shape[0]
                acc[0] += c.shape[0]
                acc[1 : width + 1] += s1
                # Centred squares plus n * mean^2 = sum X^2, without the cancellation of squaring raw values.
                acc[width + 1 :] += c.sub_(mean).pow_(2).sum(0) + s1 * mean

        return pre_hook

    def all_reduce(self, reduce_sum) -> None:
        super().all_reduce(reduce_sum)
        all_reduce_per_layer(self.moments, reduce_sum)

    def _parts(self, layer: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        acc = self.moments[layer].get(kind)
        if acc is None:
            return None
        width = (acc.numel() - 1) // 2
        return acc[0], acc[1 : width + 1], acc[width + 1 :]

    def input_sq_norms(self, layer: int, kind: str) -> torch.Tensor | None:
        """fp64 sum over calibration tokens of X_j^2 per input feature of o_proj ("attn") or down_proj ("mlp")."""
        parts = self._parts(layer, kind)
        return None if parts is None else parts[2]

    def input_variances(self, layer: int, kind: str) -> torch.Tensor | None:
        """fp64 unbiased sample variance over calibration tokens per o_proj / down_proj input feature."""
        parts = self._parts(layer, kind)
        if parts is None:
            return None
        n, s1, s2 = parts
        return ((s2 - s1 * (s1 / n)) / (n - 1)).clamp_min(0)

    def input_means(self) -> UnitScores:
        """Mean calibration input per feature (fp32), one tensor a layer: {"attn": o_proj's, "mlp": down_proj's}.

        The features are ordered as the projection's input columns (unit after unit); a removed sub-block
        gives an empty tensor. This is what FLAP's bias compensation multiplies by the removed columns.
        """
        out: UnitScores = {kind: [] for kind in KINDS}
        for layer in range(len(self.moments)):
            for kind in KINDS:
                parts = self._parts(layer, kind)
                empty = torch.zeros(0, device=self._device())
                out[kind].append(empty if parts is None else (parts[1] / parts[0]).float())
        return out

    @torch.no_grad()
    def scores(self, model: nn.Module) -> UnitScores:
        base = unwrap(model)
        family = get_family(base)
        out: UnitScores = {kind: [torch.zeros_like(t) for t in self.stats[kind]] for kind in KINDS}
        for i, mods in enumerate(family.input_modules(base)):
            for kind, key in UNIT_INPUT.items():
                if key in mods and out[kind][i].numel():
                    out[kind][i] = self.column_scores(family, base.config, mods[key], i, kind).float()
        return out

    def column_scores(self, family: ModelFamily, config, module: nn.Linear, layer: int, kind: str) -> torch.Tensor:
        """[units] fp64 scores of one layer's units of `kind` from `module` (o_proj / down_proj) and the moments."""
        raise NotImplementedError

    @staticmethod
    def _weight(module: nn.Linear) -> torch.Tensor:
        """The projection weight in fp32, gathered first when ZeRO-3 has partitioned it (every rank calls this)."""
        from prunelight.zero3 import gathered  # lazy: zero3 imports importance.base

        with gathered(module):
            return module.weight.detach().float()


class WandaSPCriterion(InputMomentsCriterion):
    """FLAP's Wanda-sp: mean over rows of |W_ij| * ||X_j||_2 per o_proj / down_proj input column, summed per unit."""

    name = "wanda_sp"

    def column_scores(self, family: ModelFamily, config, module: nn.Linear, layer: int, kind: str) -> torch.Tensor:
        cols = self._weight(module).abs().mean(0).double() * self.input_sq_norms(layer, kind).sqrt()
        units = self.stats[kind][layer].numel()
        return cols.view(units, -1).sum(1)


class FlapCriterion(InputMomentsCriterion):
    """FLAP's fluctuation metric (WIFV) per unit; standardised per layer and kind as FLAP's AL-AM (see module doc)."""

    name = "flap"

    def __init__(self, standardize: bool = True) -> None:
        super().__init__()
        if not isinstance(standardize, bool):
            raise ValueError(f"criterion_args.standardize={standardize!r} is not allowed: true or false")
        self.standardize = standardize

    def column_scores(self, family: ModelFamily, config, module: nn.Linear, layer: int, kind: str) -> torch.Tensor:
        metric = self.input_variances(layer, kind) * self._weight(module).pow(2).sum(0).double()  # WIFV per column
        if kind == "attn":
            metric = metric.pow(2)  # FLAP squares the o_proj metric (lib/prune.py, prune_flap)
        units = self.stats[kind][layer].numel()
        if not self.standardize:
            return metric.view(units, -1).sum(1)  # UL-UM: a head is the sum of its channels
        z = standardized(metric).view(units, -1).mean(1)  # AL-AM: a head is the mean of its standardised channels
        return z * family.unit_param_cost(config, kind)  # `global` divides by the cost: FLAP's order by z


def standardized(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std with the unbiased std, as FLAP's `standarlization`; zeros where the std is 0 or undefined."""
    if x.numel() < 2:
        return torch.zeros_like(x)
    std = x.std()
    if not torch.isfinite(std) or std == 0:
        return torch.zeros_like(x)
    return (x - x.mean()) / std
