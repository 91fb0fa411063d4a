"""Kubernetes platform: one pod per node incarnation, one headless service per rank.

Pods and services (`k8s_job_objects`) are owned by the master's Job (deleting it deletes the
job; a master pod that dies is replaced by the Job and the nodes stay), or by a bare master pod
started without a Job. They are never restarted by Kubernetes (`restartPolicy: Never`: the
master relaunches with a new id), and watched through one label-selected pod watch
(`k8s_pod_watch`). Each incarnation produces exactly one NodeEvent, with the exit reason read
from the pod's status (`k8s_pod_end`).

A restarted master adopts the pods of the previous one: `handle` (kept in the state store) is
the pod's name and uid, `adopt` registers the pod under its node id and reads it once, so a
pod that ended, was deleted or was replaced by another of the same name while no master
watched ends its incarnation like any exit (and the job relaunches it).

The `kubernetes` client is imported lazily (`k8s_api`): the master runs without it elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from master.client import ENV_JOB_TOKEN_FILE, ENV_MASTER_ADDR
from master.platform.api import NodeEvent, NodeLaunchSpec, Platform, PlatformError
from master.platform.k8s_api import api_error_message, default_api_client, import_client
from master.platform.k8s_job_objects import JobObjects
from master.platform.k8s_pod_end import PodEnd, pod_end
from master.platform.k8s_pod_watch import WATCH_TIMEOUT_SECONDS, PodWatch
from master.platform.k8s_resources import (
    LABEL_ID,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_ROLE,
    NODE_PORT,
    TOKEN_DIR,
    TOKEN_KEY,
    K8sSettings,
    node_pod,
    rank_label,
    service_name,
)

log = logging.getLogger(__name__)

SHUTDOWN_MARGIN_SECONDS = 5.0  # beyond the grace period, for the kubelet to report the end
FORCE_DELETE_WAIT_SECONDS = 3.0
EVENTS_TIMEOUT_SECONDS = 5.0
MAX_EVENT_LINES = 3

# Variables the kubelet sets in the master's own pod; a node pod gets its own, not the master's.
_POD_LOCAL_ENV = re.compile(
    r"^(HOSTNAME|HOME|KUBERNETES_\w*|DLROVER_K8S_\w*|\w+_SERVICE_(HOST|PORT\w*)"
    r"|\w+_PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)


@dataclass
class _PodRecord:
    """One node incarnation's pod, from its create call (or adoption) until its end is reported."""

    spec: NodeLaunchSpec
    pod_name: str
    created_at: float | None = None  # monotonic; None while the create call is in flight
    uid: str = ""  # the pod's uid once created (adopted pods: from the handle)
    kill_signal: int = 0
    reported: bool = False
    last_pod: dict[str, Any] | None = None


