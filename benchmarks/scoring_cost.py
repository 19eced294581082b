"""Scoring cost: peak memory and wall time of each criterion's importance pass, against its floor.

For every criterion (and every floor and naive variant) a fresh subprocess loads the model and the
calibration batches (--batches x --batch-size x --seq-len tokens of WikiText-2 valid), runs the pass once
under `prunelight.bench.peak_memory`, the report's measurement (CPU: VmHWM of the process, reset once the
model is loaded; "+MiB" = peak minus the RSS before the pass; CUDA: max allocated above the allocated at entry), then
--repeats more times for the wall time (median).

Variants
  <criterion>          the criterion's pass as a run scores units (`prunelight.bench.scoring_pass`).
  naive:<criterion>    the same criterion and hooks, but every weight requires grad and its gradient is
                       kept in .grad for the whole pass, as a training-style backward does.
  floor:forward        a plain no-grad forward (floor of forward-only criteria: wanda, wanda_sp, flap).
  floor:frozen         a plain forward + backward with the weights frozen, gradients flowing from the
                       embeddings (floor of activation-gradient criteria: taylor, fisher, entropy).
  floor:weights        a plain forward + backward with every weight requiring grad (floor of weight-gradient
                       criteria); floor:weights_mb1 is the same one sample at a time, as those criteria run.
Each criterion row gives its ratio to the matching floor (memory <= 1.2x, time <= 1.1x are the targets).

    python -m benchmarks scoring_cost                  # all criteria, ref-llama-gqa, 2 x 8 x 128 tokens
    python -m benchmarks scoring_cost --criteria taylor,fisher --repeats 5
    python -m benchmarks scoring_cost --tiny           # seconds: a tiny random model, for tests
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from prunelight import bench

WRITES = "results/benchmarks/scoring_cost.{json,md} (docs/benchmarks.md, \"Scoring cost\")"
FLOORS = ("floor:forward", "floor:frozen", "floor:weights", "floor:weights_mb1")


def matching_floor(name: str) -> str | None:
    """The plain pass a criterion is compared with (None for weight-only criteria)."""
    needs = bench.criterion_needs(name)
    if not needs.data:
        return None
    if not needs.backward:
        return "floor:forward"
    if needs.weight_grads:
        return "floor:weights_mb1" if needs.micro_batch_size == 1 else "floor:weights"
    return "floor:frozen"


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The scoring pass's loss: each sample's mean next-token NLL in fp32, summed over the samples."""
    logits = model(input_ids=ids, use_cache=False).logits.float()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return nll.view(ids.shape[0], -1).mean(1).sum()


def floor_pass(model, batches: list[torch.Tensor], kind: str) -> None:
    """A plain pass over `batches`: no-grad forward, or forward + backward (frozen or trainable weights)."""
    params = list(model.parameters())
    if kind == "floor:forward":
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids, use_cache=False)
        return
    trainable = kind != "floor:frozen"
    for p in params:
        p.requires_grad_(trainable)
    hook = None
    if not trainable:  # gradients flow from the embeddings, as in prunelight's calibration pass
        hook = model.get_input_embeddings().register_forward_hook(lambda m, i, out: out.requires_grad_(True))
    try:
        for ids in batches:
            for chunk in torch.split(ids, 1 if kind == "floor:weights_mb1" else len(ids)):
                _loss(model, chunk).backward()
    finally:
        if hook:
            hook.remove()
        for p in params:
            p.grad = None
            p.requires_grad_(True)


def run_worker(args: argparse.Namespace) -> dict:
    """Load, measure one pass's peak memory, then time --repeats passes (median)."""
    device = torch.device(args.device)
    model = _load_model(args).to(device).eval()
    batches = [b.to(device) for b in torch.load(args.data_file)]
    name = args.worker
    if name.startswith("floor:"):
        run = lambda: floor_pass(model, batches, name)  # noqa: E731
    else:
        naive = name.startswith("naive:")
        run = lambda: bench.scoring_pass(model, batches, name.removeprefix("naive:"), naive)  # noqa: E731
    with bench.peak_memory(device) as mem:
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"name": name, "peak_mib": None if mem.peak is None else mem.peak / 2**20,
            "extra_mib": None if mem.rise is None else mem.rise / 2**20, "memory_kind": mem.kind,
            "first_s": first, "times_s": times, "median_s": statistics.median(times) if times else first}


def _load_model(args):
    if args.tiny:
        from prunelight.testing import tiny_model

        return tiny_model("llama", hidden_size=64, intermediate_size=192)
    return bench.load_model(args.model)


def _batches(args) -> list[torch.Tensor]:
    """--batches calibration batches: WikiText-2 valid windows (random ids with --tiny)."""
    n = args.batches * args.batch_size
    if args.tiny:
        gen = torch.Generator().manual_seed(args.seed)
        return list(torch.split(torch.randint(3, 128, (n, args.seq_len), generator=gen), args.batch_size))
    data = bench.token_data(args.model, args.calibration, args.eval, samples=n, seq_len=args.seq_len, seed=args.seed,
                            eval_tokens=args.seq_len)  # one evaluation block: only the overlap check reads it
    return data.calibration_batches(args.batch_size)


