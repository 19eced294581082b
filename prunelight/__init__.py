"""prunelight: structured pruning and recovery of GQA language models in one Lightning run.

Importing the package reads no command line and changes no environment; it only registers the
pruned model types with transformers, so exported folders with per-layer widths load through
`AutoModelForCausalLM.from_pretrained` once prunelight is imported. The notebook API
(`prunelight.prune`, `prunelight.score`, `prunelight.apply_plan`, `prunelight.PruneSettings`)
is loaded on first use.
"""

from prunelight.modeling import register_auto_classes

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access, so `import prunelight` stays cheap
_LAZY = {"prune": "prunelight.api", "score": "prunelight.api", "Scores": "prunelight.api",
         "apply_plan": "prunelight.api", "PruneSettings": "prunelight.settings", "PrunePlan": "prunelight.plan"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prunelight' has no attribute {name!r}")


register_auto_classes()
