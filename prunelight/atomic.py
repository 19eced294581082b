"""Crash-safe file writing: write to a temporary name beside the target, then rename over it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _usual_mode(path: str | os.PathLike, directory: bool) -> None:
    # mkstemp/mkdtemp create 0600/0700; the result should have the mode a plain open()/mkdir() would give.
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator:
    """Yield a file object on a temporary name beside `path`; on success it is fsynced and renamed over `path`.

    Readers see either the old file or the whole new one; on error the temporary file is removed.
    """
    with atomic_path(path) as tmp:  # atomic_path fsyncs and renames
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` for a writer that opens files by name; on success it is renamed over `path`.

    Readers see either the old file or the whole new one; on error the temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _usual_mode(tmp, directory=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` so readers see either the old file or the whole new one."""
    with atomic_file(path) as f:
        f.write(text)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, data) -> Path:
    """JSON version of `atomic_write_text` (indented, keys in insertion order)."""
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success it replaces `path`, on error it is deleted.

    A previous folder at `path` survives any failure while the new one is being written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _usual_mode(tmp, directory=True)
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
