"""Generation with a removed attention sub-block: the KV cache keeps the right length, cached == uncached."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import prunelight  # noqa: F401  (registers the pruned model types)
from prunelight.export import export_pretrained
from prunelight.modeling import RemovedAttention
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.surgery import apply_plan
from prunelight.testing import FAMILIES, tiny_model

LAYERS, GROUPS, CHANNELS = 3, 2, 96
NEW = 4


def _pruned(family: str, no_attention: int):
    """A tiny 3-layer model whose layer `no_attention` lost its attention; the others lose one group/some channels."""
    model = tiny_model(family, num_hidden_layers=LAYERS)
    layers = [LayerPlan([1], list(range(0, CHANNELS, 2))) for _ in range(LAYERS)]
    layers[no_attention] = LayerPlan([], list(range(CHANNELS)))
    apply_plan(model, PrunePlan(layers=layers, num_groups=[GROUPS] * LAYERS, num_channels=[CHANNELS] * LAYERS,
                                drop_layers=[]))
    assert isinstance(model.model.layers[no_attention].self_attn, RemovedAttention)
    return model


def _batch():
    """Two prompts, the first left-padded by three tokens."""
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask


def _generate(model, ids, mask, new=NEW, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **kwargs)


def _same(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def _check_generation(model) -> None:
    ids, mask = _batch()
    with torch.no_grad():
        reference = _generate(model, ids, mask, new=2 * NEW, use_cache=False)
        _same(_generate(model, ids, mask, new=2 * NEW, use_cache=True), reference)
        # One cache across two calls: the second continues from the first call's output.
        cache = DynamicCache(config=model.config)
        first = _generate(model, ids, mask, past_key_values=cache)
        assert cache.get_seq_length() == ids.shape[1] + NEW - 1  # the last new token is not cached yet
        mask2 = torch.cat([mask, torch.ones_like(first.sequences[:, ids.shape[1]:])], dim=1)
        second = _generate(model, first.sequences, mask2, past_key_values=cache)
    assert cache.get_seq_length() == ids.shape[1] + 2 * NEW - 1
    assert torch.equal(second.sequences, reference.sequences)
    for x, y in zip(first.logits + second.logits, reference.logits):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("no_attention", [0, 1], ids=["layer0", "middle"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generation_matches_uncached(family, no_attention):
    _check_generation(_pruned(family, no_attention))


@pytest.mark.parametrize("no_attention", [0, 1], ids=["layer0", "middle"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_cache_slot_reports_the_sequence_length(family, no_attention):
    """Whichever layer transformers reads the cache length from, it reads the true one (removed attention too)."""
    model = _pruned(family, no_attention)
    ids, mask = _batch()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    lengths = [layer.get_seq_length() for layer in cache.layers]
    assert lengths == [ids.shape[1]] * LAYERS, f"cache length per layer {lengths}, removed attention at {no_attention}"


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generation_after_export(family, tmp_path):
    model = _pruned(family, 0)
    export_pretrained(model, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert isinstance(reloaded.model.layers[0].self_attn, RemovedAttention)
    _check_generation(reloaded)
    ids, mask = _batch()
    with torch.no_grad():
        _same(_generate(reloaded, ids, mask), _generate(model, ids, mask))


def test_placeholder_counts_tokens():
    """The removed layer's cache slot reports the tokens seen, like any attention layer's."""
    model = _pruned("llama", 0)
    cache = DynamicCache(config=model.config)
    ids, mask = _batch()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert [cache.get_seq_length(i) for i in range(LAYERS)] == [ids.shape[1]] * LAYERS


@pytest.mark.parametrize("how", ["past_key_values", "cache", "a_future_name", "positional"])
def test_removed_attention_finds_the_cache_however_it_is_passed(how):
    """The slot is filled whatever the library calls the argument (5.24 renamed it): the cache is found by type."""
    cache = DynamicCache()
    hidden = torch.randn(2, 5, 8)
    attn = RemovedAttention(layer_idx=0)
    out, _ = attn(hidden, None, cache) if how == "positional" else attn(hidden, None, **{how: cache})
    assert torch.equal(out, torch.zeros_like(hidden))
    assert cache.get_seq_length(0) == 5
