"""The calibration-score cache: one `scores.pt` per (model, criterion, criterion_args, calibration data, measures) key.

A trial that changes only what is done with the scores (ratio, allocation, reconstruction, recovery) reuses
the scores of an earlier trial: the run gets `--prune.scores <cache>/<digest>.pt` and skips its calibration
pass. The cache is indexed by a key computed from the trial's resolved config before the run, since the
sweep loads no model: the model folder's weight files (name, size, mtime), criterion and its arguments, the
calibration part of `prunelight.saved.scores_key` (`calibration_identity`: source, seq_len, num_samples,
seed, the batch size the run scores with, batch limits), and the measures the run records beside the unit
scores (layer importance where its allocation measures it, sub-block removals; `recorded_measures`). On a hit,
the key stored inside the file is compared with it by `prunelight.saved.check_key` (criterion, arguments,
calibration), and the file is handed over only when the trial's run takes it: its settings allow
`prune.scores` (not `attn_mlp_split: auto`; an allocation that probes measures its probes on the calibration
batches the run still reads) and the file holds every measure its
allocation needs (`check_scores_cover`); the run itself checks the model part (weights fingerprint), so a
stale, foreign or refused file is never used. A miss runs normally and then stores the run's own `scores.pt`
under the key (write-then-rename: two workers storing the same key leave one whole file).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SCORES_FILE = "scores.pt"  # what a run writes into its output folder (prunelight.saved)
INDEX_SUFFIX = ".key.json"

log = logging.getLogger("prunelight")


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if isinstance(node, dict) and "init_args" in node and part not in node:
            node = node["init_args"]
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def model_fingerprint(pretrained: str) -> dict[str, Any]:
    """A local model folder's weight files by name, size and modification time (a hub id is kept as named)."""
    path = Path(str(pretrained)).expanduser()
    if path.is_file():  # a GGUF file
        return {"path": str(path.resolve()), "files": [[path.name, path.stat().st_size, int(path.stat().st_mtime)]]}
    if not path.is_dir():
        return {"id": str(pretrained)}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    return {"path": str(path.resolve()),
            "files": [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]}


def calibration_part(config: dict[str, Any]) -> dict[str, Any]:
    """`prunelight.saved.calibration_identity` as the run will compute it, from the resolved config alone."""
    from prunelight.data import effective_calibration_batch_size
    from prunelight.saved import calibration_identity
    from prunelight.settings import PruneSettings

    # the settings as the run makes them: a key the config leaves out reads as its default
    limits = PruneSettings(**prune_section(config))
    # the size the run scores with (null falls back to data.batch_size), resolved as the data module does
    batch_size = effective_calibration_batch_size(_get(config, "data.calibration_batch_size"),
                                                  _get(config, "data.batch_size"))
    return calibration_identity(None, limits, source=_get(config, "data.calibration"),
                                seq_len=_get(config, "data.seq_len"), num_samples=_get(config, "data.num_samples"),
                                seed=_get(config, "data.seed"), batch_size=batch_size)


def prune_section(config: dict[str, Any]) -> dict[str, Any]:
    """The trial's `prune:` section as keyword arguments of `PruneSettings`."""
    return dict(config.get("prune") or {})


def recorded_measures(config: dict[str, Any]) -> dict[str, Any]:
    """What the run's scores.pt holds beside the unit scores: its layer importance measures and sub-block removals.

    Read through the run's own functions and the allocation's registry row: `prune.layer_importance` counts only
    where the row measures it (`layer_importance`: layerwise, depth), so trials differing only in an unused one
    share scores, and a trial that needs a measure never shares a key with a file that lacks it.
    """
    from prunelight.allocation.registry import allocation_of
    from prunelight.pipeline import layer_measures
    from prunelight.settings import PruneSettings

    settings = PruneSettings(**prune_section(config))
    return {"layer_importance": sorted(layer_measures(settings)),
            "block_removal": allocation_of(settings.allocation).block_removal(settings)}


def score_key(config: dict[str, Any]) -> dict[str, Any]:
    """What a trial's scores depend on, read from its resolved run config (nothing that only uses the scores).

    ValueError when the trial's prune settings are not allowed (its run refuses them too).
    """
    return {
        "model": {**model_fingerprint(_get(config, "model.pretrained")), "dtype": _get(config, "model.dtype"),
                  "attn_implementation": _get(config, "model.attn_implementation")},
        "criterion": _get(config, "prune.criterion"),
        "criterion_args": _get(config, "prune.criterion_args") or {},
        "calibration": calibration_part(config),
        **recorded_measures(config),  # what else the saved file must hold
        "seed_everything": config.get("seed_everything"),
    }


def digest(key: dict[str, Any]) -> str:
    """A short stable hash of a key (the cache file's name): `prunelight.saved.key_digest`."""
    from prunelight.saved import key_digest

    return key_digest(key)


def runs_take_scores() -> bool:
    """Whether this prunelight's runs accept `prune.scores` (re-allocation from a saved scores file)."""
    from dataclasses import fields

    from prunelight.settings import PruneSettings

    return any(f.name == "scores" for f in fields(PruneSettings))


class ScoreCache:
    """A folder of `<digest>.pt` score files, each with `<digest>.key.json` stating the key it was stored under."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)

    def path(self, key: dict[str, Any]) -> Path:
        """Where the scores of `key` live."""
        return self.folder / f"{digest(key)}.pt"

    def lookup(self, key: dict[str, Any], prune: dict[str, Any] | None = None) -> Path | None:
        """The cached file for `key`, or None; a file whose stored key differs from `key`, or (given the trial's
        `prune` section) one its run would refuse, is not used."""
        path = self.path(key)
        index = path.with_suffix(INDEX_SUFFIX)
        if not path.is_file() or not index.is_file():
            return None
        try:
            stored = json.loads(index.read_text())
        except ValueError:
            return None
        if json.loads(json.dumps(stored, sort_keys=True)) != json.loads(json.dumps(key, sort_keys=True, default=str)):
            return None
        if not self._usable(path, key, prune):
            return None
        return path

    @staticmethod
    def _usable(path: Path, key: dict[str, Any], prune: dict[str, Any] | None) -> bool:
        """The key saved inside scores.pt by the run agrees with ours (criterion, arguments, calibration), and the
        trial's run takes the file: its settings allow `prune.scores` (not with attn_mlp_split auto) and the file
        holds every measure its allocation needs (the run's own checks)."""
        from prunelight.errors import one_line
        from prunelight.saved import check_key, check_scores_cover, load_scores
        from prunelight.settings import PruneSettings

        try:
            saved = load_scores(path)
            check_key(saved.key, key, str(path), parts=("criterion", "criterion_args", "calibration"))
            if prune is not None:
                check_scores_cover(saved, PruneSettings(**{**prune, "scores": str(path)}))
        except (OSError, TypeError, ValueError) as err:
            log.info("sweep: score cache file not used: %s", one_line(err))
            return False
        return True

    def store(self, key: dict[str, Any], run_scores: str | os.PathLike) -> Path | None:
        """Copy a run's scores.pt under `key` (write-then-rename; a file already there is kept)."""
        run_scores = Path(run_scores)
        if not run_scores.is_file():
            return None
        path = self.path(key)
        self.folder.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.folder)
            os.close(fd)
            try:
                shutil.copyfile(run_scores, tmp)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        from prunelight.atomic import atomic_write_json

        atomic_write_json(path.with_suffix(INDEX_SUFFIX), key)
        return path
