"""A node pod's environment: the job's env without the master pod's own variables, the master
reached through its service, the job token read from the mounted secret; and the Warning events
Kubernetes recorded about a pod, for the message of its end."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from master.client import ENV_JOB_TOKEN_FILE, ENV_MASTER_ADDR
from master.platform.k8s_resources import TOKEN_DIR, TOKEN_KEY

log = logging.getLogger(__name__)

EVENTS_TIMEOUT_SECONDS = 5.0
MAX_EVENT_LINES = 3

# Variables the kubelet sets in the master's own pod; a node pod gets its own, not the master's.
_POD_LOCAL_ENV = re.compile(
    r"^(HOSTNAME|HOME|KUBERNETES_\w*|DLROVER_K8S_\w*|\w+_SERVICE_(HOST|PORT\w*)"
    r"|\w+_PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)


def node_pod_env(
    env: Mapping[str, str], master_host: str, advertised_host: str
) -> tuple[dict[str, str], str]:
    """The node's env for its pod, and the master's token file to put in the token secret
    ("" without one). `master_host`: the master's service name ("" = none); the master's
    address is rewritten to it where it names `advertised_host`."""
    out = {k: v for k, v in env.items() if not (_POD_LOCAL_ENV.match(k) and os.environ.get(k) == v)}
    addr = out.get(ENV_MASTER_ADDR, "")
    host, _, port = addr.rpartition(":")
    if master_host and host and host == advertised_host:
        out[ENV_MASTER_ADDR] = f"{master_host}:{port}"
    token_path = out.get(ENV_JOB_TOKEN_FILE, "")
    if token_path:
        out[ENV_JOB_TOKEN_FILE] = f"{TOKEN_DIR}/{TOKEN_KEY}"
    return out, token_path


def with_pod_events(core: Any, namespace: str, pod: str, message: str) -> str:
    """Warnings Kubernetes recorded about the pod (eviction, node trouble), then `message`
    (the log tail stays last: the master quotes the last line). Best effort: one quick read."""
    try:
        events = core.list_namespaced_event(
            namespace,
            field_selector=f"involvedObject.name={pod}",
            _request_timeout=EVENTS_TIMEOUT_SECONDS,
        )
    except Exception as e:  # the end is reported without them
        log.debug("events of pod %s: %s", pod, e)
        return message
    lines: list[str] = []
    for ev in events.items or []:
        if ev.type == "Warning" and ev.reason:
            line = f"k8s event {ev.reason}: {ev.message or ''}".strip()
            if line not in lines:
                lines.append(line)
    return "\n".join([*lines[-MAX_EVENT_LINES:], message]).strip()
