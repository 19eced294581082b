"""The measured engine table (prunelight.serving.SERVING): complete, printed in docs/serving.md, and in agreement with
the config-level checks the run plan asks before the cut. The engines themselves run every cell in
tests/test_llama_cpp.py and tests/test_served.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from prunelight import serving
from prunelight import run_plan
from prunelight.export import VllmExportError, check_vllm_shapes
from prunelight.families import MODEL_FAMILIES, LayerShape
from prunelight.gguf_export import GgufExportError
from prunelight.testing import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_family_engine_and_feature_is_measured():
    assert set(serving.SERVING) == set(MODEL_FAMILIES)
    for family, row in serving.SERVING.items():
        assert set(row) == set(serving.ENGINES), family
        for engine, cells in row.items():
            assert set(cells) == set(serving.FEATURES), (family, engine)
            assert all(c.status in (serving.RUNS, serving.REFUSED, serving.WRONG) for c in cells.values())
    assert serving.served_formats("qwen3", "llama.cpp") == ("gguf qwen3", "gguf openelm")


def test_docs_print_the_table():
    assert serving.matrix_markdown() in (ROOT / "docs" / "serving.md").read_text()


def test_vllm_layouts_agree_with_the_table():
    """`run_plan.engine_layouts(config, "vllm")` names, for each measured cell, the format the cell ran in (runs) or none;
    `check_servable` refuses the refused cells in one line naming the family and the feature."""
    for family, feature, cell in serving.cells("vllm"):
        config = tiny_config(family, head_dim=32, **dict(cell.config))
        layouts = run_plan.engine_layouts(config, "vllm")
        if cell.status == serving.RUNS:
            assert feature in layouts[cell.via], (family, feature)
            run_plan.check_servable(config, "vllm", {feature})
        else:
            assert not any(feature in states for states in layouts.values()), (family, feature)
            with pytest.raises(VllmExportError, match=f"vLLM cannot serve a {family} cut with {feature}: ") as err:
                run_plan.check_servable(config, "vllm", {feature})
            assert "\n" not in str(err.value)


def test_a_cut_is_served_when_one_format_states_all_its_features():
    """Features combine per format: a Llama cut with a removed attention (nemotron_nas) and per-layer GQA groups
    (prunelight type) has no vLLM layout; llama.cpp's deci states both."""
    config = tiny_config("llama")
    features = {serving.ATTN_REMOVED, serving.KV_PER_LAYER, serving.GROUPS_REMOVED}
    with pytest.raises(VllmExportError, match="vLLM cannot serve a llama cut with") as err:
        check_vllm_shapes(config, features)
    assert "prune.min_groups: 1" in str(err.value)
    run_plan.check_servable(config, "llama.cpp", features)
    with pytest.raises(GgufExportError, match=r"export.gguf cannot write a gemma3_text cut with mlp_per_layer: "
                                              r"llama.cpp's architectures for this model state only \(gemma3: "):
        run_plan.check_servable(tiny_config("gemma3_text"), "llama.cpp", {serving.MLP_PER_LAYER})


def test_shape_features_of_layer_shapes():
    base = LayerShape(4, 2, 96)
    assert serving.shape_features(base, [LayerShape(4, 2, 64)] * 2) == {serving.UNIFORM}
    assert serving.shape_features(base, [LayerShape(2, 1, 64)] * 2) == {serving.UNIFORM, serving.GROUPS_REMOVED}
    assert serving.shape_features(base, [LayerShape(2, 1, 96), LayerShape(4, 2, 64)]) == {
        serving.GROUPS_REMOVED, serving.KV_PER_LAYER, serving.MLP_PER_LAYER}
    assert serving.shape_features(base, [LayerShape(0, 0, 96), LayerShape(4, 2, 0)]) == {
        serving.ATTN_REMOVED, serving.MLP_REMOVED}
