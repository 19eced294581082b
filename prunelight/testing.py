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


LAYER_RATE_OPTIONS = ("rate_strategy", "alpha", "importance_scale", "freeze_top_n", "rate_range")


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
    """PruneSettings from flat keyword options (layerwise rate options are moved into `layerwise`)."""
    from prunelight.settings import LayerRates, PruneSettings

    rates = {k: options.pop(k) for k in LAYER_RATE_OPTIONS if k in options}
    return PruneSettings(ratio=ratio, layerwise=LayerRates(**rates), **options)


def allocate_flat(model, scores, ratio: float, allocation: str = "global", layer_scores=None, block_scores=None,
                  attn_share=None, **options):
    """`allocate` on `model` with flat keyword options, as the allocation tests state them."""
    from prunelight.allocation import allocate, precheck

    settings = settings_of(ratio, allocation=allocation, **options)
    return allocate(precheck(model, settings), scores, settings, layer_scores=layer_scores,
                    block_scores=block_scores, attn_share=attn_share)
