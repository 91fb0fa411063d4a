"""Kubernetes platform: one pod per node incarnation, one headless service per rank.

Pods and services are owned by the master's Job (deleting it deletes the job; a master pod
that dies is replaced by the Job and the nodes stay), or by a bare master pod started without
a Job. They are never restarted by Kubernetes (`restartPolicy: Never`: the master relaunches
with a new id), and watched
through one label-selected pod watch that resumes from its last resourceVersion after a
dropped stream and relists when that resourceVersion has expired (410 Gone). Each incarnation
produces exactly one NodeEvent, with the exit reason read from the pod's status.

A restarted master adopts the pods of the previous one: `handle` (kept in the state store) is
the pod's name and uid, `adopt` registers the pod under its node id and reads it once, so a
pod that ended, was deleted or was replaced by another of the same name while no master
watched ends its incarnation like any exit (and the job relaunches it).

The `kubernetes` client is imported only here, lazily (the master runs without it elsewhere).
"""

from __future__ import annotations

import json
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
from master.platform.k8s_resources import (
    LABEL_ID,
    LABEL_JOB,
    LABEL_ROLE,
    NODE_PORT,
    TOKEN_DIR,
    TOKEN_KEY,
    K8sConfigError,
    K8sSettings,
    dns_label,
    node_pod,
    node_service,
    service_name,
    token_secret,
)

log = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS = 240  # the server ends each watch after this; we resume at once
WATCH_CONNECT_TIMEOUT_SECONDS = 10
RETRY_MIN_SECONDS = 0.2
RETRY_MAX_SECONDS = 10.0
SHUTDOWN_MARGIN_SECONDS = 5.0  # beyond the grace period, for the kubelet to report the end
FORCE_DELETE_WAIT_SECONDS = 3.0
EVENTS_TIMEOUT_SECONDS = 5.0
WATCH_STOP_SECONDS = 5.0
MAX_EVENT_LINES = 3

