"""Budgets in deployment units: absolute parameters, weight memory at a dtype, KV-cache bytes per token.

`parse_target` reads the user's string once (from `PruneSettings.__post_init__`); `Budget` turns the parsed
target into parameters to remove once it knows the model (`make_budget`), and `target_figures` states
what a plan met, for the report.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from decimal import Decimal

# Bytes per weight of each dtype name a target may name.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "half": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "int8": 1, "int4": 0.5, "nf4": 0.5,
}
BYTE_UNITS: dict[str, int] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
COUNT_SUFFIXES: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
TARGET_OPTIONS = ("target_params", "target_memory", "target_kv_cache")

_NUMBER = r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)"


@dataclass(frozen=True)
class Target:
    """One parsed deployment target: `kind` params (a count), memory (weight bytes) or kv_cache (bytes per token)."""

    kind: str
    text: str  # as the user wrote it
    value: float  # parameters, or bytes
    dtype: str | None = None  # the dtype the bytes are counted at
    bytes_per_param: float | None = None

    @property
    def option(self) -> str:
        """The prune option that set it."""
        return f"prune.target_{self.kind}"

    @property
    def unit(self) -> str:
        """What `value` counts."""
        return {"params": "parameters", "memory": f"weight bytes at {self.dtype}",
                "kv_cache": f"KV-cache bytes per token at {self.dtype}"}[self.kind]

    def as_dict(self) -> dict:
        """JSON-able form (report)."""
        return {**asdict(self), "option": self.option, "unit": self.unit}


def parse_count(text: str | int | float) -> int:
    """'6.5B', '350M', '1.2e9', 8000000 -> a positive whole number of parameters, rounded (ValueError otherwise)."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a parameter count")
    if isinstance(text, (int, float)):
        value = Decimal(text) if math.isfinite(text) else None
    else:
        m = re.fullmatch(_NUMBER + r"\s*([a-z]?)", str(text).strip().lower())
        # Decimal, not float: '8.03B' is 8.03 x 10^9 exactly (float gives 8029999999.999999)
        value = Decimal(m.group(1)) * COUNT_SUFFIXES[m.group(2)] if m and m.group(2) in COUNT_SUFFIXES else None
    if value is None:
        raise ValueError(f"{text!r} is not a parameter count")
    count = round(value)  # the nearest whole count: a float such as 8.03e9 is 8029999999.999999, not 8029999999
    if count < 1:
        raise ValueError(f"{text!r} is not a positive parameter count")
    return int(count)


def parse_bytes(text: str) -> tuple[float, str, float]:
    """'16GiB@bf16' -> (bytes, dtype, bytes per weight) (ValueError otherwise)."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)\s*@\s*([a-z0-9]+)", str(text).strip().lower())
    if not m or m.group(2) not in BYTE_UNITS or m.group(3) not in DTYPE_BYTES:
        raise ValueError("not a size at a dtype")
    value = float(m.group(1)) * BYTE_UNITS[m.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise ValueError("not a positive size")
    return value, m.group(3), DTYPE_BYTES[m.group(3)]


def parse_target(kind: str, text) -> Target:
    """Parse one `prune.target_*` value; ValueError with what is allowed."""
    if kind == "params":
        try:
            return Target("params", str(text), float(parse_count(text)))
        except ValueError:
            raise ValueError("use a parameter count: an integer, or a number with K, M, B or T (e.g. '6.5B', "
                             "'350M', '1.2e9')") from None
    try:
        value, dtype, bpp = parse_bytes(text)
    except ValueError:
        example = "'16GiB@bf16', '900MB@fp32'" if kind == "memory" else "'64KiB@bf16'"
        raise ValueError(f"use <size><unit>@<dtype> with unit {'/'.join(u for u in BYTE_UNITS if u != 'b')} "
                         f"(case-insensitive) or B, and dtype {'/'.join(DTYPE_BYTES)} (e.g. {example})") from None
    return Target(kind, str(text), value, dtype, bpp)


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def kv_bytes_per_token(kv_heads: list[int], head_dim: int, bytes_per_value: float) -> float:
    """KV-cache bytes one token takes: a K and a V vector per KV head per layer."""
    return 2 * sum(kv_heads) * head_dim * bytes_per_value


def target_figures(target: Target, params_after: int, kv_heads_after: list[int], head_dim: int) -> dict:
    """What a plan met, in the target's unit and in the others (for report.json's `plan.target`)."""
    bpp = target.bytes_per_param or 2.0  # a params target states bytes at bf16 as a convenience
    kv = kv_bytes_per_token(kv_heads_after, head_dim, bpp)
    met = {"params_after": params_after, "weight_bytes_after": params_after * bpp,
           "kv_bytes_per_token_after": kv, "bytes_dtype": target.dtype or "bf16"}
    achieved = {"params": params_after, "memory": params_after * bpp, "kv_cache": kv}[target.kind]
    return {**target.as_dict(), "met": met, "achieved": achieved, "within_target": achieved <= target.value}
