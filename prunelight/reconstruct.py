"""Reconstruction after the cut: repair each cut sub-block's output from calibration activations.

`prune.reconstruct` chooses how the output projection that reads the units (o_proj for attention,
down_proj for the MLP) is repaired once some of its input columns are gone:

- ``none``: the cut alone (`surgery.apply_plan`).
- ``bias``: bias compensation as in FLAP (An et al., AAAI 2024; CASIA-IVA-Lab/FLAP ``lib/prune.py``
  ``compress``: ``output_bias = (mean_inp * ~mask) @ W.T``): the removed columns' mean contribution
  W[:, R] · mean(x_R) is added to the projection's output bias. Llama and Mistral have no such bias;
  the family adds one (`ModelFamily.add_output_biases`) and the config records it (`output_bias: true`).
- ``least_squares``: the kept columns W_K are refitted by damped least squares, as SlimGPT, ZipLM and
  Olica repair the remaining weights after structured removal.
- ``obs``: structured OBS (`prunelight.obs`): the plan fixes how many units each sub-block keeps, and which ones is
  chosen again here, greedily, each step removing the unit whose removal after the optimal update of the remaining
  columns adds the least output error, from the Gram of all the projection's input columns (damping λ = ridge ·
  mean(diag G) of the full Gram); the final update is the least-squares refit on the kept columns. The plan's kept
  lists are rewritten to the units kept, so plan.json states what was cut. Dense inputs only.

One output projection, with kept input columns K, calibration inputs x (see *inputs* below) and targets
y = W x_dense (the dense projection's output without its own bias), is fitted from token sums only:
n, s_x = Σ x_K, s_y = Σ y, e0 = Σ ||W_K x_K - y||², Σ ||y||², and for least squares G = Σ x_K x_Kᵀ
and C = Σ y x_Kᵀ. Activations of all tokens are never kept.

- bias: b = (s_y - W_K s_x) / n, the mean residual, which with dense inputs is exactly FLAP's
  W_R · mean(x_R). Its error is e0 - n ||b||² <= e0.
- least squares: W'_K = argmin Σ ||W' x_K - y||² + λ ||W' - W_K||² = (C + λ W_K)(G + λ I)⁻¹ with
  λ = ridge · mean(diag G). The damping is anchored at the kept weights rather than at zero: it is the
  Hessian damping H + λI of SparseGPT (percdamp 1% of the mean diagonal), which SlimGPT's column-removal
  update inherits; with dense inputs the solution is that update, W_K + W_R G_RK (G_KK + λI)⁻¹. Anchoring
  also guarantees the calibration error never rises (W_K itself costs e0 and no damping penalty).

*inputs*: ``dense`` fits on the dense model's activations (FLAP); ``pruned`` fits on the activations of
the model already cut and repaired up to this sub-block while keeping the dense output as target, so a
layer also corrects the error its predecessors left (sequential, as SparseGPT/SlimGPT process layers).
`FIT_INPUTS` is the one used by runs; docs/methods.md ("Reconstruction") gives the comparison.

Memory (layers are processed one at a time, in order, and each layer's statistics are freed before the
next): the layer-boundary hidden states of this rank's calibration batches, in the model dtype, on the
model's device: tokens x hidden for ``dense`` inputs (Llama-3-8B, 128 x 2048 tokens x 4096 x bf16 = 2 GiB),
four times that for ``pruned`` (pruned stream and the two dense targets). For least squares the Grams of
one layer: G of down_proj is kept² fp32, at most 14336² x 4 B = 822 MB for Llama-3-8B (28672² = 3.3 GB for
Llama-3-70B), o_proj's 4096² = 67 MB (8192² = 268 MB), both held during the ``dense`` pass; the solve adds
an fp64 copy of one G (1.6 GB / 6.6 GB) and C = Σ y x_Kᵀ (hidden x kept, 235 MB / 940 MB in fp32).
Tokens are added in chunks of 64 MB of fp32 whatever the width. `bias` needs only vectors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prunelight.distributed import ReduceSum
from prunelight.families import LayerShape, ModelFamily, get_family, unwrap
from prunelight.obs import damping, greedy_removal
from prunelight.plan import PrunePlan
from prunelight.surgery import apply_plan, check_plan


RECONSTRUCTIONS = ("none", "bias", "least_squares", "obs")
FIT_INPUT_CHOICES = ("dense", "pruned")
# Dense inputs gave the lower calibration and held-out NLL on both reference models and on SmolLM2, at half the
# passes and a quarter of the stored activations (docs/methods.md, Reconstruction).
FIT_INPUTS = "dense"
# A step run after each layer's cut with the layer's dense inputs and outputs (per calibration batch) and its call
# arguments: (layer index, the cut layer, its cuts, inputs, outputs, kwargs); the layer tuning's `LayerTuner.tune`.
LayerTune = Callable[[int, nn.Module, list, list[torch.Tensor], list[torch.Tensor], list[dict]], None]

_CHUNK_ELEMENTS = 1 << 24  # fp32 elements per token chunk when accumulating (64 MB), whatever the width


class _Stop(Exception):
    """Raised by a hook once it has what it needs, to skip the rest of the layer."""


# --- statistics -----------------------------------------------------------------------------------
@dataclass
class FitStats:
    """Token sums for refitting one output projection's kept columns (summed over ranks before a fit)."""

    n: torch.Tensor  # tokens (fp64 scalar)
    sum_x: torch.Tensor  # Σ x_K  [kept] fp32
    sum_y: torch.Tensor  # Σ y    [out] fp32
    err0: torch.Tensor  # Σ ||W_K x_K - y||²  (fp64 scalar): the error of the cut alone
    yy: torch.Tensor  # Σ ||y||²  (fp64 scalar)
    gram: torch.Tensor | None = None  # Σ x_K x_Kᵀ  [kept, kept] fp32 (least squares only)
    cross: torch.Tensor | None = None  # Σ y x_Kᵀ   [out, kept] fp32 (least squares only)

    @classmethod
    def empty(cls, kept: int, out: int, device, second_order: bool) -> FitStats:
        """Zero sums; `second_order` adds G and C (least squares)."""
        z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        f64 = torch.float64
        return cls(z((), dt=f64), z(kept), z(out), z((), dt=f64), z((), dt=f64),
                   z(kept, kept) if second_order else None, z(out, kept) if second_order else None)

    def add(self, x_k: torch.Tensor, y: torch.Tensor, w_k: torch.Tensor) -> None:
        """Add tokens: inputs on the kept columns [..., kept], targets [..., out], the kept weights (fp32)."""
        x_k, y = x_k.reshape(-1, x_k.shape[-1]), y.reshape(-1, y.shape[-1])
        step = max(1, _CHUNK_ELEMENTS // max(x_k.shape[1], y.shape[1]))
        for i in range(0, x_k.shape[0], step):
            xc, yc = x_k[i:i + step].float(), y[i:i + step].float()
            self.n += xc.shape[0]
            self.sum_x += xc.sum(0)
            self.sum_y += yc.sum(0)
            self.err0 += (xc @ w_k.T - yc).square().sum().double()
            self.yy += yc.square().sum().double()
            if self.gram is not None:
                self.gram.addmm_(xc.T, xc)
                self.cross.addmm_(yc.T, xc)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every sum by name (the ones a fit reads)."""
        return {k: v for k, v in vars(self).items() if v is not None}

    def reduce(self, reduce_sum: ReduceSum | None) -> None:
        """Sum every statistic over ranks (DDP), in a fixed order so all ranks match their collectives."""
        if reduce_sum is None:
            return
        for name, t in self.tensors().items():
            setattr(self, name, reduce_sum(t))


# --- fits -----------------------------------------------------------------------------------------
def bias_fit(stats: FitStats, w_k: torch.Tensor) -> tuple[torch.Tensor, float]:
    """FLAP bias compensation: b = (Σy - W_K Σx_K) / n (= W_R·mean(x_R) on dense inputs); returns b and its error."""
    n = float(stats.n)
    resid = stats.sum_y.double() - w_k.double() @ stats.sum_x.double()
    b = resid / n
    return b.float(), max(float(stats.err0) - float(resid.square().sum()) / n, 0.0)


def least_squares_fit(stats: FitStats, w_k: torch.Tensor, ridge: float) -> tuple[torch.Tensor, float]:
    """W' = (C + λ W_K)(G + λI)⁻¹ with λ = ridge·mean(diag G); returns W' (fp32) and Σ||W' x_K - y||²."""
    solved = ridge_solve(stats.gram, stats.cross, w_k, ridge)
    if solved is None:  # not positive definite even with damping (degenerate inputs): keep the cut weights
        return w_k, float(stats.err0)
    w_new, a, c, lam = solved
    # Σ||W'x - y||² = tr(W' G W'ᵀ) - 2 tr(W' Cᵀ) + Σ||y||², with G = A - λI.
    err = float((w_new @ a * w_new).sum() - lam * w_new.square().sum() - 2 * (w_new * c).sum() + stats.yy)
    return w_new.float(), max(err, 0.0)


def ridge_solve(gram: torch.Tensor, cross: torch.Tensor, w_k: torch.Tensor, ridge: float,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """The refit of `least_squares_fit` alone, in fp64: (W', A = G + λI, C, λ), or None when A is not positive
    definite. Its error is not computed: the search's levels refit many times and never read it."""
    a = gram.double()
    mean_diag = float(a.diagonal().mean())
    lam = ridge * mean_diag if mean_diag > 0 else ridge
    a.diagonal().add_(lam)  # A = G + λI, in place: one fp64 copy of the kept² matrix
    c, w = cross.double(), w_k.double()
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) != 0:
        return None
    return torch.cholesky_solve((c + lam * w).T, chol).T, a, c, lam


# --- one output projection being repaired ---------------------------------------------------------
@dataclass
class _Target:
    """The output projection of one sub-block being cut: kept columns, kept weights, token sums."""

    kind: str
    keep: list[int]
    cols: torch.Tensor
    w_k: torch.Tensor  # fp32 copy of W[:, cols]
    stats: FitStats
    ys: list[torch.Tensor] = field(default_factory=list)  # dense targets per batch (inputs="pruned" only)

    @classmethod
    def of(cls, family: ModelFamily, config, layer: nn.Module, shape: LayerShape, kind: str, keep: list[int],
           method: str) -> _Target:
        spec = next(s for s in family.unit_layout(config, shape) if s.kind == kind and s.reads_unit_output)
        proj = output_proj(family, layer, kind)
        # OBS chooses the kept units itself: its statistics cover every column.
        cols = spec.indices(list(range(spec.units)) if method == "obs" else keep).to(proj.weight.device)
        w_k = proj.weight.detach().index_select(1, cols).float()
        stats = FitStats.empty(len(cols), proj.out_features, proj.weight.device, method != "bias")
        return cls(kind, keep, cols, w_k, stats)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add a batch: the projection's full-width input and the dense target."""
        self.stats.add(x.index_select(-1, self.cols), y, self.w_k)


def output_proj(family: ModelFamily, layer: nn.Module, kind: str) -> nn.Linear:
    """The projection that reads the units' outputs: o_proj (attention) or down_proj (MLP)."""
    block = family.sub_block(layer, kind)
    return family.o(block) if kind == "attn" else family.gate_up_down(block)[2]


def _linear_part(proj: nn.Linear, out: torch.Tensor) -> torch.Tensor:
    """W x from a projection's output (its own bias removed: it is kept as it is)."""
    return out if proj.bias is None else out - proj.bias


# --- running one layer over the calibration batches -----------------------------------------------
@dataclass
class _Calls:
    """What the model passes each decoder layer besides the hidden states, per batch (masks, positions)."""

    hidden: list[torch.Tensor]  # layer-0 input per batch
    layer_kwargs: list[list[dict[str, Any]]]  # [batch][layer]


class _Catcher(nn.Module):
    """Stands in for a decoder layer while the model is run once: records its call, passes hidden on."""

    def __init__(self, index: int, last: bool, sink: list, attention_type: str | None) -> None:
        super().__init__()
        self.index, self.last, self.sink = index, last, sink
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if args:
            raise TypeError("decoder layers are expected to take everything but the hidden states by keyword")
        if self.index == 0:
            self.sink.append((hidden_states, []))
        self.sink[-1][1].append(kwargs)
        if self.last:
            raise _Stop  # the final norm and the LM head are not needed
        return hidden_states


def layer_calls(base: nn.Module, family: ModelFamily, batches: Sequence[torch.Tensor], device) -> _Calls:
    """The layer-0 input and each layer's keyword arguments per batch, from one embedding-only pass."""
    layers = family.layers(base)
    sink: list = []
    catchers = nn.ModuleList(_Catcher(i, i == len(layers) - 1, sink, getattr(layer, "attention_type", None))
                             for i, layer in enumerate(layers))
    family.set_layers(base, catchers)
    try:
        for ids in batches:
            try:
                base(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        family.set_layers(base, layers)
    return _Calls([h for h, _ in sink], [kw for _, kw in sink])


def run_layer(layer: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict], hooks: dict[nn.Module, Callable],
              stop: bool = False) -> list[torch.Tensor]:
    """Run `layer` on every batch; hooks(b, x, out) see their module's input and output; `stop` ends a batch there."""
    batch = [0]

    def wrap(fn):
        def hook(module, inputs, out):
            fn(batch[0], inputs[0], out)
            if stop:
                raise _Stop

        return hook

    handles = [m.register_forward_hook(wrap(fn)) for m, fn in hooks.items()]
    outs = []
    try:
        for b, (h, kw) in enumerate(zip(hidden, kwargs)):
            batch[0] = b
            try:
                out = layer(h, **kw)
            except _Stop:
                continue
            outs.append(out[0] if isinstance(out, tuple) else out)
    finally:
        for handle in handles:
            handle.remove()
    return outs


# --- the layer-by-layer cut ------------------------------------------------------------------------
@dataclass
class _Job:
    """One reconstruction: model, family, method and the running figures."""

    base: nn.Module
    family: ModelFamily
    method: str
    ridge: float
    reduce_sum: ReduceSum | None
    plan: PrunePlan | None = None  # rewritten by `obs` to the units it keeps
    figures: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0  # calibration tokens, all ranks

    def target(self, layer: nn.Module, shape: LayerShape, kind: str, keep: list[int]) -> _Target:
        return _Target.of(self.family, self.base.config, layer, shape, kind, keep, self.method)

    def cut_and_fit(self, i: int, layer: nn.Module, shape: LayerShape, kind: str, keep: list[int],
                    target: _Target | None) -> None:
        """Cut one sub-block (family surgery), then write the fitted weights or bias into what remains."""
        if target is None:
            self.family.cut_sub_block(layer, self.base.config, shape, kind, keep)
            return
        stats = target.stats
        stats.reduce(self.reduce_sum)
        if float(stats.n) == 0:
            raise ValueError("reconstruction saw no calibration tokens: the calibration dataset is empty")
        self.tokens = int(stats.n)
        if self.method == "obs":
            keep, w_new, before, after = self._obs(i, shape, kind, keep, target)
        self.family.cut_sub_block(layer, self.base.config, shape, kind, keep)
        proj = output_proj(self.family, layer, kind)
        if self.method != "obs":
            before = float(stats.err0)
        with torch.no_grad():
            if self.method == "obs":
                proj.weight.copy_(w_new.to(proj.weight.dtype))
            elif self.method == "bias":
                b, after = bias_fit(stats, target.w_k)
                bias = self.family.output_bias(layer, kind)
                bias.add_(b.to(bias.dtype))
            else:
                w_new, after = least_squares_fit(stats, target.w_k, self.ridge)
                if after > before:  # only rounding can do this (the damping is anchored): keep the cut weights
                    w_new, after = target.w_k, before
                proj.weight.copy_(w_new.to(proj.weight.dtype))
        yy = float(stats.yy)
        self.figures.append({"layer": i, "kind": kind, "kept": len(keep),
                             "rel_err_before": before / yy if yy > 0 else 0.0,
                             "rel_err_after": after / yy if yy > 0 else 0.0})
        target.stats = None  # frees G and C before the next sub-block

    def _obs(self, i: int, shape: LayerShape, kind: str, keep: list[int], target: _Target):
        """Greedy OBS keeping as many units as the plan: (kept units, their refitted columns, error of the plan's
        cut alone, error after), and the plan rewritten to the units kept."""
        spec = next(s for s in self.family.unit_layout(self.base.config, shape)
                    if s.kind == kind and s.reads_unit_output)
        gram, w = target.stats.gram, target.w_k  # every column, in unit order (spec.indices of all units)
        cols = torch.arange(w.shape[1], device=gram.device).view(spec.units, -1)
        res = greedy_removal(w, gram, cols, spec.units - len(keep), damping(gram, self.ridge))
        new_keep = sorted(set(range(spec.units)) - set(res.order))
        kept = set(keep)
        planned = cols[[u for u in range(spec.units) if u not in kept]].reshape(-1)
        g, w64 = gram.double(), w.double()
        before = float((w64[:, planned] @ g[planned][:, planned] * w64[:, planned]).sum())
        d = res.weight - w64
        after = max(float((d @ g * d).sum()), 0.0)
        if self.plan is not None:
            lp = self.plan.layers[i]
            if kind == "attn":
                lp.keep_groups = new_keep
            else:
                lp.keep_channels = new_keep
        w_new = res.weight[:, cols[new_keep].reshape(-1)].float()
        return new_keep, w_new, before, after


def _layer_dense_inputs(job: _Job, i: int, layer: nn.Module, shape: LayerShape, cuts, calls: list[dict],
                        dense: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fit every cut sub-block of the layer on the dense inputs (one pass); returns the next dense stream."""
    targets = {kind: job.target(layer, shape, kind, keep) for kind, keep in cuts if keep}
    hooks = {}
    for kind, t in targets.items():
        proj = output_proj(job.family, layer, kind)
        hooks[proj] = lambda b, x, out, t=t, proj=proj: t.add(x, _linear_part(proj, out))
    dense = run_layer(layer, dense, calls, hooks)
    for kind, keep in cuts:
        job.cut_and_fit(i, layer, shape, kind, keep, targets.get(kind))
    return dense


def _layer_pruned_inputs(job: _Job, i: int, layer: nn.Module, shape: LayerShape, cuts, calls: list[dict],
                         dense: list[torch.Tensor], pruned: list[torch.Tensor]):
    """Fit each cut sub-block on the pruned model's inputs against the dense outputs; returns both next streams."""
    targets = {kind: job.target(layer, shape, kind, keep) for kind, keep in cuts if keep}
    hooks = {}
    for kind, t in targets.items():  # dense pass: the targets y = W x_dense of this layer, and the next dense stream
        proj = output_proj(job.family, layer, kind)
        hooks[proj] = lambda b, x, out, t=t, proj=proj: t.ys.append(_linear_part(proj, out))
    dense = run_layer(layer, dense, calls, hooks)
    for kind, keep in cuts:  # forward order: the MLP is fitted on what the repaired attention gives it
        t = targets.get(kind)
        if t is not None:
            hook = lambda b, x, out, t=t: t.add(x, t.ys[b])  # noqa: E731
            run_layer(layer, pruned, calls, {output_proj(job.family, layer, kind): hook}, stop=True)
            t.ys = []
        job.cut_and_fit(i, layer, shape, kind, keep, t)
    return dense, run_layer(layer, pruned, calls, {})


def cut_and_reconstruct(model: nn.Module, plan: PrunePlan, batches: Sequence[torch.Tensor], settings,
                        reduce_sum: ReduceSum | None = None, inputs: str = FIT_INPUTS,
                        tune: LayerTune | None = None) -> dict[str, Any]:
    """Cut `model` in place to `plan` and repair the cut sub-blocks (`settings.reconstruct`) on calibration `batches`.

    Layers are cut one at a time, in order, after their statistics are gathered (the dense layer is gone
    afterwards). `reduce_sum` sums the statistics over ranks (DDP), so every rank writes the same weights.
    `inputs` is "dense" or "pruned" (see the module docstring). `tune` (the layer tuning's `LayerTuner.tune`) tunes
    each layer after its cut, on the dense layer's inputs and outputs this fit computes anyway. Returns the figures for the run record:
    per cut sub-block the relative output error Σ||ŷ - y||² / Σ||y||² on the calibration tokens before
    and after the repair, their means, tokens and time.
    """
    t0 = time.perf_counter()
    base = unwrap(model)
    method = settings.reconstruct
    if method not in RECONSTRUCTIONS:
        raise ValueError(f"unknown reconstruction {method!r}; use one of {', '.join(RECONSTRUCTIONS)}")
    if inputs not in FIT_INPUT_CHOICES:
        raise ValueError(f"unknown fit inputs {inputs!r}; use one of {', '.join(FIT_INPUT_CHOICES)}")
    if method == "obs" and inputs != "dense":
        raise ValueError(f"reconstruction 'obs' fits on dense inputs only, not inputs={inputs!r}")
    if method == "none":
        apply_plan(base, plan)
        return {"method": "none", "time_s": time.perf_counter() - t0}
    check_plan(base, plan)  # before any batch runs through the model
    family = get_family(base)
    job = _Job(base, family, method, settings.reconstruct_ridge, reduce_sum, plan)
    batches = list(batches)[: settings.max_calibration_batches]
    device = next(base.parameters()).device
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            calls = layer_calls(base, family, batches, device)
            streams = {"dense": calls.hidden, "pruned": calls.hidden if inputs == "pruned" else None}

            def cut_layer(i: int, layer: nn.Module, shape: LayerShape, cuts) -> None:
                """surgery.apply_plan's per-layer step: gather this layer's statistics, then cut and fit it."""
                kw = [c[i] for c in calls.layer_kwargs]
                dense_in = streams["dense"]
                if i in plan.drop_layers:  # the whole layer goes: the pruned stream passes it unchanged
                    streams["dense"] = run_layer(layer, dense_in, kw, {})
                elif inputs == "dense":
                    streams["dense"] = _layer_dense_inputs(job, i, layer, shape, cuts, kw, dense_in)
                else:
                    streams["dense"], streams["pruned"] = _layer_pruned_inputs(job, i, layer, shape, cuts, kw,
                                                                               dense_in, streams["pruned"])
                if tune is not None:  # the dense inputs and outputs just computed are the tuning's data
                    tune(i, layer, cuts, dense_in, streams["dense"], kw)

            apply_plan(base, plan, cut_layer,
                       desc=f"reconstruction ({method}{' + layer tuning' if tune is not None else ''})")
    finally:
        base.train(was_training)
    if method == "bias":
        family.add_output_biases(base)  # every layer alike, and stated in the config, so export and reload keep them
    return _summary(job, inputs, seconds=time.perf_counter() - t0)


def _summary(job: _Job, inputs: str, seconds: float) -> dict[str, Any]:
    """The run-record figures of a reconstruction."""
    return summary(job.method, inputs, job.tokens, job.figures, seconds, job.ridge)


def summary(method: str, inputs: str, tokens: int, figs: list[dict[str, Any]], seconds: float,
            ridge: float) -> dict[str, Any]:
    """The run-record figures of a repair from its per-sub-block errors (also a row's own cut step's, e.g. the search's refits)."""
    def mean(key: str) -> float | None:
        return sum(f[key] for f in figs) / len(figs) if figs else None

    out = {"method": method, "inputs": inputs, "tokens": tokens,
           "rel_err_before_mean": mean("rel_err_before"), "rel_err_after_mean": mean("rel_err_after"),
           "sub_blocks": figs, "time_s": seconds}
    if method in ("least_squares", "obs"):
        out["ridge"] = ridge
    return out

