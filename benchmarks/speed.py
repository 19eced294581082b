"""Speed of pruned models: prefill and decode tokens/s and latency, dense vs pruned, alignment on and off.

Models
  ref        `ref-llama-gqa` (8.1M parameters; hidden 256, so CPU timings are dominated by per-call overhead).
  synthetic  a Llama-shaped model built from a config with random weights (--synthetic-*: hidden 1024,
             intermediate 2816, 6 layers, 16 query / 4 KV heads, vocab 8192 by default), so the pruned widths
             matter. Random weights are fine for speed.
Pruned variants: prunelight's own plan (criterion `magnitude`, weight-only, no data; global allocation; whole
GQA groups and MLP channels) at each --ratios, with `align_channels` 1 (no alignment) and each --align value
(MLP channel counts per layer a multiple of it; GQA groups are always removed whole), cut by `prunelight.prune`.

Each model is timed with the report's measurement (`prunelight.bench.speed_rows`: random prompt of --prompt-len
tokens, then --new-tokens greedy-free decode steps with the KV cache; --warmup runs, then the median of
--repeats) at each --batch-sizes. Ideal speedup = dense parameters / pruned parameters; the table gives
measured decode and prefill speedups and their ratio to the ideal (the target: a 20%-pruned aligned
model decodes >= 1.19x dense at batch 1, 95% of the ideal 1.25x). --compile times `torch.compile(model)` too.

To see why an ideal is missed, --mlp-widths times one Llama MLP (gate/up/down, hidden = the synthetic
hidden size) at aligned and unaligned intermediate widths, per token at decode (1 token) and prefill
(--batch-sizes[-1] x --prompt-len tokens) shapes, as microseconds per million MLP parameters.

    python -m benchmarks speed                 # ref + synthetic, CPU (about 6 min alone at 2 threads)
    python -m benchmarks speed --device cuda --dtype bfloat16 --compile
    python -m benchmarks speed --tiny          # seconds: tiny shapes, for tests
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from prunelight import bench

WRITES = "results/benchmarks/speed.{json,md} (docs/benchmarks.md, \"Speed of the pruned model\")"
# what a speed row keeps of the measurement
MEASURED = ("batch_size", "prompt_len", "new_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
            "decode_latency_ms_per_token", "prefill_latency_ms", "dtype", "device", "threads")


def synthetic_model(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                    seed: int = 0):
    """A Llama-shaped causal LM with random weights (sdpa attention)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      vocab_size=vocab, max_position_embeddings=1024, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def widths(model: nn.Module) -> dict:
    """Per-layer kept MLP channels and KV groups (what decides the kernels' shapes)."""
    shapes = bench.layer_shapes(model)
    return {"mlp": [s["intermediate_size"] for s in shapes], "kv_groups": [s["num_key_value_heads"] for s in shapes]}


def time_models(models: dict[str, tuple[nn.Module, float, int]], args, compiled: bool) -> list[dict]:
    """The speed of every model at every batch size; speedups against the "dense" entry."""
    rows = []
    for name, (model, ratio, align) in models.items():
        run = torch.compile(model) if compiled else model
        facts = {"model": name, "ratio": ratio, "align": align, "compile": compiled,
                 "params": bench.count_params(model), "widths": widths(model)}
        rows += [{**facts, **{k: s[k] for k in MEASURED}} for s in bench.speed_rows(
            run, args.batch_sizes, f"{name}, compile {compiled}", prompt_len=args.prompt_len,
            new_tokens=args.new_tokens, repeats=args.repeats, warmup=args.warmup)]
    return bench.add_speedups(rows, {"decode": "decode_tokens_per_s", "prefill": "prefill_tokens_per_s"},
                              lambda r: r["ratio"] == 0, ("batch_size", "compile"))


