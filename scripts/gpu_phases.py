"""A Llama-3-8B-shaped model on one GPU: measured time and peak memory of each phase of a prunelight job, and speed.

The model is built from the published Llama-3-8B config with random weights, on the device, in bf16: quality is
meaningless, memory and time are real. Phases, each timed (device synchronised) with its peak allocated memory:

  build    the model on the device
  score    `prunelight.score` with `taylor` (activation x output gradient: no weight gradients) and with
           `taylor_element` (LLM-Pruner's element-wise first order: weight gradients), gradient checkpointing on,
           --calib-batches batches of 1 x --seq-len tokens
  cut      `prunelight.prune` at --ratio from the taylor scores (global allocation, least-squares repair on the
           same batches), on a copy of the dense model
  export   the run's export of the cut model (`prunelight.bench.export`, format auto: the layout its shapes need)
           into --work
  lora     --lora-steps AdamW steps of LoRA r=--lora-r (the family's targets) on the cut model, gradient
           checkpointing, 1 x --seq-len tokens per step
  speed    the report's speed measurement (`prunelight.bench.speed_rows`: prefill of --prompt-len tokens, then --new-tokens decode steps with the KV cache) of the
           dense model and of cuts at --speed-ratios (from the same taylor scores, no repair: the shapes are what
           matters), with align_channels 1 and --align, at each --batch-sizes; `torch.compile` too with --compile
           (--compile-mode regional: each decoder layer compiled on its own, PyTorch's regional compilation: the
           layers share their code, so Inductor's cache serves all but the first; whole: the model as one graph,
           minutes per shape on 8B)

--speed-only skips the taylor_element scoring, the repaired cut, the export and LoRA; --models limits the speed
phase to the models named as in the table ("dense", "20% align 128", ...).

Phases past --deadline seconds are skipped and said so; a phase that fails is recorded with its error and the next
one runs. Results: <out>.json and <out>.md, written after every phase.

    python scripts/gpu_phases.py --out results/benchmarks/gpu_phases_8b          # one H100 / H200 (minutes)
    python scripts/gpu_phases.py --tiny --device cpu --dtype float32 --out /tmp/p   # seconds: tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shutil
import statistics
import time
import traceback
from pathlib import Path

import torch

import prunelight
from prunelight import bench

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, tie_word_embeddings=False)
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)
GIB = 1024**3


class Phases:
    """Times phases, records each one's peak memory, and writes the results after every phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.device, self.t0 = args, torch.device(args.device), time.perf_counter()
        self.rows: list[dict] = []
        self.speed: list[dict] = []
        self.meta = {**bench.machine(args.device), "shape": args.shape, "dtype": args.dtype,
                     "seq_len": args.seq_len, "calib_batches": args.calib_batches, "ratio": args.ratio,
                     "lora_r": args.lora_r, "lora_steps": args.lora_steps, "torch": torch.__version__}
        if self.device.type == "cuda":
            self.meta["gpu"] = torch.cuda.get_device_name(self.device)

    def sync(self) -> None:
        """Wait for the device (timings are wall clock)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def allocated(self) -> float:
        """GiB allocated on the device now."""
        return torch.cuda.memory_allocated(self.device) / GIB if self.device.type == "cuda" else float("nan")

    def run(self, name: str, fn, **facts):
        """Run one phase unless past the deadline; returns its result, or None when skipped or failed."""
        elapsed = time.perf_counter() - self.t0
        if elapsed > self.args.deadline:
            self.rows.append({"phase": name, "status": f"skipped: {elapsed:.0f} s past the start, deadline "
                                                       f"{self.args.deadline:.0f} s", **facts})
            print(f"[phase] {name}: skipped (deadline)", flush=True)
            self.write()
            return None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        before = self.allocated()
        self.sync()
        t = time.perf_counter()
        row = {"phase": name, **facts}
        try:
            out = fn()
            self.sync()
            row.update(status="ok", seconds=time.perf_counter() - t)
        except Exception as err:  # noqa: BLE001 - one failed phase must not lose the others' figures
            out = None
            row.update(status=f"failed: {type(err).__name__}: {str(err)[:300]}", seconds=time.perf_counter() - t)
            traceback.print_exc()
        if self.device.type == "cuda":
            row.update(allocated_before_gib=before, peak_allocated_gib=torch.cuda.max_memory_allocated(self.device)
                       / GIB, peak_reserved_gib=torch.cuda.max_memory_reserved(self.device) / GIB)
        if isinstance(out, dict) and "record" in out:
            row.update(out["record"])
        self.rows.append(row)
        print(f"[phase] {json.dumps(row)}", flush=True)
        self.write()
        return out

    def write(self) -> None:
        """<out>.json and <out>.md (after every phase: a killed run keeps what it measured)."""
        data = {"meta": self.meta, "phases": self.rows, "speed": self.speed}
        bench.write_results(self.args.out, data, markdown(data))


def markdown(data: dict) -> str:
    """The phase table and the speed table."""
    m = data["meta"]
    lines = [f"# Phases of a prunelight job on {m.get('gpu', m.get('device'))}: {m['shape']} shape, random weights, "
             f"{m['dtype']}", "", f"torch {m['torch']}; {m['calib_batches']} x 1 x {m['seq_len']} calibration tokens; "
             f"ratio {m['ratio']}; LoRA r={m['lora_r']}, {m['lora_steps']} steps.", "",
             "| phase | status | seconds | peak allocated GiB | allocated before GiB | notes |", "|---|---|---:|---:|---:|---|"]
    for r in data["phases"]:
        notes = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                          if k not in ("phase", "status", "seconds", "peak_allocated_gib", "allocated_before_gib",
                                       "peak_reserved_gib"))
        lines.append(f"| {r['phase']} | {r['status']} | {r.get('seconds', float('nan')):.1f} | "
                     f"{r.get('peak_allocated_gib', float('nan')):.1f} | {r.get('allocated_before_gib', float('nan')):.1f}"
                     f" | {notes} |")
    if data["speed"]:
        lines += ["", "| model | params (B) | compile | batch | prefill tok/s | decode tok/s | prefill x dense | "
                  "decode x dense | ideal | decode / ideal |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        bench.add_speedups(data["speed"], {"prefill": "prefill_tokens_per_s", "decode": "decode_tokens_per_s"},
                           lambda r: r["model"] == "dense", ("batch_size", "compile"))
        nan = float("nan")
        for r in data["speed"]:
            lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f} | {r['compile']} | {r['batch_size']} | "
                         f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.1f} | "
                         f"{r.get('prefill_speedup', nan):.2f}x | {r.get('decode_speedup', nan):.2f}x | "
                         f"{r.get('ideal_speedup', nan):.2f}x | {r.get('decode_vs_ideal', nan):.0%} |")
    return "\n".join(lines) + "\n"


def build(shape: dict, device: torch.device, dtype: torch.dtype):
    """A Llama causal LM with random weights, made directly on `device` (no host copy of 8B weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype, attn_implementation="sdpa")


