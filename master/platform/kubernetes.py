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

A real cluster misbehaves, and the platform copes (docs/platforms.md lists each case): every
API call has a timeout and is retried through 429, 5xx and cut connections (`k8s_retry`); a
rank's next pod is created only once no earlier pod of the rank may still run (`k8s_rank_pods`),
deletions that failed being tried again until they land (`k8s_pod_reaper`); the trainer
container, not its sidecars, ends a node; image pulls, unschedulable pods and nodes that are not
Ready are states with limits, not exits (`k8s_pod_trouble`).

The `kubernetes` client is imported lazily (`k8s_api`): the master runs without it elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from master.platform.api import NodeEvent, NodeLaunchSpec, Platform, PlatformError
from master.platform.k8s_api import default_api_client, import_client
from master.platform.k8s_errors import (
    FailureKind,
    K8sApiError,
    classify_api_error,
    describe,
    short_reason,
)
from master.platform.k8s_job_objects import JobObjects
from master.platform.k8s_node_env import node_pod_env, with_pod_events
from master.platform.k8s_pod_calls import create_pod, delete_pod
from master.platform.k8s_pod_end import PodEnd, pod_end
from master.platform.k8s_pod_reaper import PodReaper
from master.platform.k8s_pod_trouble import (
    PodTrouble,
    PodTroubles,
    TroubleKind,
    pod_trouble,
    trouble_end,
)
from master.platform.k8s_pod_watch import WATCH_TIMEOUT_SECONDS, PodWatch
from master.platform.k8s_rank_pods import RankPods
from master.platform.k8s_resources import (
    LABEL_ID,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_ROLE,
    NODE_PORT,
    K8sSettings,
    node_pod,
    rank_label,
    service_name,
)
from master.platform.k8s_retry import ApiRetry
from master.platform.k8s_settings import ENV_NODE_LOST_GRACE_SECONDS

log = logging.getLogger(__name__)

SHUTDOWN_MARGIN_SECONDS = 5.0  # beyond the grace period, for the kubelet to report the end
FORCE_DELETE_WAIT_SECONDS = 3.0
# A rank's earlier pod, deleted with grace period 0, must be gone from the API within this.
RANK_FREE_WAIT_SECONDS = 30.0


