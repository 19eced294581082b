"""The search space: dotted run-config keys -> values, checked against the run config before any trial runs."""

from __future__ import annotations

import difflib

import itertools
import json
import math
import subprocess
import sys
from typing import Any

import yaml

from prunelight.validate import SettingsError
from prunelight.validate import bad as _bad

RANGE_KEYS = {"low", "high", "step", "log"}
JSON_PREFIX = "json:"  # values Optuna cannot store (dicts, lists) travel as JSON strings


def is_range(spec: Any) -> bool:
    """True for an optuna range {low, high[, step | log]}."""
    return isinstance(spec, dict) and {"low", "high"} <= set(spec) and set(spec) <= RANGE_KEYS


def encode(value: Any) -> Any:
    """A value as an Optuna parameter: scalars as they are, anything else as a 'json:' string."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return JSON_PREFIX + json.dumps(value, sort_keys=True)


def decode(value: Any) -> Any:
    """Inverse of `encode`."""
    if isinstance(value, str) and value.startswith(JSON_PREFIX):
        return json.loads(value[len(JSON_PREFIX):])
    return value


def check_space(space: dict[str, Any], mode: str) -> None:
    """Every key is dotted and every value a non-empty list (or, in optuna mode, a numeric range)."""
    for key, spec in space.items():
        if not isinstance(key, str) or "." not in key:
            raise _bad("sweep.space", key, "keys are dotted run-config keys such as prune.ratio or data.seq_len")
        if is_range(spec):
            if mode == "grid":
                raise _bad(f"sweep.space.{key}", spec, "grid mode takes a list of values; ranges are for optuna mode")
            low, high = spec["low"], spec["high"]
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                          for v in (low, high))
            if not numbers or low >= high:
                raise _bad(f"sweep.space.{key}", spec, "a range needs numbers low < high")
            if spec.get("log") and low <= 0:
                raise _bad(f"sweep.space.{key}", spec, "a log range needs low > 0")
            if spec.get("log") and spec.get("step"):
                raise _bad(f"sweep.space.{key}", spec, "give step or log, not both")
        elif not isinstance(spec, list) or not spec:
            raise _bad(f"sweep.space.{key}", spec, "a non-empty list of values"
                       + (" or a range {low, high, step|log}" if mode == "optuna" else ""))
        elif len({json.dumps(encode(v)) for v in spec}) != len(spec):
            raise _bad(f"sweep.space.{key}", spec, "values must be distinct")


def grid_points(space: dict[str, list]) -> list[dict[str, Any]]:
    """Every combination of a list-valued space, in a fixed order (the last key varies fastest)."""
    keys = list(space)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(space[k] for k in keys))]


def optuna_grid(space: dict[str, list]) -> dict[str, list]:
    """The space in GridSampler's form (values encoded)."""
    return {k: [encode(v) for v in values] for k, values in space.items()}


def suggest(trial, space: dict[str, Any]) -> dict[str, Any]:
    """One point of the space drawn through an Optuna trial (fixed params of enqueued retries come back as is)."""
    point = {}
    for key, spec in space.items():
        if is_range(spec):
            low, high, step, log = spec["low"], spec["high"], spec.get("step"), bool(spec.get("log"))
            ints = all(isinstance(v, int) for v in (low, high)) and (step is None or isinstance(step, int))
            if ints:
                point[key] = trial.suggest_int(key, low, high, step=step or 1, log=log)
            else:
                point[key] = trial.suggest_float(key, float(low), float(high), step=step, log=log)
        else:
            point[key] = decode(trial.suggest_categorical(key, [encode(v) for v in spec]))
    return point


