"""Plans and scores that travel: `plan.json` and `scores.pt`, what they apply to, and the checks on reading them.

Every run writes `<out_dir>/plan.json` (the plan and the model shapes it applies to) and `<out_dir>/scores.pt`
(the unit scores and layer-importance measures, with the key they are valid for). `prune.plan` applies a
saved plan with no scoring; `prune.scores` re-allocates from saved scores with no scoring pass. Both are
refused, before any work, when they do not fit the model (or, for scores, the criterion).

The scores key (`scores_key`) is what a cache of scores is indexed by: model identity (type, shapes,
dtype, a fingerprint of the weights), criterion and its arguments, and the calibration data. `check_key`
compares a file's key with the one expected and names the first field that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelight.allocation.registry import allocation_of
from prunelight.atomic import atomic_file, atomic_write_json
from prunelight.families import get_family, unwrap
from prunelight.plan import PrunePlan

log = logging.getLogger(__name__)

PLAN_FORMAT = "prunelight.plan/1"
SCORES_FORMAT = "prunelight.scores/1"
PLAN_FILE = "plan.json"
SCORES_FILE = "scores.pt"
KEY_PARTS = ("model", "criterion", "criterion_args", "calibration")
# Compared when a run reads `prune.scores`: the scores must come from this model and this criterion.
RUN_KEY_PARTS = ("model", "criterion", "criterion_args")


# --- what a plan or scores file applies to -----------------------------------------------------
def config_facts(config) -> dict[str, Any]:
    """Architecture facts a config states: type, layers, hidden size, head_dim and per-layer shapes [heads, KV, MLP]."""
    family = get_family(config)
    n = int(config.num_hidden_layers)
    stated = getattr(config, "layer_shapes", None)  # a pruned prunelight config states each layer
    if stated:
        layers = [[int(s["num_attention_heads"]), int(s["num_key_value_heads"]), int(s["intermediate_size"])]
                  for s in stated]
    else:
        b = family.base_shape(config)
        layers = [[b.num_attention_heads, b.num_key_value_heads, b.intermediate_size]] * n
    return {"model_type": str(config.model_type), "num_layers": n, "hidden_size": int(config.hidden_size),
            "head_dim": int(family.head_dim(config)), "layers": layers}


def model_facts(model: nn.Module) -> dict[str, Any]:
    """`config_facts` with the per-layer shapes read from the modules (the truth after any surgery)."""
    base = unwrap(model)
    family = get_family(base)
    facts = config_facts(base.config)
    facts["layers"] = [[s.num_attention_heads, s.num_key_value_heads, s.intermediate_size]
                       for s in family.layer_shapes(base)]
    facts["num_layers"] = len(facts["layers"])
    return facts


def weights_fingerprint(model: nn.Module) -> str:
    """A cheap fingerprint of the weights: a hash of the sums of the embedding, first and last decoder layers.

    Two checkpoints of the same shape (a base model and its fine-tuned sibling) differ here. Every rank must
    call it together under ZeRO-3 (the layers are gathered).
    """
    from prunelight.zero3 import gathered

    base = unwrap(model)
    layers = get_family(base).layers(base)
    parts = [("embed", base.get_input_embeddings()), ("first", layers[0]), ("last", layers[len(layers) - 1])]
    digest = hashlib.sha256()
    with torch.no_grad():
        for tag, module in parts:
            with gathered(module):
                for name, p in sorted(module.named_parameters(), key=lambda x: x[0]):
                    t = p.detach().double()
                    # 6 significant digits: the same weights on another device still agree
                    digest.update(f"{tag}.{name}:{tuple(p.shape)}:{t.sum().item():.6e}:{t.square().sum().item():.6e}"
                                  .encode())
    return digest.hexdigest()[:16]


def model_identity(model: nn.Module) -> dict[str, Any]:
    """The model part of the scores key: shapes, dtype and weights fingerprint."""
    base = unwrap(model)
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    return {**model_facts(base), "dtype": dtype, "fingerprint": weights_fingerprint(base)}


def calibration_identity(datamodule=None, settings=None, **facts) -> dict[str, Any]:
    """What scores were measured on: the calibration source and sampling, and the batches scoring used."""
    out: dict[str, Any] = {}
    if datamodule is not None:
        src = datamodule.calibration
        out = {"source": dataclasses.asdict(src) if dataclasses.is_dataclass(src) else str(src),
               "seq_len": datamodule.seq_len, "num_samples": datamodule.num_samples, "seed": datamodule.seed,
               "batch_size": datamodule.calibration_batch_size}
    out.update(facts)
    if settings is not None:
        out["max_calibration_batches"] = settings.max_calibration_batches
        out["importance_batches"] = settings.importance_batches
    return out


def scores_key(model: nn.Module, settings, calibration: dict[str, Any]) -> dict[str, Any]:
    """The key saved scores are valid for (and a score cache is indexed by): model, criterion, calibration data."""
    return {"model": model_identity(model), "criterion": settings.criterion,
            "criterion_args": dict(settings.criterion_args), "calibration": dict(calibration)}


def key_digest(key: dict[str, Any]) -> str:
    """A short stable hash of a key (a file name for a cache)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _diff(found: Any, expected: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first dotted path where two keys differ."""
    if isinstance(found, dict) and isinstance(expected, dict):
        for k in list(expected) + [k for k in found if k not in expected]:
            d = _diff(found.get(k), expected.get(k), f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(found, (list, tuple)) and isinstance(expected, (list, tuple)):
        found, expected = list(found), list(expected)
    return None if found == expected else (path, found, expected)


def check_key(found: dict[str, Any], expected: dict[str, Any], source: str, option: str = "prune.scores",
              parts: tuple[str, ...] = KEY_PARTS) -> None:
    """Refuse a scores file whose key differs from `expected` in any of `parts`, naming the first field that differs."""
    for part in parts:
        d = _diff(found.get(part), expected.get(part), part)
        if d is None:
            continue
        path, got, want = d
        if path == "model.fingerprint":
            why = (f"the weights differ (fingerprint {got} in the file, {want} here): the scores were made on "
                   "another checkpoint")
        elif path.startswith("model.layers"):
            why = f"the layer shapes differ: {_layers_mismatch(got, want, found, expected)}"
        else:
            why = f"{path} is {got!r} in the file, {want!r} here"
        hint = ""
        if part in ("criterion", "criterion_args"):
            hint = f"; set prune.{part}={got!r} to use these scores, or score again without prune.scores"
        raise ValueError(f"{option}={source} does not fit this run: {why}{hint}")


def _layers_mismatch(got, want, found, expected) -> str:
    a, b = found["model"]["layers"], expected["model"]["layers"]
    if len(a) != len(b):
        return f"{len(a)} layers in the file, {len(b)} here"
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            return f"layer {i} is {_shape(y)} here, {_shape(x)} in the file"
    return f"{got} vs {want}"


def _shape(s) -> str:
    return f"{s[0]} query heads / {s[1]} KV heads / {s[2]} MLP channels"


# --- scores.pt ---------------------------------------------------------------------------------
@dataclass
class SavedScores:
    """A loaded scores.pt: unit scores, layer-importance measures, the key they are valid for, provenance."""

    unit_scores: dict[str, list[torch.Tensor]]
    key: dict[str, Any]
    layer_importance: dict[str, list[float]] = field(default_factory=dict)
    block_importance: dict[str, list[float]] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def samples(self) -> int:
        """Calibration samples the scores were summed over."""
        return int(self.provenance.get("samples") or 0)


def save_scores(path: str | Path, scores: dict[str, list[torch.Tensor]], key: dict[str, Any],
                layer_importance: dict[str, list[float]] | None = None,
                block_importance: dict[str, list[float]] | None = None, **provenance) -> Path:
    """Write scores.pt atomically: plain tensors, lists and dicts only (loads with weights_only=True)."""
    from prunelight import __version__

    data = {
        "format": SCORES_FORMAT,
        "key": key,
        "unit_scores": {k: [t.detach().float().cpu().clone() for t in v] for k, v in scores.items()},
        "layer_importance": {k: [float(x) for x in v] for k, v in (layer_importance or {}).items()},
        "block_importance": None if block_importance is None
        else {k: [float(x) for x in v] for k, v in block_importance.items()},
        "provenance": {"prunelight_version": __version__, **_plain(provenance)},
    }
    with atomic_file(path, "wb") as f:
        torch.save(data, f)
    return Path(path)


def _plain(x):
    """JSON-like copy (weights_only loading accepts only plain containers)."""
    return json.loads(json.dumps(x, default=str))


def load_scores(path: str | Path, option: str = "prune.scores") -> SavedScores:
    """Read a scores.pt written by `save_scores`; a one-line error for a missing or foreign file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{option}={str(path)!r} does not exist (a scores.pt that a run wrote into its "
                                "output folder)")
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle and zip errors alike
        raise ValueError(f"{option}={str(path)!r} is not a prunelight scores file: {err}") from None
    if not isinstance(data, dict) or data.get("format") != SCORES_FORMAT:
        raise ValueError(f"{option}={str(path)!r} is not a prunelight scores file (format "
                         f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, "
                         f"expected {SCORES_FORMAT})")
    return SavedScores(unit_scores=data["unit_scores"], key=data["key"],
                       layer_importance=dict(data.get("layer_importance") or {}),
                       block_importance=data.get("block_importance"), provenance=dict(data.get("provenance") or {}),
                       source=str(path))


def check_scores_cover(saved: SavedScores, settings) -> None:
    """Refuse an allocation that needs a measure the scores file lacks, saying how to get it."""
    src = f"prune.scores={saved.source}"
    alloc = settings.allocation
    row = allocation_of(alloc)
    if row.layer_importance and settings.layer_importance not in saved.layer_importance:
        have = ", ".join(saved.layer_importance) or "none"
        raise ValueError(f"{src} has no layer importance {settings.layer_importance!r} (it has: {have}), which "
                         f"allocation {alloc} needs: make the scores with a run that measures it "
                         f"(prune.report_layer_importance: [{settings.layer_importance}]), or choose "
                         f"prune.layer_importance among those it has")
    if row.block_removal(settings) and not saved.block_importance:
        raise ValueError(f"{src} has no sub-block removal importance, which allocation {alloc} with "
                         "block_importance=removal needs: make the scores with a run of these settings, or use "
                         "block_importance=units")


def check_scores_fit_config(saved: SavedScores, settings, config) -> None:
    """Before the weights load: the file's model type, shapes and criterion against the config and settings."""
    facts = config_facts(config)
    expected = {"model": {k: facts[k] for k in facts}, "criterion": settings.criterion,
                "criterion_args": dict(settings.criterion_args)}
    found = {**saved.key, "model": {k: saved.key.get("model", {}).get(k) for k in facts}}
    check_key(found, expected, saved.source, parts=RUN_KEY_PARTS)
    check_scores_cover(saved, settings)


# --- plan.json ---------------------------------------------------------------------------------
def plan_document(plan: PrunePlan, model: nn.Module, params_before: int, params_after: int, settings=None,
                  source: str | None = None) -> dict[str, Any]:
    """plan.json: the plan, the model shapes it applies to, parameters before/after and how it was made."""
    facts = plan.meta.get("applies_to") or model_facts(model)
    doc = {
        "format": PLAN_FORMAT,
        "plan": plan.to_dict(),
        "applies_to": facts,
        "params_before": params_before,
        "params_after": params_after,
    }
    if settings is not None:
        doc.update(criterion=plan.meta.get("criterion", settings.criterion),
                   allocation=plan.meta.get("allocation", settings.allocation),
                   ratio=plan.meta.get("ratio", settings.ratio))
        if plan.meta.get("target"):
            doc["target"] = plan.meta["target"]
    if source:
        doc["source"] = source
    return doc


def write_plan(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write plan.json atomically."""
    return atomic_write_json(path, doc)


def load_plan(path: str | Path, option: str = "prune.plan") -> tuple[PrunePlan, dict[str, Any] | None]:
    """A plan from a plan.json, a report.json or a Lightning checkpoint (.ckpt); with the shapes it applies to."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{option}={str(path)!r} does not exist (use a plan.json, report.json or .ckpt that a "
                                "run wrote)")
    data: Any
    if p.suffix in (".ckpt", ".pt", ".pth"):
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:
            raise ValueError(f"{option}={str(path)!r} could not be read as a checkpoint: {err}") from None
        state = ckpt.get("prunelight") if isinstance(ckpt, dict) else None
        if not state or not state.get("plan"):
            raise ValueError(f"{option}={str(path)!r} holds no prune plan (no 'prunelight' entry with a plan: "
                             "a checkpoint written after the cut by `prunelight fit` has one)")
        raw = state["plan"]
    else:
        try:
            data = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"{option}={str(path)!r} is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{option}={str(path)!r} holds no prune plan")
        if data.get("format") == PLAN_FORMAT:
            raw = {**data["plan"]}
            raw.setdefault("meta", {})
            raw["meta"] = {**raw["meta"], "applies_to": data.get("applies_to") or raw["meta"].get("applies_to")}
        elif data.get("prune_plan"):  # report.json: kept units, and the budget meta under `plan`
            raw = {**data["prune_plan"], "meta": data.get("plan") or {}}
        elif "layers" in data and "num_groups" in data:  # json.dump(plan.to_dict())
            raw = data
        else:
            raise ValueError(f"{option}={str(path)!r} holds no prune plan (expected a plan.json, a report.json with "
                             "`prune_plan`, or a .ckpt)")
    try:
        plan = PrunePlan.from_dict(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{option}={str(path)!r} holds a malformed plan: {err}") from None
    _legacy_repair(plan.meta)
    return plan, plan.meta.get("applies_to")


def _legacy_repair(meta: dict[str, Any]) -> None:
    """Plans written before `meta["repair"]` existed kept a cross-validated ridge under `search.ridge_cv` (or, when
    re-applied, `made_with.ridge_cv`): read it as the plan's repair, so they re-apply as they did."""
    if "repair" in meta:
        return
    for section in ("search", "made_with"):
        cv = (meta.get(section) or {}).get("ridge_cv") or {}
        if cv.get("chosen_by") == "cv" and cv.get("ridge") is not None:
            meta["repair"] = {"reconstruct_ridge": float(cv["ridge"]), "chosen_by": "cv"}
            return


def check_plan_fits(plan: PrunePlan, applies_to: dict[str, Any] | None, facts: dict[str, Any], source: str,
                    option: str = "prune.plan") -> None:
    """Refuse a plan made for another architecture or shape, naming the first mismatch."""
    def refuse(why: str) -> None:
        raise ValueError(f"{option}={source} does not fit the model: {why}")

    if applies_to:
        if applies_to.get("model_type") != facts["model_type"]:
            refuse(f"the model is {facts['model_type']}, the plan was made for {applies_to.get('model_type')}")
        for name, what in (("hidden_size", "hidden size"), ("head_dim", "head_dim")):
            if applies_to.get(name) is not None and applies_to[name] != facts[name]:
                refuse(f"its {what} is {facts[name]}, the plan was made for {applies_to[name]}")
    n = facts["num_layers"]
    if plan.num_layers != n:
        refuse(f"it has {n} layers, the plan was made for {plan.num_layers}")
    made = (applies_to or {}).get("layers")
    for i, shape in enumerate(facts["layers"]):
        heads, kv, inter = shape
        if made is not None and (made[i][0], made[i][1]) != (heads, kv):
            refuse(f"layer {i} has {heads} query heads / {kv} KV heads, the plan was made for "
                   f"{made[i][0]} / {made[i][1]}")
        if plan.num_groups[i] != kv:
            refuse(f"layer {i} has {kv} KV heads, the plan was made for {plan.num_groups[i]}")
        if plan.num_channels[i] != inter:
            refuse(f"layer {i} has {inter} MLP channels, the plan was made for {plan.num_channels[i]}")
        lp = plan.layers[i]
        for what, keep, size in (("KV groups", lp.keep_groups, kv), ("MLP channels", lp.keep_channels, inter)):
            if len(set(keep)) != len(keep) or any(not 0 <= j < size for j in keep):
                refuse(f"layer {i} keeps {what} that are out of range or repeated (the layer has {size})")
    bad = [i for i in plan.drop_layers if not 0 <= i < n]
    if bad or len(set(plan.drop_layers)) != len(plan.drop_layers):
        refuse(f"drop_layers {plan.drop_layers} are not distinct layers in [0, {n})")


def read_saved_inputs(settings, config) -> tuple[PrunePlan | None, SavedScores | None]:
    """`prune.plan` / `prune.scores` read once and checked against the model's config (before the weights load)."""
    plan = scores = None
    if settings.plan:
        plan, applies_to = load_plan(settings.plan)
        check_plan_fits(plan, applies_to, config_facts(config), settings.plan)
    if settings.scores:
        scores = load_scores(settings.scores)
        check_scores_fit_config(scores, settings, config)
    return plan, scores
