"""The levels database: every sub-block's pruned and repaired weights at a ladder of widths, from the dense inputs.

For each sub-block (a layer's attention, a layer's MLP) a *level* is how many of its units are removed: every GQA
group count, and MLP widths on a grid of `step` channels. Levels are nested: a level removes the first r units of
the sub-block's removal order, so a level is the previous one minus some units, plus its refit. The order is either
the criterion's (lowest score first, as every allocation takes units within a sub-block), structured OBS's greedy
order (`obs.greedy_removal` on the sub-block's Gram), or `obs_kfac`: the same greedy with the output error weighted
by the output side of the Kronecker-factored Fisher (`output_fishers`, `metric_weight`). Under F ≈ G ⊗ M (G the
input Gram, M the covariance of the gradients at the projection's output) removing units S and refitting the rest
costs tr(M ΔW G ΔWᵀ): the refit of the kept columns is the same least-squares update whatever M is (it zeroes the
error's gradient for every invertible M), only which units go changes. This is the curvature The LLM Surgeon
(van der Ouderaa et al., ICLR 2024) scores structured removals with; ours differs in using it only for a one-shot
greedy order per sub-block, in drawing the labels from the dense model (the Fisher of KL(dense || candidate), the
search's fitness), and in shrinking M halfway to the identity (`KFAC_SHRINK`: M / mean diag M + I).

What is stored is compact: per sub-block its order (unit indices) and the Gram G = Σ x xᵀ of its output
projection's inputs over the calibration tokens of the *dense* model (fp32); the weights at a level are derived on
demand, the kept o_proj / down_proj columns refitted by the least-squares fit `prune.reconstruct` uses, and cached
(`weight_at`). With dense inputs the targets are y = W x, so every statistic of `reconstruct.least_squares_fit`
follows from G alone (`stats_from_gram`): a level's weights are exactly what `reconstruct: least_squares` writes
when that sub-block is cut to that level. The database's `repair` says which refit it holds (`repair_for`): with
order `obs` and `reconstruct: obs` it is OBS's final update (damping from the full Gram); otherwise least_squares
(with order `obs` the units are OBS's greedy choice, refitted as `reconstruct: least_squares` refits them).
SmolLM2-135M: 30 x (576² + 1536²) x 4 B = 323 MB of Grams, plus the orders.

The database is saved (`save` / `load`, a torch file with a key of the model's sizes and weights, the criterion, the
order, the ridge and the calibration tokens: `database_key`), so other ratios and later runs reuse it as they reuse
saved scores, and anything else rebuilds it.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prunelight.atomic import atomic_path
from prunelight.console import progress
from prunelight.families import get_family, unwrap
from prunelight.importance.base import UnitScores
from prunelight.importance.obs import ObsCriterion, unit_columns
from prunelight.obs import damping, greedy_removal
from prunelight.distributed import ReduceSum
from prunelight.reconstruct import FitStats, output_proj, ridge_solve

ORDERS = ("criterion", "obs", "obs_kfac")
# obs_kfac's output metric: the Fisher of each sub-block's output, normalized to mean diagonal 1, plus this times
# the identity (shrinkage halfway toward plain OBS's output error; docs/methods.md).
KFAC_SHRINK = 1.0
REPAIRS = ("least_squares", "obs")  # the refits a database can hold
KINDS = ("attn", "mlp")
Levels = dict[str, list[int]]  # kind -> per layer, removed units (attn: groups; mlp: channels, a multiple of step)


class DensePass:
    """What the levels database reads from a dense pass over the calibration batches: per layer the Gram of the
    o_proj / down_proj inputs, the tokens, and each forward's final hidden states (the LM head's inputs, float32, on
    the host: the model tuning's targets). Attached to the scoring pass (`collect_dense_pass`), it spares the
    database a dense pass of its own; `input_grams` runs it alone."""

    def __init__(self) -> None:
        self.grams = ObsCriterion()
        self.hidden: list[torch.Tensor] = []
        self._hook = None

    def attach(self, model: nn.Module) -> None:
        """Hook the output projections' inputs and the final norm's output."""
        base = unwrap(model)
        self.grams.attach(base)
        self._hook = get_family(base).final_norm(base).register_forward_hook(
            lambda _m, _i, out: self.hidden.append(out.detach().float().cpu()))

    def detach(self) -> None:
        """Remove the hooks (the sums are kept)."""
        self.grams.detach()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def result(self, batches: list[torch.Tensor], reduce_sum: ReduceSum | None = None,
               ) -> tuple[list[dict[str, torch.Tensor]], int, list[torch.Tensor]] | None:
        """(Grams, tokens, hidden states per batch) summed over ranks, when the pass read exactly `batches` (their
        tokens, in order, whatever the micro-batches), else None."""
        rows = [int(b.shape[0]) for b in batches]
        seen = getattr(self.grams, "tokens", None)  # None: never attached (a criterion that reads no data)
        if (seen is None or int(seen) != sum(b.numel() for b in batches)
                or sum(h.shape[0] for h in self.hidden) != sum(rows)):
            return None
        # the forwards' chunks, regrouped into the batches (a copy only where a batch ran in micro-batches)
        hidden = (list(self.hidden) if [h.shape[0] for h in self.hidden] == rows
                  else list(torch.cat(self.hidden).split(rows)))
        grams, tokens = self.grams.grams, int(self.grams.tokens)
        if reduce_sum is not None:
            grams = [{k: reduce_sum(g) for k, g in layer.items()} for layer in grams]
            tokens = int(reduce_sum(torch.tensor([float(tokens)], dtype=torch.float64))[0])
        return grams, tokens, hidden


def input_grams(model: nn.Module, batches: list[torch.Tensor], reduce_sum: ReduceSum | None = None,
                hidden: list[torch.Tensor] | None = None) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Per layer, the Gram of the o_proj / down_proj inputs over `batches` of the dense model, and the tokens
    (both summed over ranks with `reduce_sum`), from one pass of the decoder (no logits). `hidden`: a list to
    extend with each batch's final hidden states (`DensePass`)."""
    base = unwrap(model)
    dense = DensePass()
    dense.attach(base)
    device = next(base.parameters()).device
    was_training = base.training
    base.eval()
    decoder = base.get_decoder()  # the LM head's logits are not needed: a fifth of SmolLM2's forward
    try:
        with torch.no_grad():
            for ids in batches:
                decoder(input_ids=ids.to(device), use_cache=False)
    finally:
        dense.detach()
        base.train(was_training)
    grams, tokens, states = dense.result(list(batches), reduce_sum)
    if hidden is not None:
        hidden.extend(states)
    return grams, tokens


