"""The test plays the kubelet (and the node controller): it moves pods through their lives.

Every change goes through the store, so the platform sees it exactly as it would see a real
kubelet's status update: a MODIFIED event on its watch (and Events for the reasons).
"""

from __future__ import annotations

import copy
from typing import Any

from tests.k8s_fake.store import BATCH, CORE, ObjectStore, now_rfc3339, terminate_containers

FAKE_NODE = "fake-node-1"


class FakeKubelet:
    """Status transitions of pods in one namespace, the way kubelet and controllers write them."""

    def __init__(self, store: ObjectStore, namespace: str = "default") -> None:
        self.store = store
        self.namespace = namespace

    def _update(self, name: str, mutate) -> dict[str, Any]:
        return self.store.update(CORE, "pods", self.namespace, name, mutate)

    def schedule(self, name: str) -> dict[str, Any]:
        """Bind the pod to a node (it stays Pending until run())."""

        def mutate(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = FAKE_NODE

        return self._update(name, mutate)

    def run(self, name: str) -> dict[str, Any]:
        """Scheduled, image pulled, container started: phase Running."""
        now = now_rfc3339()

        def mutate(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = FAKE_NODE
            pod["status"] = {
                "phase": "Running",
                "hostIP": "10.0.0.1",
                "podIP": f"10.244.0.{sum(name.encode()) % 250 + 1}",
                "startTime": now,
                "qosClass": pod["status"].get("qosClass", "BestEffort"),
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": now},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                ],
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c.get("image", ""),
                        "imageID": "",
                        "ready": True,
                        "restartCount": 0,
                        "started": True,
                        "state": {"running": {"startedAt": now}},
                    }
                    for c in pod["spec"].get("containers", [])
                ],
            }

        return self._update(name, mutate)

    def exit(self, name: str, exit_code: int, reason: str = "", message: str = "") -> dict:
        """The container ended by itself: Succeeded with 0, Failed otherwise."""
        reason = reason or ("Completed" if exit_code == 0 else "Error")
        pod = self._update(name, lambda p: terminate_containers(p, exit_code, reason, message))
        return pod

    def oom_kill(self, name: str) -> dict[str, Any]:
        """The kernel OOM killer ended the container (cgroup memory limit)."""
        return self.exit(name, 137, reason="OOMKilled")

    def evict(self, name: str, message: str = "") -> dict[str, Any]:
        """Node-pressure eviction by the kubelet: Failed with reason Evicted."""
        message = message or "The node was low on resource: memory. Threshold quantity: 100Mi."

        def mutate(pod: dict[str, Any]) -> None:
            terminate_containers(pod, 137, "ContainerStatusUnknown", "")
            pod["status"]["phase"] = "Failed"
            pod["status"]["reason"] = "Evicted"
            pod["status"]["message"] = message
            pod["status"]["conditions"].append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": message,
                    "lastTransitionTime": now_rfc3339(),
                }
            )

        # The kubelet's eviction manager records the event before it kills the pod, so the
        # event exists by the time a watcher sees the pod fail.
        self.record_event(name, "Evicted", message)
        pod = self._update(name, mutate)
        return pod

    def node_lost(self, name: str) -> dict[str, Any]:
        """The node went away: the taint manager deletes the pod, no kubelet ever confirms."""
        self.store.unreachable.add((self.namespace, name))

        def mutate(pod: dict[str, Any]) -> None:
            for cond in pod["status"].get("conditions", []):
                if cond["type"] == "Ready":
                    cond["status"] = "Unknown"
                    cond["reason"] = "NodeStatusUnknown"
            pod["status"].setdefault("conditions", []).append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "DeletionByTaintManager",
                    "message": "Taint manager: deleting due to NoExecute taint",
                    "lastTransitionTime": now_rfc3339(),
                }
            )

        self._update(name, mutate)
        self.record_event(name, "NodeNotReady", "Node is not ready", kind="Warning")
        return self.store.delete(CORE, "pods", self.namespace, name, grace_seconds=30)

    def image_pull_backoff(self, name: str, image: str = "") -> dict[str, Any]:
        """The image cannot be pulled: the pod stays Pending with a waiting container."""
        message = f'Back-off pulling image "{image or "?"}"'

        def mutate(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = FAKE_NODE
            pod["status"]["containerStatuses"] = [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"waiting": {"reason": "ImagePullBackOff", "message": message}},
                }
                for c in pod["spec"].get("containers", [])
            ]

        pod = self._update(name, mutate)
        self.record_event(name, "Failed", message)
        return pod

    def record_event(self, pod_name: str, reason: str, message: str, kind: str = "Warning"):
        """A core/v1 Event about the pod, as kubelet and controllers write them."""
        pod = self.store.get(CORE, "pods", self.namespace, pod_name)
        now = now_rfc3339()
        return self.store.create(
            CORE,
            "events",
            self.namespace,
            {
                "metadata": {"generateName": pod_name + "."},
                "involvedObject": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod_name,
                    "namespace": self.namespace,
                    "uid": pod["metadata"]["uid"],
                },
                "reason": reason,
                "message": message,
                "type": kind,
                "count": 1,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "source": {"component": "kubelet", "host": FAKE_NODE},
            },
        )


class FakeJobController:
    """Plays the Job controller for one step at a time: the test says when a Job gets a pod.

    `start_pod` makes the pod the way the controller does: from the Job's template (with the
    labels the API server put there), named `<job>-<random>`, controlled by the Job.
    """

    def __init__(self, store: ObjectStore, namespace: str = "default") -> None:
        self.store = store
        self.namespace = namespace

    def start_pod(self, job_name: str) -> dict[str, Any]:
        job = self.store.get(BATCH, "jobs", self.namespace, job_name)
        template = copy.deepcopy(job["spec"]["template"])
        meta = template.get("metadata") or {}
        body = {
            "metadata": {
                "generateName": f"{job_name}-",
                "labels": dict(meta.get("labels") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": BATCH,
                        "kind": "Job",
                        "name": job_name,
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template["spec"],
        }
        return self.store.create(CORE, "pods", self.namespace, body)
