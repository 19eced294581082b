"""GGUF export: the layout llama.cpp reads (llama / deci per-layer arrays), read-back, and the refusals."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch

from prunelight import sources
from prunelight.run_plan import check_gguf_export
from prunelight.errors import PrunelightError
from prunelight.families import get_family
from prunelight.gguf_export import GgufExportError, check_gguf_widths, write_gguf
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
    with pytest.raises(GgufExportError, match="cannot write model_type 'qwen3'"):
        check_gguf_export(PruneSettings(), ExportSettings(gguf={"dtype": "f16"}).gguf, tiny_config("qwen3"))
    check_gguf_export(PruneSettings(), ExportSettings(gguf={"dtype": "f16"}).gguf, tiny_config("qwen2"))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(GgufExportError, match="rope scaling of type 'yarn' for llama") as err:
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
    err = capsys.readouterr().err.strip().splitlines()
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


def test_qwen2_is_llama_with_qkv_biases_uniform_and_deci_per_layer(tiny, tmp_path):
    """Qwen2 is written as llama.cpp's llama (deci per layer): q/k/v biases, q/k rows and biases in llama.cpp's
    interleaved rotary order (llama.cpp's qwen2 architecture needs all query heads: attn_q is hidden x hidden)."""
    source, _ = tiny
    tokenizer = sources.load_tokenizer(source)
    model = tiny_model("qwen2", vocab_size=262, tie_word_embeddings=True)
    reader, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert "output.weight" not in tensors  # tied
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"  # llama.cpp splits text as Qwen2's tokenizer
    bias = model.model.layers[0].self_attn.k_proj.bias.detach()
    assert np.array_equal(tensors["blk.0.attn_k.bias"].data, bias.reshape(2, 2, 8).transpose(1, 2).reshape(32).numpy())
    v_bias = model.model.layers[0].self_attn.v_proj.bias.detach()
    assert np.array_equal(tensors["blk.0.attn_v.bias"].data, v_bias.numpy())  # v rows are not rotated
    with pytest.raises(PrunelightError, match="drops its q/k/v biases") as err:  # transformers reads llama unbiased
        sources.load_config(sources.resolve_pretrained(str(tmp_path / "m.gguf")))
    assert "\n" not in str(err.value)
    cut = copy.deepcopy(model)
    apply_plan(cut, sized_plan(cut, [2, 1], [64, 32]))
    reader, tensors = read(write_gguf(cut, tmp_path / "c.gguf", "f32", tokenizer=tokenizer))
    assert reader.fields["general.architecture"].contents() == "deci"
    assert reader.fields["deci.attention.head_count_kv"].contents() == [2, 1]
    assert tensors["blk.1.attn_q.bias"].data.shape == (32,)
