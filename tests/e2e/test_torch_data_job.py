"""Torch jobs whose data survives restarts: examples/torch/files_train.py (DDP on gloo, the
ElasticDistributedSampler, a fixed global batch, snapshots every few steps) under dlrover-run,
with a rank crashing once, and with the world shrinking 2 -> 1 and growing back to 2. From the
ids each rank logs after each step, every record of each epoch is trained exactly once (the steps
an attempt took after the snapshot the next one restored are dropped, as the model drops them),
and the loss curve of the elastic run is the fault-free run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from master.rpc.standalone import start_standalone_master
from tests.integration.dlrover_run_helpers import (
    base_env,
    kill_tree,
    run_launcher,
    start_launcher,
    wait_for,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "torch", "files_train.py")
RECORDS, EPOCHS = 2048, 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    subprocess.run(
        [sys.executable, TRAIN, "--make-data", str(folder), "--records", str(RECORDS)],
        check=True,
        env=base_env(),
    )
    return str(folder / "*.txt")


def train_args(tmp_path, data, *extra: str) -> list[str]:
    return [
        TRAIN,
        "--data",
        data,
        "--epochs",
        str(EPOCHS),
        "--ckpt",
        str(tmp_path / "ckpt.pt"),
        "--ids-log",
        str(tmp_path / "ids.jsonl"),
        "--loss-log",
        str(tmp_path / "loss.jsonl"),
        *extra,
    ]


def read(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path).read().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # being written
    return out


def kept_ids(records: list[dict]) -> dict[int, list[int]]:
    """Per epoch, the ids the final model trained on: each step as the group that started last
    among those that logged it trained it (a later group restored an earlier snapshot and
    trained the steps after it again)."""
    started = {}
    for r in records:
        if r["event"] == "start":
            started[r["group"]] = min(r["t"], started.get(r["group"], r["t"]))
    by_step: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["event"] == "step":
            by_step[r["step"]][r["group"]].append(r)
    kept: dict[int, list[int]] = defaultdict(list)
    for groups in by_step.values():
        last = max(groups, key=lambda g: started[g])
        for r in groups[last]:
            kept[r["epoch"]] += r["ids"]
    return kept


def assert_every_record_once_per_epoch(tmp_path) -> list[dict]:
    records = read(tmp_path / "ids.jsonl")
    kept = kept_ids(records)
    assert sorted(kept) == list(range(EPOCHS))
    for epoch, ids in kept.items():
        assert sorted(ids) == list(range(RECORDS)), f"epoch {epoch}: {len(ids)} ids"
    return records


def losses(tmp_path) -> dict[int, float]:
    """Rank 0's loss per step; a step trained again after a restore: its last value."""
    return {r["step"]: r["loss"] for r in read(tmp_path / "loss.jsonl")}


@pytest.mark.parametrize(
    "launcher, snapshot",
    [("dlrover-run", "torch.save"), ("dlrover-run", "flash"), ("torchrun", "torch.save")],
)
def test_a_rank_crashing_once_trains_every_record_once_per_epoch(
    tmp_path, data, launcher, snapshot
):
    extra = ["--crash-at-step", "13", "--ckpt-every", "5"]
    if snapshot == "flash":
        extra += ["--flash", str(tmp_path / "flash")]
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    argv = train_args(tmp_path, data, *extra)
    if launcher == "dlrover-run":
        out = run_launcher(flags, argv, timeout=180)
    else:  # plain torchrun, no master; a fresh store per restart (DESIGN: environment facts)
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *flags, *argv],
            env=base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=180,
        )
    assert out.returncode == 0, out.stdout[-4000:]
    records = assert_every_record_once_per_epoch(tmp_path)
    resumed = {r["step"] for r in records if r["event"] == "start" and r["step"] > 0}
    assert resumed and resumed <= {10}, resumed  # the snapshot of step 10, mid-epoch 0


