"""Greedy continuations and their log-probabilities from vLLM, for prunelight's serving check and speed benchmark.

Runs in vLLM's own environment (it imports vllm, json and nothing of prunelight; `prunelight.vllm.run_vllm` starts
it from the installed package):

    python .../prunelight/engines/vllm_generate.py SPEC.json OUT.json

SPEC: {"folder": ..., "prompts": [[token ids], ...], "max_tokens": N, "max_model_len": 512,
       "trust_remote_code": bool}. OUT: {"engine": "vllm <version>", "architecture": ..., "outputs":
[{"tokens": [...], "logprobs": [...]}, ...], "load_s": seconds}. With "speed": {"repeats": R, "prompt_len": P,
"decode_tokens": D, "batch": B}, it times prefill (one token out) and decode (D tokens out) R times instead.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _generate(llm, params_cls, prompts, max_tokens):
    params = params_cls(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]
        result.append({"tokens": list(c.token_ids), "logprobs": lps})
    return result


def _speed(llm, params_cls, spec):
    """Median-ready timings: prefill tokens/s (prompt tokens with 1 token out) and decode tokens/s."""
    s = spec["speed"]
    prompt = [[(7 * i + 13 * b) % 1000 + 10 for i in range(s["prompt_len"])] for b in range(s["batch"])]
    prefill_p = params_cls(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode_p = params_cls(temperature=0.0, max_tokens=s["decode_tokens"] + 1, ignore_eos=True)
    runs = []
    llm.generate([{"prompt_token_ids": p} for p in prompt], decode_p, use_tqdm=False)  # warm-up
    for _ in range(s["repeats"]):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompt], prefill_p, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompt], decode_p, use_tqdm=False)
        t2 = time.perf_counter()
        prefill_s = t1 - t0
        decode_s = max((t2 - t1) - prefill_s, 1e-9)  # the decode run's own prefill taken out
        runs.append({"prefill_tok_s": s["batch"] * s["prompt_len"] / prefill_s,
                     "decode_tok_s": s["batch"] * s["decode_tokens"] / decode_s,
                     "prefill_s": prefill_s, "decode_s": decode_s})
    return runs


def main(spec_path: str, out_path: str) -> None:
    """Serve `folder` in vLLM and write what SPEC asks for to OUT."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    spec = json.loads(open(spec_path).read())
    t0 = time.perf_counter()
    llm = LLM(model=spec["folder"], dtype="float32", max_model_len=spec.get("max_model_len", 512),
              enforce_eager=True, trust_remote_code=spec.get("trust_remote_code", False), seed=0)
    load_s = time.perf_counter() - t0
    arch = llm.llm_engine.model_config.architectures
    out = {"engine": f"vllm {vllm.__version__}", "architecture": arch, "load_s": load_s}
    if spec.get("speed"):
        out["speed"] = _speed(llm, SamplingParams, spec)
    else:
        out["outputs"] = _generate(llm, SamplingParams, spec["prompts"], spec["max_tokens"])
    with open(out_path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run at import
    main(*sys.argv[1:3])
