"""Reading node pods: the trainer container by name, nodes not Ready, troubles and their limits,
and which pods of a rank may still run."""

from __future__ import annotations

import logging
import signal
import threading

from master.platform.k8s_pod_end import node_not_ready, pod_end
from master.platform.k8s_pod_trouble import PodTroubles, TroubleKind, pod_trouble
from master.platform.k8s_rank_pods import RankPods


def container(name: str, **state) -> dict:
    return {"name": name, "state": state}


def pod(
    *statuses: dict,
    phase: str = "Running",
    conditions: list | None = None,
    name: str = "job-worker-1-7",
    rank: str = "1",
    version: int = 1,
    deleting: bool = False,
) -> dict:
    meta = {
        "name": name,
        "uid": "u-" + name,
        "resourceVersion": str(version),
        "labels": {"dlrover.io/node-type": "worker", "dlrover.io/rank": rank},
    }
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    status = {"phase": phase, "containerStatuses": list(statuses), "conditions": conditions or []}
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": status}


def cond(kind: str, status: str, reason: str = "", message: str = "") -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message}


RUNNING = {"running": {"startedAt": "x"}}
OOM = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
READY = [cond("Ready", "True"), cond("ContainersReady", "True")]


def test_the_trainer_is_found_by_name_behind_a_sidecar():
    p = pod(container("istio-proxy", **RUNNING), container("worker", **OOM), conditions=READY)
    end = pod_end(p, "worker")
    assert (end.exit_code, end.oom_killed, end.reason, end.force_delete) == (
        137,
        True,
        "OOMKilled",
        True,  # the sidecar runs on: the pod is deleted
    )
    # The sidecar's own end is not the node's.
    proxy_done = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    assert (
        pod_end(
            pod(container("istio-proxy", **proxy_done), container("worker", **RUNNING)), "worker"
        )
        is None
    )
    # Both ended, the proxy first in the list: the trainer's code counts.
    failed = pod(container("istio-proxy", **proxy_done), container("worker", **OOM), phase="Failed")
    assert pod_end(failed, "worker").oom_killed


def test_a_node_not_ready_is_told_from_a_container_not_ready():
    marked = [cond("Ready", "False"), cond("ContainersReady", "True")]  # the node controller
    assert node_not_ready({"conditions": marked})
    unready = [cond("Ready", "False"), cond("ContainersReady", "False")]  # the kubelet
    assert not node_not_ready({"conditions": unready})
    assert not node_not_ready({"conditions": READY})
    assert not node_not_ready({"conditions": []})  # not started yet


def test_a_taint_manager_deletion_is_a_loss_only_on_a_node_not_ready():
    taint = cond("DisruptionTarget", "True", "DeletionByTaintManager")
    healthy = pod(container("worker", **RUNNING), conditions=[*READY, taint], deleting=True)
    assert pod_end(healthy, "worker") is None  # the kubelet stops it and says how
    lost_conditions = [cond("Ready", "False"), cond("ContainersReady", "True"), taint]
    lost = pod(container("worker", **RUNNING), conditions=lost_conditions, deleting=True)
    end = pod_end(lost, "worker")
    assert (end.exit_code, end.reason, end.node_lost, end.force_delete) == (
        -signal.SIGKILL,
        "NodeLost",
        True,
        True,
    )


def test_troubles_are_read_from_the_pod():
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "i"'}}
    pulling = pod(container("worker", **waiting), phase="Pending")
    assert pod_trouble(pulling).kind == TroubleKind.IMAGE_PULL
    assert pod_end(pulling, "worker") is None  # a state, not an exit
    why = "0/3 nodes are available: 3 Insufficient cpu."
    pending = pod(phase="Pending", conditions=[cond("PodScheduled", "False", "Unschedulable", why)])
    trouble = pod_trouble(pending)
    assert trouble.kind == TroubleKind.UNSCHEDULABLE and why in trouble.line()
    not_ready = pod(
        container("worker", **RUNNING),
        conditions=[cond("Ready", "False"), cond("ContainersReady", "True")],
    )
    assert pod_trouble(not_ready).kind == TroubleKind.NODE_NOT_READY
    assert pod_trouble(pod(container("worker", **RUNNING), conditions=READY)) is None


def test_a_trouble_ends_the_node_only_past_its_limit_and_not_once_over():
    expired = []
    done = threading.Event()

    def on_expired(name, trouble, seconds):
        expired.append((name, trouble.kind, seconds))
        done.set()

    lines = []
    troubles = PodTroubles(
        {TroubleKind.IMAGE_PULL: 0.2, TroubleKind.NODE_NOT_READY: 60},
        on_expired,
        note=lambda level, line: lines.append((level, line)),
    )
    waiting = {"waiting": {"reason": "ErrImagePull", "message": "no such tag"}}
    troubles.observe("a", pod_trouble(pod(container("worker", **waiting), phase="Pending")))
    over = {"waiting": {"reason": "ImagePullBackOff", "message": "back-off"}}
    troubles.observe("b", pod_trouble(pod(container("worker", **over), phase="Pending")))
    troubles.observe("b", None)  # b pulled its image
    assert done.wait(5)
    assert [(n, k) for n, k, _ in expired] == [("a", TroubleKind.IMAGE_PULL)]
    assert expired[0][2] >= 0.2
    assert any("b: image_pull over" in line for _, line in lines)
    assert troubles.current() == {}
    troubles.close()
    assert lines[0][0] == logging.WARNING


def test_rank_pods_ignore_stale_reads_and_count_lost_pods_out():
    pods = RankPods()
    old = pod(container("worker", **RUNNING), name="job-worker-1-7", version=5)
    pods.replace_all([old])
    assert pods.synced and [p.name for p in pods.may_run("worker", "1")] == ["job-worker-1-7"]
    pods.update(pod(name="job-worker-1-7", version=9), deleted=True)
    pods.update(old)  # a list answered before the deletion, read late
    assert pods.may_run("worker", "1") == []
    other = pod(container("worker", **RUNNING), name="job-worker-1-8", version=10)
    pods.update(other)
    assert pods.may_run("worker", "1", exclude="job-worker-1-8") == []
    pods.mark_lost("job-worker-1-8")
    assert pods.may_run("worker", "1") == []
    assert pods.wait_gone(["job-worker-1-8"], timeout=0.1) == []
    ended = pod(container("worker", **OOM), name="job-worker-2-9", rank="2", phase="Failed")
    pods.update(ended)
    assert pods.may_run("worker", "2") == []
