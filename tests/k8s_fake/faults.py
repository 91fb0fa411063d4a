"""Failures the fake API server answers instead of serving, per method and path, as a real one does.

A test adds faults to `api.faults` (a `FaultPlan`): each matches a method and a path pattern and
fails the next `times` matching requests (None: all of them) with an HTTP status and a Status
object, or with a connection cut before the request is served (RESET) or after (RESET_AFTER).
Faults are tried in the order they were added, so "429, then 503" is two faults of one request
each. Watch requests are left alone unless a fault asks for them.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

RESET = 0  # the status of a fault that cuts the connection without answering
# ... and of one that serves the request, then cuts the connection instead of answering (a
# create that happened, though the client never heard of it)
RESET_AFTER = -1

# Messages as kube-apiserver and its admission plugins write them ({name}: the object's name).
QUOTA_MESSAGE = (
    'pods "{name}" is forbidden: exceeded quota: compute-resources, requested: limits.cpu=1, '
    "used: limits.cpu=8, limited: limits.cpu=8"
)
POD_SECURITY_MESSAGE = (
    'pods "{name}" is forbidden: violates PodSecurity "restricted:latest": '
    'allowPrivilegeEscalation != false (container "worker" must set '
    "securityContext.allowPrivilegeEscalation=false), runAsNonRoot != true (pod or container "
    '"worker" must set securityContext.runAsNonRoot=true)'
)
RBAC_MESSAGE = (
    'pods is forbidden: User "system:serviceaccount:default:tfjob-master" cannot create '
    'resource "pods" in API group "" in the namespace "default"'
)
_REASONS = {
    403: "Forbidden",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
_MESSAGES = {
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: etcdserver: request timed out",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted",
}


@dataclass
class Fault:
    """One injected failure: what it matches, how it answers, how many requests it fails."""

    method: str  # GET, POST, PUT, PATCH, DELETE or "*"
    path: str  # a regular expression searched in the request's path
    status: int  # an HTTP status, RESET or RESET_AFTER
    message: str = ""  # the Status message ("" = the usual one for the status)
    retry_after_seconds: int | None = None  # a Retry-After header (and details.retryAfterSeconds)
    times: int | None = 1  # None: every matching request
    watch: bool = False  # whether watch requests match too
    hits: int = 0  # requests it failed so far

    @property
    def reason(self) -> str:
        return _REASONS.get(self.status, "InternalError")

    def text(self, name: str) -> str:
        return (self.message or _MESSAGES.get(self.status, "injected failure")).format(name=name)


class FaultPlan:
    """The faults of one fake server, safe to change while it serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(
        self,
        method: str,
        path: str,
        status: int,
        *,
        message: str = "",
        retry_after_seconds: int | None = None,
        times: int | None = 1,
        watch: bool = False,
    ) -> Fault:
        """Fail the next `times` requests of `method` whose path matches `path`."""
        fault = Fault(method.upper(), path, status, message, retry_after_seconds, times, watch)
        with self._lock:
            self._faults.append(fault)
        return fault

    def take(self, method: str, path: str, watch: bool) -> Fault | None:
        """The fault that fails this request, counted; None: serve it."""
        with self._lock:
            for fault in self._faults:
                if fault.times is not None and fault.hits >= fault.times:
                    continue
                if fault.method not in ("*", method) or (watch and not fault.watch):
                    continue
                if re.search(fault.path, path):
                    fault.hits += 1
                    return fault
            return None

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
