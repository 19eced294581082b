"""What a run shows: progress bars that change nothing, and a compact cut summary."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from prunelight.console import cut_summary, progress, show_progress


def _rng_after(iterate) -> torch.Tensor:
    torch.manual_seed(0)
    iterate()
    return torch.random.get_rng_state()


def test_progress_bar_draws_nothing_from_the_global_rng():
    """An extra DataLoader iterator draws a seed from the global RNG: a bar must not create one.

    (tqdm.auto's asyncio wrapper did, which shifted LoRA's initialisation after the cut.)
    """
    loader = DataLoader(list(range(10)), batch_size=2)
    plain = _rng_after(lambda: list(loader))
    for show in (False, True):
        with show_progress(show):
            wrapped = _rng_after(lambda: list(progress(loader, "test", total=len(loader))))
        assert torch.equal(plain, wrapped)


def test_cut_summary_is_compact_and_complete():
    layers = [{"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 588}] + [
        {"num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 469}] * 3
    meta = {"params_target_removed": 1000, "budget_error_params": 12, "layers_dropped": []}
    text = cut_summary(meta, layers, 10_000, 8_988, {"dense": 10.0, "pruned": 11.5}, "taylor", "global")
    assert "parameters 10,000 -> 8,988 (10.12% removed; target 1,000, budget error +12)" in text
    assert "KV groups per layer:   2 1x3" in text and "MLP channels per layer: 588 469x3" in text
    assert "perplexity: dense 10.00 -> pruned 11.50" in text
