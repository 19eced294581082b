"""User-facing errors: early checks of what a run names (model, files) and the one line `prunelight` prints."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path


class PrunelightError(Exception):
    """A problem the user can fix (a missing file, an unreachable hub); printed as one line by the command."""


def looks_local(name: str) -> bool:
    """Whether `name` is meant as a local path rather than a hub id ("org/model")."""
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
            or Path(name).expanduser().exists())


def check_local_path(option: str, name: str) -> None:
    """A local path that does not exist fails here, instead of as a hub repo-id error."""
    if looks_local(name) and not Path(name).expanduser().exists():
        raise PrunelightError(f"{option}={name!r} does not exist (a local folder was expected; a hub id looks like "
                              "'org/model')")


@contextlib.contextmanager
def hub_download(option: str, name: str) -> Iterator[None]:
    """Turn a failed hub download into one line naming what could not be fetched and how to run offline."""
    try:
        yield
    except (OSError, ConnectionError) as err:
        if looks_local(name):
            raise
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        why = "not in the local cache and the hub is not reachable (offline)" if offline else _first_line(err)
        raise PrunelightError(
            f"{option}={name!r} could not be downloaded from the Hugging Face hub: {why}. To run offline, download it "
            f"where there is network (`hf download {name}`) or point {option} at local files") from err


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


_LITERAL = re.compile(r'Parser key "([^"]+)":\s*Expected a typing\.Literal\[(.*?)\]\. Got value: (.*)', re.S)
_TYPE = re.compile(r'Parser key "([^"]+)":\s*Expected a <class \'(\w+)\'>\. Got value: (.*)', re.S)
_KEY = re.compile(r'Parser key "([^"]+)":\s*(.*)', re.S)


def one_line(err: BaseException) -> str:
    """The message of `err` as one line; jsonargparse's multi-line reports are reduced to option, value, allowed."""
    text = str(err).strip() or type(err).__name__
    m = _LITERAL.search(text)
    if m:
        allowed = ", ".join(v.strip(" '\"") for v in m.group(2).split(","))
        return f"{m.group(1)}={m.group(3).strip().splitlines()[0]!r} is not allowed: use one of {allowed}"
    m = _TYPE.search(text)
    if m:
        return f"{m.group(1)}={m.group(3).strip().splitlines()[0]!r} is not allowed: expected a {m.group(2)}"
    m = _KEY.search(text)
    if m:
        detail = " ".join(m.group(2).split())
        if "Given value type" in detail or "Expected a" in detail:
            detail = re.sub(r"\s*- ", " ", detail)
        return f"{m.group(1)}: {detail}"[:400]
    return " ".join(text.split())[:600]


class GgufExportError(ValueError):
    """The model (or its tokenizer) cannot be written as a GGUF file llama.cpp runs."""
