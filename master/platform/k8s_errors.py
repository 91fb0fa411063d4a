"""What a failed Kubernetes API call means: retry it, or fail with its cause named.

Pure functions of the exception (no `kubernetes` import): 429, 5xx, timeouts and cut connections
heal and are retried (a 429's `Retry-After` says when); a 403 names its cause from the server's
message (RBAC, a ResourceQuota, Pod Security admission, an admission webhook); 422 is an invalid
object. `api_error_message` turns any of them into one line with the fix.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from master.platform.api import PlatformError

RETRY_AFTER_MAX_SECONDS = 60.0  # a server's Retry-After is honoured up to this
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class FailureKind(str, enum.Enum):
    """The cause of a failed API call; `retryable` kinds may heal by themselves."""

    TRANSIENT = "transient"  # 429, 5xx, a timeout, a refused or cut connection
    QUOTA = "quota"  # 403: a ResourceQuota of the namespace is used up (heals as pods end)
    RBAC = "rbac"  # 403: the service account may not make this call
    POD_SECURITY = "pod_security"  # 403: Pod Security admission refuses the pod
    ADMISSION = "admission"  # an admission webhook refused the object
    INVALID = "invalid"  # 422 (or 400): the object itself is wrong
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # 409: exists already, or changed meanwhile
    OTHER = "other"

    @property
    def retryable(self) -> bool:
        return self in (FailureKind.TRANSIENT, FailureKind.QUOTA)


@dataclass(frozen=True)
class ApiFailure:
    """One failed call: its kind, HTTP status (None without a response), the server's message
    and how long the server asked the client to wait (None: it did not say)."""

    kind: FailureKind
    status: int | None
    detail: str
    retry_after_seconds: float | None = None


class K8sApiError(PlatformError):
    """An API call failed for good (or past the retry budget); `failure` says why."""

    def __init__(self, message: str, failure: ApiFailure) -> None:
        super().__init__(message)
        self.failure = failure


def _server_message(e: BaseException) -> tuple[str, dict[str, Any]]:
    """The Status object's message and details in the response body, if any."""
    body = getattr(e, "body", None)
    if body:
        try:
            status = json.loads(body)
        except (ValueError, TypeError):
            return str(body)[:500], {}
        if isinstance(status, dict):
            return str(status.get("message") or ""), status.get("details") or {}
    return "", {}


def _retry_after(e: BaseException, details: dict[str, Any]) -> float | None:
    """Seconds from the Retry-After header, else the Status details' retryAfterSeconds."""
    headers = getattr(e, "headers", None) or {}
    raw = headers.get("Retry-After") if hasattr(headers, "get") else None
    if raw is None:
        raw = details.get("retryAfterSeconds")
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        return None  # absent, or an HTTP date (never sent by the API server)
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_SECONDS)


def _is_connection_error(e: BaseException) -> bool:
    """A refused, reset or timed-out connection (OSError, http.client or urllib3 errors)."""
    import http.client

    if isinstance(e, (OSError, http.client.HTTPException)):
        return True
    try:
        from urllib3.exceptions import HTTPError
    except ImportError:  # the kubernetes client brings urllib3; without it no call was made
        return False
    return isinstance(e, HTTPError)


def _forbidden_kind(message: str) -> FailureKind:
    text = message.lower()
    if "quota" in text:
        return FailureKind.QUOTA
    if "podsecurity" in text or "pod security" in text:
        return FailureKind.POD_SECURITY
    if "admission webhook" in text:
        return FailureKind.ADMISSION
    return FailureKind.RBAC


def classify_api_error(e: BaseException) -> ApiFailure:
    """What a failed call's exception means (an ApiException, a urllib3 error, an OSError)."""
    status = getattr(e, "status", None)
    if not isinstance(status, int) or status <= 0:
        text = f"{type(e).__name__}: {e}".rstrip(": ")
        if _is_connection_error(e):  # no HTTP answer: refused, cut, timed out
            return ApiFailure(FailureKind.TRANSIENT, None, text)
        return ApiFailure(FailureKind.OTHER, None, text)  # a bug, not the cluster: no retry
    message, details = _server_message(e)
    detail = message or str(getattr(e, "reason", "") or e)
    if status in TRANSIENT_STATUSES:
        kind = FailureKind.TRANSIENT
    elif status == 403:
        kind = _forbidden_kind(message)
    elif status in (400, 422):
        webhook = "admission webhook" in detail.lower()
        kind = FailureKind.ADMISSION if webhook else FailureKind.INVALID
    elif status in (404, 410):
        kind = FailureKind.NOT_FOUND
    elif status == 409:
        kind = FailureKind.CONFLICT
    else:
        kind = FailureKind.OTHER
    return ApiFailure(kind, status, detail, _retry_after(e, details))


def describe(action: str, failure: ApiFailure, namespace: str) -> str:
    """One clear line for a failed call, naming its cause and what to change."""
    detail = failure.detail
    kind = failure.kind
    if kind == FailureKind.RBAC:
        return (
            f"{action}: forbidden by RBAC ({detail}). The master's service account needs the "
            f"role in examples/k8s/rbac.yaml in namespace {namespace!r}; "
            "`dlrover submit --platform k8s` creates it"
        )
    if kind == FailureKind.QUOTA:
        return (
            f"{action}: refused by a ResourceQuota of namespace {namespace!r} ({detail}). "
            f"Free the quota (kubectl describe resourcequota -n {namespace}), raise it, or ask "
            "the job for less cpu/memory or fewer replicas"
        )
    if kind == FailureKind.POD_SECURITY:
        return (
            f"{action}: refused by Pod Security admission in namespace {namespace!r} "
            f"({detail}). Run the job in a namespace whose pod-security.kubernetes.io/enforce "
            "level admits the pod, or change the pod as the message says"
        )
    if kind == FailureKind.ADMISSION:
        return f"{action}: refused by an admission webhook ({detail})"
    if kind == FailureKind.INVALID:
        return f"{action}: the API server finds the object invalid ({failure.status}: {detail})"
    status = failure.status or "error"
    return f"{action}: {status} {detail}".strip()


def api_error_message(action: str, e: BaseException, namespace: str) -> str:
    """`describe` for an exception."""
    return describe(action, classify_api_error(e), namespace)


def short_reason(failure: ApiFailure) -> str:
    """A few words for a retry line: '429 (retry after 2s)', '503 Service Unavailable', ..."""
    if failure.status is None:
        return re.sub(r"\s+", " ", failure.detail)[:160]
    words = f"{failure.status} {failure.detail}".strip()[:160]
    if failure.retry_after_seconds is not None:
        words += f" (retry after {failure.retry_after_seconds:g}s)"
    return words