def output_fishers(model: nn.Module, batches: list[torch.Tensor], reduce_sum: ReduceSum | None = None,
                   seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Per layer, Σ g gᵀ of the gradients at the o_proj / down_proj outputs (fp32), each token's label drawn from
    the dense model's own next-token distribution (`sampled_labels`): the output factor of the Kronecker-factored
    Fisher, the curvature of KL(dense || candidate) at the dense model (summed over ranks with `reduce_sum`).

    Only activations get gradients (the weights' requires_grad is off during the passes). Memory: one [out, out]
    matrix per sub-block (Llama-3-8B: 64 x 4096² x 4 B = 4.3 GB), plus one backward pass of a batch.
    """
    base = unwrap(model)
    family = get_family(base)
    device = next(base.parameters()).device
    fishers: list[dict[str, torch.Tensor]] = []
    handles = []

    def on_output(acc: torch.Tensor):
        def hook(module, args, out):
            def grad_hook(g):
                g = g.reshape(-1, g.shape[-1]).float()
                acc.addmm_(g.T, g)
            out.register_hook(grad_hook)
        return hook

    for layer in family.layers(base):
        acc = {}
        for kind in KINDS:
            if family.sub_block(layer, kind) is None:
                continue
            proj = output_proj(family, layer, kind)
            acc[kind] = torch.zeros(proj.out_features, proj.out_features, device=proj.weight.device)
            handles.append(proj.register_forward_hook(on_output(acc[kind])))
        fishers.append(acc)
    # The embedding output is the one leaf that needs a gradient, so only activations get them.
    handles.append(base.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
    flags = [(p, p.requires_grad) for p in base.parameters()]
    was_training = base.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        base.eval()
        with torch.enable_grad():
            for ids in progress(batches, "output Fisher (levels order obs_kfac)"):
                logits = base(input_ids=ids.to(device), use_cache=False).logits[:, :-1].float()
                labels = sampled_labels(ids, logits.detach(), seed)
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum").backward()
    finally:
        for h in handles:
            h.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
        base.train(was_training)
    if reduce_sum is not None:
        fishers = [{k: reduce_sum(m) for k, m in layer.items()} for layer in fishers]
    return fishers


def sequence_crc(ids: torch.Tensor, seed: int = 0) -> int:
    """A 32-bit CRC of one sequence's token ids: the same on any rank, in any batch and in any order of sequences."""
    return zlib.crc32(ids.detach().to("cpu", torch.int64).numpy().tobytes(), seed)


def sampled_labels(ids: torch.Tensor, logits: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """One label per position drawn from softmax(logits) [rows, positions, vocab], each row with a generator seeded by
    its own tokens, so a sequence gets the same labels on any rank and in any batch (DDP equals one process)."""
    out = torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device)
    for r in range(logits.shape[0]):
        # A 32-bit key: the CPU generator keeps only the low 32 bits of a seed, so seed enters the hash instead.
        key = sequence_crc(ids[r], seed)
        gen = torch.Generator(device=logits.device).manual_seed(key)
        out[r] = torch.multinomial(logits[r].softmax(-1), 1, generator=gen).squeeze(1)
    return out


def metric_weight(w: torch.Tensor, fisher: torch.Tensor, shrink: float = KFAC_SHRINK) -> torch.Tensor:
    """Lᵀ W (fp64) with L Lᵀ = M = F / mean(diag F) + shrink I: greedy OBS on it ranks units by tr(M ΔW H ΔWᵀ),
    the output error weighted by the output Fisher; the update of the remaining columns is the same as plain OBS's."""
    m = fisher.double()
    mean = float(m.diagonal().mean())
    m = m / mean if mean > 0 else torch.zeros_like(m)
    m.diagonal().add_(shrink)
    return torch.linalg.cholesky(m).T @ w.double()


def stats_from_gram(w: torch.Tensor, gram: torch.Tensor, kept_cols: torch.Tensor, tokens: int,
                    wg: torch.Tensor | None = None) -> FitStats:
    """`reconstruct.FitStats` of a projection with dense inputs, from the full Gram: targets y = W x.

    Only the second-order sums are exact (n, G_KK, C = W G_:K, Σ||y||², e0); the first-order ones (Σx, Σy) are
    not kept by the Gram and are zero, which no least-squares figure reads. `wg`: W G when already computed.
    """
    w64 = w.double()
    wg = (w64 @ gram.double()) if wg is None else wg.double()  # [out, d]
    gone = torch.ones(w.shape[1], dtype=torch.bool)
    gone[kept_cols.cpu()] = False
    gone = gone.to(w.device)
    w_r = w64[:, gone]
    err0 = (w_r @ gram[gone][:, gone].double() * w_r).sum()
    return FitStats(n=torch.tensor(float(tokens), dtype=torch.float64), sum_x=torch.zeros(len(kept_cols)),
                    sum_y=torch.zeros(w.shape[0]), err0=err0, yy=(wg * w64).sum(),
                    gram=gram[kept_cols][:, kept_cols].float(), cross=wg[:, kept_cols].float())


@dataclass
class SubBlock:
    """One sub-block's entry: its removal order, the columns each unit owns, the Gram and the dense weight."""

    order: list[int]
    columns: torch.Tensor  # [units, block]
    gram: torch.Tensor  # [d, d] fp32
    weight: torch.Tensor  # [out, d] the dense o_proj / down_proj weight (fp32)
    _wg: torch.Tensor | None = field(default=None, repr=False)

    @property
    def wg(self) -> torch.Tensor:
        """W G (fp64), computed once: the cross term of every level's refit."""
        if self._wg is None:
            self._wg = self.weight.double() @ self.gram.double()
        return self._wg

    @property
    def units(self) -> int:
        """Units of the sub-block."""
        return int(self.columns.shape[0])


@dataclass
class LevelsDatabase:
    """Every sub-block's nested removal order and dense-input statistics; weights at a level on demand."""

    blocks: dict[tuple[str, int], SubBlock]
    order: str
    ridge: float
    tokens: int
    key: dict[str, Any] = field(default_factory=dict)
    repair: str = "least_squares"  # the `prune.reconstruct` whose weights it holds (`repair_for`)
    cache_bytes: int = 1 << 29  # derived weights kept (least recently used first out)
    build_s: float = 0.0
    # the dense model's final hidden states on each batch the database was built from (None when it was loaded;
    # not saved): the model tuning's targets without another dense pass
    dense_hidden: list[torch.Tensor] | None = field(default=None, repr=False)
    ridge_validated: bool = False  # the ridge was chosen by cross-validation (search's cut_ridge: cv), not the run's
    _cache: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)

    def set_ridge(self, ridge: float) -> None:
        """Derive every later level's refit with this ridge (the cached refits of the old one are dropped)."""
        self.ridge = float(ridge)
        self._cache.clear()

    def weight_at(self, kind: str, layer: int, removed: int) -> torch.Tensor:
        """The full-width output-projection weight (fp32) with the first `removed` units of the order gone
        (their columns zero) and the kept columns refitted."""
        key = (kind, layer, removed)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        b = self.blocks[(kind, layer)]
        if removed == 0:
            return b.weight
        gone = set(b.order[:removed])
        keep_units = [u for u in range(b.units) if u not in gone]
        out = torch.zeros_like(b.weight)
        if keep_units:
            cols = b.columns[keep_units].reshape(-1).to(b.weight.device)
            out[:, cols] = self._refit(b, cols)
        self._cache[key] = out
        size = sum(t.numel() * t.element_size() for t in self._cache.values())
        while size > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            size -= old.numel() * old.element_size()
        return out

    def _refit(self, b: SubBlock, cols: torch.Tensor) -> torch.Tensor:
        # `stats_from_gram`'s G_KK and C = (W G)_:K, as the fit reads them (fp32), without the errors: the damped
        # refit never raises the error (anchored at W_K), so the cut's check of it would only ever keep W'
        gram = b.gram.index_select(0, cols).index_select(1, cols)
        cross = b.wg.index_select(1, cols).float()
        w_k = b.weight[:, cols]
        if self.repair == "obs":  # OBS's final update: the damping of the full Gram (reconstruct: obs)
            lam = damping(b.gram, self.ridge)
            mean_k = float(gram.diagonal().double().mean())
            ridge = lam / mean_k if mean_k > 0 else self.ridge
        else:
            ridge = self.ridge
        solved = ridge_solve(gram, cross, w_k, ridge)
        return w_k if solved is None else solved[0].float()

    def save(self, path: Path) -> None:
        """Write the database (orders, Grams, dense weights are not stored: they are the model's)."""
        data = {"key": self.key, "order": self.order, "ridge": self.ridge, "tokens": self.tokens,
                "blocks": {f"{k}:{i}": {"order": b.order, "gram": b.gram.cpu()} for (k, i), b in self.blocks.items()}}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:  # a temporary name of its own: ranks may write the same database at once
            torch.save(data, tmp)


def database_key(model: nn.Module, batches: list[torch.Tensor], criterion: str, order: str, ridge: float,
                 reduce_sum: ReduceSum | None = None) -> dict[str, Any]:
    """What a saved database is valid for: the model's layer sizes and a fingerprint of all its weights, criterion,
    order, the ridge OBS's order was chosen with, and the calibration tokens (their count and a fingerprint of their
    content, summed over ranks). Not the repair: a level's refit is derived from the Gram on demand, for either."""
    base = unwrap(model)
    family = get_family(base)
    shapes = family.layer_shapes(base)
    counts = torch.tensor([float(sum(b.numel() for b in batches)), _tokens_fingerprint(batches)],
                          dtype=torch.float64)
    if reduce_sum is not None:
        counts = reduce_sum(counts).cpu()
    return {"groups": [s.num_key_value_heads for s in shapes], "channels": [s.intermediate_size for s in shapes],
            "fingerprint": _weights_fingerprint(base), "criterion": criterion, "order": order, "ridge": float(ridge),
            "tokens": int(counts[0]), "tokens_fingerprint": float(counts[1])}


def _weights_fingerprint(model: nn.Module) -> float:
    """Σ|w| over every parameter, in fp64 chunks (bounded scratch memory even for an 8B embedding)."""
    total = 0.0
    with torch.no_grad():
        for p in model.parameters():
            for chunk in p.detach().reshape(-1).split(1 << 24):
                total += float(chunk.abs().sum(dtype=torch.float64))
    return total


def _tokens_fingerprint(batches: list[torch.Tensor]) -> float:
    """Sum over sequences of `sequence_crc`: the Grams do not depend on the sequences' order, neither does this, and
    a sum of per-rank values is exact in fp64 up to 2**21 sequences."""
    return float(sum(sequence_crc(row) for b in batches for row in b.reshape(-1, b.shape[-1])))


def _dense_blocks(model: nn.Module, grams: list[dict[str, torch.Tensor]]):
    base = unwrap(model)
    family = get_family(base)
    shapes = family.layer_shapes(base)
    for i, layer in enumerate(family.layers(base)):
        for kind in KINDS:
            if kind in grams[i]:
                cols = unit_columns(family, base.config, shapes[i], kind)
                w = output_proj(family, layer, kind).weight.detach().float()
                yield kind, i, cols, w


def build_database(model: nn.Module, batches: list[torch.Tensor], scores: UnitScores, limits: dict[str, list[int]],
                   order: str = "criterion", ridge: float = 1e-2, criterion: str = "",
                   reduce_sum: ReduceSum | None = None, repair: str = "least_squares",
                   key: dict[str, Any] | None = None, dense: DensePass | None = None) -> LevelsDatabase:
    """Grams from one dense pass (summed over ranks with `reduce_sum`, so every rank holds the same database), then
    each sub-block's removal order up to `limits[kind][layer]` units. `key`: its `database_key`, when the caller
    has it already (computed here otherwise). `dense`: a `DensePass` another pass collected (the scoring pass's),
    used when it read exactly `batches` (else the database runs its own)."""
    import time

    if order not in ORDERS:
        raise ValueError(f"levels order={order!r} is not allowed: use one of {', '.join(ORDERS)}")
    if repair not in REPAIRS or repair != repair_for(order, repair):  # repair_for owns the pairing rule
        raise ValueError(f"levels repair={repair!r} is not allowed with order {order!r}: use least_squares, or obs "
                         "with order obs")
    t0 = time.perf_counter()
    collected = dense.result(batches, reduce_sum) if dense is not None else None
    if collected is not None:
        grams, tokens, hidden = collected
    else:
        hidden = []
        grams, tokens = input_grams(model, batches, reduce_sum, hidden)
    fishers = output_fishers(model, batches, reduce_sum) if order == "obs_kfac" else None
    blocks = {}
    for kind, i, cols, w in _dense_blocks(model, grams):
        g = grams[i][kind]
        n = cols.shape[0]
        lim = limits[kind][i]
        if order in ("obs", "obs_kfac"):
            ranked = w if fishers is None else metric_weight(w, fishers[i][kind])
            seq = greedy_removal(ranked, g, cols, lim, damping(g, ridge)).order if lim else []
        else:
            s = scores[kind][i].float()
            seq = sorted(range(n), key=lambda j: (float(s[j]), j))[:lim]
        blocks[(kind, i)] = SubBlock(list(seq), cols, g, w)
    if key is None:
        key = database_key(model, batches, criterion, order, ridge, reduce_sum)
    db = LevelsDatabase(blocks, order, ridge, tokens, key, repair=repair, dense_hidden=hidden)
    db.build_s = time.perf_counter() - t0
    return db


def load_database(path: Path, model: nn.Module, key: dict[str, Any], repair: str = "least_squares",
                  ) -> LevelsDatabase | None:
    """A saved database when its key matches `key` (else None: it is rebuilt), deriving `repair`'s refits."""
    if not path.is_file():
        return None
    data = torch.load(path, weights_only=False)
    if data.get("key") != key:
        return None
    grams: list[dict[str, torch.Tensor]] = [{} for _ in key["groups"]]
    for name, entry in data["blocks"].items():
        kind, i = name.split(":")
        grams[int(i)][kind] = entry["gram"]
    blocks = {}
    for kind, i, cols, w in _dense_blocks(model, grams):
        entry = data["blocks"][f"{kind}:{i}"]
        blocks[(kind, i)] = SubBlock(list(entry["order"]), cols, entry["gram"].to(w.device), w)
    return LevelsDatabase(blocks, data["order"], data["ridge"], data["tokens"], data["key"], repair=repair)


def repair_for(order: str, reconstruct: str) -> str:
    """The refit a database of this order holds for a run repairing with `reconstruct`: OBS's update when both are
    obs (the cut then chooses the same units again), else least_squares (what the other repairs are measured by)."""
    return "obs" if order == "obs" and reconstruct == "obs" else "least_squares"


