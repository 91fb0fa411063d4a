"""The Kubernetes platform's typed settings, read once from the master pod's `DLROVER_K8S_*` env.

`K8sSettings.from_env` is the one place those variables are read; `dlrover submit --platform k8s`
writes them into the master pod (`static_env`). Pure: no `kubernetes` import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_DATA_DIR = "/var/dlrover"
DEFAULT_IMAGE = "dlrover-elastic:latest"
DEFAULT_GRACE_SECONDS = 30
DEFAULT_API_TIMEOUT_SECONDS = 30.0  # one API request (connect, then read)
DEFAULT_API_RETRY_BUDGET_SECONDS = 120.0  # how long one call is retried through 429/5xx/resets
DEFAULT_NODE_LOST_GRACE_SECONDS = 60.0  # a pod's node not Ready this long: the node is lost
DEFAULT_IMAGE_PULL_TIMEOUT_SECONDS = 300.0  # an image pull failing this long ends the node

# The master pod's environment the platform reads (K8sSettings.from_env).
ENV_JOB_NAME = "DLROVER_K8S_JOB_NAME"
ENV_NAMESPACE = "DLROVER_K8S_NAMESPACE"
ENV_IMAGE = "DLROVER_K8S_IMAGE"
ENV_IMAGE_PULL_POLICY = "DLROVER_K8S_IMAGE_PULL_POLICY"
ENV_MASTER_POD_NAME = "DLROVER_K8S_MASTER_POD_NAME"
ENV_MASTER_POD_UID = "DLROVER_K8S_MASTER_POD_UID"
ENV_MASTER_SERVICE = "DLROVER_K8S_MASTER_SERVICE"
# The object that owns every node pod, service and secret: the master's Job, which outlives
# each master pod (a restarted master is a new pod of the same Job).
ENV_OWNER_KIND = "DLROVER_K8S_OWNER_KIND"
ENV_OWNER_API_VERSION = "DLROVER_K8S_OWNER_API_VERSION"
ENV_OWNER_NAME = "DLROVER_K8S_OWNER_NAME"
ENV_OWNER_UID = "DLROVER_K8S_OWNER_UID"
# The label the Job controller puts on the Job's pods: the Job's uid (read by the downward API).
JOB_UID_LABEL = "controller-uid"
MASTER_TOKEN_DIR = "/var/run/dlrover/master-token"  # the node token secret, in the master pod
MASTER_BACKOFF_LIMIT = 5  # master pod restarts before the Job fails (as the local supervisor)
ENV_SHM_SIZE = "DLROVER_K8S_SHM_SIZE"
ENV_DATA_DIR = "DLROVER_K8S_DATA_DIR"
ENV_DATA_CLAIM = "DLROVER_K8S_DATA_CLAIM"
ENV_GRACE_SECONDS = "DLROVER_K8S_GRACE_SECONDS"
# How the platform copes with a real cluster (see docs/platforms.md, "When the cluster misbehaves").
ENV_API_TIMEOUT_SECONDS = "DLROVER_K8S_API_TIMEOUT_SECONDS"
ENV_API_RETRY_BUDGET_SECONDS = "DLROVER_K8S_API_RETRY_BUDGET_SECONDS"
ENV_NODE_LOST_GRACE_SECONDS = "DLROVER_K8S_NODE_LOST_GRACE_SECONDS"
ENV_IMAGE_PULL_TIMEOUT_SECONDS = "DLROVER_K8S_IMAGE_PULL_TIMEOUT_SECONDS"
ENV_PREFIX = "DLROVER_K8S_"


class K8sConfigError(ValueError):
    """A Kubernetes setting is missing or invalid; the message names it and the fix."""


def owner_reference(kind: str, name: str, uid: str, api_version: str = "v1") -> dict[str, Any]:
    """Makes the garbage collector delete the dependent when its owner (the master pod) goes.

    blockOwnerDeletion is left unset: setting it needs update rights on the owner's finalizers.
    """
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": True}


@dataclass(frozen=True)
class K8sSettings:
    """Where and how the platform creates a job's pods; built once from the master pod's env."""

    job_name: str
    namespace: str = "default"
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = ""  # "" = the cluster's default
    master_pod_name: str = ""
    master_pod_uid: str = ""  # a bare master pod (no owner_*): it owns the nodes
    owner_kind: str = ""  # the stable owner of the job's objects, e.g. the master's Job
    owner_api_version: str = ""
    owner_name: str = ""
    owner_uid: str = ""  # "" and no master pod uid: no owner references (master outside)
    master_service: str = ""  # the master's service; nodes dial <service>.<namespace>.svc
    shm_size: str = ""  # sizeLimit of /dev/shm (memory-backed emptyDir), e.g. "2Gi"
    data_dir: str = DEFAULT_DATA_DIR  # run dirs (logs, model, state) live under this path
    data_claim: str = ""  # PVC mounted at data_dir in the master and every node; "" = emptyDir
    grace_seconds: int = DEFAULT_GRACE_SECONDS  # terminationGracePeriodSeconds of node pods
    api_timeout_seconds: float = DEFAULT_API_TIMEOUT_SECONDS
    api_retry_budget_seconds: float = DEFAULT_API_RETRY_BUDGET_SECONDS
    node_lost_grace_seconds: float = DEFAULT_NODE_LOST_GRACE_SECONDS
    image_pull_timeout_seconds: float = DEFAULT_IMAGE_PULL_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if not self.job_name:
            raise K8sConfigError(
                f"{ENV_JOB_NAME} is not set: the Kubernetes platform needs the job name to label "
                "and name its pods. Start the master with `dlrover submit --platform k8s`, "
                f"or set {ENV_JOB_NAME} in the master pod"
            )
        if not self.namespace:
            raise K8sConfigError(f"{ENV_NAMESPACE} is empty. Set it to the job's namespace")
        if self.grace_seconds < 0:
            raise K8sConfigError(f"{ENV_GRACE_SECONDS} must be >= 0, got {self.grace_seconds}")
        for name, env in _SECONDS_ENV.items():
            value = getattr(self, name)
            if not value > 0:
                raise K8sConfigError(f"{env} must be a number of seconds > 0, got {value!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> K8sSettings:
        """The one place the DLROVER_K8S_* variables are read; `overrides` win over them."""
        values: dict[str, Any] = {
            "job_name": env.get(ENV_JOB_NAME, ""),
            "namespace": env.get(ENV_NAMESPACE, "") or "default",
            "image": env.get(ENV_IMAGE, "") or DEFAULT_IMAGE,
            "image_pull_policy": env.get(ENV_IMAGE_PULL_POLICY, ""),
            "master_pod_name": env.get(ENV_MASTER_POD_NAME, ""),
            "master_pod_uid": env.get(ENV_MASTER_POD_UID, ""),
            "owner_kind": env.get(ENV_OWNER_KIND, ""),
            "owner_api_version": env.get(ENV_OWNER_API_VERSION, ""),
            "owner_name": env.get(ENV_OWNER_NAME, ""),
            "owner_uid": env.get(ENV_OWNER_UID, ""),
            "master_service": env.get(ENV_MASTER_SERVICE, ""),
            "shm_size": env.get(ENV_SHM_SIZE, ""),
            "data_dir": env.get(ENV_DATA_DIR, "") or DEFAULT_DATA_DIR,
            "data_claim": env.get(ENV_DATA_CLAIM, ""),
        }
        grace = env.get(ENV_GRACE_SECONDS, "")
        if grace:
            values["grace_seconds"] = _number(ENV_GRACE_SECONDS, grace, int)
        for name, key in _SECONDS_ENV.items():
            if env.get(key, ""):
                values[name] = _number(key, env[key], float)
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in overrides.items():
            if key not in known:
                raise K8sConfigError(
                    f"unknown Kubernetes platform option {key!r}; known: {', '.join(sorted(known))}"
                )
            if value not in (None, ""):
                values[key] = _typed(key, value)
        return cls(**values)

    def static_env(self) -> list[dict[str, str]]:
        """The settings as env entries of the master pod (pod name and uid come from the API)."""
        pairs = {
            ENV_JOB_NAME: self.job_name,
            ENV_IMAGE: self.image,
            ENV_IMAGE_PULL_POLICY: self.image_pull_policy,
            ENV_MASTER_SERVICE: self.master_service,
            ENV_SHM_SIZE: self.shm_size,
            ENV_DATA_DIR: self.data_dir,
            ENV_DATA_CLAIM: self.data_claim,
            ENV_GRACE_SECONDS: str(self.grace_seconds),
            # The cluster-behaviour settings only where they differ from the defaults.
            **{
                key: _seconds_text(getattr(self, name))
                for name, key in _SECONDS_ENV.items()
                if getattr(self, name) != _FIELD_DEFAULTS[name]
            },
            ENV_OWNER_KIND: self.owner_kind,
            ENV_OWNER_API_VERSION: self.owner_api_version,
            ENV_OWNER_NAME: self.owner_name,
        }
        return [{"name": k, "value": v} for k, v in pairs.items() if v]

    def owner(self) -> dict[str, Any] | None:
        """The owner reference of every object the platform creates: the stable owner (the
        master's Job) if set, else the master pod itself (a master that is never restarted)."""
        if self.owner_kind or self.owner_name:
            if not (self.owner_kind and self.owner_name and self.owner_uid):
                raise K8sConfigError(
                    f"{ENV_OWNER_KIND}, {ENV_OWNER_NAME} and {ENV_OWNER_UID} go together "
                    f"(got kind={self.owner_kind!r} name={self.owner_name!r} "
                    f"uid={self.owner_uid!r}); in a Job's pod the uid comes from the label "
                    f"{JOB_UID_LABEL!r} (`dlrover submit --platform k8s` sets all three)"
                )
            return owner_reference(
                self.owner_kind, self.owner_name, self.owner_uid, self.owner_api_version or "v1"
            )
        if not (self.master_pod_uid and self.master_pod_name):
            return None
        return owner_reference("Pod", self.master_pod_name, self.master_pod_uid)

    @property
    def owner_uid_in_use(self) -> str:
        owner = self.owner()
        return owner["uid"] if owner else ""

    def master_host(self) -> str:
        return f"{self.master_service}.{self.namespace}.svc" if self.master_service else ""


# Settings in seconds (floats) and the variable each is read from.
_SECONDS_ENV = {
    "api_timeout_seconds": ENV_API_TIMEOUT_SECONDS,
    "api_retry_budget_seconds": ENV_API_RETRY_BUDGET_SECONDS,
    "node_lost_grace_seconds": ENV_NODE_LOST_GRACE_SECONDS,
    "image_pull_timeout_seconds": ENV_IMAGE_PULL_TIMEOUT_SECONDS,
}
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(K8sSettings)}


def _number(key: str, text: str, kind: type) -> Any:
    """`text` as an int or float, or a K8sConfigError naming the variable."""
    try:
        return kind(text)
    except ValueError:
        what = "a whole number of seconds" if kind is int else "a number of seconds"
        raise K8sConfigError(f"{key}={text!r} is not {what}") from None


def _typed(name: str, value: Any) -> Any:
    """An override (a platform option, maybe a string) as its field's type."""
    if name == "grace_seconds":
        return _number(name, str(value), int)
    if name in _SECONDS_ENV:
        return _number(name, str(value), float)
    return value


def _seconds_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
