"""dlrover-run with 2 and 3 agents on this machine sharing one master (gloo on CPU)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from master.rpc.standalone import start_standalone_master
from tests.integration.dlrover_run_helpers import (
    base_env,
    events,
    kill_tree,
    script_args,
    start_launcher,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def master(tmp_path):
    server, port, token = start_standalone_master(token="multi-agent-token")
    token_file = tmp_path / "token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    yield f"127.0.0.1:{port}", str(token_file)
    server.stop(grace=None)


class Agents:
    """Launchers started by one test; every one is killed (whole session) at the end."""

    def __init__(self, tmp_path, master, nnodes: str, extra_flags: list[str], argv: list[str]):
        self.tmp = tmp_path
        self.addr, self.token_file = master
        self.nnodes, self.extra, self.argv = nnodes, extra_flags, argv
        self.procs = []

    def start(self, node_rank: int, **env_extra: str):
        flags = [
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            "1",
            "--master-addr",
            self.addr,
            "--local-addr",
            "127.0.0.1",
            "--node-rank",
            str(node_rank),
            "--rdzv-id",
            "multi",
            "--rdzv-conf",
            "lease_timeout=3,last_call_timeout=1",
            *self.extra,
        ]
        env = base_env(DLROVER_JOB_TOKEN_FILE=self.token_file, **env_extra)
        proc = start_launcher(flags, self.argv, self.tmp / f"agent{node_rank}.log", env)
        self.procs.append(proc)
        return proc

    def log(self, node_rank: int) -> str:
        return (self.tmp / f"agent{node_rank}.log").read_text()

    def wait(self, proc, timeout: float = 150) -> int:
        return proc.wait(timeout)

    def close(self):
        for p in self.procs:
            kill_tree(p)


@pytest.fixture
def agents(tmp_path, master):
    made = []

    def make(nnodes: str, extra_flags: list[str], argv: list[str]) -> Agents:
        a = Agents(tmp_path, master, nnodes, extra_flags, argv)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def _steps(tmp_path, world: int) -> int:
    """The highest step reached by a group of `world` ranks."""
    return max(
        (e["step"] for e in events(tmp_path) if e["event"] == "step" and e["world"] == world),
        default=0,
    )


def _done_ranks(tmp_path, steps: int, world: int) -> list[int]:
    return sorted(
        e["rank"]
        for e in events(tmp_path)
        if e["event"] == "done" and e["step"] == steps and e["world"] == world
    )


def test_worker_sigkill_two_agents_restart_and_resume(tmp_path, agents):
    argv = script_args(tmp_path, "--steps", "30", "--kill-at-step", "6", "--step-seconds", "0.05")
    group = agents("2", ["--max-restarts", "1"], argv)
    p0, p1 = group.start(0), group.start(1)
    assert group.wait(p0) == 0, group.log(0)[-3000:]
    assert group.wait(p1) == 0, group.log(1)[-3000:]
    assert _done_ranks(tmp_path, 30, 2) == [0, 1]
    second = [e for e in events(tmp_path) if e["event"] == "loop" and e["step"] > 0]
    assert sorted(e["rank"] for e in second) == [0, 1]
    assert all(e["step"] >= 5 for e in second)
    # Node 1 lost a worker (its restart counts); node 0 only followed the membership change.
    # (Node 0 sees it either as nodes waiting or as its own workers failing after the peer's.)
    assert "[worker_failure]" in group.log(1)
    assert "[membership]" in group.log(0) and "[worker_failure]" not in group.log(0)


def test_script_error_on_one_node_spends_one_restart_in_all(tmp_path, agents):
    argv = script_args(tmp_path, "--steps", "20", "--exit-at-step", "5", "--step-seconds", "0.05")
    group = agents("2", ["--max-restarts", "1"], argv)
    p0, p1 = group.start(0), group.start(1)
    assert group.wait(p0) == 0, group.log(0)[-3000:]
    assert group.wait(p1) == 0, group.log(1)[-3000:]
    assert _done_ranks(tmp_path, 20, 2) == [0, 1]
    # Rank 1 exited with code 3 (a script error); rank 0 died of the broken connection. The
    # first node to report a failure in the round is charged (usually node 1; node 0 when its
    # agent noticed first); the other re-rendezvous as for a membership change.
    charged = [r for r in (0, 1) if "[worker_failure]" in group.log(r)]
    assert len(charged) == 1, [group.log(0)[-2000:], group.log(1)[-2000:]]
    assert "[membership]" in group.log(1 - charged[0])
    done = {e["rank"]: e["restart"] for e in events(tmp_path) if e["event"] == "done"}
    assert sum(done.values()) == 1, done  # TORCHELASTIC_RESTART_COUNT: one restart spent


def test_agent_sigkill_survivor_continues_at_smaller_world(tmp_path, agents):
    argv = script_args(tmp_path, "--steps", "60", "--step-seconds", "0.1")
    group = agents("1:2", ["--max-restarts", "0"], argv)
    p0, p1 = group.start(0), group.start(1)
    wait_for(lambda: _steps(tmp_path, 2) >= 5, 120, "both agents training at world size 2")
    os.kill(p1.pid, signal.SIGKILL)  # the agent only: its workers die with it (PDEATHSIG)
    assert group.wait(p0) == 0, group.log(0)[-3000:]
    assert _done_ranks(tmp_path, 60, 1) == [0]
    resumed = [e for e in events(tmp_path) if e["event"] == "loop" and e["world"] == 1]
    assert resumed and resumed[0]["step"] >= 4
    # max_restarts is 0: continuing at all shows the node loss was not charged as a restart.
    assert "peer node restarted or was lost" in group.log(0)


@pytest.mark.slow
def test_third_agent_joins_and_the_world_grows(tmp_path, agents):
    argv = script_args(tmp_path, "--steps", "70", "--step-seconds", "0.1")
    group = agents("2:3", ["--max-restarts", "0"], argv)
    procs = [group.start(0), group.start(1)]
    wait_for(lambda: _steps(tmp_path, 2) >= 5, 120, "two agents training at world size 2")
    procs.append(group.start(2))
    for rank, p in enumerate(procs):
        assert group.wait(p) == 0, group.log(rank)[-3000:]
    assert _done_ranks(tmp_path, 70, 3) == [0, 1, 2]
    grown = [e for e in events(tmp_path) if e["event"] == "loop" and e["world"] == 3]
    assert min(e["step"] for e in grown) >= 4
    assert "re-rendezvous for new nodes" in group.log(0)


@pytest.mark.slow
def test_hung_rank_on_one_of_two_agents_restarts_the_group(tmp_path, agents):
    argv = script_args(tmp_path, "--steps", "25", "--hang-at-step", "5", "--step-seconds", "0.05")
    group = agents("2", ["--max-restarts", "1", "--hang-timeout", "4"], argv)
    p0, p1 = group.start(0), group.start(1)
    assert group.wait(p0) == 0, group.log(0)[-3000:]
    assert group.wait(p1) == 0, group.log(1)[-3000:]
    assert "[hang] local rank 0 reported no step" in group.log(1)
    assert _done_ranks(tmp_path, 25, 2) == [0, 1]


@pytest.mark.slow
def test_node_check_excludes_a_straggler_and_reports_to_the_master(tmp_path, agents, master):
    argv = script_args(tmp_path, "--steps", "10")
    flags = ["--network-check", "--exclude-straggler", "--straggler-ratio", "3"]
    group = agents("1:2", flags, argv)
    p0 = group.start(0)
    p1 = group.start(1, DLROVER_NODE_CHECK_DELAY="5")  # its compute takes 5 s longer
    assert group.wait(p1) == 3, group.log(1)[-3000:]
    assert "the node check excluded this node" in group.log(1)
    assert group.wait(p0) == 0, group.log(0)[-3000:]
    assert _done_ranks(tmp_path, 10, 1) == [0]
    # Both nodes reported what they saw to the master's KV store.
    from master.client import KVClient, MasterClient

    addr, token_file = master
    client = MasterClient(addr, open(token_file).read())
    try:
        kv = KVClient(client)
        for rank in (0, 1):
            raw = kv.get(f"dlrover/node_check/multi/0/{rank}".encode(), 5)
            assert raw is not None
            report = json.loads(raw)
            assert report["stragglers"] == [1] and report["faulty"] == []
    finally:
        client.close()
