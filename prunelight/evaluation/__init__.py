"""Evaluation of dense, pruned and recovered models: perplexity, zero-shot, efficiency, figures."""

from prunelight.evaluation.perplexity import evaluate_perplexity, evaluate_perplexity_suite
from prunelight.evaluation.suite import EvaluationSettings, Evaluator

__all__ = ["EvaluationSettings", "Evaluator", "evaluate_perplexity", "evaluate_perplexity_suite"]
