"""Shared fixtures: tiny random GQA models of each family, and the ../shared data when present."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

from prunelight.testing import FAMILIES, shared_dir, tiny_model


def pytest_collection_modifyitems(config, items) -> None:
    """Run the tests marked slow first: under `pytest -n 2` they then overlap with the rest instead of ending the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny(family):
    return tiny_model(family)


@pytest.fixture(scope="session")
def shared() -> Path:
    path = shared_dir()
    if path is None:
        pytest.skip("reference data not found: set PRUNELIGHT_SHARED to the shared/ folder (../shared beside the repo)")
    return path


@pytest.fixture(scope="session")
def ref_model_dir(shared) -> Path:
    path = shared / "models" / "ref-llama-gqa"
    if not (path / "model.safetensors").exists():
        pytest.skip(f"reference model not found at {path}")
    return path
