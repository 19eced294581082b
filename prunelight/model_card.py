"""The exported folder's README.md: base model, what was removed, the recovery, perplexities, format and command.

Built from the run record as a plain dict (`RunRecord.to_dict()`), read defensively: a field a run did
not fill (or a newer record adds, e.g. distillation) is left out or shown as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import prunelight
from prunelight.export import NOT_RUN

NAS_ENGINES = ("vLLM serves it as `DeciLMForCausalLM` (`LLM(model=folder, trust_remote_code=True)`: the remote code is "
              "only the config class in `modeling_prunelight.py`); transformers loads it with prunelight imported or "
              "trust_remote_code=True")
PRUNED_ENGINES = ("transformers only, with trust_remote_code=True (per-layer widths: serving engines do not load "
                  "this type; re-run with export.format: stock)")


def _num(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return str(v)


def _compact(values: list) -> str:
    """'32 x 8' for equal values, else the list."""
    if values and len(set(values)) == 1:
        return f"{values[0]} in each of {len(values)} layers"
    return ", ".join(str(v) for v in values)


def model_card(record: dict[str, Any], config: Any = None, command: str | None = None) -> str:
    """Markdown model card for an exported folder from a run record dict and the saved config."""
    rec = record or {}
    plan = rec.get("plan") or {}
    cal = rec.get("calibration") or {}
    base = rec.get("model") or "unknown"
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    model_type = cfg.get("model_type", "unknown")
    stock = not cfg.get("layer_shapes") and not cfg.get("auto_map") and not str(model_type).startswith("prunelight")
    nas = bool(cfg.get("block_configs"))
    tags = ["prunelight", "pruned", "structured-pruning", str(model_type)]
    hub_id = (base not in ("config", "unknown") and not base.startswith((".", "/", "~", "pkg://"))
              and not base.endswith(".gguf") and not Path(base).exists())  # a GGUF or package file is no hub id
    lines = ["---", f"base_model: {base}" if hub_id else "base_model: null  # a local folder or a test config",
             "library_name: transformers", "tags:", *[f"- {t}" for t in tags], "---", "",
             f"# {base} pruned with prunelight", ""]
    before, after = rec.get("params_before"), rec.get("params_after")
    lines += ["## What was removed", ""]
    if before and after:
        lines.append(f"- Parameters: {_num(before)} -> {_num(after)} ({100 * (before - after) / before:.2f}% removed)")
    if cal:
        lines.append(f"- Criterion `{cal.get('criterion')}`, allocation `{cal.get('allocation')}`, ratio "
                     f"{cal.get('ratio')}, {cal.get('samples')} calibration samples of {cal.get('seq_len')} tokens"
                     + (f" from {cal['source']}" if cal.get("source") else ""))
    if plan:
        lines.append(f"- GQA groups removed: {_num(plan.get('groups_removed'))}; MLP channels removed: "
                     f"{_num(plan.get('channels_removed'))}; layers dropped: {plan.get('layers_dropped') or 'none'}")
        stock_shapes = plan.get("stock_shapes") or {}
        if stock_shapes:
            lines.append(f"- Uniform shape (export.format: stock): {stock_shapes.get('chosen')} group(s) removed per "
                         f"layer, chosen by {stock_shapes.get('chosen_by')} among "
                         f"{len(stock_shapes.get('candidates') or [])} candidate shape(s)")
        served = plan.get("served_shapes") or {}
        if served:
            chosen = served.get("chosen") or {}
            lines.append(f"- Served layout (export.format: nemotron_nas): {chosen.get('groups_kept')} GQA group(s) "
                         f"kept in every layer that keeps attention, attention removed in layers "
                         f"{chosen.get('attention_removed_layers') or 'none'}, chosen by {served.get('chosen_by')}")
    layers = rec.get("layers") or []
    if layers:
        for key, name in (("num_attention_heads", "Query heads"), ("num_key_value_heads", "KV heads"),
                          ("intermediate_size", "MLP width")):
            lines.append(f"- {name}: {_compact([layer.get(key) for layer in layers])}")
    if rec.get("reconstruction"):
        r = rec["reconstruction"]
        lines.append(f"- Reconstruction after the cut: `{r.get('method')}`"
                     + (f", then each cut layer tuned toward the dense layer's outputs ({r['tuning']['epochs']} epochs "
                        f"at most, lr {r['tuning']['lr']:g})" if r.get("tuning") else ""))
    lines += ["", "## Recovery", ""]
    recovery = rec.get("recovery") or {}
    if recovery:
        lines.append(f"- Mode: `{recovery.get('mode')}`, {recovery.get('steps')} optimizer steps")
        if recovery.get("lora"):
            lines.append(f"- LoRA: `{json.dumps(recovery['lora'], sort_keys=True)}`")
        distill = recovery.get("distillation") or rec.get("distillation")
        if distill:
            lines.append(f"- Distillation: `{json.dumps(distill, sort_keys=True, default=str)}`")
    else:
        lines.append("- none recorded")
    ppl = rec.get("ppl") or {}
    if ppl:
        ev = rec.get("eval") or {}
        lines += ["", "## Perplexity", "",
                  f"Measured on {ev.get('source', 'the run eval text')}" + (f", {ev['seq_len']}-token windows"
                                                                           if ev.get("seq_len") else "") + ".", "",
                  "| model | perplexity |", "|---|---|"]
        lines += [f"| {state} | {_num(value)} |" for state, value in ppl.items()]
    lines += ["", "## Format", ""]
    archs = ", ".join(cfg.get("architectures") or [])
    if stock:
        lines.append(f"Stock `{model_type}` config (`{archs}`), no custom code. Loads with plain transformers, "
                     "without trust_remote_code or prunelight (prunelight's tests check such folders give the pruned "
                     f"model's logits). Not run by prunelight: {NOT_RUN}; they support this architecture's stock "
                     "config, but no prunelight export was checked in them.")
    elif nas:
        lines.append(f"Nemotron-NAS layout `{model_type}` (`{archs}`): per-layer MLP widths, one query/KV head count "
                     f"in every layer that keeps attention (`block_configs`). {NAS_ENGINES}.")
    else:
        lines.append(f"prunelight config type `{model_type}` (`{archs}`): {PRUNED_ENGINES}.")
    if rec.get("engines_verified"):
        lines.append("")
        lines.append(f"Engines this format is verified in by prunelight's serving check (`scripts/serve_check.py`: "
                     f"greedy output equal to transformers' on the same folder): {'; '.join(rec['engines_verified'])}.")
    if rec.get("export_gguf"):
        lines += ["", f"GGUF for llama.cpp (and Ollama, LM Studio, llamafile): `{Path(rec['export_gguf']).name}` beside "
                      "this folder; its layout was checked in llama.cpp by `scripts/llama_cpp_check.py` (greedy "
                      "output equal to transformers' on the file's own weights, F16 up to near ties; perplexity "
                      "within 1% for F16, 3% for Q8_0)."]
    lines += ["", "## How it was made", "", f"prunelight {prunelight.__version__}."]
    if command:
        lines += ["", "```", command, "```"]
    if cal.get("settings"):
        lines += ["", "`prune:` settings:", "", "```json", json.dumps(cal["settings"], indent=1, default=str), "```"]
    lines += ["", "## License", "",
              "The license and use policy of the base model apply; its LICENSE/NOTICE/USE_POLICY files are copied "
              "here when the base model was a local folder that had them.", ""]
    return "\n".join(lines)