def nested(point: dict[str, Any]) -> dict[str, Any]:
    """{'prune.ratio': 0.2} -> {'prune': {'ratio': 0.2}} (a YAML fragment for `--config`)."""
    out: dict[str, Any] = {}
    for key, value in point.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def resolved_config(base: list[str]) -> dict[str, Any]:
    """The run config the base file(s) give, with every default filled in (`prunelight fit --print_config`).

    Read from a `prunelight` subprocess, as the trials run: the sweep never runs the CLI in its own process.
    """
    args = ["fit"] + [a for b in base for a in ("--config", b)] + ["--print_config"]
    done = subprocess.run([sys.executable, "-m", "prunelight", *args], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise ValueError(lines[-1].removeprefix("prunelight: error: ") if lines else
                         f"prunelight fit --print_config exited with status {done.returncode}")
    return yaml.safe_load(done.stdout) or {}


# A row's own option (`prune.allocation_args.<name>`): a key of the run config when some allocation row takes it; a
# trial keeps it only when its allocation does (the sweep may vary the allocation beside one row's options).
ROW_OPTION = "prune.allocation_args."


def _row_options() -> dict[str, list[str]]:
    """Option name -> the allocation rows whose options dataclass has it."""
    from dataclasses import fields

    from prunelight.allocation import ALLOCATIONS

    out: dict[str, list[str]] = {}
    for name, row in ALLOCATIONS.items():
        for f in fields(row.options) if row.options is not None else ():
            out.setdefault(f.name, []).append(name)
    return out


def _lookup(config: dict, key: str) -> tuple[bool, list[str]]:
    """Whether `key` names a setting of `config`, and the keys beside it (for the error message)."""
    if key.startswith(ROW_OPTION) and "." not in key[len(ROW_OPTION):]:
        options = _row_options()
        return key[len(ROW_OPTION):] in options, sorted(options)
    node: Any = config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
            continue
        if isinstance(node, dict) and node.get("class_path") and "init_args" in node and part in node["init_args"]:
            node = node["init_args"][part]
            continue
        return False, sorted(node) if isinstance(node, dict) else []
    return True, []


def check_keys(space: dict[str, Any], config: dict[str, Any], base: list[str]) -> None:
    """Refuse a key the run config does not have, naming it and the keys that do exist there."""
    for key in space:
        ok, beside = _lookup(config, key)
        if not ok:
            parent, last = key.rsplit(".", 1) if "." in key else ("", key)
            close = difflib.get_close_matches(last, beside, n=3)  # a misspelt key's likely meaning first
            listed = close + [k for k in beside if k not in close]
            hint = ((f"; did you mean {' or '.join(repr(f'{parent}.{c}') for c in close)}?" if close else "")
                    + (f"; keys under {parent!r} include {', '.join(listed[:12])}" if beside else ""))
            raise _bad("sweep.space", key, f"not a key of the run config {' + '.join(base)}{hint}")


def apply_point(config: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a resolved run config with the point's dotted keys set; of `prune.allocation_args`, the options
    the point's allocation row takes (another row's option in the space does not apply to this trial)."""
    out = json.loads(json.dumps(config, default=str))
    for key, value in point.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    prune = out.get("prune")
    if isinstance(prune, dict) and prune.get("allocation_args") and any(k.startswith(ROW_OPTION) for k in point):
        takes = {name for name, rows in _row_options().items() if prune.get("allocation", "search") in rows}
        prune["allocation_args"] = {k: v for k, v in prune["allocation_args"].items() if k in takes}
    return out


def check_values(space: dict[str, Any], config: dict[str, Any]) -> None:
    """Every listed `prune.*` value is checked by PruneSettings now, so a bad value fails before any trial runs."""
    from prunelight.settings import PruneSettings

    prune = dict(config.get("prune") or {})
    for key, spec in space.items():
        if not key.startswith("prune.") or is_range(spec):
            continue
        rows = _row_options().get(key[len(ROW_OPTION):], []) if key.startswith(ROW_OPTION) else [None]
        for value in spec:
            for row in rows:  # a row's option is checked by every row that takes it
                section = apply_point({**prune, **({"allocation": row, "allocation_args": {}} if row else {})},
                                      {key.split(".", 1)[1]: value})
                try:
                    PruneSettings(**section)
                except (ValueError, TypeError) as err:
                    raise SettingsError(f"sweep.space.{key}: {err}") from None
