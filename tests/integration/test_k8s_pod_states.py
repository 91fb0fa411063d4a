"""Pods as real clusters show them: sidecars, nodes that stop answering, image pulls, scheduling.

The test plays the kubelet, the scheduler and the node controller through the fake API server
(`tests/k8s_fake`); the platform is the real one, through the real `kubernetes` client.
"""

from __future__ import annotations

import logging
import signal
import time

import pytest

from tests.integration.test_k8s_platform import (
    JOB,
    launch_spec,
    make_platform,
    next_event,
    pod_of,
)
from tests.k8s_fake import FakeKubeApiServer

SIDECAR = {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0"}
NODE_LOST_GRACE_SECONDS = 1.0
MARGIN_SECONDS = 5.0


@pytest.fixture
def api():
    with FakeKubeApiServer() as server:
        yield server


@pytest.fixture
def master_pod(api):
    body = {
        "metadata": {"name": f"{JOB}-master", "labels": {"dlrover.io/job": JOB}},
        "spec": {"containers": [{"name": "master", "image": "img:1"}]},
    }
    api.create("pods", body)
    return api.kubelet.run(f"{JOB}-master")


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / ".job_token"
    path.write_text("s3cret-token")
    return str(path)


@pytest.fixture
def started(api, master_pod, token_file):
    """A platform (cleaned up after the test) and a helper that launches and returns a pod."""
    platforms = []

    def start(node_id: int = 1, run: bool = True, node: str = "fake-node-2", **settings):
        platform = make_platform(api, master_pod, **settings)
        platforms.append(platform)
        platform.launch(launch_spec("worker", 0, node_id, token_file))
        name = pod_of(api, "worker", 0, node_id)["metadata"]["name"]
        if run:
            api.kubelet.run(name, node=node)  # not the master's node
        return platform, name

    yield start
    for platform in platforms:
        platform.shutdown(0)


def gone(api, name: str) -> bool:
    return all(p["metadata"]["name"] != name for p in api.pods())


# -- sidecars ---------------------------------------------------------------------------------


def test_a_sidecar_listed_first_neither_hides_an_oom_nor_keeps_the_node_alive(api, started):
    api.sidecars.append(SIDECAR)  # a mesh's webhook puts its proxy before the trainer
    platform, name = started()
    assert [c["name"] for c in api.pod(name)["spec"]["containers"]] == ["istio-proxy", "worker"]

    api.kubelet.oom_kill(name, container="worker")
    assert api.pod(name)["status"]["phase"] == "Running"  # the proxy runs on
    ev = next_event(platform)
    assert (ev.id, ev.exit_code, ev.oom_killed, ev.details["reason"]) == (1, 137, True, "OOMKilled")
    # The pod is deleted: the sidecar does not outlive its node.
    api.wait_for(lambda: gone(api, name), what="the pod with its sidecar deleted")


def test_a_sidecar_that_ends_first_does_not_end_the_node(api, started):
    api.sidecars.append(SIDECAR)
    platform, name = started()
    api.kubelet.exit_container(name, "istio-proxy", 0)
    api.kubelet.exit_container(name, "worker", 3, message="ValueError: bad input")
    ev = next_event(platform)  # the first event is the trainer's: the proxy's end was none
    assert (ev.id, ev.exit_code, ev.oom_killed) == (1, 3, False)
    assert ev.message.splitlines()[-1] == "ValueError: bad input"
    assert platform.events.empty()


# -- nodes that stop answering ------------------------------------------------------------------


def test_a_node_lost_without_disruption_target_ends_the_node_within_the_grace(api, started):
    platform, name = started(node_lost_grace_seconds=NODE_LOST_GRACE_SECONDS)
    lost_at = time.monotonic()
    # Ready=False, no DisruptionTarget, no deletion: as the node controller marks its pods.
    assert api.kubelet.node_not_ready("fake-node-2") == [name]
    api.wait_for(lambda: "NodeNotReady" in platform.troubles().get(1, ""), what="not Ready seen")
    # The master's own verdict (a lost heartbeat) waits for the grace too: a pod deleted from
    # the API now could still run on that node.
    assert platform.signal_node(1, signal.SIGKILL)

    ev = next_event(platform, timeout=NODE_LOST_GRACE_SECONDS + MARGIN_SECONDS)
    took = time.monotonic() - lost_at
    assert NODE_LOST_GRACE_SECONDS <= took <= NODE_LOST_GRACE_SECONDS + MARGIN_SECONDS
    assert (ev.id, ev.exit_code, ev.details["reason"]) == (1, -signal.SIGKILL, "NodeLost")
    assert "not Ready" in ev.message and "DLROVER_K8S_NODE_LOST_GRACE_SECONDS" in ev.message
    # Its pod would stay Terminating for ever on the lost node: force-deleted, after the grace.
    api.wait_for(lambda: gone(api, name), what="the lost node's pod force-deleted")
    deletes = api.served("DELETE", f"/pods/{name}$")
    assert deletes[0][0] >= lost_at + NODE_LOST_GRACE_SECONDS


def test_a_kill_held_back_on_a_node_not_ready_is_made_when_it_is_ready_again(api, started):
    platform, name = started(node_lost_grace_seconds=60)
    api.kubelet.node_not_ready("fake-node-2")
    api.wait_for(lambda: "NodeNotReady" in platform.troubles().get(1, ""), what="not Ready seen")
    assert platform.signal_node(1, signal.SIGKILL)
    assert not api.served("DELETE", f"/pods/{name}$")  # held back while the node is away
    api.kubelet.node_ready("fake-node-2")
    ev = next_event(platform)  # long before the 60 s grace
    assert (ev.id, ev.exit_code, ev.details["reason"]) == (1, -signal.SIGKILL, "Deleted")
    assert [code for _, code in api.served("DELETE", f"/pods/{name}$")] == [200]


def test_a_no_execute_taint_on_a_healthy_node_is_not_a_node_loss(api, started):
    platform, name = started()
    api.kubelet.taint_evict(name)  # DisruptionTarget by the taint manager, node Ready
    ev = next_event(platform)
    # The node's kubelet stopped the container (SIGTERM) and said how it ended.
    assert (ev.id, ev.exit_code) == (1, 143)
    assert ev.details["reason"] != "NodeLost"


# -- image pulls and scheduling ------------------------------------------------------------------


def test_err_image_pull_then_backoff_then_running_is_no_exit(api, started, caplog):
    caplog.set_level(logging.INFO)
    platform, name = started(run=False)
    api.kubelet.err_image_pull(name)
    api.wait_for(lambda: "ErrImagePull" in platform.troubles().get(1, ""), what="ErrImagePull")
    api.kubelet.image_pull_backoff(name)
    api.wait_for(
        lambda: "ImagePullBackOff" in platform.troubles().get(1, ""), what="ImagePullBackOff"
    )
    api.kubelet.run(name)  # the registry answers again
    api.wait_for(lambda: not platform.troubles(), what="the pull state over")

    api.kubelet.exit(name, 0)
    ev = next_event(platform)  # the first event is the real end: no exit, no relaunch before
    assert (ev.id, ev.exit_code) == (1, 0)
    assert platform.events.empty()
    assert [p["metadata"]["name"] for p in api.pods("dlrover.io/role=node")] == [name]
    logged = caplog.text
    for state in ("ErrImagePull", "ImagePullBackOff", "image_pull over"):
        assert state in logged


def test_an_unschedulable_pod_is_reported_with_the_schedulers_message(api, started, caplog):
    why = "0/3 nodes are available: 3 Insufficient cpu. preemption: 0/3 nodes are available."
    platform, name = started(run=False)
    api.kubelet.unschedulable(name, why)
    api.wait_for(lambda: why in platform.troubles().get(1, ""), what="unschedulable reported")
    assert any(why in line and name in line for line in platform.notices())
    assert f"pod {name}: Unschedulable: {why}" in caplog.text
    api.kubelet.run(name)  # the cluster scaled up
    api.wait_for(lambda: not platform.troubles(), what="scheduled at last")
    assert platform.events.empty()