def lora_steps(model, args: argparse.Namespace, device: torch.device) -> dict:
    """LoRA recovery steps with gradient checkpointing; mean step time after two warm-up steps."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    peft_model = bench.add_lora(model, args.lora_r)
    peft_model.train()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(args.lora_steps):
        ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=gen).to(device)
        t = time.perf_counter()
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    peft_model.unload()  # leaves the base model as it was
    model.gradient_checkpointing_disable()
    step = statistics.median(times[2:] or times)
    return {"record": {"trainable_params": sum(p.numel() for p in trainable), "last_loss": float(loss),
                       "step_seconds_median": step, "tokens_per_s": args.seq_len / step}}


def compile_model(model, mode: str):
    """`model` under torch.compile: each decoder layer in place (`regional`) or the whole model (`whole`)."""
    if mode == "whole":
        return torch.compile(model)
    # the layer index (static by default) and the KV cache length become symbolic, and the limit is raised: each
    # layer still gets its own few graphs (prefill / decode, batch size; guards on its cache entry), which the
    # default limit of 8 would otherwise send back to eager after the first layers
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for layer in model.model.layers:
        layer.compile()
    return model


def uncompile(model) -> None:
    """Undo `compile_model(model, "regional")`: the layers run eagerly again, and copies of the model stay plain."""
    for layer in model.model.layers:
        layer._compiled_call_impl = None


def speed_rows(name: str, model, args: argparse.Namespace, compile_now: bool) -> list[dict]:
    """The speed at every batch size (under torch.compile when `compile_now`)."""
    facts = {"model": name, "params": bench.count_params(model),
             "compile": args.compile_mode if compile_now else False}
    keep = ("batch_size", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_latency_ms_per_token",
            "prefill_latency_ms", "peak_memory_bytes")
    run = compile_model(model, args.compile_mode) if compile_now else model
    try:
        rows = [{**facts, **{k: s[k] for k in keep}} for s in bench.speed_rows(
            run, args.batch_sizes, f"{name}, compile {compile_now}", prompt_len=args.prompt_len,
            new_tokens=args.new_tokens, repeats=args.repeats, warmup=args.warmup)]
    finally:
        if compile_now and args.compile_mode == "regional":
            uncompile(model)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tiny", action="store_true", help="a tiny shape and short phases (seconds, CPU)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--calib-batches", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-steps", type=int, default=50)
    p.add_argument("--speed-ratios", default="0.2,0.3,0.5")
    p.add_argument("--align", type=int, default=128, help="align_channels compared with 1 at the first speed ratio")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--compile", default=None, help="models also timed under torch.compile (comma-separated names; "
                   "empty: none; default: dense and the first ratio with --align, none with --tiny)")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds after which remaining phases are skipped")
    p.add_argument("--compile-mode", default="regional", choices=["regional", "whole"],
                   help="regional: each decoder layer compiled (seconds); whole: one graph of the model (minutes on 8B)")
    p.add_argument("--speed-only", action="store_true", help="only the build, the taylor scoring and the speed phase")
    p.add_argument("--models", default=None, help="the speed phase's models (comma-separated names; default: all)")
    p.add_argument("--compile-seconds", type=float, default=150, help="time a compiled model's phase is given")
    p.add_argument("--work", default="/tmp/prunelight-gpu-phases", help="scratch folder for the export")
    p.add_argument("--out", default="results/benchmarks/gpu_phases_8b")
    args = p.parse_args(argv)
    args.shape = "tiny" if args.tiny else "llama3-8b"
    if args.tiny:
        args.seq_len, args.calib_batches, args.lora_steps, args.align = 64, 2, 3, 32
        args.batch_sizes, args.prompt_len, args.new_tokens, args.repeats, args.warmup = "1,2", 16, 4, 1, 0
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    ratios = [float(r) for r in args.speed_ratios.split(",") if r]
    cuts = {"dense": None}
    for k, ratio in enumerate(ratios):
        for align in ([1, args.align] if k == 0 else [args.align]):
            cuts[f"{ratio:.0%} align {align}"] = (ratio, align)
    if args.models is not None:
        wanted = {m.strip() for m in args.models.split(",") if m.strip()}
        if unknown := wanted - set(cuts):
            p.error(f"--models {sorted(unknown)}: not among this run's models {sorted(cuts)}")
        cuts = {name: c for name, c in cuts.items() if name in wanted}
    if args.compile is None:  # dense and the first ratio aligned, among the models timed
        default = [] if args.tiny else ["dense", f"{ratios[0]:.0%} align {args.align}"]
        args.compile = ",".join(name for name in default if name in cuts)
    compiled = {c.strip() for c in args.compile.split(",") if c.strip()}
    if unknown := compiled - set(cuts):
        p.error(f"--compile {sorted(unknown)}: not among this run's models {sorted(cuts)}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (--tiny --device cpu --dtype float32 checks the code path)")
    shape = TINY if args.tiny else LLAMA3_8B
    ph = Phases(args)
    gen = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, shape["vocab_size"], (1, args.seq_len), generator=gen)
                   for _ in range(args.calib_batches)]

    dense = ph.run("build", lambda: build(shape, device, dtype))
    if dense is None:
        return
    ph.meta["params"] = sum(q.numel() for q in dense.parameters())
    ph.meta["weights_gib"] = ph.meta["params"] * dense.dtype.itemsize / GIB

    def score(criterion: str):
        dense.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            return prunelight.score(dense, bench.preset_settings(None, ratio=args.ratio, criterion=criterion,
                                                                 allocation="global"), calibration)
        finally:
            dense.gradient_checkpointing_disable()
            if hasattr(dense, "_require_grads_hook"):
                # transformers' checkpointing left its embedding hook (outputs require grad): under torch.compile
                # every layer would then be compiled twice, for an input that requires grad and one that does not
                dense.disable_input_require_grads()
            for q in dense.parameters():
                q.grad = None

    taylor = ph.run("score taylor", lambda: score("taylor"), criterion="taylor")
    if not args.speed_only:
        ph.run("score taylor_element", lambda: score("taylor_element"), criterion="taylor_element")
    if taylor is None:
        ph.write()
        return

    def cut():
        pruned = copy.deepcopy(dense)
        settings = bench.preset_settings(None, ratio=args.ratio, criterion="taylor", allocation="global",
                                         reconstruct="least_squares")
        prunelight.prune(pruned, settings, calibration, scores=taylor)
        kept = sum(q.numel() for q in pruned.parameters())
        return {"model": pruned, "record": {"params_after": kept, "removed": 1 - kept / ph.meta["params"]}}

    out = None if args.speed_only else ph.run("cut (copy + least-squares repair)", cut, ratio=args.ratio)
    pruned = out["model"] if out else None
    if pruned is not None:
        def export():
            folder = Path(args.work) / "export"
            shutil.rmtree(folder, ignore_errors=True)
            bench.export(pruned, folder, format="auto")
            size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))
            shutil.rmtree(folder, ignore_errors=True)
            return {"record": {"export_gib": size / GIB}}

        ph.run("export (safetensors)", export)
        ph.run("lora recovery", lambda: lora_steps(pruned, args, device), lora_r=args.lora_r, steps=args.lora_steps)
        del pruned, out

    def cut_for_speed(ratio: float, align: int):
        model = copy.deepcopy(dense)  # the taylor scores: shapes of a data criterion's cut, no repair
        settings = bench.shape_settings(ratio, criterion="taylor", align_channels=align)
        prunelight.prune(model, settings, calibration, scores=taylor)
        return model

    # eager first, every model; torch.compile (minutes per model on 8B) last, and only with time left for it
    for compile_now in (False, True):
        for name, cut_args in cuts.items():
            if compile_now and name not in compiled:
                continue
            if compile_now and time.perf_counter() - ph.t0 > args.deadline - args.compile_seconds:
                ph.rows.append({"phase": f"speed {name} compiled", "status": "skipped: not enough time left"})
                continue

            def one(name=name, cut_args=cut_args, compile_now=compile_now):
                model = dense if cut_args is None else cut_for_speed(*cut_args)
                ph.speed.extend(speed_rows(name, model, args, compile_now))
                torch._dynamo.reset()

            ph.run(f"speed {name}{' compiled' if compile_now else ''}", one)
    ph.write()
    print("\n" + markdown({"meta": ph.meta, "phases": ph.rows, "speed": ph.speed}))


if __name__ == "__main__":
    main()
