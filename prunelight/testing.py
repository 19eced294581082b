"""Helpers for tests and benchmarks: tiny random GQA models and the location of reference data."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3")
# Every tiny model the per-family checks run on: each family, plus Llama 3.2's tied embeddings.
VARIANTS: dict[str, tuple[str, dict]] = {
    **{name: (name, {}) for name in FAMILIES},
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
}
# Families whose tiny model gets random norm weights and biases (stock init: ones / zeros), so the exactness
# checks see q_norm / k_norm, the sandwich norms and the biases act.
_RANDOM_NORMS = ("qwen3", "gemma2", "gemma3_text", "phi3")


def tiny_config(family: str = "llama", **overrides):
    """A 2-layer GQA config (4 query heads, 2 KV heads) of the given family; seconds to build and run."""
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if family == "qwen3":  # per-head q_norm / k_norm; biased q/k/v/o to check their slicing
        return Qwen3Config(**{"attention_bias": True, **common})
    # Gemma: tied embeddings, scale from query_pre_attn_scalar (not head_dim), soft-capping low enough to
    # bend the tiny model's scores and logits, and alternating sliding (window 4) / full attention layers.
    gemma = {"tie_word_embeddings": True, "query_pre_attn_scalar": 24, "sliding_window": 4}
    if family == "gemma2":
        return Gemma2Config(**{**common, **gemma, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                               **overrides})
    if family == "gemma3_text":
        return Gemma3TextConfig(**{**common, **gemma, "sliding_window_pattern": 2, **overrides})
    if family == "phi3":  # fused qkv_proj / gate_up_proj; partial rotary as in Phi-4-mini
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return Phi3Config(**{"rope_parameters": rope, **common})
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A tiny random causal LM in fp32 with eager attention (deterministic under `seed`)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager")
    if family in ("qwen2", *_RANDOM_NORMS):  # stock init zeroes biases; random ones make bias slicing visible
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
                elif family in _RANDOM_NORMS and p.dim() == 1:  # norm weights
                    p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def shared_dir() -> Path | None:
    """The shared data folder: $PRUNELIGHT_SHARED, else ../shared beside the repository; None if absent."""
    env = os.environ.get("PRUNELIGHT_SHARED")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared")
    for path in candidates:
        if path.is_dir():
            return path
    return None


_TINY_TEXT = (
    "the quick brown fox jumps over the lazy dog . a model that is pruned must still speak . "
    "grouped query attention shares one key and value head among several query heads . "
    "we remove whole groups and channels , then recover with low rank adapters . "
)


def tiny_tokenizer(vocab_size: int = 128):
    """A small BPE tokenizer (fits the tiny models' 128-token vocabulary), built offline in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()=<>/ "
    tok.train_from_iterator([_TINY_TEXT * 20, alphabet], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_sentencepiece_tokenizer(space_prefix: bool = True):
    """A small SentencePiece-style BPE tokenizer (byte fallback, "▁" for spaces), laid out as transformers converts
    SentencePiece models (Llama 2, Mistral, Gemma, Phi-3-mini): 3 specials, the 256 byte pieces, characters, then
    pieces of the tiny text's words; its merges are every split of every piece into two pieces, in piece order
    (transformers' SentencePieceExtractor). `space_prefix`: "▁" before the text (Llama 2); False: Gemma's."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁"]
    pieces += sorted(set(_TINY_TEXT.replace(" ", "")) - {"▁"})
    # frequent pairs first (higher scores), so words are built along competing merge paths, as in trained vocabularies
    pieces += ["er", "th", "he", "ou", "ck", "in", "re", "ow", "ve", "ro", "▁t", "an", "nd", "ed", "on"]
    for word in dict.fromkeys(_TINY_TEXT.split()):
        for end in range(2, len(word) + 2):  # ▁w, ▁wo, ... : every piece reachable by one merge from a shorter one
            piece = ("▁" + word)[:end]
            if piece not in pieces:
                pieces.append(piece)
    pieces.append("▁▁")
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for piece in pieces:
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([*([normalizers.Prepend("▁")] if space_prefix else []),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if space_prefix else [])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_tiny_checkpoint(path, family: str = "llama", seed: int = 0, **overrides):
    """Save a tiny random model plus tokenizer as a Hugging Face folder (what `model.pretrained` points at)."""
    from pathlib import Path

    path = Path(path)
    model = tiny_model(family, seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def write_tiny_corpus(folder, lines: int = 400, seed: int = 0):
    """Write train/valid/test text files of made-up sentences (disjoint lines) for data tests."""
    import random
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = _TINY_TEXT.replace(".", "").replace(",", "").split()
    out = {}
    for split in ("train", "valid", "test"):
        rows = [f"{split} {i} " + " ".join(rng.choice(words) for _ in range(12)) for i in range(lines)]
        (folder / f"{split}.txt").write_text("\n".join(rows) + "\n")
        out[split] = folder / f"{split}.txt"
    return out



def tiny_fit_args(ckpt, files: dict, *extra: str) -> list[str]:
    """`prunelight fit` over configs/reference.yaml pointed at a tiny checkpoint and corpus (tests' CLI runs)."""
    from pathlib import Path

    reference = Path(__file__).resolve().parents[1] / "configs" / "reference.yaml"
    return [
        "fit", "--config", str(reference),
        f"--model.pretrained={ckpt}", "--model.attn_implementation=eager",
        f"--data.calibration.path={files['valid']}", f"--data.eval.path={files['test']}",
        f"--data.train.path={files['train']}", "--data.seq_len=16", "--data.num_samples=8",
        "--trainer.limit_val_batches=0", *extra,
    ]


def settings_of(ratio: float = 0.2, **options):
    """PruneSettings from flat keyword options: the allocation row's own options (e.g. `alpha` of layerwise,
    `fill_width` of blockwise) are moved into `allocation_args`.

    The allocation is `global` unless given: allocation tests hand `allocate` scores directly, with no probes for
    calibrated to rescale them by, and no search."""
    from dataclasses import fields

    from prunelight.allocation.registry import allocation_of
    from prunelight.settings import PruneSettings

    options.setdefault("allocation", "global")
    row = allocation_of(options["allocation"])
    own = {f.name for f in fields(row.options)} if row.options is not None else set()
    args = {**{k: options.pop(k) for k in list(options) if k in own}, **options.pop("allocation_args", {})}
    return PruneSettings(ratio=ratio, allocation_args=args, **options)


def allocate_flat(model, scores, ratio: float, allocation: str = "global", layer_scores=None, block_scores=None,
                  attn_share=None, **options):
    """`allocate` on `model` with flat keyword options, as the allocation tests state them."""
    from prunelight.allocation import allocate, precheck

    settings = settings_of(ratio, allocation=allocation, **options)
    return allocate(precheck(model, settings), scores, settings, layer_scores=layer_scores,
                    block_scores=block_scores, attn_share=attn_share)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's 256 byte-level symbols (each byte as a printable character), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_tiny_gguf(path, seed: int = 0, quantization: str = "F32", **overrides):
    """Write a tiny random Llama as a GGUF file (what llama.cpp's converter writes) and return (path, HF model).

    The GGUF's weights are the returned model's (q/k rows permuted the way llama.cpp stores them, which
    transformers undoes on load); `quantization` F32 or Q8_0 (rows are multiples of 32); a byte-level BPE
    tokenizer of 256 byte symbols, 3 merges and 3 specials. Tests load it through transformers' own GGUF support.
    """
    import gguf
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    merges = ["t h", "h e", "\u0120 t"]  # a few merges: an empty list makes transformers look for SentencePiece scores
    tokens = specials + _byte_level_alphabet() + [m.replace(" ", "") for m in merges]
    cfg = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, unk_token_id=0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg.update(overrides)
    model = tiny_model("llama", seed=seed, **cfg).eval()
    c = model.config
    qtype = {"F32": gguf.GGMLQuantizationType.F32, "Q8_0": gguf.GGMLQuantizationType.Q8_0}[quantization]
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quantization]

    def permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's rotary layout of q/k rows
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else 10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(ftype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)

    def put(name: str, t: torch.Tensor, quantize: bool = True) -> None:
        a = t.detach().float().numpy()
        if quantize and a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    sd = model.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = permute(sd[p + "self_attn.q_proj.weight"].numpy(), c.num_attention_heads)
        k = permute(sd[p + "self_attn.k_proj.weight"].numpy(), c.num_key_value_heads)
        put(f"blk.{i}.attn_q.weight", torch.from_numpy(np.ascontiguousarray(q)))
        put(f"blk.{i}.attn_k.weight", torch.from_numpy(np.ascontiguousarray(k)))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], quantize=False)
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], quantize=False)
    put("output_norm.weight", sd["model.norm.weight"], quantize=False)
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model