@dataclass
class _PodRecord:
    """One node incarnation's pod, from its create call (or adoption) until its end is reported."""

    spec: NodeLaunchSpec
    pod_name: str
    container: str  # the trainer container's name: the node (other containers are sidecars)
    created_at: float | None = None  # monotonic; None while the create call is in flight
    uid: str = ""  # the pod's uid once created (adopted pods: from the handle)
    kill_signal: int = 0
    deferred: bool = False  # a delete held back while the pod's node is not Ready
    deferred_grace: int | None = None
    reported: bool = False
    last_pod: dict[str, Any] | None = None
    delete_error: str = ""  # why the master could not delete the pod (shutdown)


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
        s = self.settings
        self._retry = ApiRetry(s.namespace, s.api_retry_budget_seconds, s.api_timeout_seconds)
        self._objects = JobObjects(self._core, s, self._owner_uid, self._retry)
        self._pods = RankPods()
        self._fatal: K8sApiError | None = None  # a deletion refused for good (raised next call)
        self._reaper = PodReaper(self._retry, self._core, on_fatal=self._on_fatal)
        self._troubles = PodTroubles(
            {
                TroubleKind.IMAGE_PULL: s.image_pull_timeout_seconds,
                TroubleKind.NODE_NOT_READY: s.node_lost_grace_seconds,
            },
            on_expired=self._on_trouble_expired,
            note=self._retry.note,
        )
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

    def notices(self) -> list[str]:
        """The latest lines about the cluster: API retries, pods held up and why."""
        return self._retry.notices()

    def troubles(self) -> dict[int, str]:
        """What holds each troubled node's pod up (unschedulable, image pull, node not Ready)."""
        by_pod = self._troubles.current()
        with self._lock:
            return {
                node_id: f"{by_pod[r.pod_name][0].line()} (for {by_pod[r.pod_name][1]:.0f}s)"
                for node_id, r in self._records.items()
                if r.pod_name in by_pod
            }

    # -- Platform ----------------------------------------------------------------------

    def address_for(self, node_type: str, rank: int) -> str:
        name = service_name(self.settings.job_name, node_type, rank)
        return f"{name}.{self.settings.namespace}.svc:{NODE_PORT}"

    def launch(self, spec: NodeLaunchSpec) -> None:
        """Create the incarnation's pod once no earlier pod of its rank may still run."""
        if self._closed:
            raise RuntimeError("the Kubernetes platform is shut down")
        self._raise_fatal()
        env, token_path = node_pod_env(spec.env, self.settings.master_host(), self.host)
        if token_path:
            self._objects.ensure_secret(token_path)
        if spec.rank >= 0:  # a standby has no address until it takes a rank over
            self._objects.ensure_service(spec.type, spec.rank)
        body = node_pod(self.settings, spec, env, token_secret=self._objects.secret)
        name = body["metadata"]["name"]
        container = body["spec"]["containers"][0]["name"]
        record = _PodRecord(spec=spec, pod_name=name, container=container)
        with self._lock:
            self._records[spec.id] = record
        try:
            if spec.rank >= 0:
                self._free_rank(spec, name)
            selector = f"{self._selector},{LABEL_ID}={spec.id}"
            uid = create_pod(self._retry, self._core, body, selector, self._owner_uid)
        except BaseException:
            with self._lock:
                self._records.pop(spec.id, None)
            raise
        with self._lock:
            record.created_at = time.monotonic()
            record.uid = uid
        log.info("created pod %s (%s-%d id=%d)", name, spec.type, spec.rank, spec.id)

    def _free_rank(self, spec: NodeLaunchSpec, name: str) -> None:
        """Delete the pods of earlier incarnations of the rank that may still run, and wait
        until they are gone: a rank never runs twice (one left by a previous master too)."""
        if not self._pods.wait_synced(self._retry.budget_seconds):
            raise PlatformError(
                f"cannot create pod {name}: the job's pods could not be listed "
                f"({self._pod_watch.last_error or 'no answer'})"
            )
        old = [p.name for p in self._pods.may_run(spec.type, rank_label(spec.rank), name)]
        if not old:
            return
        what = f"{spec.type}-{spec.rank}"
        self._retry.note(
            logging.WARNING,
            f"{what}: pod {', '.join(old)} of an earlier incarnation may still run; "
            f"{name} is created once it is gone",
        )
        with self._lock:
            for r in self._records.values():
                if r.pod_name in old and not r.reported:
                    r.kill_signal = r.kill_signal or int(signal.SIGKILL)
        for pod in old:
            delete_pod(self._retry, self._core, pod, 0)
        left = self._pods.wait_gone(old, RANK_FREE_WAIT_SECONDS)
        if left:
            raise PlatformError(
                f"cannot start {what}: pod {', '.join(left)} of an earlier incarnation is still "
                f"there {RANK_FREE_WAIT_SECONDS:.0f}s after its deletion, and a rank never runs "
                "twice"
            )
        self._retry.note(logging.INFO, f"{what}: earlier pods gone; creating {name}")

    def can_stand_in(self, standby_id: int, node_type: str, rank: int) -> bool:
        """Not a standby whose pod's node is not Ready: lost too, perhaps with the PS."""
        with self._lock:
            record = self._records.get(standby_id)
        if record is None or record.reported:
            return False
        trouble = self._troubles.current().get(record.pod_name)
        return trouble is None or trouble[0].kind != TroubleKind.NODE_NOT_READY

    def take_over(self, standby_id: int, node_type: str, rank: int) -> None:
        """The standby's pod gets the rank's label, so the rank's service (its address) selects
        it; the failed pod it replaces is no longer an endpoint."""
        with self._lock:
            record = self._records.get(standby_id)
        if record is None:
            raise PlatformError(f"no pod for standby node id {standby_id}")
        self._objects.ensure_service(node_type, rank)
        patch = {"metadata": {"labels": {LABEL_RANK: rank_label(rank)}}}
        self._retry.call(
            f"patch pod {record.pod_name}",
            self._core.patch_namespaced_pod,
            record.pod_name,
            self._ns,
            patch,
        )
        with self._lock:
            record.spec = dataclasses.replace(record.spec, type=node_type, rank=rank)
        log.info("pod %s took over %s-%d", record.pod_name, node_type, rank)

    def signal_node(self, node_id: int, sig: int = signal.SIGKILL) -> bool:
        """SIGKILL deletes the pod at once; any other signal deletes it with its grace period
        (on a node that is not Ready: see `_delete_or_defer`)."""
        self._raise_fatal()
        with self._lock:
            record = self._records.get(node_id)
            if record is None or record.reported or record.created_at is None:
                return False
            record.kill_signal = int(sig)
        return self._delete_or_defer(record, 0 if sig == signal.SIGKILL else None)

    def stop_node(self, node_id: int, grace_seconds: float) -> None:
        self._raise_fatal()
        with self._lock:
            record = self._records.get(node_id)
            if record is None or record.reported or record.created_at is None:
                return
            record.kill_signal = int(signal.SIGTERM)
        self._delete_or_defer(record, max(0, math.ceil(grace_seconds)))

    def _delete_or_defer(self, record: _PodRecord, grace: int | None) -> bool:
        """Delete the pod, unless its node is not Ready: then it ends as lost after the grace
        (deleted now it would be gone from the API, yet could still run there), or is deleted
        when the node is Ready again (`_observe`)."""
        with self._lock:
            record.deferred, record.deferred_grace = True, grace
        trouble = self._troubles.current().get(record.pod_name)
        if trouble is not None and trouble[0].kind == TroubleKind.NODE_NOT_READY:
            self._retry.note(
                logging.WARNING,
                f"pod {record.pod_name}: {trouble[0].message}; it is deleted when the node is "
                f"Ready again, or ends as lost after {self.settings.node_lost_grace_seconds:g}s "
                f"({ENV_NODE_LOST_GRACE_SECONDS})",
            )
            return True
        with self._lock:
            record.deferred = False
        return self._delete_now(record.pod_name, grace)

    def _delete_now(self, name: str, grace: int | None) -> bool:
        """One delete now; one that failed for a while is the reaper's to retry (its end comes
        through the watch). False: the pod was gone. K8sApiError: it is refused for good."""
        kwargs: dict[str, Any] = {"_request_timeout": self._retry.request_timeout}
        if grace is not None:
            kwargs["grace_period_seconds"] = grace
        try:
            self._core.delete_namespaced_pod(name, self._ns, **kwargs)
            return True
        except Exception as e:  # classified below
            failure = classify_api_error(e)
        if failure.kind == FailureKind.NOT_FOUND:
            return False
        if not failure.kind.retryable:
            raise K8sApiError(describe(f"delete pod {name}", failure, self._ns), failure)
        self._retry.note(
            logging.WARNING,
            f"k8s API: delete pod {name}: {short_reason(failure)}; trying again in the "
            "background (the rank's next pod waits until this one is gone)",
        )
        self._reaper.delete(name, grace)
        return True

    def shutdown(self, grace_seconds: float = 5.0) -> None:
        """Stop every pod (grace, then force), report each end, remove services and secret.

        Ended pods stay (their logs stay readable) until the master pod is deleted. A pod the
        API server would not let the master delete is reported as such: it may still run.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self._retry.budget_seconds
        with self._lock:
            # created_at is 0.0 for adopted pods: they are stopped too.
            live = [
                r for r in self._records.values() if not r.reported and r.created_at is not None
            ]
            for r in live:
                r.kill_signal = r.kill_signal or int(signal.SIGTERM)
        for r in live:
            r.delete_error = self._delete_by(r.pod_name, max(0, math.ceil(grace_seconds)), deadline)
        self._wait_reported(live, grace_seconds + SHUTDOWN_MARGIN_SECONDS)
        left = [r for r in live if not r.reported]
        for r in left:
            log.warning("pod %s did not end within the grace period; force-deleting", r.pod_name)
            r.delete_error = self._delete_by(r.pod_name, 0, deadline)
        self._wait_reported(left, FORCE_DELETE_WAIT_SECONDS)
        for r in left:
            message = "force-deleted at shutdown"
            if r.delete_error:
                message = (
                    f"could not be deleted at shutdown ({r.delete_error}): it may still run; "
                    f"delete it with `kubectl delete pod {r.pod_name} -n {self._ns}`"
                )
                log.error("pod %s %s", r.pod_name, message)
            self._finish(r, PodEnd(-signal.SIGKILL, message=message, reason="Deleted"))
        self._reaper.close()
        for name in self._reaper.pending():  # ended nodes whose pods (sidecars) still run
            self._delete_by(name, 0, deadline)
        self._troubles.close()
        self._stop_watch()
        self._objects.delete_all()
        close = getattr(self._api, "close", None)
        if callable(close):
            close()

    def _delete_by(self, name: str, grace: int, deadline: float) -> str:
        """A shutdown deletion, retried until `deadline`; why it failed ("" if it did not)."""
        budget = max(deadline - time.monotonic(), 0.1)
        try:
            delete_pod(self._retry, self._core, name, grace, budget_seconds=budget)
        except K8sApiError as e:
            log.error("%s", e)
            return str(e)
        return ""

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
        body = node_pod(self.settings, spec, {})
        name = name or body["metadata"]["name"]
        container = body["spec"]["containers"][0]["name"]
        # Registered before the read: a change after the read arrives through the watch.
        record = _PodRecord(spec=spec, pod_name=name, container=container, created_at=0.0, uid=uid)
        with self._lock:
            self._records[spec.id] = record
            self._objects.adopt(service_name(self.settings.job_name, spec.type, spec.rank))
        selector = f"{self._selector},{LABEL_ID}={spec.id}"
        try:
            pods = self._retry.call(
                f"read pod {name}",
                self._core.list_namespaced_pod,
                self._ns,
                label_selector=selector,
            )
        except K8sApiError:
            with self._lock:
                self._records.pop(spec.id, None)
            raise
        data = self._api.sanitize_for_serialization(pods)
        pod = next(
            (p for p in data.get("items") or [] if p["metadata"]["name"] == name),
            None,
        )
        if pod is not None and uid and pod["metadata"].get("uid") != uid:
            found = pod["metadata"].get("uid")
            log.warning("pod %s was replaced while no master watched (uid %s)", name, found)
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

    @property
    def _ns(self) -> str:
        return self.settings.namespace

    # -- events ----------------------------------------------------------------------------

    def _on_list(self, pods: list[dict[str, Any]], started: float) -> None:
        """Observe every listed pod; an incarnation whose pod is missing from a list read
        after it was created was deleted while the watch was down."""
        self._pods.replace_all(pods)
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
            end = pod_end(r.last_pod or {}, r.container, deleted=True, kill_signal=r.kill_signal)
            self._end(r, end)

    def _observe(self, pod: dict[str, Any], deleted: bool = False) -> None:
        self._pods.update(pod, deleted)
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
        end = pod_end(pod, record.container, deleted=deleted, kill_signal=kill)
        if end is None:
            trouble = pod_trouble(pod)
            self._troubles.observe(record.pod_name, trouble)
            with self._lock:
                held = record.deferred and (
                    trouble is None or trouble.kind != TroubleKind.NODE_NOT_READY
                )
                if held:
                    record.deferred = False
            if held:  # the node is Ready again: the delete held back is made now
                self._reaper.delete(record.pod_name, record.deferred_grace)
            return
        self._end(record, end)

    def _end(self, record: _PodRecord, end: PodEnd) -> None:
        """A node's end as its pod shows it: a lost pod no longer counts as running, one that
        will not end by itself (or whose sidecars run on) is deleted, then the end reported."""
        self._troubles.forget(record.pod_name)
        if end.node_lost:
            self._pods.mark_lost(record.pod_name)
        if end.force_delete and not self._closed:
            self._reaper.delete(record.pod_name, 0)
        self._finish(record, end)

    def _on_trouble_expired(self, pod: str, trouble: PodTrouble, seconds: float) -> None:
        """A pod held up past its limit: an image that never pulled, a node never Ready again."""
        with self._lock:
            record = next(
                (r for r in self._records.values() if r.pod_name == pod and not r.reported), None
            )
        if record is None:
            return
        end = trouble_end(trouble, seconds)
        self._retry.note(logging.WARNING, f"pod {pod}: {end.message}; the node has ended")
        self._end(record, end)

    def _on_fatal(self, error: K8sApiError) -> None:
        """A deletion the API server refuses for good: the job's next platform call fails."""
        log.error("%s", error)
        with self._lock:
            self._fatal = self._fatal or error

    def _raise_fatal(self) -> None:
        with self._lock:
            fatal = self._fatal
        if fatal is not None:
            raise fatal

    def _finish(self, record: _PodRecord, end: PodEnd) -> None:
        """Report an incarnation's end, exactly once."""
        with self._lock:
            if record.reported:
                return
            record.reported = True
            self._ended.notify_all()
        message = end.message
        if end.exit_code != 0 and not record.kill_signal:
            message = with_pod_events(self._core, self._ns, record.pod_name, message)
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
