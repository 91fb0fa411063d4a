"""The pod calls the platform makes through its `ApiRetry`, with what each answer means.

A create retried after its answer was lost (a cut connection) gets 409 for the pod it made: that
pod is taken as made. A delete of a pod already gone is no failure.
"""

from __future__ import annotations

from typing import Any

from master.platform.k8s_errors import FailureKind, K8sApiError
from master.platform.k8s_pod_end import TERMINAL_PHASES
from master.platform.k8s_retry import ApiRetry


def create_pod(
    retry: ApiRetry, core: Any, body: dict[str, Any], selector: str, owner_uid: str
) -> str:
    """Create the pod `body`; its uid. `selector` selects exactly this incarnation's pods (its
    id label), `owner_uid` is the owner the platform gives its pods ("" = none)."""
    name = body["metadata"]["name"]
    try:
        created = retry.call(
            f"create pod {name}", core.create_namespaced_pod, retry.namespace, body
        )
        return getattr(created.metadata, "uid", "") or ""
    except K8sApiError as e:
        if e.failure.kind != FailureKind.CONFLICT:
            raise
        conflict = e
    pods = retry.call(
        f"read pod {name}", core.list_namespaced_pod, retry.namespace, label_selector=selector
    )
    for pod in pods.items or []:
        owners = {o.uid for o in pod.metadata.owner_references or []}
        ours = not owner_uid or owner_uid in owners
        if pod.metadata.name == name and ours and pod.status.phase not in TERMINAL_PHASES:
            return pod.metadata.uid or ""
    raise conflict  # a namesake from elsewhere (an earlier job of the same name)


def delete_pod(retry: ApiRetry, core: Any, name: str, grace: int | None, **options: Any) -> bool:
    """Delete a pod through `retry` (grace None: its own grace period); False if it was gone.

    Raises K8sApiError when the delete cannot be made (a 403, or the budget spent)."""
    kwargs: dict[str, Any] = dict(options)
    if grace is not None:
        kwargs["grace_period_seconds"] = grace
    try:
        retry.call(
            f"delete pod {name}", core.delete_namespaced_pod, name, retry.namespace, **kwargs
        )
    except K8sApiError as e:
        if e.failure.kind == FailureKind.NOT_FOUND:
            return False
        raise
    return True
