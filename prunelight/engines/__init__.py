"""Programs prunelight runs in a serving engine's own environment, shipped in the package so an installed wheel has
them: `vllm_generate.py` (vLLM's Python; imports nothing of prunelight) and `llama_cpp_eval.mjs` (node with
node-llama-cpp). They are run as files, never imported; `prunelight.vllm` and `prunelight.llama_cpp` start them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def helper(name: str) -> Path:
    """The path of the shipped helper `name` (a file in this package), for a subprocess to run."""
    # A regular install (wheel or editable) unpacks the package, so the resource is a real file on disk.
    return Path(str(resources.files(__name__) / name))