@torch.no_grad()
def time_mlp(hidden: int, width: int, tokens: int, repeats: int, device, dtype) -> float:
    """Median seconds of one Llama MLP forward on `tokens` tokens at intermediate `width`."""
    gate, up, down = (nn.Linear(hidden, width, bias=False), nn.Linear(hidden, width, bias=False),
                      nn.Linear(width, hidden, bias=False))
    mods = [m.to(device=device, dtype=dtype) for m in (gate, up, down)]
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    f = lambda: mods[2](nn.functional.silu(mods[0](x)) * mods[1](x))  # noqa: E731
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(10):
            f()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / 10)
    return statistics.median(times)


def mlp_table(args, device, dtype) -> list[dict]:
    """Per-parameter MLP time at aligned and unaligned widths, at decode and prefill token counts."""
    rows = []
    hidden = args.synthetic_hidden
    for tokens in (1, args.batch_sizes[-1] * args.prompt_len):
        for width in args.mlp_widths:
            t = time_mlp(hidden, width, tokens, args.repeats, device, dtype)
            mparams = 3 * hidden * width / 1e6
            rows.append({"tokens": tokens, "width": width, "aligned_128": width % 128 == 0,
                         "aligned_64": width % 64 == 0, "seconds": t, "us_per_mparam": 1e6 * t / mparams})
            print(f"MLP {hidden}x{width} at {tokens} tokens: {1e6 * t:,.0f} us ({1e6 * t / mparams:.1f} us/M params)",
                  flush=True)
    return rows