@pytest.fixture
def master(tmp_path):
    server, port, token = start_standalone_master(token="data-job-token")
    token_file = tmp_path / "token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_the_world_shrinking_and_growing_keeps_records_and_the_loss_curve(tmp_path, data, master):
    log = tmp_path / "ids.jsonl"
    argv = train_args(tmp_path, data, "--ckpt-every", "3", "--step-seconds", "0.2")
    env = base_env(DLROVER_JOB_TOKEN_FILE=str(tmp_path / "token"))
    procs = []

    def start(node_rank: int):
        flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", master]
        flags += ["--local-addr", "127.0.0.1", "--node-rank", str(node_rank)]
        flags += ["--rdzv-id", "data", "--rdzv-conf", "lease_timeout=3,last_call_timeout=3"]
        # A group that stops stepping (seen once on a loaded machine: a new round's workers
        # never got past their start) is restarted from the snapshot after 30 s.
        flags += ["--max-restarts", "3", "--hang-timeout", "30"]
        proc = start_launcher(flags, argv, tmp_path / f"agent{node_rank}-{len(procs)}.log", env)
        procs.append(proc)
        return proc

    def steps_at(world: int) -> int:
        steps = [r["step"] for r in read(log) if r["event"] == "step" and r["world"] == world]
        return max(steps, default=0)

    try:
        start(0)
        first = start(1)
        wait_for(lambda: steps_at(2) >= 6, 120, "two nodes training")
        kill_tree(first)  # node 1 lost: node 0 goes on alone from the last snapshot
        wait_for(lambda: steps_at(1) > 0, 120, "one node training")
        again = start(1)  # node 1 back: the world grows to 2 again
        assert again.wait(150) == 0, (tmp_path / "agent1-2.log").read_text()[-3000:]
        assert procs[0].wait(60) == 0, (tmp_path / "agent0-0.log").read_text()[-3000:]
    finally:
        for p in procs:
            kill_tree(p)
    records = assert_every_record_once_per_epoch(tmp_path)
    worlds = [r["world"] for r in sorted(records, key=lambda r: r.get("t", 0)) if "t" in r]
    assert worlds[:2] == [2, 2] and 1 in worlds and worlds[-1] == 2, worlds
    elastic = losses(tmp_path)

    # The same job without faults at world size 2: the same loss at every step (the global
    # batch holds the same records at any world size; only float rounding differs).
    reference = tmp_path / "reference"
    reference.mkdir()
    out = run_launcher(
        ["--standalone", "--nproc-per-node", "2"],
        train_args(reference, data),
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    fault_free = losses(reference)
    assert sorted(elastic) == sorted(fault_free) == list(range(1, len(fault_free) + 1))
    for step, loss in fault_free.items():
        assert abs(elastic[step] - loss) <= 1e-4 * max(1.0, loss), (step, elastic[step], loss)


def test_a_job_on_the_masters_shards_loses_a_dataloader_worker_and_trains_each_record_once(
    tmp_path, data
):
    """Through `dlrover submit`: one rank reads the master's shards of the files with two
    DataLoader workers; one is killed at step 23, the rank fails, dlrover-run restarts it, and it
    restores model and data from the snapshot of step 20."""
    import yaml

    command = ["python", "-m", "dlrover_torch.run", "--nnodes", "1", "--nproc-per-node", "1"]
    command += ["--max-restarts", "2", *train_args(tmp_path, data, "--sharded")]
    command += ["--kill-loader-worker-at-step", "23", "--ckpt-every", "10"]
    job = {
        "name": "torch-sharded",
        "command": command,
        "workdir": str(tmp_path),
        "env": {"OMP_NUM_THREADS": "1"},
        "worker": {"replicas": 1, "max_relaunches": 0},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    summary = tmp_path / "summary.json"
    out = subprocess.run(
        [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
        + ["--summary-json", str(summary), "--run-dir", str(tmp_path / "run")],
        cwd=ROOT,
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert json.loads(summary.read_text())["status"] == "succeeded"
    records = read(tmp_path / "ids.jsonl")
    starts = [r["step"] for r in records if r["event"] == "start"]
    assert starts == [0, 20], starts
    kept = kept_ids(records)[-1]
    assert sorted(kept) == sorted(list(range(RECORDS)) * EPOCHS)
