"""Efficiency figures: parameter breakdown, bytes, KV cache and the speed measurement's contract."""

from __future__ import annotations

import sys

import pytest
import torch

from prunelight.allocation import count_params
from prunelight.evaluation.efficiency import (
    PeakMemory,
    efficiency_report,
    folder_bytes,
    kv_cache_bytes,
    measure_speed,
    parameter_breakdown,
    weight_bytes,
)
from prunelight.plan import LayerPlan, PrunePlan
from prunelight.surgery import apply_plan
from prunelight.testing import tiny_model


def test_breakdown_adds_up_and_follows_the_cut(family):
    model = tiny_model(family)
    before = parameter_breakdown(model)
    assert before["total"] == count_params(model) == sum(v for k, v in before.items() if k != "total")
    # A tied LM head (Gemma, Llama 3.2) shares the embedding's weight, counted once under "embeddings".
    assert before["embeddings"] == 128 * 64
    assert before["lm_head"] == (0 if model.config.tie_word_embeddings else 128 * 64)
    plan = PrunePlan([LayerPlan([0], list(range(40))), LayerPlan([0, 1], list(range(96)))], [2, 2], [96, 96])
    apply_plan(model, plan)
    after = parameter_breakdown(model)
    assert after["mlp"] == before["mlp"] - 3 * 64 * (96 - 40)  # gate, up, down lose 56 channels each
    assert after["attention"] < before["attention"] and after["embeddings"] == before["embeddings"]
    assert after["total"] == count_params(model)


def test_bytes_and_kv_cache(tmp_path):
    model = tiny_model("llama")
    assert weight_bytes(model) == 4 * count_params(model)  # fp32
    model.save_pretrained(tmp_path)
    assert folder_bytes(tmp_path) == pytest.approx(weight_bytes(model), rel=0.05)
    # 2 layers x 2 KV heads x head_dim 16 x (K and V) x fp32
    assert kv_cache_bytes(model, batch_size=3, length=10) == 2 * 2 * 2 * 16 * 3 * 10 * 4
    apply_plan(model, PrunePlan([LayerPlan([1], list(range(96))), LayerPlan([0, 1], list(range(96)))], [2, 2], [96, 96]))
    assert kv_cache_bytes(model, batch_size=3, length=10) == 3 * 2 * 16 * 3 * 10 * 4


def test_speed_measurement_reports_the_stated_shape():
    model = tiny_model("llama")
    res = measure_speed(model, batch_size=2, prompt_len=8, new_tokens=3, repeats=2, warmup=1)
    assert (res["batch_size"], res["prompt_len"], res["new_tokens"], res["repeats"]) == (2, 8, 3, 2)
    assert res["prefill_tokens_per_s"] > 0 and res["decode_tokens_per_s"] > 0
    assert res["decode_latency_ms_per_token"] == pytest.approx(1000 * 2 / res["decode_tokens_per_s"])
    assert res["peak_memory_bytes"] is None or res["peak_memory_bytes"] > weight_bytes(model)
    with pytest.raises(ValueError, match="exceeds the context"):
        measure_speed(model, prompt_len=250, new_tokens=10)
    with pytest.raises(ValueError, match="must be >= 1"):
        measure_speed(model, new_tokens=0)


def test_efficiency_report_has_everything(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    rep = efficiency_report(model, tmp_path, prompt_len=4, new_tokens=2, repeats=1)
    assert rep["params"]["total"] == count_params(model)
    assert rep["disk_bytes"] == folder_bytes(tmp_path) and rep["weight_bytes"] == weight_bytes(model)
    assert efficiency_report(model, None, prompt_len=4, new_tokens=2, repeats=1)["disk_bytes"] is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process RSS figures are read from Linux /proc")
def test_peak_memory_rise_counts_what_the_block_allocates():
    with PeakMemory(torch.device("cpu")) as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    assert mem.start is not None and mem.peak >= mem.start
    assert mem.rise >= 60 * 2**20, mem.rise
    with PeakMemory(torch.device("cpu")) as quiet:
        pass
    assert quiet.rise < 16 * 2**20, "an empty block must not inherit the earlier 64 MiB peak"
