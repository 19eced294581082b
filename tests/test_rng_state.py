"""Random states per rank: each rank saves and restores its own streams; other world sizes and old checkpoints load."""

from __future__ import annotations

import logging
import random
import socket

import numpy as np
import pytest
import torch

from prunelight import distributed, rng_state


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _draws() -> list[float]:
    """One draw from each stream a training step uses (torch CPU, Python, NumPy)."""
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _states_and_draws(seed: int) -> tuple[dict, list[float]]:
    """The states of a rank seeded with `seed`, and what it draws next from them."""
    _seed(seed)
    states = rng_state.current()
    return states, _draws()


def _as_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(distributed, "rank_and_world_size", lambda: (rank, world))


def test_gather_puts_every_ranks_states_at_its_global_rank(monkeypatch):
    """On rank 1 of 2 the checkpoint's list holds rank 0's states first, this rank's second."""
    rank0, _ = _states_and_draws(0)
    _as_rank(monkeypatch, 1, 2)

    def fake_all_gather(out: list, obj) -> None:  # torch.distributed.all_gather_object as rank 1 sees it
        out[:] = [rank0, obj]

    monkeypatch.setattr(torch.distributed, "all_gather_object", fake_all_gather)
    _seed(1)
    gathered = rng_state.gather()
    draws = _draws()
    assert len(gathered) == 2 and gathered[0] is rank0
    rng_state.restore(gathered)
    assert _draws() == draws, "rank 1 continues its own streams"


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_restores_its_own_entry_not_rank_zeros(monkeypatch, rank):
    saved = [_states_and_draws(seed) for seed in (10, 11)]
    assert saved[0][1] != saved[1][1]
    _as_rank(monkeypatch, rank, 2)
    _seed(99)  # the resumed process starts from other streams
    rng_state.restore([states for states, _ in saved])
    assert _draws() == saved[rank][1]


def test_a_rank_past_the_saved_list_keeps_its_streams_and_the_change_is_said_once(monkeypatch, caplog):
    """Resumed on 4 processes from a 2-process checkpoint: ranks 2 and 3 keep their seeded streams, no IndexError."""
    saved = [_states_and_draws(seed)[0] for seed in (10, 11)]
    _as_rank(monkeypatch, 3, 4)
    _, fresh = _states_and_draws(7)
    _seed(7)
    with caplog.at_level(logging.WARNING, logger="prunelight.rng_state"):
        rng_state.restore(saved)
    assert _draws() == fresh
    assert not caplog.records, "only rank 0 says it"
    _as_rank(monkeypatch, 0, 4)
    with caplog.at_level(logging.WARNING, logger="prunelight.rng_state"):
        rng_state.restore(saved)
    (record,) = caplog.records
    assert "2 process(es), this run has 4" in record.getMessage() and "\n" not in record.getMessage()


def test_fewer_processes_restore_their_entries(monkeypatch):
    """Resumed on 1 process from a 2-process checkpoint: rank 0 continues rank 0's streams."""
    saved = [_states_and_draws(seed) for seed in (10, 11)]
    _as_rank(monkeypatch, 0, 1)
    _seed(99)
    rng_state.restore([states for states, _ in saved])
    assert _draws() == saved[0][1]


def test_an_old_single_process_checkpoint_still_restores():
    """Before per-rank states the checkpoint held one dict, its CUDA entry every device's state."""
    states, draws = _states_and_draws(5)
    old = {**states, "cuda": [torch.zeros(16, dtype=torch.uint8)]}  # ignored where CUDA does not run
    _seed(99)
    rng_state.restore(old)
    assert _draws() == draws


def test_the_checkpoint_holds_the_gathered_list(monkeypatch):
    """save_checkpoint_state stores what every rank gathered; load_checkpoint_state hands it to the first training step."""
    from prunelight import module as checkpoint_state
    from prunelight.module import PruneLM
    from prunelight.testing import tiny_config

    module = PruneLM(config=tiny_config("llama").to_dict(), recovery="full", attn_implementation="eager")
    module.configure_model()
    per_rank = [_states_and_draws(seed)[0] for seed in (10, 11)]
    monkeypatch.setattr(rng_state, "gather", lambda: per_rank)
    checkpoint: dict = {}
    checkpoint_state.save_checkpoint_state(module, checkpoint)
    assert checkpoint[checkpoint_state.CKPT_KEY]["rng"] is per_rank
    checkpoint_state.load_checkpoint_state(module, checkpoint)
    assert module._rng_to_restore is per_rank


# --- two real processes (gloo on CPU) ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, out: str) -> None:
    """Seed per rank, gather, draw; scramble the streams, restore from the gathered list, draw again."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        _seed(100 + rank)
        gathered = rng_state.gather()
        expected = _draws()
        _seed(12345)  # the same fresh streams on both ranks, as after a restart
        rng_state.restore(gathered)
        torch.save({"n": len(gathered), "expected": expected, "restored": _draws()}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_two_gloo_processes_each_restore_their_own_streams(tmp_path):
    # fork: the workers start with this process's imports (a spawned one would import transformers again, seconds)
    torch.multiprocessing.start_processes(_gloo_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True,
                                          start_method="fork")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert all(r["n"] == 2 for r in results)
    assert results[0]["expected"] != results[1]["expected"], "each rank has its own streams"
    for r in results:
        assert r["restored"] == r["expected"]
