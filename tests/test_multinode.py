"""Two nodes on one machine: the reference job as two torchrun agents meeting at a c10d rendezvous (gloo, CPU).

Each node is its own `torchrun --nnodes 2 --node_rank N --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT -m
prunelight fit ... --trainer.num_nodes 2` process group with its own working folder, standing in for its own disk:
`export.out_dir` is relative, so a node that wrote outputs shows in its folder. Checkpoints go to one absolute
folder, the shared filesystem a cluster gives its nodes (a resume needs every rank to read the same file).
`tests/dist_probe.RankProbe` writes what each rank holds. The job: prune 20% (flap, global, least-squares refit)
and a few LoRA steps, checkpointing every `EVERY` steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_probe import free_port
from safetensors.torch import load_file

# One group under `pytest -n`: the module-scoped two-node jobs then run once, on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multinode")]

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, HOLD = 6, 2, 4  # the interrupted run stops after its step-4 checkpoint
SAMPLES, SEQ_LEN, CAL_BATCH = 16, 64, 4
NODE_TIMEOUT_S = 300


def _fit_args(shared: Path, out: Path, nproc: int) -> list[str]:
    """`prunelight fit` on the reference config, made short; the same on every node."""
    return [
        "-m", "prunelight", "fit", "--config", str(ROOT / "configs" / "reference.yaml"),
        "--config", str(ROOT / "callbacks" / "checkpoint.yaml"),
        f"--trainer.callbacks.dirpath={out / 'ckpt'}", f"--trainer.callbacks.every_n_train_steps={EVERY}",
        "--trainer.callbacks+=dist_probe.RankProbe", f"--trainer.callbacks.out_dir={out}",
        f"--model.pretrained={shared / 'models' / 'ref-llama-gqa'}",
        f"--data.calibration.path={shared / 'data' / 'wikitext2' / 'valid.txt'}",
        f"--data.eval.path={shared / 'data' / 'wikitext2' / 'test.txt'}",
        f"--data.train.path={shared / 'data' / 'corpus' / 'brown.txt'}", "--data.train.max_tokens=20000",
        f"--data.num_samples={SAMPLES}", f"--data.seq_len={SEQ_LEN}", "--data.batch_size=4",
        f"--data.calibration_batch_size={CAL_BATCH}", "--data.eval_batch_size=8", "--data.max_eval_blocks=8",
        f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.num_nodes=2", f"--trainer.devices={nproc}", "--trainer.strategy=ddp",
        "--export.out_dir=run",  # relative: each node's own folder
    ]


def _start_nodes(shared: Path, out: Path, nproc: int = 1, node1_args: tuple[str, ...] = (),
                 args: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """Both nodes' torchrun agents, node 1 with `node1_args` added (the test's hold), both with `args`."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    nodes = []
    for node in (0, 1):
        cwd = out / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc),
               "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
               "--rdzv_id", f"{out.name}-{port}",
               # node 0 hosts the rendezvous store (both nodes' addresses are 127.0.0.1 here)
               "--rdzv_conf", f"is_host={int(node == 0)}",
               *_fit_args(shared, out, nproc), *args, *(node1_args if node == 1 else ())]
        log = open(out / f"node{node}.log", "ab")
        nodes.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return nodes


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc: torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill(node: subprocess.Popen) -> None:
    """kill -9 of a node: its torchrun agent and every process below it."""
    for pid in [node.pid, *_descendants(node.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait()


def _finish(nodes: list[subprocess.Popen], out: Path) -> None:
    deadline = time.monotonic() + NODE_TIMEOUT_S
    try:
        for node in nodes:
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill(node)
    logs = "\n".join((out / f"node{n}.log").read_text(errors="replace")[-3000:] for n in (0, 1))
    assert [n.returncode for n in nodes] == [0, 0], logs


def _ranks(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _exporting_node(ranks: list[dict]) -> Path:
    return Path(ranks[0]["cwd"])


@pytest.fixture(scope="module")
def straight(shared, ref_model_dir, tmp_path_factory):
    """The uninterrupted two-node job: (folder, per-rank results)."""
    out = tmp_path_factory.mktemp("two_nodes")
    _finish(_start_nodes(shared, out), out)
    return out, _ranks(out, 2)


@pytest.fixture(scope="module")
def one_process(straight, shared):
    """The same calibration samples scored and allocated in this one process, with the run's prune settings."""
    from prunelight.data import PruneDataModule, TextSource
    from prunelight.module import PruneLM
    from prunelight.pipeline import make_plan
    from prunelight.settings import PruneSettings

    out, ranks = straight
    report = json.loads((_exporting_node(ranks) / "run" / "report.json").read_text())
    model = str(shared / "models" / "ref-llama-gqa")
    text = shared / "data" / "wikitext2"
    dm = PruneDataModule(TextSource(path=str(text / "valid.txt")), TextSource(path=str(text / "test.txt")),
                         tokenizer=model, num_samples=SAMPLES, seq_len=SEQ_LEN, calibration_batch_size=CAL_BATCH)
    dm.setup("fit")
    lm = PruneLM(pretrained=model, dtype="float32")
    lm.configure_model()
    plan = make_plan(lm.base_model, dm.calibration_batches(0, 1),
                        PruneSettings(**report["calibration"]["settings"])).plan
    return plan


def test_two_nodes_meet_and_train_as_one_ddp_job(straight):
    out, ranks = straight
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["num_nodes"] == 2 and r["strategy"] == "DDPStrategy" for r in ranks)
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]
    assert {r["cwd"] for r in ranks} == {str(out / "node0"), str(out / "node1")}, "one rank on each node"
    assert all(r["steps"] == STEPS for r in ranks)


def test_the_plan_equals_the_one_process_plan(straight, one_process):
    _, ranks = straight
    assert not one_process.is_identity()
    for r in ranks:
        assert r["plan"]["layers"] == one_process.to_dict()["layers"]
        assert r["plan"]["meta"]["params_removed"] == one_process.meta["params_removed"]
        assert r["plan"]["meta"]["samples"] == SAMPLES  # the ranks' shares add up to the samples


def test_recovered_weights_are_equal_on_both_nodes(straight):
    _, (a, b) = straight
    lora_b = [k for k in a["final"] if "lora_B" in k]
    assert lora_b and any(a["final"][k].abs().sum() > 0 for k in lora_b), "LoRA did not train"
    assert a["final"].keys() == b["final"].keys()
    for k in a["final"]:
        assert torch.equal(a["final"][k], b["final"][k]), k


def test_only_global_rank_zero_writes_the_outputs(straight):
    out, ranks = straight
    exporter = _exporting_node(ranks)
    other = Path(ranks[1]["cwd"])
    assert {p.name for p in (exporter / "run").iterdir()} >= {"report.json", "report.md", "plan.json", "model"}
    assert (exporter / "run" / "model" / "model.safetensors").exists()
    assert not any(other.rglob("*")), f"the node of rank 1 wrote {sorted(map(str, other.rglob('*')))}"
    report = json.loads((exporter / "run" / "report.json").read_text())
    assert report["recovery"]["steps"] == STEPS
    assert set(report["ppl"]) >= {"dense", "pruned", "recovered"}
    # the checkpoints (every EVERY steps and last.ckpt) were written once, into the shared folder
    assert (out / "ckpt" / "last.ckpt").exists()


@pytest.fixture(scope="module")
def killed_and_resumed(shared, ref_model_dir, tmp_path_factory):
    """Node 1 stops after the step-HOLD checkpoint and is killed with -9; then both nodes restart with
    `--ckpt_path last`. Returns (folder, per-rank results of the restarted job, how node 0 ended)."""
    out = tmp_path_factory.mktemp("two_nodes_killed")
    nodes = _start_nodes(shared, out, node1_args=(f"--trainer.callbacks.hold_at_step={HOLD}",))
    deadline = time.monotonic() + NODE_TIMEOUT_S
    while not list(out.glob("held*")) and all(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    held = list(out.glob("held*"))
    if not held:
        for n in nodes:
            _kill(n)
        pytest.fail("node 1 never reached step %d:\n%s" % (HOLD, (out / "node1.log").read_text()[-3000:]))
    _kill(nodes[1])
    t0 = time.monotonic()
    # node 0 is left waiting for its peer in the step's gradient all-reduce: gloo sees the closed connection
    try:
        nodes[0].wait(timeout=60)
        node0 = f"exited with status {nodes[0].returncode} after {time.monotonic() - t0:.1f} s"
    except subprocess.TimeoutExpired:
        _kill(nodes[0])
        node0 = "still waiting after 60 s: killed"
    last = torch.load(out / "ckpt" / "last.ckpt", weights_only=False, map_location="cpu")
    assert last["global_step"] == HOLD
    assert not list(out.glob("rank*.pt")), "the killed job must not have finished"
    # the same command on both nodes again, resuming from the shared folder's last.ckpt
    _finish(_start_nodes(shared, out, args=("--ckpt_path=last",)), out)
    return out, _ranks(out, 2), node0


def test_a_killed_node_and_a_restart_of_both_end_where_the_uninterrupted_job_ends(straight, killed_and_resumed):
    _, want = straight
    out, got, node0 = killed_and_resumed
    print(f"after kill -9 of node 1, node 0 {node0}")
    assert all(r["steps"] == STEPS for r in got)
    for r in got:
        assert r["plan"]["layers"] == want[0]["plan"]["layers"]
        assert r["final"].keys() == want[0]["final"].keys()
        differ = [k for k in want[0]["final"] if not torch.equal(r["final"][k], want[0]["final"][k])]
        assert not differ, f"rank {r['rank']}: resumed weights differ from the uninterrupted job in {differ[:5]}"
    a = load_file(_exporting_node(want) / "run" / "model" / "model.safetensors")
    b = load_file(_exporting_node(got) / "run" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_by_two(shared, ref_model_dir, tmp_path_factory):
    """Two nodes of two processes each: (folder, per-rank results)."""
    if len(os.sched_getaffinity(0)) < 4 and not os.environ.get("PRUNELIGHT_TEST_2X2"):
        pytest.skip(f"two nodes x two processes need 4 cores for 4 training processes, this machine gives "
                    f"{len(os.sched_getaffinity(0))} (PRUNELIGHT_TEST_2X2=1 runs it anyway: about a minute on 2)")
    out = tmp_path_factory.mktemp("two_nodes_two_processes")
    _finish(_start_nodes(shared, out, nproc=2), out)
    return out, _ranks(out, 4)


def test_two_nodes_of_two_processes_give_the_same_plan_and_weights(two_by_two, one_process):
    out, ranks = two_by_two
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and all(r["world_size"] == 4 for r in ranks)
    by_node = {}
    for r in ranks:
        by_node.setdefault(r["cwd"], set()).add(r["node_rank"])
    assert sorted(by_node) == [str(out / "node0"), str(out / "node1")], "two processes on each node"
    assert sorted(r["node_rank"] for r in ranks) == [0, 0, 1, 1]
    for r in ranks:
        assert r["plan"]["layers"] == one_process.to_dict()["layers"]
        for k, v in ranks[0]["final"].items():
            assert torch.equal(r["final"][k], v), (r["rank"], k)
    exporter = _exporting_node(ranks)
    assert (exporter / "run" / "model" / "model.safetensors").exists()
    other = out / ("node1" if exporter.name == "node0" else "node0")
    assert not any(other.rglob("*")), "only the node of global rank 0 writes"
