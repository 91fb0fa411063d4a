"""The object store behind the fake API server: objects, resourceVersions, watch history, GC.

It behaves like the parts of etcd + kube-apiserver + garbage collector the platform relies on:
one global resourceVersion bumped on every write, a history of changes that watches replay from
a resourceVersion (and that `compact()` truncates, so older resourceVersions answer 410 Gone),
pod deletion with a grace period that a (fake) kubelet completes, and owner-reference garbage
collection when an owner is removed.
"""

from __future__ import annotations

import base64
import copy
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.k8s_fake.selectors import parse_field_selector, parse_label_selector

CORE = "v1"
RBAC = "rbac.authorization.k8s.io/v1"
BATCH = "batch/v1"

# (groupVersion, resource) -> kind. Everything else answers 404.
KINDS: dict[tuple[str, str], str] = {
    (CORE, "pods"): "Pod",
    (CORE, "services"): "Service",
    (CORE, "events"): "Event",
    (CORE, "secrets"): "Secret",
    (CORE, "configmaps"): "ConfigMap",
    (CORE, "serviceaccounts"): "ServiceAccount",
    (RBAC, "roles"): "Role",
    (RBAC, "rolebindings"): "RoleBinding",
    (BATCH, "jobs"): "Job",
}
DEFAULT_POD_GRACE_SECONDS = 30
TERMINAL_PHASES = ("Succeeded", "Failed")

