"""The search's fitness: the KL of a candidate's next-token distributions from the dense model's on calibration
sequences (`KLFitness`), cross-fitted in folds (`CrossFitKL`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from prunelight.allocation.prefix import recorded_inputs, started_at
from prunelight.allocation.search.levels import KINDS, Levels, LevelsDatabase, SubBlock, input_grams
from prunelight.console import progress
from prunelight.distributed import ReduceSum
from prunelight.families import OwnedSlice, get_family, linear_dense_side, linear_head, unwrap
from prunelight.memory import free_memory
from prunelight.reconstruct import output_proj

log = logging.getLogger(__name__)

# fitness_folds: auto cross-fits with 2 folds when their copies of the Grams take at most half of the free memory
# (the rest is for the search's forwards, the refits' solves and their cache); Llama-3-8B's 2 x 28 GB do not fit
# beside the model and the database on an 80 GB GPU, SmolLM2's 2 x 0.3 GB fit anywhere.
AUTO_FOLDS = 2
AUTO_FOLDS_MEMORY_SHARE = 0.5
# The fitness keeps every layer's input for 2 candidates scored on all its sequences (the best, which is the search's
# parent, and the newest) where they fit in a quarter of the memory free when it is set up (each fold checks its own;
# SmolLM2, 16 x 128 tokens per fold: 2 x 0.14 GB; Llama-3-8B, 16 x 2048 tokens in bf16: 2 x 8.6 GB).
PREFIX_ENTRIES = 2
PREFIX_MEMORY_SHARE = 0.25


class KLFitness:
    """Mean per-token KL(dense || candidate) of next-token distributions on the first n calibration sequences.

    With `top_k` the distributions are coarsened to the dense model's k most likely tokens at each position plus
    one bucket for the rest: KL = sum_top p (log p - log q) + p_rest (log p_rest - log q_rest), a lower bound of
    the full KL (coarsening never raises a divergence) that keeps k log-probabilities and indices per token.
    """

    def __init__(self, model: nn.Module, db: LevelsDatabase, sequences: torch.Tensor, batch: int = 8,
                 reduce_sum: ReduceSum | None = None, top_k: int | None = None,
                 prefix_entries: int | None = None, hidden: Sequence[torch.Tensor] | None = None) -> None:
        self.base = unwrap(model)
        self.reduce_sum = reduce_sum  # under DDP: each rank scores its own sequences, the KL is their pooled mean
        self.family = get_family(self.base)
        self.db, self.batch = db, batch
        self.device = next(self.base.parameters()).device
        self.seqs = sequences.to(self.device)
        self.projs = {(k, i): output_proj(self.family, layer, k)
                      for i, layer in enumerate(self.family.layers(self.base)) for k in KINDS
                      if (k, i) in db.blocks}
        self.dense_w = {key: p.weight.data for key, p in self.projs.items()}
        self.mlp_slices = self._mlp_slices()
        self._kept_index: dict[tuple[int, int], list[torch.Tensor]] = {}  # (layer, MLP level) -> per tensor
        self.top_k = top_k
        self.n_layers = len(self.family.layers(self.base))
        self.decoder = self.base.get_decoder()
        self.head = self.family.logits_head(self.base)
        self.linear = top_k is None and linear_head(self.base)
        # `hidden`: the dense decoder's last hidden states of each chunk of `batch` sequences, recorded by a pass
        # that ran anyway (the fold's Grams); else one dense pass here
        dtype = next(self.base.parameters()).dtype
        with torch.no_grad():
            self.dense = ([self._dense(h[:, :-1].to(self.device, dtype)) for h in hidden] if hidden is not None
                          else [self._dense(self._hidden(chunk)) for chunk in torch.split(self.seqs, batch)])
        self.forwards = 0  # sequences run
        self.layers_run = 0  # decoder layers run, summed over sequences (forwards x layers without the prefixes)
        # Candidates scored on every sequence keep each decoder layer's input. Offspring differ from their parent
        # in a few sub-blocks, so each runs from its first layer that differs from a kept candidate. The one of
        # least KL (the search's parent) is never dropped; of the others the least recently used goes first.
        self.prefix_entries = prefix_entries if prefix_entries is not None else self._prefix_entries()
        self.kept: OrderedDict[tuple, tuple[float, list[list[torch.Tensor]]]] = OrderedDict()

    def _mlp_slices(self) -> dict[int, list[tuple[nn.Module, str, int, list[OwnedSlice]]]]:
        """Per layer with an MLP in the database, each MLP tensor the channels own: (module, "weight" / "bias",
        axis, its owned slices in layout order: one, or gate then up in a fused gate_up_proj)."""
        config = self.base.config
        out: dict[int, list[tuple[nn.Module, str, int, list[OwnedSlice]]]] = {}
        shapes = self.family.layer_shapes(self.base)
        for i, layer in enumerate(self.family.layers(self.base)):
            if ("mlp", i) not in self.db.blocks:
                continue
            mlp = self.family.sub_block(layer, "mlp")
            by_tensor: dict[tuple[str, str], list[OwnedSlice]] = {}
            for sl in self.family.unit_layout(config, shapes[i]):
                if sl.kind == "mlp":
                    by_tensor.setdefault((sl.module, sl.param_name), []).append(sl)
            out[i] = [(getattr(mlp, name), param, sls[0].axis, sls) for (name, param), sls in by_tensor.items()]
        return out

    def _narrow_mlp(self, i: int, removed: int, down: torch.Tensor) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """Give layer i's MLP only the channels its level keeps (`down`: the level's full-width down_proj weight, the
        removed columns zero): the candidate's forward then skips the removed channels' products, which the
        zero columns would cancel anyway. Returns what to put back."""
        key = (i, removed)
        if key not in self._kept_index:  # a level's indices, built once (candidates share most levels)
            block = self.db.blocks[("mlp", i)]
            keep = sorted(set(range(block.units)) - set(block.order[:removed]))
            self._kept_index[key] = [torch.cat([sl.indices(keep) for sl in sls]).to(self.device)
                                     for _, _, _, sls in self.mlp_slices[i]]
        undo = []
        for (module, param, axis, _), idx in zip(self.mlp_slices[i], self._kept_index[key]):
            t = getattr(module, param)
            if t is None:
                continue
            src = down if (axis == 1 and param == "weight") else t.data
            undo.append((module, param, t.data))
            t.data = src.index_select(axis if param == "weight" else 0, idx).to(t.dtype)
        return undo

    def _prefix_entries(self) -> int:
        """PREFIX_ENTRIES when that many copies of every layer's input fit in PREFIX_MEMORY_SHARE of the free
        memory on every rank (ranks must run the same layers), else 0 (every candidate runs every layer)."""
        hidden = int(self.base.get_input_embeddings().weight.shape[1])
        dtype = next(self.base.parameters()).dtype
        need = PREFIX_ENTRIES * self.seqs.numel() * hidden * self.n_layers * torch.finfo(dtype).bits // 8
        free = free_memory(self.device)
        fits = free is not None and need <= PREFIX_MEMORY_SHARE * free
        if self.reduce_sum is not None:
            fits = float(self.reduce_sum(torch.tensor([0.0 if fits else 1.0], dtype=torch.float64))[0]) == 0.0
        return PREFIX_ENTRIES if fits else 0

    def _dense(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What is kept of the dense next-token distributions of one batch: with a linear head, per position the
        hidden state h, logsumexp(z) and W^T p; else all log-probabilities (indices None) or the top k and their
        indices."""
        if self.linear:
            return linear_dense_side(self.head, hidden)
        # fp32: bf16 log-probabilities alone put ~2e-4 nats of KL between the dense model and itself.
        logp = F.log_softmax(self.head(hidden).float(), dim=-1)
        if self.top_k is None or self.top_k >= logp.shape[-1]:
            return logp, None
        return logp.topk(self.top_k, dim=-1)

    def _linear_kl(self, dense: tuple[torch.Tensor, ...], hidden: torch.Tensor) -> float:
        """Summed KL(dense || candidate) over one batch's positions with a linear head z = W h + b: per position
        sum_v p (log p - log q) = lse(z_c) - lse(z_d) - (h_c - h_d) . W^T p (the bias cancels), where the dense side
        is kept as h_d, lse(z_d) and W^T p; the differences keep it exact to float32 for near-dense candidates."""
        rows = hidden.shape[0]
        h_d, lse_d, wp = (t[:rows] for t in dense)
        lse = torch.logsumexp(self.head(hidden).float(), dim=-1)
        kl = (lse - lse_d).double() - ((hidden.float() - h_d) * wp).sum(-1).double()
        return float(kl.sum())

    @staticmethod
    def _kl(top: torch.Tensor, idx: torch.Tensor | None, logp: torch.Tensor) -> float:
        """Summed KL(dense || candidate) over the chunk's positions (`idx` None: the whole distribution)."""
        if idx is None:
            return float((top.exp() * (top - logp)).sum())
        q = logp.gather(-1, idx)
        p_rest = (1 - top.exp().sum(-1)).clamp_min(0).double()
        q_rest = (1 - q.exp().sum(-1)).clamp_min(1e-30).double()
        rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), 0.0)
        return float((top.exp() * (top - q)).sum()) + float(rest.sum())

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states at every position that predicts a next token."""
        return self.decoder(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]

    def _start(self, key: tuple) -> tuple[int, list[list[torch.Tensor]] | None]:
        """The first layer to run for the candidate `key` and the kept inputs it starts from (0, None: all)."""
        best, source = 0, None
        for kept_key in self.kept:
            if kept_key[0] != key[0]:  # refitted another way: no layer's output is known
                continue
            same = next((i for i, (a, b) in enumerate(zip(key[1], kept_key[1])) if a != b), self.n_layers)
            start = min(same, self.n_layers - 1)  # the same candidate still runs its last layer
            if start > best:
                best, source = start, kept_key
        if source is None:
            return 0, None
        self.kept.move_to_end(source)
        return best, self.kept[source][1]

    def _keep(self, key: tuple, kl: float, states: list[list[torch.Tensor]]) -> None:
        """Keep a candidate's layer inputs; past `prefix_entries`, drop the least recently used but the best."""
        self.kept[key] = (kl, states)
        self.kept.move_to_end(key)
        while len(self.kept) > self.prefix_entries:
            best = min(self.kept, key=lambda k: self.kept[k][0])
            del self.kept[next(k for k in self.kept if k != best)]

    @torch.no_grad()
    def __call__(self, levels: Levels, n: int) -> float:
        """KL on the first `n` sequences with the assignment's weights swapped in (the dense ones restored after)."""
        was = self.base.training
        self.base.eval()
        # The refits' ridge and kind, then per layer the levels: the first layer that differs is where a run starts.
        key = ((self.db.ridge, self.db.repair), tuple(zip(levels["attn"], levels["mlp"])))
        start, source = self._start(key) if self.prefix_entries else (0, None)
        keep = self.prefix_entries > 0 and n >= self.seqs.shape[0]
        record_from = start if keep else self.n_layers  # the layers whose inputs this run adds to the kept ones
        narrowed: list[tuple[nn.Module, str, torch.Tensor]] = []
        try:
            for (kind, i), proj in self.projs.items():
                r = levels[kind][i]
                if not r:
                    continue
                w = self.db.weight_at(kind, i, r)
                if kind == "mlp" and r < self.db.blocks[(kind, i)].units:
                    narrowed += self._narrow_mlp(i, r, w)
                else:
                    proj.weight.data = w.to(proj.weight.dtype)
            total, tokens = 0.0, 0
            with started_at(self.base, start) as stand, recorded_inputs(self.base, record_from) as inputs:
                for b, chunk in enumerate(torch.split(self.seqs[:n], self.batch)):
                    rows = chunk.shape[0]  # the last chunk may hold fewer sequences than the dense one kept
                    if stand is not None:
                        stand.state = source[start][b][:rows]
                    hidden = self._hidden(chunk)
                    if self.linear:
                        total += self._linear_kl(self.dense[b], hidden)
                    else:
                        top, idx = self.dense[b]
                        logp = F.log_softmax(self.head(hidden).float(), dim=-1)
                        total += self._kl(top[:rows], None if idx is None else idx[:rows], logp)
                    tokens += hidden.shape[0] * hidden.shape[1]
                    self.forwards += rows
                    self.layers_run += rows * (self.n_layers - start)
            if self.reduce_sum is not None:
                t = self.reduce_sum(torch.tensor([total, float(tokens)], dtype=torch.float64)).cpu()
                total, tokens = float(t[0]), int(t[1])
            kl = total / max(tokens, 1)
            if keep:
                self._keep(key, kl, [source[i] if i < start else inputs[i] for i in range(self.n_layers)])
            return kl
        finally:
            for module, param, t in narrowed:
                getattr(module, param).data = t
            for key_, proj in self.projs.items():
                proj.weight.data = self.dense_w[key_]
            self.base.train(was)


