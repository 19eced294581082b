"""Checks on the real reference model in ../shared (skipped when it is absent)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prunelight.families import get_family
from prunelight.data import TextSource, pack_blocks, sample_windows, tokenize_source
from prunelight.evaluation.perplexity import evaluate_perplexity
from prunelight.export import export_pretrained
from prunelight.pipeline import make_plan
from prunelight.settings import PruneSettings
from prunelight.surgery import apply_plan, mask_units

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ref(ref_model_dir, shared):
    model = AutoModelForCausalLM.from_pretrained(ref_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(ref_model_dir)
    wt = shared / "data" / "wikitext2"
    calib = sample_windows(tokenize_source(tok, TextSource(path=str(wt / "valid.txt"), max_tokens=60000)), 32, 128, 0)
    evalb = pack_blocks(tokenize_source(tok, TextSource(path=str(wt / "test.txt"), max_tokens=128 * 48)), 128)
    return model, tok, list(torch.split(calib, 16)), list(torch.split(evalb, 16))


def test_taylor_plan_cut_equals_mask_on_reference(ref):
    model, _, calib, evalb = ref
    plan = make_plan(model, calib, PruneSettings(ratio=0.2, criterion="taylor")).plan
    masked = copy.deepcopy(model)
    mask_units(masked, plan)
    cut = copy.deepcopy(model)
    apply_plan(cut, plan)
    with torch.no_grad():
        torch.testing.assert_close(cut(evalb[0]).logits, masked(evalb[0]).logits, atol=2e-4, rtol=1e-4)
    for shape in get_family(cut).layer_shapes(cut):
        assert shape.num_attention_heads == 4 * shape.num_key_value_heads  # the 4:1 GQA ratio survives


def test_taylor_beats_random_and_export_reloads(ref, tmp_path):
    model, tok, calib, evalb = ref
    results = {}
    for criterion in ("taylor", "random"):
        pruned = copy.deepcopy(model)
        plan = make_plan(pruned, calib, PruneSettings(ratio=0.2, criterion=criterion, allocation="global")).plan
        apply_plan(pruned, plan)
        results[criterion] = evaluate_perplexity(pruned, evalb)["ppl"]
        if criterion == "taylor":
            folder = export_pretrained(pruned, tmp_path / "taylor", tokenizer=tok)
            reloaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
            with torch.no_grad():
                torch.testing.assert_close(reloaded(evalb[0]).logits, pruned(evalb[0]).logits, atol=1e-5, rtol=1e-5)
    dense = evaluate_perplexity(model, evalb)["ppl"]
    assert dense < results["taylor"] < results["random"], (dense, results)
