"""GGUF export: the layout llama.cpp reads (llama / deci per-layer arrays), read-back, and the refusals."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch

from prunelight import serving, sources
from prunelight.run_plan import check_gguf_export
from prunelight.errors import PrunelightError
from prunelight.families import LayerShape, get_family
from prunelight.gguf_export import (
    ARCHS,
    GgufExportError,
    _llama_cpp_attention_scale,
    check_gguf_config,
    check_gguf_shapes,
    check_gguf_widths,
    gguf_layouts,
    sliding_period,
    write_gguf,
)
from prunelight.settings import ExportSettings, PruneSettings, SettingsError
from prunelight.surgery import apply_plan
from prunelight.testing import make_tiny_gguf, sized_plan, tiny_config, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama loaded from its own GGUF (tokenizer keys to carry over), with 32-wide GQA groups."""
    path, _ = make_tiny_gguf(tmp_path_factory.mktemp("src") / "tiny.gguf", hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    source = sources.resolve_pretrained(str(path))
    return source, sources.load_model(source, dtype=torch.float32).eval()


def per_layer(model):
    """Layer 0: one GQA group of two, 64 of 96 channels; layer 1: attention removed, every channel kept."""
    m = copy.deepcopy(model)
    apply_plan(m, sized_plan(m, [1, 0], [64, 96]))
    return m


def read(path):
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


def test_uniform_model_is_llama_and_reads_back_with_equal_logits(tiny, tmp_path):
    source, model = tiny
    path = write_gguf(model, tmp_path / "m.gguf", "f32", source_gguf=source.gguf_path)
    reader, tensors = read(path)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    assert reader.fields["llama.attention.key_length"].contents() == 16
    # the tokenizer keys are the source's, as stored
    src = gguf.GGUFReader(str(source.gguf_path))
    assert reader.fields["tokenizer.ggml.tokens"].contents() == src.fields["tokenizer.ggml.tokens"].contents()
    assert "output.weight" in tensors  # untied head
    back = sources.load_model(sources.resolve_pretrained(str(path)), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 70, 200, 9, 31, 4]])
    with torch.no_grad():  # transformers undoes the rotary row order only if it was written per llama.cpp's rule
        assert torch.allclose(back(ids).logits, model(ids).logits, atol=1e-5)
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed


def test_per_layer_widths_are_deci_arrays_with_removed_sub_blocks(tiny, tmp_path):
    source, model = tiny
    cut = per_layer(model)
    path = write_gguf(cut, tmp_path / "m.gguf", "f16", source_gguf=source.gguf_path)
    reader, tensors = read(path)
    assert reader.fields["general.architecture"].contents() == "deci"
    assert reader.fields["deci.attention.head_count"].contents() == [2, 0]
    assert reader.fields["deci.attention.head_count_kv"].contents() == [1, 0]
    assert reader.fields["deci.feed_forward_length"].contents() == [64, 96]
    assert "blk.1.attn_q.weight" not in tensors and "blk.1.attn_norm.weight" not in tensors
    assert tensors["blk.0.attn_q.weight"].data.shape == (32, 64)  # 2 heads x 16 rows, read as (rows, cols)
    assert tensors["blk.0.ffn_down.weight"].data.shape == (64, 64)
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # norms stay f32
    # K rows in llama.cpp's interleaved rotary order for this layer's own single KV head
    k = cut.model.layers[0].self_attn.k_proj.weight.detach()
    want = k.reshape(1, 2, 8, 64).transpose(1, 2).reshape(16, 64).half().numpy()
    assert np.array_equal(tensors["blk.0.attn_k.weight"].data, want)


def test_tied_embeddings_write_no_output_weight(tmp_path):
    path, _ = make_tiny_gguf(tmp_path / "src.gguf", tie_word_embeddings=True)
    source = sources.resolve_pretrained(str(path))
    model = sources.load_model(source, dtype=torch.float32)
    _, tensors = read(write_gguf(model, tmp_path / "m.gguf", "q8_0", source_gguf=source.gguf_path))
    assert "output.weight" not in tensors
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_prunelight_names_what_it_cannot_read_back(tiny, tmp_path):
    source, model = tiny
    path = write_gguf(per_layer(model), tmp_path / "m.gguf", "f32", source_gguf=source.gguf_path)
    with pytest.raises(PrunelightError, match="cannot read its per-layer head counts") as err:
        sources.load_config(sources.resolve_pretrained(str(path)))
    assert "\n" not in str(err.value)


