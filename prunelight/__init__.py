"""prunelight: structured pruning and recovery of GQA language models in one Lightning run.

Importing the package reads no command line and changes no environment; it only registers the
pruned model types with transformers, so exported folders with per-layer widths load through
`AutoModelForCausalLM.from_pretrained` once prunelight is imported.
"""

from prunelight.modeling import register_auto_classes

__version__ = "0.1.0"

register_auto_classes()