def auto_fitness_folds(db: LevelsDatabase, sequences: int, reduce_sum: ReduceSum | None = None) -> int:
    """`fitness_folds: auto`: AUTO_FOLDS when every rank scores at least that many sequences and the folds' copies
    of the Grams take at most AUTO_FOLDS_MEMORY_SHARE of the memory free where the Grams are held, else 1."""
    grams = [b.gram for b in db.blocks.values()]
    need = AUTO_FOLDS * sum(g.numel() * g.element_size() for g in grams)
    free = free_memory(grams[0].device) if grams else None
    fits = sequences >= AUTO_FOLDS and free is not None and need <= AUTO_FOLDS_MEMORY_SHARE * free
    if reduce_sum is not None:  # every rank must take the same count: one that does not fit decides for all
        fits = float(reduce_sum(torch.tensor([0.0 if fits else 1.0], dtype=torch.float64))[0]) == 0.0
    folds = AUTO_FOLDS if fits else 1
    log.info("allocation search: fitness_folds auto -> %d (fold copies %.2f GB, free %s)", folds, need / 1e9,
             "unknown" if free is None else f"{free / 1e9:.1f} GB")
    return folds



def without_sequences(model: nn.Module, db: LevelsDatabase, rows: torch.Tensor, batch: int,
                      reduce_sum: ReduceSum | None = None, hidden: list[torch.Tensor] | None = None,
                      ) -> LevelsDatabase:
    """The database refitted without `rows`: the same orders, each Gram less those sequences' (summed over ranks).
    `hidden`: a list that receives the dense final hidden states of each chunk of `batch` rows (`input_grams`)."""
    grams, tokens = input_grams(model, list(rows.split(max(batch, 1))), reduce_sum, hidden)
    blocks = {}
    for (kind, i), b in db.blocks.items():
        g = grams[i][kind].to(b.gram.device)
        blocks[(kind, i)] = SubBlock(b.order, b.columns, g.neg_().add_(b.gram), b.weight)  # in place: G - G_rows
    del grams
    return LevelsDatabase(blocks, db.order, db.ridge, db.tokens - tokens, repair=db.repair,
                          cache_bytes=db.cache_bytes)