def test_truncated_gguf_is_named_before_anything_loads(tiny, tmp_path):
    source, _ = tiny
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.gguf_path.read_bytes()[:20000])
    with pytest.raises(PrunelightError, match="is not a complete GGUF file") as err:
        sources.load_config(sources.resolve_pretrained(str(cut)))
    assert "\n" not in str(err.value)


def test_a_gguf_header_is_parsed_once_per_file_version(tiny, tmp_path, monkeypatch):
    """The checks before each load and the report's quantization share one parse; a file rewritten in place (the same
    path, another size) is parsed again, so a good file truncated afterwards is still refused."""
    source, _ = tiny
    path = tmp_path / "m.gguf"
    data = source.gguf_path.read_bytes()
    path.write_bytes(data)
    expected = sources.gguf_quantization(source.gguf_path)
    parses = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or real(*a, **k))
    for _ in range(3):
        sources.check_gguf_file(path, "model.pretrained", str(path))
    assert sources.gguf_quantization(path) == expected
    assert len(parses) == 1
    path.write_bytes(data[:20000])
    with pytest.raises(PrunelightError, match="is not a complete GGUF file"):
        sources.check_gguf_file(path, "model.pretrained", str(path))
    assert len(parses) == 2


def test_block_size_refusals_from_the_config_alone():
    config = tiny_config("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16)
    check_gguf_widths("f16", config, align_channels=1)  # float types take any width
    check_gguf_widths("q8_0", config, align_channels=32)
    with pytest.raises(GgufExportError, match=r"prune.align_channels=8 is not allowed; use prune.align_channels: 32"):
        check_gguf_widths("q4_0", config, align_channels=8)
    with pytest.raises(GgufExportError, match=r"hidden_size \(48\)"):
        check_gguf_widths("q8_0", tiny_config("llama", hidden_size=48, head_dim=12), align_channels=32)
    with pytest.raises(ValueError, match="prune.reconstruct=bias"):
        check_gguf_export(PruneSettings(reconstruct="bias"), ExportSettings(gguf={"dtype": "f16"}).gguf, config)
    # llama.cpp's qwen3 (and openelm) read no attn_output.bias; Qwen3 as published has none
    with pytest.raises(GgufExportError, match=r"qwen3 model: llama.cpp's qwen3 architecture \(nor openelm\) cannot "
                                              r"state an o_proj bias"):
        check_gguf_export(PruneSettings(), ExportSettings(gguf={"dtype": "f16"}).gguf, tiny_config("qwen3"))
    for family in ("qwen2", "gemma2", "gemma3_text", "phi3"):
        check_gguf_export(PruneSettings(), ExportSettings(gguf={"dtype": "f16"}).gguf, tiny_config(family))
    check_gguf_export(PruneSettings(), ExportSettings(gguf={"dtype": "f16"}).gguf,
                      tiny_config("qwen3", attention_bias=False))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(GgufExportError, match=r"llama.cpp's llama architecture \(nor deci\) cannot state rope scaling "
                                              r"of type 'yarn'") as err:
        check_gguf_export(PruneSettings(), ExportSettings(gguf={"dtype": "f16"}).gguf,
                          tiny_config("llama", rope_scaling=yarn))
    assert "\n" not in str(err.value)


def test_write_refuses_a_width_the_block_does_not_divide(tiny, tmp_path):
    source, model = tiny
    cut = copy.deepcopy(model)
    apply_plan(cut, sized_plan(cut, [2, 2], [95, 96]))
    with pytest.raises(GgufExportError, match=r"input widths \[95\].*prune.align_channels: 32"):
        write_gguf(cut, tmp_path / "m.gguf", "q8_0", source_gguf=source.gguf_path)
    assert not list(tmp_path.iterdir())


def test_gguf_setting_is_checked_once():
    assert ExportSettings(gguf={"dtype": "q8_0"}).gguf.dtype == "q8_0"
    assert ExportSettings().gguf is None
    with pytest.raises(SettingsError, match="export.gguf.dtype='q4_k' is not allowed: use one of f32, f16, bf16, q8_0"):
        ExportSettings(gguf={"dtype": "q4_k"})


def test_fit_writes_the_gguf_beside_the_folder(tmp_path, monkeypatch):
    """`prunelight fit ... --export.gguf.dtype f32`: the cut model as GGUF beside model/, named in report and card."""
    import json

    from prunelight.cli import cli_main
    from prunelight.testing import tiny_fit_args, write_tiny_corpus

    path, _ = make_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cli = cli_main(tiny_fit_args(path, files, "--trainer.max_steps=1", "--trainer.enable_progress_bar=false",
                                 "--export.out_dir=runs/g", "--prune.reconstruct=none", "--model.recovery=none",
                                 "--export.gguf.dtype=f32"))
    out = tmp_path / "runs" / "g"
    report = json.loads((out / "report.json").read_text())
    assert report["export_gguf"] == "runs/g/model.F32.gguf"  # like export_dir, as the option names it
    assert any(e.startswith("llama.cpp") for e in report["engines_verified"])
    assert "model.F32.gguf" in (out / "model" / "README.md").read_text()
    reader, tensors = read(out / "model.F32.gguf")
    base = cli.model.model
    shapes = get_family(base).layer_shapes(base)
    arch = reader.fields["general.architecture"].contents()
    assert arch == ("llama" if len(set(shapes)) == 1 else "deci")
    assert tensors["token_embd.weight"].data.shape == tuple(base.get_input_embeddings().weight.shape)


def test_fit_refuses_an_unaligned_quantized_gguf_before_any_work(tmp_path, capsys, monkeypatch):
    from prunelight.cli import main
    from prunelight.testing import tiny_fit_args, write_tiny_corpus

    path, _ = make_tiny_gguf(tmp_path / "models" / "tiny.gguf", hidden_size=64, intermediate_size=96, head_dim=16)
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert main(tiny_fit_args(path, files, "--export.gguf.dtype=q8_0", "--export.out_dir=runs/g")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[prunelight] ")]
    assert err == ["prunelight: error: export.gguf.dtype=q8_0 needs every kept MLP width to be a multiple of its "
                   "32-value block: prune.align_channels=1 is not allowed; use prune.align_channels: 32 (or a "
                   "multiple of it)"]
    assert not (tmp_path / "runs").exists()


def test_removed_mlp_under_a_kept_attention_is_a_zero_mlp(tiny, tmp_path):
    """llama.cpp's deci skips the rest of a layer with feed_forward_length 0 (its attention too): a zero MLP stands in."""
    source, model = tiny
    cut = copy.deepcopy(model)
    apply_plan(cut, sized_plan(cut, [2, 0], [0, 0]))  # layer 0 keeps attention only; layer 1 keeps nothing
    reader, tensors = read(write_gguf(cut, tmp_path / "m.gguf", "f32", source_gguf=source.gguf_path))
    assert reader.fields["deci.feed_forward_length"].contents() == [32, 0]
    assert reader.fields["deci.attention.head_count"].contents() == [4, 0]
    assert not tensors["blk.0.ffn_down.weight"].data.any() and not tensors["blk.0.ffn_up.weight"].data.any()
    assert not any(name.startswith("blk.1.") for name in tensors)


def test_tokenizer_from_a_hugging_face_tokenizer(tiny, tmp_path):
    """Without a source GGUF the vocabulary, merges and special ids come from the tokenizer itself."""
    source, model = tiny
    tokenizer = sources.load_tokenizer(source)
    reader, _ = read(write_gguf(model, tmp_path / "m.gguf", "f16", tokenizer=tokenizer))
    src = gguf.GGUFReader(str(source.gguf_path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
        assert reader.fields[key].contents() == src.fields[key].contents(), key
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def test_llama3_rope_scaling_writes_rope_freqs(tiny, tmp_path):
    """Llama-3 rope scaling: `rope_freqs.weight` (F32, head_dim / 2) divides each rotary frequency as transformers
    scales its inverse frequencies; such a file is not read back (transformers' GGUF loader ignores the tensor)."""
    source, _ = tiny
    model = tiny_model("llama", vocab_size=262, max_position_embeddings=128, rope_scaling=dict(LLAMA3_ROPE))
    path = write_gguf(model, tmp_path / "m.gguf", "q8_0", tokenizer=sources.load_tokenizer(source))
    reader, tensors = read(path)
    freqs = tensors["rope_freqs.weight"]
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32 and freqs.data.shape == (8,)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert torch.allclose(torch.from_numpy(freqs.data.copy()).double(),
                          plain / model.model.rotary_emb.inv_freq.double(), rtol=1e-5)
    assert freqs.data[0] == 1.0 and freqs.data[-1] == 8.0 and 1.0 < freqs.data[1] < 8.0  # all three bands
    with pytest.raises(PrunelightError, match="ignores its Llama-3 rope scaling") as err:
        sources.load_config(sources.resolve_pretrained(str(path)))
    assert "\n" not in str(err.value)


def test_qwen2_is_qwen2_dense_llama_without_groups_and_deci_per_layer(tiny, tmp_path):
    """Qwen2 keeping every query head is llama.cpp's own qwen2 (half-split rotary: rows as transformers has them);
    with GQA groups removed it is llama (qwen2's attn_q is hidden x hidden), q/k rows and biases in llama.cpp's
    interleaved rotary order; per-layer widths are deci."""
    source, _ = tiny
    tokenizer = sources.load_tokenizer(source)
    model = tiny_model("qwen2", vocab_size=262, tie_word_embeddings=True)
    reader, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert "output.weight" not in tensors  # tied
    # the pre-tokenizer is the tokenizer's (found as llama.cpp's converter finds it), not the family's
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    bias = model.model.layers[0].self_attn.k_proj.bias.detach()
    assert np.array_equal(tensors["blk.0.attn_k.bias"].data, bias.numpy())
    uniform = copy.deepcopy(model)
    apply_plan(uniform, sized_plan(uniform, [1, 1], [64, 64]))
    reader, tensors = read(write_gguf(uniform, tmp_path / "u.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "llama"
    bias = uniform.model.layers[0].self_attn.k_proj.bias.detach()
    assert np.array_equal(tensors["blk.0.attn_k.bias"].data, bias.reshape(1, 2, 8).transpose(1, 2).reshape(16).numpy())
    v_bias = uniform.model.layers[0].self_attn.v_proj.bias.detach()
    assert np.array_equal(tensors["blk.0.attn_v.bias"].data, v_bias.numpy())  # v rows are not rotated
    with pytest.raises(PrunelightError, match="drops its q/k/v biases") as err:  # transformers reads llama unbiased
        sources.load_config(sources.resolve_pretrained(str(tmp_path / "u.gguf")))
    assert "\n" not in str(err.value)
    cut = copy.deepcopy(model)
    apply_plan(cut, sized_plan(cut, [2, 1], [64, 32]))
    reader, tensors = read(write_gguf(cut, tmp_path / "c.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "deci"
    assert reader.fields["deci.attention.head_count_kv"].contents() == [2, 1]
    assert tensors["blk.1.attn_q.bias"].data.shape == (32,)


# --- every family in its own llama.cpp architecture (what llama.cpp runs: tests/test_llama_cpp.py) -----------------
def test_gemma3_keys_and_tensors_as_llama_cpps_converter_writes_them(tiny, tmp_path):
    """Gemma 3: norms + 1 (Gemma's RMSNorm multiplies by 1 + weight), sandwich norms, q/k norms, the sliding-window
    period as a scalar (the loader ignores an array there), the sliding layers' own rope base, the attention-scale
    ratio query_pre_attn_scalar^-0.5 / head_dim^-0.5 folded into the q norm; no output.weight (tied)."""
    source, _ = tiny
    model = tiny_model("gemma3_text", vocab_size=262)
    reader, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=sources.load_tokenizer(source)))
    def field(key):
        return reader.fields[f"gemma3.{key}"].contents()

    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert (field("attention.sliding_window"), field("attention.sliding_window_pattern")) == (4, 2)
    assert reader.fields["gemma3.attention.sliding_window_pattern"].types == [gguf.GGUFValueType.UINT32]
    assert (field("rope.freq_base"), field("rope.freq_base_swa")) == (1e6, 1e4)
    layer = model.model.layers[0]
    for name, norm in (("attn_norm", layer.input_layernorm), ("post_attention_norm", layer.post_attention_layernorm),
                       ("ffn_norm", layer.pre_feedforward_layernorm), ("post_ffw_norm", layer.post_feedforward_layernorm),
                       ("attn_k_norm", layer.self_attn.k_norm)):
        assert np.allclose(tensors[f"blk.0.{name}.weight"].data, norm.weight.detach().numpy() + 1), name
    ratio = (24 ** -0.5) / (16 ** -0.5)
    assert np.allclose(tensors["blk.0.attn_q_norm.weight"].data, (layer.self_attn.q_norm.weight.detach().numpy() + 1)
                       * ratio, rtol=1e-6)
    assert np.array_equal(tensors["blk.0.attn_q.weight"].data, layer.self_attn.q_proj.weight.detach().numpy())
    assert "output.weight" not in tensors and "gemma3.final_logit_softcapping" not in reader.fields


def test_gemma2_soft_caps_and_the_scale_folded_into_q(tiny, tmp_path):
    source, _ = tiny
    model = tiny_model("gemma2", vocab_size=262)
    reader, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=sources.load_tokenizer(source)))
    assert reader.fields["gemma2.attn_logit_softcapping"].contents() == 2.0
    assert reader.fields["gemma2.final_logit_softcapping"].contents() == 3.0
    q = model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    assert np.allclose(tensors["blk.1.attn_q.weight"].data, q * (16 / 24) ** 0.5, rtol=1e-6)  # no q norm in Gemma 2
    untied = tiny_config("gemma2", tie_word_embeddings=False)
    with pytest.raises(GgufExportError, match="gemma2 architecture cannot state an LM head of its own"):
        check_gguf_config(untied)


def test_llama_cpp_attention_scale_rule_of_gemma_27b():
    """llama.cpp's gemma2/gemma3 graphs scale by (hidden / layer 0's heads)^-0.5 at 46 / 62 layers (the 27B models),
    else by head_dim^-0.5: the fold follows whatever the cut file states."""
    config = tiny_config("gemma3_text")
    facts = ARCHS["gemma3"]
    shapes = [LayerShape(2, 1, 96)] * 62
    assert _llama_cpp_attention_scale(facts, config, 16, shapes) == pytest.approx((64 // 2) ** -0.5)
    assert _llama_cpp_attention_scale(facts, config, 16, shapes[:61]) == pytest.approx(16 ** -0.5)


def test_sliding_period_after_layers_are_dropped():
    assert sliding_period([True, False, True, False]) == 2
    assert sliding_period([True] * 5 + [False]) == 6
    assert sliding_period([False, False]) == 1
    assert sliding_period([True, True, False, True, False]) is None  # a layer of a period-2 model dropped
    config = tiny_config("gemma3_text", num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"])
    check_gguf_config(config)
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    config.num_hidden_layers = 4
    with pytest.raises(GgufExportError, match="cannot state these sliding-window layers") as err:
        check_gguf_config(config)
    assert "\n" not in str(err.value)


def test_phi3_fused_in_phi3_and_split_for_llama_layers(tiny, tmp_path):
    """Phi-3 keeping every query head is phi3 (fused attn_qkv / ffn_up = gate then up, partial rotary dims); with
    groups removed, full rotary, it is llama with the projections split; partial rotary cannot go there."""
    source, _ = tiny
    tokenizer = sources.load_tokenizer(source)
    model = tiny_model("phi3", vocab_size=262)
    apply_plan(model, sized_plan(model, [2, 2], [64, 64]))
    reader, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "phi3"
    assert reader.fields["phi3.rope.dimension_count"].contents() == 8  # partial_rotary_factor 0.5 of head_dim 16
    assert tensors["blk.0.attn_qkv.weight"].data.shape == (128, 64) and tensors["blk.0.ffn_up.weight"].data.shape == (
        128, 64)
    full = tiny_model("phi3", vocab_size=262, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    apply_plan(full, sized_plan(full, [1, 1], [64, 64]))
    reader, tensors = read(write_gguf(full, tmp_path / "f.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "llama"
    gate_up = full.model.layers[0].mlp.gate_up_proj.weight.detach()
    assert np.array_equal(tensors["blk.0.ffn_gate.weight"].data, gate_up[:64].numpy())
    assert np.array_equal(tensors["blk.0.ffn_up.weight"].data, gate_up[64:].numpy())
    assert tensors["blk.0.attn_k.weight"].data.shape == (16, 64)
    cut = copy.deepcopy(model)
    apply_plan(cut, sized_plan(cut, [1, 2], [64, 64]))
    with pytest.raises(GgufExportError, match=r"phi3 cut: llama.cpp's phi3 architecture cannot state groups_removed, "
                                              r"kv_per_layer .*llama cannot state partial rotary embeddings"):
        write_gguf(cut, tmp_path / "c.gguf", "f32", tokenizer=tokenizer)


def test_qwen3_per_layer_is_openelm_when_tied(tiny, tmp_path):
    """llama.cpp's qwen3 sizes every layer from layer 0; openelm reads per-layer widths with the same layers (q/k
    norms, SiLU MLP, half-split rotary) and fused attn_qkv, but its head is the token embedding: tied only."""
    source, _ = tiny
    tokenizer = sources.load_tokenizer(source)
    model = tiny_model("qwen3", vocab_size=262, attention_bias=False, tie_word_embeddings=True)
    apply_plan(model, sized_plan(model, [1, 2], [64, 96]))
    reader, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "openelm"
    assert reader.fields["openelm.attention.head_count_kv"].contents() == [1, 2]
    assert reader.fields["openelm.feed_forward_length"].contents() == [64, 96]
    assert tensors["blk.0.attn_qkv.weight"].data.shape == (64, 64)  # (2 + 2 * 1) heads x 16
    untied = tiny_model("qwen3", vocab_size=262, attention_bias=False)
    apply_plan(untied, sized_plan(untied, [1, 2], [64, 96]))
    with pytest.raises(GgufExportError, match=r"qwen3 cut: llama.cpp's qwen3 architecture cannot state kv_per_layer, "
                                              r"mlp_per_layer .*openelm cannot state an LM head of its own") as err:
        write_gguf(untied, tmp_path / "u.gguf", "f32", tokenizer=tokenizer)
    assert "\n" not in str(err.value)


def test_config_level_checks_agree_with_the_engine_table():
    """`gguf_layouts(config)` (what the run plan asks before the cut) says each llama.cpp cell of the measured table:
    a `runs` cell's feature is stated by the architecture it names, a `refused` one by none; and `check_gguf_shapes`
    refuses exactly the refused ones, in one line naming the family."""
    for family, feature, cell in serving.cells("llama.cpp"):
        config = tiny_config(family, **dict(cell.config))
        layouts = gguf_layouts(config)
        if cell.status == serving.RUNS:
            assert feature in layouts[cell.via.removeprefix("gguf ")], (family, feature)
            check_gguf_shapes(config, {feature})
        else:
            assert not any(feature in states for states in layouts.values()), (family, feature)
            with pytest.raises(GgufExportError, match=f"cannot write a {family} cut with {feature}") as err:
                check_gguf_shapes(config, {feature})
            assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["gemma3_text", "gemma2", "phi3"])
def test_a_file_prunelight_wrote_that_transformers_misreads_is_refused_as_a_source(tmp_path, family):
    """transformers' GGUF loader reads these architectures as another model when prunelight wrote them (docs/gguf.md):
    as `model.pretrained` they are refused in one line naming the folder to load instead; a llama file is not."""
    path, _ = make_tiny_gguf(tmp_path / "src.gguf")
    tokenizer = sources.load_tokenizer(sources.resolve_pretrained(str(path)))
    for name, fam, refused in (("m.gguf", family, True), ("l.gguf", "llama", False)):
        out = write_gguf(tiny_model(fam, vocab_size=262), tmp_path / name, "f32", tokenizer=tokenizer)
        if refused:
            with pytest.raises(PrunelightError, match="misreads the .* files prunelight writes") as err:
                sources.check_gguf_file(out, "model.pretrained", str(out))
            assert "\n" not in str(err.value) and "folder written beside it" in str(err.value)
        else:
            sources.check_gguf_file(out, "model.pretrained", str(out))
