"""The test plays the kubelet (and the node controller): it moves pods through their lives.

Every change goes through the store, so the platform sees it exactly as it would see a real
kubelet's status update: a MODIFIED event on its watch (and Events for the reasons). Besides
runs and exits: one container of several ending (sidecars run on), a node that stops answering
without a DisruptionTarget (the node controller marks its pods not Ready), image pulls that
fail then recover, pods the scheduler cannot place; `auto_run` runs every new pod by itself.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from tests.k8s_fake.store import (
    BATCH,
    CORE,
    ApiError,
    ObjectStore,
    Watcher,
    now_rfc3339,
    terminate_containers,
)

FAKE_NODE = "fake-node-1"


class FakeKubelet:
    """Status transitions of pods in one namespace, the way kubelet and controllers write them."""

    def __init__(self, store: ObjectStore, namespace: str = "default") -> None:
        self.store = store
        self.namespace = namespace
        self._auto: Watcher | None = None

    def _update(self, name: str, mutate) -> dict[str, Any]:
        return self.store.update(CORE, "pods", self.namespace, name, mutate)

    def schedule(self, name: str) -> dict[str, Any]:
        """Bind the pod to a node (it stays Pending until run())."""

        def mutate(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = FAKE_NODE

        return self._update(name, mutate)

    def run(self, name: str, node: str = FAKE_NODE) -> dict[str, Any]:
        """Scheduled, image pulled, containers started: phase Running."""
        now = now_rfc3339()

        def mutate(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = node
            pod["status"] = {
                "phase": "Running",
                "hostIP": "10.0.0.1",
                "podIP": f"10.244.0.{sum(name.encode()) % 250 + 1}",
                "startTime": now,
                "qosClass": pod["status"].get("qosClass", "BestEffort"),
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                    {"type": "Ready", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
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

    def oom_kill(self, name: str, container: str = "") -> dict[str, Any]:
        """The kernel OOM killer ended the container (cgroup memory limit); `container`: only
        that one of several (the others run on)."""
        if container:
            return self.exit_container(name, container, 137, reason="OOMKilled")
        return self.exit(name, 137, reason="OOMKilled")

    def exit_container(
        self, name: str, container: str, exit_code: int, reason: str = "", message: str = ""
    ) -> dict[str, Any]:
        """One container ended; the pod stays Running while another runs (restartPolicy Never:
        Succeeded once all ended with 0, else Failed)."""
        reason = reason or ("Completed" if exit_code == 0 else "Error")
        now = now_rfc3339()

        def mutate(pod: dict[str, Any]) -> None:
            status = pod["status"]
            for cs in status.get("containerStatuses") or []:
                if cs["name"] == container:
                    started = (cs["state"].get("running") or {}).get("startedAt", now)
                    terminated = {"exitCode": exit_code, "reason": reason, "startedAt": started}
                    terminated["finishedAt"] = now
                    if message:
                        terminated["message"] = message
                    cs.update(ready=False, started=False, state={"terminated": terminated})
            ended = [cs["state"].get("terminated") for cs in status["containerStatuses"]]
            for cond in status.get("conditions") or []:
                if cond["type"] in ("Ready", "ContainersReady"):
                    cond.update(status="False", reason="ContainersNotReady")
            if all(ended):
                status["phase"] = "Failed" if any(t["exitCode"] for t in ended) else "Succeeded"

        return self._update(name, mutate)

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

    def node_not_ready(self, node: str = FAKE_NODE) -> list[str]:
        """The node stopped answering (its Ready condition went Unknown): the node controller
        marks every pod on it not Ready (MarkPodsNotReady: Ready=False, ContainersReady kept)
        and records NodeNotReady on each; no DisruptionTarget, no deletion (the taint manager
        waits for its tolerationSeconds). Deletions of those pods never finish. The names."""
        names = []
        for (_, resource, ns, name), pod in self.store.all_objects():
            if resource != "pods" or ns != self.namespace:
                continue
            if pod["spec"].get("nodeName") != node or pod["status"].get("phase") != "Running":
                continue
            self.store.unreachable.add((self.namespace, name))

            def mutate(p: dict[str, Any]) -> None:
                for cond in p["status"].get("conditions") or []:
                    if cond["type"] == "Ready":
                        cond.update(status="False", lastTransitionTime=now_rfc3339())

            self._update(name, mutate)
            self.record_event(name, "NodeNotReady", "Node is not ready")
            names.append(name)
        return names

    def taint_evict(self, name: str) -> dict[str, Any]:
        """A NoExecute taint on a healthy node (e.g. `kubectl taint ... :NoExecute`): the taint
        manager deletes the pod, and the node's kubelet stops it as for any graceful deletion."""

        def mutate(pod: dict[str, Any]) -> None:
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
        return self.store.delete(CORE, "pods", self.namespace, name)

    def node_ready(self, node: str = FAKE_NODE) -> list[str]:
        """The node answers again: its kubelet reports its pods Ready, and deletions of them
        finish again. The names of the pods made Ready."""
        names = []
        for (_, resource, ns, name), pod in self.store.all_objects():
            if resource != "pods" or ns != self.namespace or pod["spec"].get("nodeName") != node:
                continue
            self.store.unreachable.discard((self.namespace, name))
            if pod["status"].get("phase") != "Running":
                continue

            def mutate(p: dict[str, Any]) -> None:
                for cond in p["status"].get("conditions") or []:
                    if cond["type"] == "Ready":
                        cond.update(status="True", lastTransitionTime=now_rfc3339())

            self._update(name, mutate)
            names.append(name)
        return names

    def _waiting(self, name: str, reason: str, message: str) -> dict[str, Any]:
        """Every container of the scheduled pod waits for `reason`; the pod stays Pending."""
        now = now_rfc3339()

        def mutate(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = pod["spec"].get("nodeName") or FAKE_NODE
            pod["status"]["conditions"] = [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
                {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
            ]
            pod["status"]["containerStatuses"] = [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
                for c in pod["spec"].get("containers", [])
            ]

        return self._update(name, mutate)

    def err_image_pull(self, name: str, image: str = "") -> dict[str, Any]:
        """A pull attempt failed (registry unreachable, unknown tag): ErrImagePull."""
        image = image or self._image(name)
        message = f'failed to pull and unpack image "{image}": failed to resolve reference'
        pod = self._waiting(name, "ErrImagePull", message)
        self.record_event(name, "Failed", f'Failed to pull image "{image}": {message}')
        return pod

    def image_pull_backoff(self, name: str, image: str = "") -> dict[str, Any]:
        """The kubelet waits before it pulls again: ImagePullBackOff (the pod stays Pending)."""
        image = image or self._image(name)
        message = f'Back-off pulling image "{image}"'
        pod = self._waiting(name, "ImagePullBackOff", message)
        self.record_event(name, "BackOff", message)
        return pod

    def unschedulable(self, name: str, message: str = "") -> dict[str, Any]:
        """The scheduler finds no node for the pod: PodScheduled=False, reason Unschedulable."""
        message = message or "0/3 nodes are available: 3 Insufficient cpu."

        def mutate(pod: dict[str, Any]) -> None:
            pod["status"]["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                    "lastTransitionTime": now_rfc3339(),
                }
            ]

        pod = self._update(name, mutate)
        self.record_event(name, "FailedScheduling", message, source="default-scheduler")
        return pod

    def _image(self, name: str) -> str:
        pod = self.store.get(CORE, "pods", self.namespace, name)
        return pod["spec"]["containers"][-1].get("image", "?")

    def auto_run(self, delay_seconds: float = 0.05) -> None:
        """From now on every new pod of the namespace runs by itself after `delay_seconds`."""
        watcher = self.store.open_watch(CORE, "pods", self.namespace, None, None, None)
        watcher.initial = []
        self._auto = watcher

        def loop() -> None:
            while not watcher.dropped:
                for kind, pod in self.store.next_changes(watcher, 0.2):
                    if kind == "ADDED" and not pod["spec"].get("nodeName"):
                        name = pod["metadata"]["name"]
                        timer = threading.Timer(delay_seconds, self._run_if_pending, (name,))
                        timer.daemon = True
                        timer.start()

        threading.Thread(target=loop, name="fake-kubelet", daemon=True).start()

    def stop_auto_run(self) -> None:
        watcher = self._auto
        if watcher is not None:
            watcher.dropped = True
            self.store.close_watch(watcher)

    def _run_if_pending(self, name: str) -> None:
        try:
            pod = self.store.get(CORE, "pods", self.namespace, name)
        except ApiError:  # deleted meanwhile
            return
        if pod["status"].get("phase") == "Pending" and not pod["metadata"].get("deletionTimestamp"):
            self.run(name)

    def record_event(
        self,
        pod_name: str,
        reason: str,
        message: str,
        kind: str = "Warning",
        source: str = "kubelet",
    ):
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
                "source": {"component": source, "host": FAKE_NODE},
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