# A container waiting for one of these will not start without a change to the pod.
FATAL_WAITING_REASONS = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
)
# Pod status reasons for pods that the node, not the program, ended.
NODE_ENDED_REASONS = frozenset({"Evicted", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"})
# Variables the kubelet sets in the master's own pod; a node pod gets its own, not the master's.
_POD_LOCAL_ENV = re.compile(
    r"^(HOSTNAME|HOME|KUBERNETES_\w*|DLROVER_K8S_\w*|\w+_SERVICE_(HOST|PORT\w*)"
    r"|\w+_PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)


@dataclass(frozen=True)
class PodEnd:
    """How a pod's node ended, read from its status (exit_code < 0: killed by that signal)."""

    exit_code: int
    oom_killed: bool = False
    message: str = ""
    reason: str = ""  # OOMKilled, Evicted, NodeLost, Deleted, Error, Completed, ...
    force_delete: bool = False  # the pod will never end by itself: delete it now


def _container_state(status: Mapping[str, Any], state: str) -> dict[str, Any] | None:
    for cs in status.get("containerStatuses") or []:
        value = (cs.get("state") or {}).get(state)
        if value:
            return value
    return None


def _node_lost(status: Mapping[str, Any]) -> bool:
    if status.get("reason") == "NodeLost":
        return True
    return any(
        c.get("type") == "DisruptionTarget" and c.get("reason") == "DeletionByTaintManager"
        for c in status.get("conditions") or []
    )


def pod_end(pod: Mapping[str, Any], deleted: bool = False, kill_signal: int = 0) -> PodEnd | None:
    """The end of a node's pod from its status; None while it is pending or running.

    `deleted`: the pod object is gone (its last state is `pod`). `kill_signal`: the master
    asked for the pod's end with this signal (deleted with or without a grace period).
    """
    status = pod.get("status") or {}
    phase = status.get("phase", "")
    terminated = _container_state(status, "terminated")
    if phase in ("Succeeded", "Failed"):
        reason = status.get("reason", "")
        if reason in NODE_ENDED_REASONS:
            detail = status.get("message", "")
            return PodEnd(
                -signal.SIGKILL, message=f"{reason}: {detail}".rstrip(": "), reason=reason
            )
        if terminated is not None:
            code = int(terminated.get("exitCode", 1))
            why = terminated.get("reason", "")
            message = terminated.get("message", "") or ""
            if why == "OOMKilled":
                message = message or "OOMKilled: the container went over its memory limit"
                return PodEnd(code, oom_killed=True, message=message, reason=why)
            return PodEnd(code, message=message, reason=why or phase)
        if phase == "Succeeded":
            return PodEnd(0, reason=phase)
        detail = f"{reason}: {status.get('message', '')}".strip(": ")
        return PodEnd(-signal.SIGKILL, message=detail or "pod failed", reason=reason or phase)
    if deleted:
        if terminated is not None:
            code = int(terminated.get("exitCode", 1))
            return PodEnd(code, message=terminated.get("message", "") or "", reason="Deleted")
        if kill_signal:
            return PodEnd(-kill_signal, message="pod deleted by the master", reason="Deleted")
        return PodEnd(
            -signal.SIGKILL,
            message="pod deleted outside the master (kubectl, eviction, or its node was lost)",
            reason="Deleted",
        )
    if (pod.get("metadata") or {}).get("deletionTimestamp") and _node_lost(status):
        return PodEnd(
            -signal.SIGKILL,
            message="NodeLost: the pod's node stopped responding",
            reason="NodeLost",
            force_delete=True,
        )
    waiting = _container_state(status, "waiting")
    if waiting and waiting.get("reason") in FATAL_WAITING_REASONS:
        why = waiting["reason"]
        return PodEnd(
            1,
            message=f"{why}: {waiting.get('message', '')}".rstrip(": "),
            reason=why,
            force_delete=True,
        )
    return None


@dataclass
class _PodRecord:
    spec: NodeLaunchSpec
    pod_name: str
    created_at: float | None = None  # monotonic; None while the create call is in flight
    uid: str = ""  # the pod's uid once created (adopted pods: from the handle)
    kill_signal: int = 0
    reported: bool = False
    last_pod: dict[str, Any] | None = None


def _import_client() -> tuple[Any, Any]:
    try:
        from kubernetes import client, config
    except ImportError:
        raise K8sConfigError(
            "the Kubernetes platform needs the `kubernetes` client: "
            "pip install 'dlrover-elastic[k8s]' (the image installs it by default)"
        ) from None
    return client, config


def default_api_client() -> Any:
    """An ApiClient from the pod's service account, or from the kubeconfig outside a cluster."""
    client, config = _import_client()

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            # KUBECONFIG is read now, not when the client was imported.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except (config.ConfigException, OSError) as e:
            raise K8sConfigError(
                "no Kubernetes credentials: not running in a pod with a service account, and "
                f"no usable kubeconfig ({e}). Run the master in the cluster "
                "(`dlrover submit --platform k8s`) or set KUBECONFIG"
            ) from None
    return client.ApiClient()


def api_error_message(action: str, e: Exception, namespace: str) -> str:
    """One clear line for a failed API call, with the fix for permission problems."""
    status = getattr(e, "status", None)
    detail = getattr(e, "reason", "") or str(e)
    body = getattr(e, "body", None)
    if body:
        try:
            detail = json.loads(body).get("message", detail)
        except (ValueError, AttributeError):
            pass
    if status == 403:
        return (
            f"{action}: forbidden ({detail}). The master's service account needs the role in "
            f"examples/k8s/rbac.yaml in namespace {namespace!r}; "
            "`dlrover submit --platform k8s` creates it"
        )
    return f"{action}: {status or 'error'} {detail}".strip()


class KubernetesPlatform(Platform):
    """Nodes as pods of the master's namespace, addressed through per-rank headless services."""

    def __init__(
        self,
        host: str = "",
        settings: K8sSettings | None = None,
        api_client: Any = None,
        watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
        **options: Any,
    ) -> None:
        super().__init__()
        client, _ = _import_client()
        self.settings = settings or K8sSettings.from_env(os.environ, **options)
        self.host = host  # the master's advertised host; rewritten to its service for nodes
        self.watch_timeout_seconds = watch_timeout_seconds
        self._api = api_client if api_client is not None else default_api_client()
        self._core = client.CoreV1Api(self._api)
        self._selector = f"{LABEL_JOB}={self.settings.job_name},{LABEL_ROLE}=node"
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._records: dict[int, _PodRecord] = {}
        self._services: set[str] = set()
        self._secret: str = ""
        self._closed = False
        self._stopping = threading.Event()
        self._watch: Any = None
        self._resource_version: str | None = None
        self.relists = 0  # how often the pod list was read (first sync + after each 410)
        self._owner_uid = self.settings.owner_uid_in_use
        self._adopted_secret = ""
        if not self._owner_uid:
            log.warning(
                "no owner (master Job or pod): pods will not be owned and outlive the job "
                "(run the master through `dlrover submit --platform k8s`)"
            )
        self._watcher = threading.Thread(target=self._watch_loop, name="k8s-watch", daemon=True)
        self._watcher.start()

    # -- Platform ----------------------------------------------------------------------

    def address_for(self, node_type: str, rank: int) -> str:
        name = service_name(self.settings.job_name, node_type, rank)
        return f"{name}.{self.settings.namespace}.svc:{NODE_PORT}"

    def launch(self, spec: NodeLaunchSpec) -> None:
        if self._closed:
            raise RuntimeError("the Kubernetes platform is shut down")
        env = self._node_env(spec.env)
        self._ensure_service(spec.type, spec.rank)
        body = node_pod(self.settings, spec, env, token_secret=self._secret)
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
        for name in sorted(self._services):
            self._delete_quietly(self._core.delete_namespaced_service, name)
        if self._secret or self._adopted_secret:
            self._delete_quietly(
                self._core.delete_namespaced_secret, self._secret or self._adopted_secret
            )
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
            self._services.add(service_name(self.settings.job_name, spec.type, spec.rank))
        self._adopted_secret = dns_label(self.settings.job_name, "token")
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
            self._ensure_secret(token_path)
            out[ENV_JOB_TOKEN_FILE] = f"{TOKEN_DIR}/{TOKEN_KEY}"
        return out

    def _ensure_secret(self, token_path: str) -> None:
        if self._secret:
            return
        try:
            with open(token_path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise RuntimeError(f"cannot read the job token file {token_path!r}: {e}") from None
        body = token_secret(self.settings, token)
        self._create_owned(
            body,
            self._core.create_namespaced_secret,
            self._core.read_namespaced_secret,
            self._core.delete_namespaced_secret,
        )
        self._secret = body["metadata"]["name"]

    def _ensure_service(self, node_type: str, rank: int) -> None:
        body = node_service(self.settings, node_type, rank)
        name = body["metadata"]["name"]
        if name in self._services:
            return
        self._create_owned(
            body,
            self._core.create_namespaced_service,
            self._core.read_namespaced_service,
            self._core.delete_namespaced_service,
        )
        self._services.add(name)

    def _create_owned(self, body: dict[str, Any], create, read, delete) -> None:
        """Create an object; one left over from an earlier master of this job is replaced."""
        from kubernetes.client.exceptions import ApiException

        name, kind = body["metadata"]["name"], body["kind"].lower()
        try:
            create(self._ns, body)
            return
        except ApiException as e:
            if e.status != 409:
                raise RuntimeError(
                    api_error_message(f"create {kind} {name}", e, self._ns)
                ) from None
        try:
            existing = read(name, self._ns)
            owners = {o.uid for o in existing.metadata.owner_references or []}
            if self._owner_uid in owners or not self._owner_uid:
                return
            log.info("replacing %s %s left over from an earlier master", kind, name)
            delete(name, self._ns)
            create(self._ns, body)
        except ApiException as e:
            raise RuntimeError(api_error_message(f"replace {kind} {name}", e, self._ns)) from None

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

    def _delete_quietly(self, delete, name: str) -> None:
        try:
            delete(name, self._ns)
        except Exception as e:
            if getattr(e, "status", None) != 404:
                log.warning("delete %s: %s", name, e)

    # -- events ----------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        """List, then watch from the list's resourceVersion; resume or relist on failures."""
        from kubernetes.client.exceptions import ApiException

        delay = RETRY_MIN_SECONDS
        while not self._stopping.is_set():
            try:
                if self._resource_version is None:
                    self._resource_version = self._relist()
                self._watch_once()
                delay = RETRY_MIN_SECONDS
                continue  # the server ended the stream (timeout or dropped): resume
            except ApiException as e:
                if e.status == 410:
                    log.info(
                        "pod watch: resourceVersion %s expired; relisting", self._resource_version
                    )
                    self._resource_version = None
                    continue
                if self._stopping.is_set():
                    return
                log.warning(
                    "pod watch: %s; retrying in %.1fs",
                    api_error_message("watch pods", e, self._ns),
                    delay,
                )
            except Exception as e:  # a cut connection, a read timeout, a refused connect
                if self._stopping.is_set():
                    return
                log.warning("pod watch interrupted (%s); resuming in %.1fs", e, delay)
            self._stopping.wait(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    def _relist(self) -> str:
        started = time.monotonic()
        pods = self._core.list_namespaced_pod(self._ns, label_selector=self._selector)
        data = self._api.sanitize_for_serialization(pods)
        self.relists += 1
        seen = set()
        for pod in data.get("items") or []:
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
        return data["metadata"]["resourceVersion"]

    def _watch_once(self) -> None:
        from kubernetes import watch

        w = watch.Watch()
        self._watch = w
        if self._stopping.is_set():
            return
        stream = w.stream(
            self._core.list_namespaced_pod,
            self._ns,
            label_selector=self._selector,
            resource_version=self._resource_version,
            timeout_seconds=self.watch_timeout_seconds,
            allow_watch_bookmarks=True,
            _request_timeout=(WATCH_CONNECT_TIMEOUT_SECONDS, self.watch_timeout_seconds + 30),
        )
        for event in stream:
            obj = event["raw_object"]
            if event["type"] in ("ADDED", "MODIFIED"):
                self._observe(obj)
            elif event["type"] == "DELETED":
                self._observe(obj, deleted=True)
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self._resource_version = rv
            if self._stopping.is_set():
                w.stop()

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
        """End the watch thread. Watch.stop() only cuts a stream whose response has arrived
        (and a stream starting later resets it), so keep calling it until the thread ends."""
        self._stopping.set()
        deadline = time.monotonic() + WATCH_STOP_SECONDS
        while self._watcher.is_alive() and time.monotonic() < deadline:
            w = self._watch
            if w is not None:
                w.stop()
            self._watcher.join(timeout=0.05)
        if self._watcher.is_alive():
            log.warning("the pod watch did not stop within %.0fs", WATCH_STOP_SECONDS)

    # -- introspection (tests, status) -------------------------------------------------------

    def pod_name_of(self, node_id: int) -> str:
        with self._lock:
            record = self._records.get(node_id)
            return record.pod_name if record else ""