class CrossFitKL:
    """`KLFitness` cross-fitted: the sequences in `folds` contiguous folds, each scored with the levels refitted
    without its own sequences; the KL on the first n sequences is the token-weighted mean over the folds they span.

    In-sample, a level's least-squares refit partly fits the noise of the very tokens it is scored on, which flatters
    every refitted level by an amount of its own; here each fold measures what its refits do on unseen tokens."""

    def __init__(self, model: nn.Module, db: LevelsDatabase, sequences: torch.Tensor, folds: int, batch: int = 8,
                 reduce_sum: ReduceSum | None = None, top_k: int | None = None) -> None:
        parts = [p for p in torch.tensor_split(sequences, min(folds, sequences.shape[0])) if p.shape[0]]
        self.sizes = [p.shape[0] for p in parts]
        self.parts = [self._fold(model, db, p, batch, reduce_sum, top_k)
                      for p in progress(parts, "search fitness folds", unit="fold")]

    @staticmethod
    def _fold(model: nn.Module, db: LevelsDatabase, part: torch.Tensor, batch: int, reduce_sum: ReduceSum | None,
              top_k: int | None) -> KLFitness:
        """One fold's fitness: its Grams and its dense hidden states from one dense pass over its sequences."""
        hidden: list[torch.Tensor] = []
        refit = without_sequences(model, db, part, batch, reduce_sum, hidden)
        return KLFitness(model, refit, part, batch=max(batch, 1), reduce_sum=reduce_sum, top_k=top_k, hidden=hidden)

    @property
    def forwards(self) -> int:
        """Calibration sequences run by every fold."""
        return sum(p.forwards for p in self.parts)

    @property
    def layers_run(self) -> int:
        """Decoder layers run by every fold, summed over sequences."""
        return sum(p.layers_run for p in self.parts)

    def __call__(self, levels: Levels, n: int) -> float:
        """Mean KL on the first `n` sequences, each fold's with its own refits (rows of equal length)."""
        total, left = 0.0, n
        for size, part in zip(self.sizes, self.parts):
            k = min(left, size)
            if k <= 0:
                break
            total += k * part(levels, k)
            left -= k
        return total / max(n - left, 1)



def calibration_rows(batches: Sequence[torch.Tensor], n: int | None = None) -> torch.Tensor:
    """The first `n` calibration sequences (None: all) as one [n, seq_len] tensor (rows of equal length)."""
    rows = [r for b in batches for r in b]
    if not rows:
        raise ValueError("allocation search needs calibration batches")
    length = min(r.numel() for r in rows)
    return torch.stack([r[:length] for r in rows[:n]])