class KubernetesPlatform(Platform):
    """Nodes as pods of the master's namespace, addressed through per-rank headless services."""

    # A standby PS is a pod of the PS group's resources; it takes a rank over by its label.
    runs_ps_standby = True

    def __init__(
        self,
        host: str = "",
        settings: K8sSettings | None = None,
        api_client: Any = None,
        watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
        **options: Any,
    ) -> None:
        super().__init__()
        client, _ = import_client()
        self.settings = settings or K8sSettings.from_env(os.environ, **options)
        self.host = host  # the master's advertised host; rewritten to its service for nodes
        self._api = api_client if api_client is not None else default_api_client()
        self._core = client.CoreV1Api(self._api)
        self._selector = f"{LABEL_JOB}={self.settings.job_name},{LABEL_ROLE}=node"
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._records: dict[int, _PodRecord] = {}
        self._closed = False
        self._owner_uid = self.settings.owner_uid_in_use
        self._objects = JobObjects(self._core, self.settings, self._owner_uid)
        if not self._owner_uid:
            log.warning(
                "no owner (master Job or pod): pods will not be owned and outlive the job "
                "(run the master through `dlrover submit --platform k8s`)"
            )
        self._pod_watch = PodWatch(
            self._api,
            self._core,
            self.settings.namespace,
            self._selector,
            on_pod=self._observe,
            on_list=self._on_list,
            timeout_seconds=watch_timeout_seconds,
        )
        self._pod_watch.start()

    @property
    def relists(self) -> int:
        """How often the pod list was read (first sync + after each 410)."""
        return self._pod_watch.relists

    # -- Platform ----------------------------------------------------------------------

    def address_for(self, node_type: str, rank: int) -> str:
        name = service_name(self.settings.job_name, node_type, rank)
        return f"{name}.{self.settings.namespace}.svc:{NODE_PORT}"

    def launch(self, spec: NodeLaunchSpec) -> None:
        if self._closed:
            raise RuntimeError("the Kubernetes platform is shut down")
        env = self._node_env(spec.env)
        if spec.rank >= 0:  # a standby has no address until it takes a rank over
            self._objects.ensure_service(spec.type, spec.rank)
        body = node_pod(self.settings, spec, env, token_secret=self._objects.secret)
        name = body["metadata"]["name"]
        record = _PodRecord(spec=spec, pod_name=name)
        with self._lock:
            self._records[spec.id] = record
        try:
            created = self._core.create_namespaced_pod(self.settings.namespace, body)
        except Exception as e:
            with self._lock:
                self._records.pop(spec.id, None)
            raise RuntimeError(api_error_message(f"create pod {name}", e, self._ns)) from None
        with self._lock:
            record.created_at = time.monotonic()
            record.uid = getattr(created.metadata, "uid", "") or ""
        log.info("created pod %s (%s-%d id=%d)", name, spec.type, spec.rank, spec.id)

    def take_over(self, standby_id: int, node_type: str, rank: int) -> None:
        """The standby's pod gets the rank's label, so the rank's service (its address) selects
        it; the failed pod it replaces is no longer an endpoint."""
        with self._lock:
            record = self._records.get(standby_id)
        if record is None:
            raise PlatformError(f"no pod for standby node id {standby_id}")
        self._objects.ensure_service(node_type, rank)
        patch = {"metadata": {"labels": {LABEL_RANK: rank_label(rank)}}}
        try:
            self._core.patch_namespaced_pod(record.pod_name, self._ns, patch)
        except Exception as e:
            message = api_error_message(f"patch pod {record.pod_name}", e, self._ns)
            raise PlatformError(message) from None
        with self._lock:
            record.spec = dataclasses.replace(record.spec, type=node_type, rank=rank)
        log.info("pod %s took over %s-%d", record.pod_name, node_type, rank)

    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        """SIGKILL deletes the pod at once; any other signal deletes it with its grace period."""
        with self._lock:
            record = self._records.get(node_id)
            if record is None or record.reported or record.created_at is None:
                return False
            record.kill_signal = int(sig)
        grace = 0 if sig == signal.SIGKILL else None
        return self._delete_pod(record.pod_name, grace)

    def stop_node(self, node_id: int, grace_seconds: float) -> None:
        with self._lock:
            record = self._records.get(node_id)
            if record is None or record.reported or record.created_at is None:
                return
            record.kill_signal = int(signal.SIGTERM)
        self._delete_pod(record.pod_name, max(0, math.ceil(grace_seconds)))

    def shutdown(self, grace_seconds: float = 5.0) -> None:
        """Stop every pod (grace, then force), report each end, remove services and secret.

        Ended pods stay (their logs stay readable) until the master pod is deleted.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            # created_at is 0.0 for adopted pods: they are stopped too.
            live = [
                r for r in self._records.values() if not r.reported and r.created_at is not None
            ]
            for r in live:
                r.kill_signal = r.kill_signal or int(signal.SIGTERM)
        for r in live:
            self._delete_pod(r.pod_name, max(0, math.ceil(grace_seconds)))
        self._wait_reported(live, grace_seconds + SHUTDOWN_MARGIN_SECONDS)
        left = [r for r in live if not r.reported]
        for r in left:
            log.warning("pod %s did not end within the grace period; force-deleting", r.pod_name)
            self._delete_pod(r.pod_name, 0)
        self._wait_reported(left, FORCE_DELETE_WAIT_SECONDS)
        for r in left:
            self._finish(
                r, PodEnd(-signal.SIGKILL, message="force-deleted at shutdown", reason="Deleted")
            )
        self._stop_watch()
        self._objects.delete_all()
        close = getattr(self._api, "close", None)
        if callable(close):
            close()

    # -- resuming under a restarted master ----------------------------------------------------

    def handle(self, node_id: int) -> dict[str, Any]:
        """The pod's name and uid: a later master adopts exactly this pod, not a namesake."""
        with self._lock:
            record = self._records.get(node_id)
            if record is None:
                return {}
            return {"pod": record.pod_name, "uid": record.uid}

    def restore_addresses(self, addresses: dict[tuple[str, int], str]) -> None:
        """Node addresses are the rank services' DNS names: the same for every master."""
        for (node_type, rank), addr in addresses.items():
            if addr != self.address_for(node_type, rank):
                raise PlatformError(
                    f"the state store gives {node_type}-{rank} the address {addr!r}, but this "
                    f"job's service for it is {self.address_for(node_type, rank)!r}: the state "
                    f"belongs to another job or namespace (job {self.settings.job_name!r}, "
                    f"namespace {self._ns!r})"
                )

    def adopt(self, spec: NodeLaunchSpec, handle: dict[str, Any]) -> None:
        """Watch a pod a previous master created; an end it missed is reported now."""
        if self._closed:
            raise RuntimeError("the Kubernetes platform is shut down")
        name = str(handle.get("pod") or "")
        uid = str(handle.get("uid") or "")
        if not name:
            name = node_pod(self.settings, spec, {})["metadata"]["name"]
        # Registered before the read: a change after the read arrives through the watch.
        record = _PodRecord(spec=spec, pod_name=name, created_at=0.0, uid=uid)
        with self._lock:
            self._records[spec.id] = record
            self._objects.adopt(service_name(self.settings.job_name, spec.type, spec.rank))
        selector = f"{self._selector},{LABEL_ID}={spec.id}"
        try:
            pods = self._core.list_namespaced_pod(self._ns, label_selector=selector)
        except Exception as e:
            with self._lock:
                self._records.pop(spec.id, None)
            raise PlatformError(api_error_message(f"read pod {name}", e, self._ns)) from None
        data = self._api.sanitize_for_serialization(pods)
        pod = next(
            (p for p in data.get("items") or [] if p["metadata"]["name"] == name),
            None,
        )
        if pod is not None and uid and pod["metadata"].get("uid") != uid:
            log.warning(
                "pod %s was replaced while no master watched (uid %s, not %s)",
                name,
                pod["metadata"].get("uid"),
                uid,
            )
            pod = None
        if pod is None:
            self._finish(
                record,
                PodEnd(
                    -signal.SIGKILL,
                    message=f"pod {name} was deleted while no master watched it",
                    reason="Deleted",
                ),
            )
            return
        owners = {o.get("uid") for o in pod["metadata"].get("ownerReferences") or []}
        if self._owner_uid and self._owner_uid not in owners:
            log.warning(
                "adopted pod %s is not owned by %s: deleting that owner will not remove it",
                name,
                self._owner_uid,
            )
        log.info("adopted pod %s (%s-%d id=%d)", name, spec.type, spec.rank, spec.id)
        self._observe(pod)

    # -- launching helpers ------------------------------------------------------------------

    @property
    def _ns(self) -> str:
        return self.settings.namespace

    def _node_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The node's env for its pod: without the master pod's own variables, with the master
        reachable through its service, and the token file at the mounted secret."""
        out = {
            k: v for k, v in env.items() if not (_POD_LOCAL_ENV.match(k) and os.environ.get(k) == v)
        }
        master_host = self.settings.master_host()
        addr = out.get(ENV_MASTER_ADDR, "")
        host, _, port = addr.rpartition(":")
        if master_host and host and host == self.host:
            out[ENV_MASTER_ADDR] = f"{master_host}:{port}"
        token_path = out.get(ENV_JOB_TOKEN_FILE, "")
        if token_path:
            self._objects.ensure_secret(token_path)
            out[ENV_JOB_TOKEN_FILE] = f"{TOKEN_DIR}/{TOKEN_KEY}"
        return out

    def _delete_pod(self, name: str, grace: int | None) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            if grace is None:
                self._core.delete_namespaced_pod(name, self._ns)
            else:
                self._core.delete_namespaced_pod(name, self._ns, grace_period_seconds=grace)
            return True
        except ApiException as e:
            if e.status != 404:
                log.warning("%s", api_error_message(f"delete pod {name}", e, self._ns))
            return False
        except Exception as e:  # the API server is unreachable: the watch reports later
            log.warning("delete pod %s: %s", name, e)
            return False

    # -- events ----------------------------------------------------------------------------

    def _on_list(self, pods: list[dict[str, Any]], started: float) -> None:
        """Observe every listed pod; an incarnation whose pod is missing from a list read
        after it was created was deleted while the watch was down."""
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["name"])
            self._observe(pod)
        with self._lock:
            gone = [
                r
                for r in self._records.values()
                if not r.reported
                and r.created_at is not None
                and r.created_at < started
                and r.pod_name not in seen
            ]
        for r in gone:  # deleted while we were not watching
            end = pod_end(r.last_pod or {}, deleted=True, kill_signal=r.kill_signal)
            self._finish(r, end)

    def _observe(self, pod: dict[str, Any], deleted: bool = False) -> None:
        meta = pod.get("metadata") or {}
        try:
            node_id = int((meta.get("labels") or {}).get(LABEL_ID, ""))
        except ValueError:
            return
        with self._lock:
            record = self._records.get(node_id)
            if record is None or record.reported or record.pod_name != meta.get("name"):
                return  # not ours (an earlier job's pod), or already reported
            if record.uid and meta.get("uid") and record.uid != meta.get("uid"):
                return  # another pod of the same name: not this incarnation
            record.last_pod = pod
            kill = record.kill_signal
        end = pod_end(pod, deleted=deleted, kill_signal=kill)
        if end is None:
            return
        if end.force_delete:
            self._delete_pod(record.pod_name, 0)
        self._finish(record, end)

    def _finish(self, record: _PodRecord, end: PodEnd) -> None:
        """Report an incarnation's end, exactly once."""
        with self._lock:
            if record.reported:
                return
            record.reported = True
            self._ended.notify_all()
        message = end.message
        if end.exit_code != 0 and not record.kill_signal:
            message = self._with_pod_events(record.pod_name, message)
        spec = record.spec
        log.info("pod %s ended: %s exit code %d", record.pod_name, end.reason, end.exit_code)
        self.events.put(
            NodeEvent(
                type=spec.type,
                rank=spec.rank,
                id=spec.id,
                exit_code=end.exit_code,
                oom_killed=end.oom_killed,
                message=message,
                details={"pod": record.pod_name, "reason": end.reason},
            )
        )

    def _with_pod_events(self, pod: str, message: str) -> str:
        """Warnings Kubernetes recorded about the pod (eviction, node trouble), then `message`
        (the log tail stays last: the master quotes the last line)."""
        try:
            events = self._core.list_namespaced_event(
                self._ns,
                field_selector=f"involvedObject.name={pod}",
                _request_timeout=EVENTS_TIMEOUT_SECONDS,
            )
        except Exception as e:
            log.debug("events of pod %s: %s", pod, e)
            return message
        lines: list[str] = []
        for ev in events.items or []:
            if ev.type == "Warning" and ev.reason:
                line = f"k8s event {ev.reason}: {ev.message or ''}".strip()
                if line not in lines:
                    lines.append(line)
        return "\n".join([*lines[-MAX_EVENT_LINES:], message]).strip()

    def _wait_reported(self, records: list[_PodRecord], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(not r.reported for r in records):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._ended.wait(remaining)

    def _stop_watch(self) -> None:
        """End the pod watch thread: no pod change is observed after it."""
        self._pod_watch.stop()

    # -- introspection (tests, status) -------------------------------------------------------

    def pod_name_of(self, node_id: int) -> str:
        with self._lock:
            record = self._records.get(node_id)
            return record.pod_name if record else ""