# A cut of a tiny 2-layer model (2 GQA groups, 96 channels per layer) showing each shape feature of
# prunelight.serving: (GQA groups kept per layer, MLP channels kept per layer); 0 removes the sub-block.
FEATURE_CUTS: dict[str, tuple[list[int], list[int]]] = {
    "uniform": ([2, 2], [64, 64]),
    "groups_removed": ([1, 1], [64, 64]),
    "mlp_per_layer": ([2, 2], [64, 96]),
    "kv_per_layer": ([1, 2], [96, 96]),
    "attn_removed": ([2, 0], [96, 96]),
    "mlp_removed": ([2, 2], [96, 0]),
}


def tiny_cut(family: str, feature: str, seed: int = 0, **overrides):
    """A tiny model of `family` (2 layers, `tiny_config` with `overrides`) cut to show one shape feature."""
    from prunelight.surgery import apply_plan

    model = tiny_model(family, seed=seed, **{"num_hidden_layers": 2, **overrides})
    apply_plan(model, sized_plan(model, *FEATURE_CUTS[feature]))
    return model


def sized_plan(model, keep_groups: list[int], keep_channels: list[int], scores=None):
    """A hand-sized plan: per layer keep this many GQA groups and MLP channels (0 removes the sub-block).

    The units kept are those with the highest `scores` (a criterion's `{"attn": [...], "mlp": [...]}` per-layer
    scores), or without scores the largest summed |weight|: no data read, so checks cut real models in seconds.
    """
    from prunelight.families import KINDS, get_family
    from prunelight.plan import LayerPlan, PrunePlan

    family = get_family(model)
    layers = []
    for i, (owned, n_groups, n_chans) in enumerate(zip(family.owned_by_layer(model), keep_groups, keep_channels)):
        score = {kind: None if scores is None else torch.as_tensor(scores[kind][i]).float() for kind in KINDS}
        for t in owned if scores is None else []:
            s = t.to_units(t.param.detach().abs())
            score[t.kind] = s if score[t.kind] is None else score[t.kind] + s
        kept = {kind: sorted(torch.argsort(score[kind], descending=True)[:n].tolist())
                for kind, n in (("attn", n_groups), ("mlp", n_chans))}
        layers.append(LayerPlan(kept["attn"], kept["mlp"]))
    shapes = family.layer_shapes(model)
    return PrunePlan(layers, [s.num_key_value_heads for s in shapes], [s.intermediate_size for s in shapes])


