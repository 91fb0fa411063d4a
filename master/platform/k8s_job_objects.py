"""The objects a job's node pods share: one headless service per rank and the job token secret.

Each is created once, owned like the pods (by the master's Job or pod), and deleted when the
platform shuts down; one left over from an earlier master of the job is taken over or replaced.
Every call goes through the platform's `ApiRetry` (a timeout, retries through what heals).
"""

from __future__ import annotations

import logging
from typing import Any

from master.platform.k8s_errors import FailureKind, K8sApiError
from master.platform.k8s_resources import K8sSettings, dns_label, node_service, token_secret
from master.platform.k8s_retry import ApiRetry

log = logging.getLogger(__name__)


class JobObjects:
    """The per-rank services and the token secret of one job, in the settings' namespace."""

    def __init__(self, core: Any, settings: K8sSettings, owner_uid: str, retry: ApiRetry) -> None:
        self._core = core  # CoreV1Api
        self._retry = retry
        self.settings = settings
        self._owner_uid = owner_uid
        self._services: set[str] = set()
        self.secret = ""  # the token secret's name once this master created it
        self._adopted_secret = ""

    @property
    def _ns(self) -> str:
        return self.settings.namespace

    def ensure_secret(self, token_path: str) -> None:
        """Create the job token secret from the token file, once."""
        if self.secret:
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
        self.secret = body["metadata"]["name"]

    def ensure_service(self, node_type: str, rank: int) -> None:
        """Create the rank's headless service, once."""
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

    def adopt(self, service: str) -> None:
        """A previous master's service (and the job's token secret) are this master's now."""
        self._services.add(service)
        self._adopted_secret = dns_label(self.settings.job_name, "token")

    def delete_all(self) -> None:
        """Delete every service and the secret; failures other than 404 are logged."""
        for name in sorted(self._services):
            self._delete_quietly(self._core.delete_namespaced_service, name)
        if self.secret or self._adopted_secret:
            self._delete_quietly(
                self._core.delete_namespaced_secret, self.secret or self._adopted_secret
            )

    def _create_owned(self, body: dict[str, Any], create, read, delete) -> None:
        """Create an object; one left over from an earlier master of this job is replaced.

        A 409 is also what a create whose answer was lost (a cut connection) gets when retried:
        the object is ours then, and kept. K8sApiError when it cannot be made.
        """
        name, kind = body["metadata"]["name"], body["kind"].lower()
        call = self._retry.call
        try:
            call(f"create {kind} {name}", create, self._ns, body)
            return
        except K8sApiError as e:
            if e.failure.kind != FailureKind.CONFLICT:
                raise
        existing = call(f"read {kind} {name}", read, name, self._ns)
        owners = {o.uid for o in existing.metadata.owner_references or []}
        if self._owner_uid in owners or not self._owner_uid:
            return
        log.info("replacing %s %s left over from an earlier master", kind, name)
        call(f"delete {kind} {name}", delete, name, self._ns)
        call(f"create {kind} {name}", create, self._ns, body)

    def _delete_quietly(self, delete, name: str) -> None:
        try:
            self._retry.call(f"delete {name}", delete, name, self._ns)
        except K8sApiError as e:
            if e.failure.kind != FailureKind.NOT_FOUND:
                log.warning("%s", e)