def markdown(meta: dict, rows: list[dict], mlp: list[dict]) -> str:
    """Speed tables per model family and the MLP width table."""
    lines = [f"Speed on {meta['device']} ({meta['dtype']}, {meta['threads']} thread(s), torch {meta['torch']}, "
             f"{meta['date']}); prompt {meta['prompt_len']} tokens, {meta['new_tokens']} decode steps with the KV "
             f"cache; {meta['warmup']} warm-up + median of {meta['repeats']}. Speedups are against dense at the same "
             f"batch size; ideal = dense params / pruned params.", ""]
    for family in dict.fromkeys(r["family"] for r in rows):
        lines += [f"**{family}** ({meta['families'][family]})", "",
                  "| model | compile | batch | params | decode tok/s | decode ms/token | prefill tok/s | ideal "
                  "| decode speedup (vs ideal) | prefill speedup (vs ideal) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["family"] == family):
            lines.append(
                f"| {r['model']} | {'on' if r['compile'] else 'off'} | {r['batch_size']} | {r['params'] / 1e6:.2f}M "
                f"| {r['decode_tokens_per_s']:,.1f} | {r['decode_latency_ms_per_token']:.2f} "
                f"| {r['prefill_tokens_per_s']:,.0f} | {r['ideal_speedup']:.2f}x "
                f"| {r['decode_speedup']:.2f}x ({r['decode_vs_ideal']:.0%}) "
                f"| {r['prefill_speedup']:.2f}x ({r['prefill_vs_ideal']:.0%}) |")
        lines.append("")
    if mlp:
        lines += [f"One Llama MLP, hidden {meta['synthetic']['hidden']}: time per million MLP parameters "
                  f"(lower is better) at aligned and unaligned intermediate widths.", "",
                  "| tokens | width | multiple of 128 | us | us / M params |", "|---:|---:|---|---:|---:|"]
        lines += [f"| {m['tokens']} | {m['width']} | {'yes' if m['aligned_128'] else 'no'} | "
                  f"{1e6 * m['seconds']:,.0f} | {m['us_per_mparam']:.2f} |" for m in mlp]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the speed benchmark."""
    p = bench.parser(__doc__, __file__)
    p.add_argument("--model", default=bench.shared_path("models", "ref-llama-gqa"),
                   help="the real model timed besides the synthetic one ('' to skip)")
    p.add_argument("--no-synthetic", action="store_true")
    p.add_argument("--synthetic-hidden", type=int, default=1024)
    p.add_argument("--synthetic-intermediate", type=int, default=2816)
    p.add_argument("--synthetic-layers", type=int, default=6)
    p.add_argument("--synthetic-heads", type=int, default=16)
    p.add_argument("--synthetic-kv-heads", type=int, default=4)
    p.add_argument("--synthetic-vocab", type=int, default=8192)
    p.add_argument("--ratios", default="0.2,0.3,0.5")
    p.add_argument("--align", default="128", help="align_channels values compared with 1 (comma-separated)")
    p.add_argument("--align-all-ratios", action="store_true", help="every --align at every ratio (default: "
                   "all --align values at the first ratio, the largest one at the others)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    p.add_argument("--mlp-widths", default="2048,2047,2052,2100,2176,2253,2304",
                   help="intermediate widths for the single-MLP table ('' to skip)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tiny", action="store_true", help="tiny shapes, one batch size, one repeat (for tests)")
    p.add_argument("--out-dir", default=str(bench.RESULTS))
    p.add_argument("--name", default="speed")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tiny:
        args.synthetic_hidden, args.synthetic_intermediate, args.synthetic_layers = 128, 384, 2
        args.synthetic_heads, args.synthetic_kv_heads, args.synthetic_vocab = 4, 2, 256
        args.batch_sizes, args.prompt_len, args.new_tokens, args.repeats, args.warmup = "1", 8, 2, 1, 0
        args.mlp_widths, args.align, args.model = "128,100", "64", ""
    args.ratios = [float(r) for r in args.ratios.split(",") if r]
    args.align = [int(a) for a in args.align.split(",") if a]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.mlp_widths = [int(w) for w in args.mlp_widths.split(",") if w]
    if not args.batch_sizes or any(b < 1 for b in args.batch_sizes) or any(not 0 < r < 1 for r in args.ratios):
        p.error(f"--batch-sizes must be >= 1 and --ratios in (0, 1); got {args.batch_sizes}, {args.ratios}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    families: dict[str, nn.Module] = {}
    described = {}
    if args.model:
        families["ref"] = bench.load_model(args.model)
        described["ref"] = Path(args.model).name
    if not args.no_synthetic:
        families["synthetic"] = synthetic_model(args.synthetic_hidden, args.synthetic_intermediate,
                                                args.synthetic_layers, args.synthetic_heads,
                                                args.synthetic_kv_heads, args.synthetic_vocab)
        described["synthetic"] = (f"synthetic Llama, random weights: hidden {args.synthetic_hidden}, intermediate "
                                  f"{args.synthetic_intermediate}, {args.synthetic_layers} layers, "
                                  f"{args.synthetic_heads}/{args.synthetic_kv_heads} heads, vocab {args.synthetic_vocab}")
    if not families:
        p.error("nothing to time: give --model or leave the synthetic model on")
    rows = []
    for family, dense in families.items():
        models = {"dense": (dense, 0.0, 1)}
        for k, ratio in enumerate(args.ratios):
            aligns = args.align if (k == 0 or args.align_all_ratios) else args.align[-1:]
            for align in [1, *aligns]:
                try:
                    pruned = bench.cut_copy(dense, bench.shape_settings(ratio, align_channels=align))[0]
                    models[f"{ratio:.0%} align {align}"] = (pruned, ratio, align)
                except ValueError as err:  # e.g. a multiple larger than the model's MLP
                    print(f"{family} {ratio:.0%} align {align}: skipped ({err})", flush=True)
        models = {k: (m.to(device=device, dtype=dtype), r, a) for k, (m, r, a) in models.items()}
        for compiled in [False, True] if args.compile else [False]:
            rows += [{"family": family, **r} for r in time_models(models, args, compiled)]
    mlp = mlp_table(args, device, dtype) if args.mlp_widths else []
    meta = {**bench.machine(args.device), "dtype": args.dtype, "threads": args.threads, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "warmup": args.warmup, "repeats": args.repeats, "families": described,
            "synthetic": {"hidden": args.synthetic_hidden, "intermediate": args.synthetic_intermediate}}
    table = markdown(meta, rows, mlp)
    bench.write_results(Path(args.out_dir) / args.name, {"meta": meta, "rows": rows, "mlp": mlp}, table)
    print("\n" + table)


if __name__ == "__main__":
    main()
