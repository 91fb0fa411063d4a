"""A process's heartbeat outlives the datasets that started it: a node that goes on after its
data ends (a chief's final evaluation) keeps beating, once per process and identity."""

from __future__ import annotations

import time

from master.client import process_heartbeat
from tests.integration.conftest import TOKEN


def _env(harness, i: int) -> dict[str, str]:
    node = harness.nodes[i]
    return {
        "DLROVER_MASTER_ADDR": harness.addr,
        "DLROVER_JOB_TOKEN": TOKEN,
        "DLROVER_NODE_TYPE": node.type,
        "DLROVER_NODE_RANK": str(node.rank),
        "DLROVER_NODE_ID": str(node.id),
    }


def _last_beat(harness, i: int) -> float:
    return harness.job.nodes.get(harness.nodes[i].id).last_heartbeat


def test_one_beat_per_process_and_identity_kept_after_its_users_are_gone(harness):
    first = process_heartbeat(_env(harness, 0))
    try:
        assert first is not None and first.is_alive()
        assert process_heartbeat(_env(harness, 0)) is first  # a second dataset shares it
        node = harness.job.nodes.get(harness.nodes[0].id)
        assert node.registered
        seen = _last_beat(harness, 0)
        deadline = time.monotonic() + 10
        while _last_beat(harness, 0) <= seen:  # it goes on beating with nobody holding it
            assert time.monotonic() < deadline, "no heartbeat after registration"
            time.sleep(0.05)
        # Another identity in this process (a promoted standby): its own beat, the old stops.
        second = process_heartbeat(_env(harness, 1))
        assert second is not None and second is not first
        first.join(timeout=10)
        assert not first.is_alive()
        assert harness.job.nodes.get(harness.nodes[1].id).registered
    finally:
        for beat in (first, process_heartbeat(_env(harness, 1))):
            if beat is not None:
                beat.stop()


def test_no_node_in_the_environment_no_beat(harness):
    env = _env(harness, 0)
    del env["DLROVER_NODE_TYPE"], env["DLROVER_NODE_RANK"], env["DLROVER_NODE_ID"]
    assert process_heartbeat(env) is None