Key = tuple[str, str, str, str]  # groupVersion, resource, namespace, name


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ApiError(Exception):
    """An error the server answers with a Status object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> dict[str, Any]:
        return status_object(self.code, self.reason, self.message)


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class _Change:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    gv: str
    resource: str
    namespace: str
    obj: dict[str, Any]


@dataclass(eq=False)
class Watcher:
    """One open watch stream: where it is in the history and what it selects."""

    gv: str
    resource: str
    namespace: str | None
    label_pred: Callable[[Any], bool]
    field_pred: Callable[[Any], bool]
    cursor: int
    initial: list[dict[str, Any]] = field(default_factory=list)
    expired: bool = False
    dropped: bool = False
    abrupt: bool = False

    def matches(self, change: _Change) -> bool:
        if (change.gv, change.resource) != (self.gv, self.resource):
            return False
        if self.namespace is not None and change.namespace != self.namespace:
            return False
        labels = change.obj.get("metadata", {}).get("labels") or {}
        return self.label_pred(labels) and self.field_pred(change.obj)


class ObjectStore:
    """Thread-safe object storage with watch history; the HTTP layer and the kubelet use it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._objects: dict[Key, dict[str, Any]] = {}
        self._rv = 0
        self._history: list[_Change] = []
        self.horizon = 0  # watches from a resourceVersion below this are expired (410)
        self._watchers: set[Watcher] = set()
        self._timers: list[threading.Timer] = []
        self._closed = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        # The fake kubelet: how long a graceful pod deletion takes, and the exit code a
        # container reports after SIGTERM (per pod name, else the default).
        self.kubelet_delay = 0.05
        self.sigterm_exit_code = 143
        self.sigterm_exit_codes: dict[str, int] = {}
        self.unreachable: set[tuple[str, str]] = set()  # pods on a lost node never terminate
        # While set, watch requests are refused with 503 (the master cannot reach the server).
        self.refuse_watches = False

    # -- bookkeeping -----------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    def log_request(self, method: str, path: str, params: dict[str, str]) -> None:
        with self._lock:
            self.requests.append((method, path, dict(params)))

    def _bump(self, obj: dict[str, Any]) -> int:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        return self._rv

    def _record(self, kind: str, key: Key, obj: dict[str, Any]) -> None:
        self._history.append(_Change(self._rv, kind, key[0], key[1], key[2], copy.deepcopy(obj)))
        self._changed.notify_all()

    def compact(self) -> int:
        """Forget the history: new watches from any resourceVersion before now get 410 Gone.

        Open watches still receive what they have not read yet, as from the real watch cache.
        """
        with self._lock:
            self.horizon = self._rv
            keep_after = min([w.cursor for w in self._watchers] + [self.horizon])
            self._history = [c for c in self._history if c.rv > keep_after]
            return self.horizon

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for timer in self._timers:
                timer.cancel()
            for w in self._watchers:
                w.dropped = True
            self._changed.notify_all()

    # -- CRUD --------------------------------------------------------------------

    @staticmethod
    def kind_of(gv: str, resource: str) -> str:
        kind = KINDS.get((gv, resource))
        if kind is None:
            raise ApiError(404, "NotFound", f"the server could not find resource {resource!r}")
        return kind

    def create(self, gv: str, resource: str, namespace: str, body: dict[str, Any]) -> dict:
        kind = self.kind_of(gv, resource)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise ApiError(422, "Invalid", f"{kind}: metadata.name: Required value")
        if obj.get("kind", kind) != kind:
            raise ApiError(400, "BadRequest", f"kind {obj.get('kind')!r} posted to {resource}")
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the object does not match the URL")
        obj["kind"], obj["apiVersion"] = kind, gv
        meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        _validate(kind, obj)
        _defaults(kind, obj)
        key = (gv, resource, namespace, meta["name"])
        with self._lock:
            if key in self._objects:
                raise ApiError(409, "AlreadyExists", f'{resource} "{meta["name"]}" already exists')
            self._bump(obj)
            self._objects[key] = obj
            self._record("ADDED", key, obj)
            return copy.deepcopy(obj)

    def get(self, gv: str, resource: str, namespace: str, name: str) -> dict[str, Any]:
        self.kind_of(gv, resource)
        with self._lock:
            obj = self._objects.get((gv, resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            return copy.deepcopy(obj)

    def list(
        self,
        gv: str,
        resource: str,
        namespace: str | None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        self.kind_of(gv, resource)
        label_pred = parse_label_selector(label_selector)
        field_pred = parse_field_selector(field_selector)
        with self._lock:
            items = [
                copy.deepcopy(obj)
                for (g, r, ns, _), obj in sorted(self._objects.items())
                if (g, r) == (gv, resource)
                and (namespace is None or ns == namespace)
                and label_pred(obj["metadata"].get("labels") or {})
                and field_pred(obj)
            ]
            return items, self._rv

    def replace(self, gv: str, resource: str, namespace: str, name: str, body: dict) -> dict:
        with self._lock:
            current = self.get(gv, resource, namespace, name)
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv and rv != current["metadata"]["resourceVersion"]:
                raise ApiError(
                    409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}"'
                )
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "namespace", "name"):
                meta[k] = current["metadata"][k]
            obj["kind"], obj["apiVersion"] = current["kind"], gv
            if "status" in current and "status" not in obj:
                obj["status"] = current["status"]
            return self._write((gv, resource, namespace, name), obj)

    def patch(
        self, gv: str, resource: str, namespace: str, name: str, patch: Any, content_type: str
    ) -> dict[str, Any]:
        with self._lock:
            current = self.get(gv, resource, namespace, name)
            if "json-patch" in content_type:
                obj = _json_patch(current, patch)
            else:  # merge-patch and strategic-merge-patch (lists are replaced, not merged)
                obj = _merge_patch(current, patch)
            for k in ("uid", "name", "namespace"):
                obj["metadata"][k] = current["metadata"][k]
            return self._write((gv, resource, namespace, name), obj)

    def update(
        self, gv: str, resource: str, namespace: str, name: str, mutate: Callable[[dict], None]
    ) -> dict[str, Any]:
        """Change an object in place (what controllers and the kubelet do)."""
        with self._lock:
            obj = self.get(gv, resource, namespace, name)
            mutate(obj)
            return self._write((gv, resource, namespace, name), obj)

    def _write(self, key: Key, obj: dict[str, Any]) -> dict[str, Any]:
        self._bump(obj)
        self._objects[key] = obj
        self._record("MODIFIED", key, obj)
        return copy.deepcopy(obj)

    def delete(
        self,
        gv: str,
        resource: str,
        namespace: str,
        name: str,
        grace_seconds: int | None = None,
        propagation: str | None = None,
    ) -> dict[str, Any]:
        """Delete an object; pods with a grace period go through the kubelet first."""
        key = (gv, resource, namespace, name)
        if (gv, resource) == (BATCH, "jobs") and propagation is None:
            # batch/v1 Jobs keep their old default: dependents are orphaned unless the client
            # asks for cascading (kubectl does: propagationPolicy=Background).
            propagation = "Orphan"
        with self._lock:
            obj = self.get(gv, resource, namespace, name)
            if (gv, resource) != (CORE, "pods"):
                return self._remove(key, propagation)
            spec, status, meta = obj.get("spec", {}), obj.get("status", {}), obj["metadata"]
            if grace_seconds is None:
                grace_seconds = spec.get("terminationGracePeriodSeconds", DEFAULT_POD_GRACE_SECONDS)
            immediate = (
                grace_seconds == 0
                or not spec.get("nodeName")  # never scheduled: nothing to stop
                or status.get("phase") in TERMINAL_PHASES
            )
            if immediate:
                return self._remove(key, propagation)
            if meta.get("deletionTimestamp"):
                return obj  # already terminating; a longer grace period does not restart it
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = grace_seconds
            obj = self._write(key, obj)
            if (namespace, name) not in self.unreachable and not self._closed:
                timer = threading.Timer(
                    self.kubelet_delay, self._kubelet_finish, args=(namespace, name, meta["uid"])
                )
                timer.daemon = True
                self._timers.append(timer)
                timer.start()
            return obj

    def _kubelet_finish(self, namespace: str, name: str, uid: str) -> None:
        """The kubelet side of a graceful deletion: SIGTERM the container, report, remove."""
        code = self.sigterm_exit_codes.get(name, self.sigterm_exit_code)
        with self._lock:
            key = (CORE, "pods", namespace, name)
            obj = self._objects.get(key)
            if obj is None or obj["metadata"]["uid"] != uid or self._closed:
                return
            if obj.get("status", {}).get("phase") not in TERMINAL_PHASES:
                reason = "Completed" if code == 0 else "Error"
                obj = copy.deepcopy(obj)
                terminate_containers(obj, code, reason, "")
                self._write(key, obj)
            self._remove(key, None)

    def _remove(self, key: Key, propagation: str | None) -> dict[str, Any]:
        obj = self._objects.pop(key)
        self._bump(obj)
        self._record("DELETED", key, obj)
        if propagation != "Orphan":
            self._collect_dependents(obj["metadata"]["uid"])
        else:
            self._orphan_dependents(obj["metadata"]["uid"])
        return copy.deepcopy(obj)

    def _orphan_dependents(self, owner_uid: str) -> None:
        """Orphan propagation: the dependents stay, without their reference to the owner."""
        for key, obj in list(self._objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            kept = [r for r in refs if r.get("uid") != owner_uid]
            if len(kept) != len(refs):
                obj = copy.deepcopy(obj)
                obj["metadata"]["ownerReferences"] = kept
                self._write(key, obj)

    def _collect_dependents(self, owner_uid: str) -> None:
        """The garbage collector: delete everything whose ownerReferences name `owner_uid`."""
        dependents = [
            key
            for key, obj in self._objects.items()
            if any(
                ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or []
            )
        ]
        for key in dependents:
            if key in self._objects:
                self.delete(*key)

    # -- watch -------------------------------------------------------------------

    def open_watch(
        self,
        gv: str,
        resource: str,
        namespace: str | None,
        label_selector: str | None,
        field_selector: str | None,
        resource_version: str | None,
    ) -> Watcher:
        self.kind_of(gv, resource)
        with self._lock:
            w = Watcher(
                gv,
                resource,
                namespace,
                parse_label_selector(label_selector),
                parse_field_selector(field_selector),
                cursor=self._rv,
            )
            if resource_version in (None, "", "0"):
                # No starting point: synthetic ADDED events for what exists now.
                items, _ = self.list(gv, resource, namespace, label_selector, field_selector)
                w.initial = items
            else:
                try:
                    rv = int(resource_version)
                except ValueError:
                    raise ApiError(400, "BadRequest", "invalid resourceVersion") from None
                if rv < self.horizon:
                    w.expired = True
                w.cursor = rv
            self._watchers.add(w)
            return w

    def next_changes(self, w: Watcher, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        """Changes after the watcher's cursor, waiting up to `timeout` for the first one."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = [c for c in self._history if c.rv > w.cursor and w.matches(c)]
                if self._history:
                    w.cursor = max(w.cursor, self._history[-1].rv)
                if found or w.dropped:
                    return [(c.type, copy.deepcopy(c.obj)) for c in found]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._changed.wait(remaining)

    def close_watch(self, w: Watcher) -> None:
        with self._lock:
            self._watchers.discard(w)

    def open_watch_count(self) -> int:
        with self._lock:
            return len(self._watchers)

    def drop_watches(self, abrupt: bool = False) -> int:
        """End every open watch stream: cleanly, or by cutting the connection (abrupt)."""
        with self._lock:
            for w in self._watchers:
                w.dropped = True
                w.abrupt = abrupt
            self._changed.notify_all()
            return len(self._watchers)

    def all_objects(self) -> Iterable[tuple[Key, dict[str, Any]]]:
        with self._lock:
            return [(k, copy.deepcopy(v)) for k, v in self._objects.items()]


def terminate_containers(pod: dict[str, Any], exit_code: int, reason: str, message: str) -> None:
    """Mark every container of `pod` terminated and set the phase restartPolicy Never gives."""
    status = pod.setdefault("status", {})
    now = now_rfc3339()
    statuses = []
    for c in pod.get("spec", {}).get("containers", []):
        old = next((s for s in status.get("containerStatuses") or [] if s["name"] == c["name"]), {})
        started = (old.get("state", {}).get("running") or {}).get("startedAt", now)
        terminated = {"exitCode": exit_code, "reason": reason, "startedAt": started}
        terminated["finishedAt"] = now
        if message:
            terminated["message"] = message
        statuses.append(
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "started": False,
                "state": {"terminated": terminated},
            }
        )
    status["containerStatuses"] = statuses
    status["phase"] = "Succeeded" if exit_code == 0 else "Failed"
    status["conditions"] = [
        {"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now}
    ]


def _validate(kind: str, obj: dict[str, Any]) -> None:
    """The API server's checks on create that our objects could fail (422 Invalid)."""
    if kind != "Job":
        return
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    policy = (template.get("spec") or {}).get("restartPolicy")
    if policy not in ("Never", "OnFailure"):
        raise ApiError(
            422,
            "Invalid",
            f'Job.batch "{obj["metadata"]["name"]}" is invalid: spec.template.spec.restartPolicy:'
            f' Unsupported value: "{policy}": supported values: "OnFailure", "Never"',
        )
    if spec.get("podFailurePolicy") and policy != "Never":
        raise ApiError(
            422,
            "Invalid",
            f'Job.batch "{obj["metadata"]["name"]}" is invalid: spec.podFailurePolicy: only '
            'allowed when spec.template.spec.restartPolicy is "Never"',
        )
    containers = {c["name"] for c in (template.get("spec") or {}).get("containers") or []}
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        name = (rule.get("onExitCodes") or {}).get("containerName")
        if name and name not in containers:
            raise ApiError(
                422,
                "Invalid",
                f"spec.podFailurePolicy.rules.onExitCodes.containerName: {name!r} is not a "
                "container of the pod template",
            )


def _defaults(kind: str, obj: dict[str, Any]) -> None:
    """What the API server fills in on create."""
    if kind == "Pod":
        obj.setdefault("spec", {})
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    elif kind == "Service":
        spec = obj.setdefault("spec", {})
        if spec.get("clusterIP") != "None":
            spec["clusterIP"] = f"10.96.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}"
        spec["clusterIPs"] = [spec["clusterIP"]]
        spec.setdefault("type", "ClusterIP")
    elif kind == "Job":
        # Without manualSelector the server selects the Job's pods by its own uid, and labels
        # the pod template with it (new and legacy label names), as the real one does.
        uid, name = obj["metadata"]["uid"], obj["metadata"]["name"]
        spec = obj.setdefault("spec", {})
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
        labels.update(
            {
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
            }
        )
        obj["status"] = {}
    elif kind == "Secret":
        data = obj.setdefault("data", {})
        for k, v in (obj.pop("stringData", None) or {}).items():
            data[k] = base64.b64encode(v.encode()).decode()
        obj.setdefault("type", "Opaque")


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = _merge_patch(result.get(k), v)
    return result


def _json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 JSON patch: add, replace and remove."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = parts[-1]
        if op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif op["op"] == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif op["op"] == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
        else:
            raise ApiError(422, "Invalid", f"unsupported JSON patch op {op['op']!r}")
    return doc