class ThreadRanks:
    """`reduce_sum` for threads standing in for DDP ranks: every call returns the sum over all of them."""

    def __init__(self, n: int) -> None:
        import threading

        self.barrier = threading.Barrier(n, timeout=120)
        self.slots: list = [None] * n

    def reduce_sum(self, rank: int):
        """Rank `rank`'s all-reduce: the sum of every rank's tensor, added in rank order on every rank."""
        def fn(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())  # same order on every rank
            self.barrier.wait()  # nobody overwrites a slot before all have read it
            return total

        return fn

    def run(self, fn):
        """`fn(rank, reduce_sum)` on every rank, each in its own thread; the results by rank (a rank's error is raised
        here, after the others were released)."""
        import threading

        n = len(self.slots)
        results, errors = [None] * n, []

        def one(r: int) -> None:
            try:
                results[r] = fn(r, self.reduce_sum(r))
            except BaseException as err:  # noqa: BLE001 - raised by the calling thread
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def cut_with(model, batches, settings, shape=None, **kwargs):
    """`cut.run_cut` as the Python API runs it: the run plan made on `model` first (tests read the `CutResult`)."""
    from prunelight.allocation import Shape
    from prunelight.cut import run_cut
    from prunelight.run_plan import prepare_run

    return run_cut(model, batches, prepare_run(settings, shape or Shape.FREE, model=model), **kwargs)
