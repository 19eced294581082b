"""prunelight: structured pruning and recovery of GQA language models in one Lightning run."""

from prunelight import _env

if _env.running_as_cli():
    # Must happen before transformers/datasets are imported: they read the offline flags at import.
    _env.offline_if_local()

from prunelight.modeling import register_auto_classes

__version__ = "0.1.0"

# Pruned folders (per-layer widths) load through AutoModelForCausalLM once prunelight is imported.
register_auto_classes()
