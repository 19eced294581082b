"""Efficiency figures measured the same way for every model: parameters, size, memory, speed."""

from __future__ import annotations

import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from prunelight.families import get_family, unwrap


def parameter_breakdown(model: nn.Module) -> dict:
    """Total parameters and per component: embeddings, attention, MLP, norms, LM head (tied counted once)."""
    base = unwrap(model)
    family = get_family(base)
    seen: set[int] = set()

    def count(module: nn.Module) -> int:
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    out = {"attention": 0, "mlp": 0}
    for layer in family.layers(base):
        out["attention"] += count(family.attn(layer))
        out["mlp"] += count(family.mlp(layer))
    out["embeddings"] = count(base.get_input_embeddings())
    out["lm_head"] = count(base.get_output_embeddings())
    out["norms_and_other"] = count(base)
    out["total"] = sum(out.values())
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters as held in memory (≈ safetensors size; tied weights counted once)."""
    base = unwrap(model)
    ptrs, n = set(), 0
    for t in base.parameters():
        if t.data_ptr() not in ptrs:
            ptrs.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def folder_bytes(folder: str | Path) -> int:
    """Size on disk of the weight files (*.safetensors, *.bin) of a model folder."""
    folder = Path(folder)
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


def kv_cache_bytes(model: nn.Module, batch_size: int, length: int) -> int:
    """Bytes of the KV cache for `batch_size` sequences of `length` tokens (pruned KV heads shrink it)."""
    base = unwrap(model)
    family = get_family(base)
    head_dim = family.head_dim(base.config)
    kv_heads = sum(s.num_key_value_heads for s in family.layer_shapes(base))
    elem = next(base.parameters()).element_size()
    return 2 * kv_heads * head_dim * batch_size * length * elem


def _rss_field(name: str) -> int | None:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_freed_heap() -> None:
    """Return freed heap pages to the OS (glibc `malloc_trim`), so RSS reflects live memory.

    Without it, memory freed by earlier work (an lm-eval pass holds GBs of small Python objects) stays in
    the process's RSS and is counted as the next model's "peak".
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class PeakMemory:
    """Peak memory over a block, and its rise above the block's start.

    CUDA: allocator peak and the peak minus what was allocated at entry. CPU (Linux): the process's peak
    RSS (VmHWM, reset at entry after freed heap is returned) and the peak minus the RSS at entry, i.e. what
    the block itself needed on top of the loaded model.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: int | None = None
        self.start: int | None = None
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss"

    @property
    def rise(self) -> int | None:
        """Peak minus the memory in use when the block started."""
        return None if self.peak is None or self.start is None else max(0, self.peak - self.start)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = int(torch.cuda.memory_allocated(self.device))
        elif sys.platform.startswith("linux"):
            release_freed_heap()
            try:  # "5" resets the peak RSS counter (Linux >= 4.0) to the current RSS
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass
            self.start = _rss_field("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        elif sys.platform.startswith("linux"):
            self.peak = _rss_field("VmHWM")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_speed(model: nn.Module, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 32,
                  repeats: int = 3, warmup: int = 1, seed: int = 0) -> dict:
    """Prefill and decode tokens/s and per-token decode latency (median of `repeats`) on random token ids."""
    if min(batch_size, prompt_len, new_tokens, repeats) < 1:
        raise ValueError(f"batch_size, prompt_len, new_tokens and repeats must be >= 1, got "
                         f"{batch_size}, {prompt_len}, {new_tokens}, {repeats}")
    base = unwrap(model)
    max_pos = getattr(base.config, "max_position_embeddings", None)
    if max_pos and prompt_len + new_tokens > max_pos:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the context ({max_pos})")
    was_training = base.training
    base.eval()
    device = next(base.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, base.config.vocab_size, (batch_size, prompt_len), generator=gen).to(device)
    step_ids = torch.randint(0, base.config.vocab_size, (batch_size, new_tokens), generator=gen).to(device)
    prefill, decode = [], []
    try:
        with PeakMemory(device) as mem:
            for r in range(warmup + repeats):
                _sync(device)
                t0 = time.perf_counter()
                out = base(input_ids=ids, use_cache=True)
                _sync(device)
                t1 = time.perf_counter()
                cache = out.past_key_values
                for i in range(new_tokens):  # fixed tokens: decode cost without sampling noise
                    out = base(input_ids=step_ids[:, i : i + 1], past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                _sync(device)
                t2 = time.perf_counter()
                if r >= warmup:
                    prefill.append(t1 - t0)
                    decode.append(t2 - t1)
    finally:
        base.train(was_training)
    tp, td = statistics.median(prefill), statistics.median(decode)
    return {
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "device": str(device),
        "dtype": str(next(base.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prefill_tokens_per_s": batch_size * prompt_len / tp,
        "decode_tokens_per_s": batch_size * new_tokens / td,
        "decode_latency_ms_per_token": 1000 * td / new_tokens,
        "prefill_latency_ms": 1000 * tp,
        "peak_memory_bytes": mem.peak,
        "peak_memory_rise_bytes": mem.rise,
        "peak_memory_kind": mem.kind,
        "kv_cache_bytes": kv_cache_bytes(base, batch_size, prompt_len + new_tokens),
    }


def efficiency_report(model: nn.Module, folder: str | Path | None = None, **speed_kwargs) -> dict:
    """Parameters (total and per component), bytes in memory and on disk, and speed at the stated shape."""
    return {
        "params": parameter_breakdown(model),
        "weight_bytes": weight_bytes(model),
        "disk_bytes": folder_bytes(folder) if folder is not None and Path(folder).is_dir() else None,
        "speed": measure_speed(model, **speed_kwargs),
    }
