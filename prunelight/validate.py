"""One-line refusals of a setting's value: the option, the value and what is allowed (used by every settings and
options dataclass, each checking its own fields once, in `__post_init__`)."""

from __future__ import annotations

import math
from typing import Any


class SettingsError(ValueError):
    """A setting with a value that is not allowed; the message names the option, the value and what is allowed."""


def bad(option: str, value: Any, allowed: str) -> SettingsError:
    """The refusal of `option=value`, saying what is `allowed`."""
    return SettingsError(f"{option}={value!r} is not allowed: {allowed}")


def choice(option: str, value: Any, choices: tuple[str, ...]) -> None:
    """Refuse a value outside `choices`."""
    if value not in choices:
        raise bad(option, value, f"use one of {', '.join(choices)}")


def integer(option: str, value: Any, low: int, optional: bool = False) -> None:
    """Refuse anything but an integer >= `low` (or None when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad(option, value, f"must be an integer >= {low}" + (" or null" if optional else ""))


def number(option: str, value: Any, low: float, high: float, low_open: bool, high_open: bool) -> None:
    """Refuse anything but a finite number in the interval from `low` to `high` (open or closed at each end)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise bad(option, value, f"must be a number in {interval}")


def flag(option: str, value: Any) -> None:
    """Refuse anything but true or false."""
    if not isinstance(value, bool):
        raise bad(option, value, "true or false")
