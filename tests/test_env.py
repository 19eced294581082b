"""Offline mode is switched on for local model folders, before the hub libraries need it."""

from __future__ import annotations

import os

from prunelight import _env


def test_offline_set_for_local_folder(tmp_path, monkeypatch):
    for var in _env.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  pretrained: {tmp_path}\n")
    assert _env.offline_if_local(["fit", "--config", str(cfg)])
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_hub_ids_stay_online(monkeypatch):
    for var in _env.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not _env.offline_if_local(["fit", "--model.pretrained=meta-llama/Meta-Llama-3-8B"])
    assert "HF_HUB_OFFLINE" not in os.environ
