"""Compatibility home of `evaluate_perplexity` (the implementation lives in prunelight.evaluation.perplexity)."""

from prunelight.evaluation.perplexity import evaluate_perplexity

__all__ = ["evaluate_perplexity"]