def markdown(meta: dict, rows: dict[str, dict]) -> str:
    """One row per criterion: its cost, the naive variant's, and the ratios to the matching floor."""
    f = lambda x, p=0: "—" if x is None else f"{x:,.{p}f}"  # noqa: E731
    lines = [
        f"Importance pass on `{meta['model_name']}`, {meta['batches']} batch(es) of {meta['batch_size']} x "
        f"{meta['seq_len']} tokens; memory: {meta['memory_note']}; time: median of {meta['repeats']} repeats "
        f"after one measured pass; {meta['threads']} thread(s), {meta['device']}, torch {meta['torch']}, "
        f"{meta['date']}. Ratios are to the matching floor (targets: memory <= 1.2x, time <= 1.1x).",
        "",
        "| pass | +MiB | time (s) | floor | memory / floor | time / floor | naive +MiB | naive time (s) |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name in [n for n in FLOORS if n in rows]:
        r = rows[name]
        lines.append(f"| {name} | {f(r.get('extra_mib'))} | {f(r.get('median_s'), 2)} | | | | | |")
    for name, r in rows.items():
        if name.startswith(("floor:", "naive:")):
            continue
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | | | | |")
            continue
        floor = rows.get(meta["floors"].get(name) or "", {})
        naive = rows.get(f"naive:{name}", {})
        mem_ratio = (r["extra_mib"] / floor["extra_mib"]) if floor.get("extra_mib") and r.get("extra_mib") is not None else None
        t_ratio = r["median_s"] / floor["median_s"] if floor.get("median_s") else None
        lines.append(
            f"| {name} | {f(r.get('extra_mib'))} | {f(r.get('median_s'), 2)} | {meta['floors'].get(name) or '—'} "
            f"| {f(mem_ratio, 2)} | {f(t_ratio, 2)} | {f(naive.get('extra_mib'))} | {f(naive.get('median_s'), 2)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the scoring-cost benchmark (or one worker of it)."""
    known = bench.criteria()
    p = bench.parser(__doc__, __file__)
    bench.add_data_arguments(p)
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama and random ids (seconds; for tests)")
    p.add_argument("--criteria", default=",".join(known))
    p.add_argument("--no-naive", action="store_true", help="skip the naive (full weight gradient) variants")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed passes after the measured one (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mmap-threshold", type=int, default=None,
                   help="set MALLOC_MMAP_THRESHOLD_ (bytes) in the workers: glibc then returns every large freed "
                        "block at once instead of raising its threshold and reusing heap, so peak RSS follows live "
                        "tensors (131072 = glibc's initial value, fixed)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out-dir", default=str(bench.RESULTS))
    p.add_argument("--name", default="scoring_cost")
    args = bench.parse_args(p, argv, run_worker, "--worker")
    if args is None:  # a worker process: it has answered
        return
    if not args.tiny and not args.model:
        p.error("--model is required when the shared reference data is not found (set PRUNELIGHT_SHARED), or --tiny")
    criteria = [c for c in args.criteria.split(",") if c]
    unknown = [c for c in criteria if c not in known]
    if unknown:
        p.error(f"unknown criteria {unknown}; available: {', '.join(known)}")
    floors = {c: matching_floor(c) for c in criteria}
    names = [fl for fl in FLOORS if fl in floors.values()]
    for c in criteria:
        names.append(c)
        if not args.no_naive and floors[c] not in (None, "floor:forward"):
            names.append(f"naive:{c}")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="prunelight-cost-") as tmp:
        data_file = Path(tmp) / "batches.pt"
        torch.save(_batches(args), data_file)
        for name in names:
            cmd = [__file__, "--worker", name, "--data-file", str(data_file), "--repeats", str(args.repeats),
                   "--device", args.device, "--threads", str(args.threads)]
            cmd += ["--tiny"] if args.tiny else ["--model", str(args.model)]
            env = {} if args.mmap_threshold is None else {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
            rows[name] = {"name": name, **bench.run_worker(cmd, threads=args.threads, env=env)}
            r = rows[name]
            print(f"{name}: " + (r["error"] if "error" in r else f"+{r['extra_mib'] or 0:.0f} MiB, "
                                 f"{r['median_s']:.3f} s"), flush=True)
    meta = {
        "model_name": "tiny llama (random)" if args.tiny else Path(args.model).name, "batches": args.batches,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "repeats": args.repeats, **bench.machine(args.device),
        "threads": args.threads, "floors": floors,
        "memory_note": "CUDA max allocated above the allocated at entry" if args.device.startswith("cuda")
        else "peak RSS (VmHWM) of a fresh process minus its RSS with the model and batches loaded"
        + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold is not None else ""),
    }
    table = markdown(meta, rows)
    bench.write_results(Path(args.out_dir) / args.name, {"meta": meta, "rows": rows}, table)
    print("\n" + table)


if __name__ == "__main__":
    main()
