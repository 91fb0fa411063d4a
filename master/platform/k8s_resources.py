"""Kubernetes objects of a job as plain dicts: node pods and services, the master's Job and RBAC.

Pure functions, no `kubernetes` import: `dlrover submit --platform k8s --dry-run` works without
the client installed, and tests check every object against the client's models. The settings
the master pod passes to the platform travel as `DLROVER_K8S_*` environment variables; their
names, and the one place that reads them (`K8sSettings.from_env`), are here too.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from master.platform.api import NodeLaunchSpec
from master.platform.pod_guard import guarded_command

LABEL_JOB = "dlrover.io/job"
LABEL_ROLE = "dlrover.io/role"  # "master" or "node"
LABEL_TYPE = "dlrover.io/node-type"
LABEL_RANK = "dlrover.io/rank"
STANDBY = "standby"  # the rank label of a standby node's pod until it takes a rank over
LABEL_ID = "dlrover.io/node-id"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "dlrover"

NODE_PORT = 2222  # every PS/chief/worker serves here; one service per rank keeps it unique
MASTER_PORT = 50051
FS_GROUP = 1000  # the image's `dlrover` user (Dockerfile); lets it read mounted secrets
TOKEN_DIR = "/var/run/dlrover/token"
TOKEN_KEY = "token"
JOB_SPEC_DIR = "/etc/dlrover/job"
JOB_SPEC_KEY = "job.yaml"
DEFAULT_DATA_DIR = "/var/dlrover"
DEFAULT_IMAGE = "dlrover-elastic:latest"
DEFAULT_GRACE_SECONDS = 30

# What the master's service account may do: exactly the calls the platform makes.
MASTER_ROLE_RULES: tuple[dict[str, Any], ...] = (
    # patch: a standby PS pod takes a rank over by its rank label (the rank's service selects it)
    {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["create", "delete", "list", "watch", "patch"],
    },
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "delete", "get"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "delete", "get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
)

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
ENV_PREFIX = "DLROVER_K8S_"


class K8sConfigError(ValueError):
    """A Kubernetes setting is missing or invalid; the message names it and the fix."""


def dns_label(*parts: str, max_len: int = 63) -> str:
    """A DNS-1035 label (service and pod host names) from parts, shortened with a hash if long."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(p for p in parts if p).lower()).strip("-")
    if not name or not name[0].isalpha():
        name = "j-" + name  # DNS-1035 names start with a letter
    if len(name) > max_len:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = name[: max_len - len(digest) - 1].rstrip("-") + "-" + digest
    return name


def rank_label(rank: int) -> str:
    """A rank as a label value and name part; a standby (negative rank) is "standby"."""
    return str(rank) if rank >= 0 else STANDBY


def service_name(job: str, node_type: str, rank: int) -> str:
    """The headless service of one rank: its DNS name is the rank's address for all relaunches."""
    return dns_label(job, node_type, rank_label(rank))


def pod_name(job: str, node_type: str, rank: int, node_id: int) -> str:
    """One pod per incarnation: job, type, rank and the incarnation's id."""
    return dns_label(job, node_type, rank_label(rank), str(node_id))


def master_name(job: str) -> str:
    """Name of the master pod, its service, service account, role and binding."""
    return dns_label(job, "master")


def _quantity_cpu(cpu: float) -> str:
    millis = max(1, round(cpu * 1000))
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def resources(cpu: float, memory_mb: int) -> dict[str, Any]:
    """Requests = limits (guaranteed QoS), so an OOM is the node's own limit, not a neighbour."""
    q: dict[str, str] = {}
    if cpu > 0:
        q["cpu"] = _quantity_cpu(cpu)
    if memory_mb > 0:
        q["memory"] = f"{memory_mb}Mi"
    return {"requests": q, "limits": dict(q)} if q else {}


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
            try:
                values["grace_seconds"] = int(grace)
            except ValueError:
                raise K8sConfigError(
                    f"{ENV_GRACE_SECONDS}={grace!r} is not a whole number of seconds"
                ) from None
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in overrides.items():
            if key not in known:
                raise K8sConfigError(
                    f"unknown Kubernetes platform option {key!r}; known: {', '.join(sorted(known))}"
                )
            if value not in (None, ""):
                values[key] = int(value) if key == "grace_seconds" else value
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


def _meta(
    name: str, namespace: str, labels: Mapping[str, str], owner: Mapping[str, Any] | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if owner:
        meta["ownerReferences"] = [dict(owner)]
    return meta


def job_labels(job: str, role: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ROLE: role, LABEL_MANAGED_BY: MANAGER}


def node_selector_labels(job: str, node_type: str, rank: int) -> dict[str, str]:
    """What a rank's service selects: every incarnation of that rank (never the id)."""
    return {**job_labels(job, "node"), LABEL_TYPE: node_type, LABEL_RANK: rank_label(rank)}


def _data_volume(name: str, claim: str) -> dict[str, Any]:
    if claim:
        return {"name": name, "persistentVolumeClaim": {"claimName": claim}}
    return {"name": name, "emptyDir": {}}


def shm_volume(size: str) -> dict[str, Any]:
    """/dev/shm as memory-backed emptyDir: the default 64 MB is too small for flash checkpoints."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if size:
        empty_dir["sizeLimit"] = size
    return {"name": "dshm", "emptyDir": empty_dir}


def runs_pod_guard(spec: NodeLaunchSpec) -> bool:
    """Whether the node's container starts under master.platform.pod_guard: a node that may
    train (not a PS) in the job's own image, which has this package. Its trainers then report
    progress once a second, the guard handing the master their last positions at the end."""
    return not spec.image and spec.type != "ps"


def node_pod(
    s: K8sSettings, spec: NodeLaunchSpec, env: Mapping[str, str], token_secret: str = ""
) -> dict[str, Any]:
    """The pod of one node incarnation: the spec's command, env and resources, never restarted."""
    labels = {**node_selector_labels(s.job_name, spec.type, spec.rank), LABEL_ID: str(spec.id)}
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "data", "mountPath": s.data_dir},
    ]
    volumes: list[dict[str, Any]] = [shm_volume(s.shm_size), _data_volume("data", s.data_claim)]
    if token_secret:
        mounts.append({"name": "job-token", "mountPath": TOKEN_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "job-token",
                "secret": {"secretName": token_secret, "defaultMode": 0o440},
            }
        )
    command = list(spec.image_command if spec.image and spec.image_command else spec.command)
    if runs_pod_guard(spec):
        command = guarded_command(command)
    container: dict[str, Any] = {
        "name": spec.type,
        "image": spec.image or s.image,
        "command": command,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": [{"name": "node", "containerPort": NODE_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        # The tail of the log becomes the termination message: the master's exit message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    workdir = spec.image_workdir if spec.image else spec.workdir
    if workdir:
        container["workingDir"] = workdir
    if s.image_pull_policy:
        container["imagePullPolicy"] = s.image_pull_policy
    res = resources(spec.cpu, spec.memory_mb)
    if res:
        container["resources"] = res
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(
            pod_name(s.job_name, spec.type, spec.rank, spec.id), s.namespace, labels, s.owner()
        ),
        "spec": {
            "restartPolicy": "Never",  # the master relaunches, with a new id and pod
            "hostname": service_name(s.job_name, spec.type, spec.rank),
            "containers": [container],
            "volumes": volumes,
            "automountServiceAccountToken": False,  # nodes never call the Kubernetes API
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": s.grace_seconds,
            "securityContext": {"fsGroup": FS_GROUP},
        },
    }


def node_service(s: K8sSettings, node_type: str, rank: int) -> dict[str, Any]:
    """Headless service of one rank; publishes the pod's address before it is ready, because
    TF servers dial each other while starting."""
    selector = node_selector_labels(s.job_name, node_type, rank)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            service_name(s.job_name, node_type, rank),
            s.namespace,
            {**selector},
            s.owner(),
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": "node", "port": NODE_PORT, "targetPort": NODE_PORT, "protocol": "TCP"}
            ],
        },
    }


def token_secret(s: K8sSettings, token: str) -> dict[str, Any]:
    """The job token for node pods, mounted as a file (it never appears in a pod spec)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(
            dns_label(s.job_name, "token"), s.namespace, job_labels(s.job_name, "node"), s.owner()
        ),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


# -- what `dlrover submit --platform k8s` creates ------------------------------------------


@dataclass(frozen=True)
class SubmitSettings:
    """A job submitted to a cluster: the job YAML and where its master runs.

    The master runs as a Job that Kubernetes restarts (a new pod) when the master dies, up to
    MASTER_BACKOFF_LIMIT times; the new master resumes the job from the state store. So the
    state must outlive the master pod: `state` is an etcd:// URL, or the run dir (with the
    SQLite state in it) is on the claim `data_claim`.
    """

    job_name: str
    job_yaml: str  # the user's file, verbatim; the master reads it from a ConfigMap
    namespace: str = "default"
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = ""
    shm_size: str = ""
    data_claim: str = ""
    state: str = ""  # etcd://...; "" = SQLite in the run dir (needs data_claim)
    master_cpu: float = 1.0
    master_memory_mb: int = 1024

    def __post_init__(self) -> None:
        if self.state and not self.state.startswith("etcd://"):
            if not self.data_claim or not self.state.startswith(DEFAULT_DATA_DIR + "/"):
                raise K8sConfigError(
                    f"--state {self.state!r}: in a cluster the state must outlive the master "
                    "pod; use --state etcd://HOST:PORT, or --data-claim PVC with the SQLite "
                    f"state under {DEFAULT_DATA_DIR}/ (the default when --state is left out)"
                )
        if not self.state and not self.data_claim:
            raise K8sConfigError(
                "the master's state must outlive the master pod, so that Kubernetes can "
                "restart the master and it resumes the job: pass --state etcd://HOST:PORT "
                "(an etcd the master can reach) or --data-claim PVC (a PersistentVolumeClaim "
                f"mounted at {DEFAULT_DATA_DIR} in the master and every node; the state is "
                "then a SQLite file in the run dir there)"
            )

    def platform(self) -> K8sSettings:
        """The platform settings the master pod passes to its KubernetesPlatform."""
        return K8sSettings(
            job_name=self.job_name,
            namespace=self.namespace,
            image=self.image,
            image_pull_policy=self.image_pull_policy,
            master_service=master_name(self.job_name),
            shm_size=self.shm_size,
            data_claim=self.data_claim,
            owner_kind="Job",
            owner_api_version="batch/v1",
            owner_name=master_name(self.job_name),  # its uid: the pod's JOB_UID_LABEL
        )

    def run_dir(self) -> str:
        """One per Job, shared by its master pods: named by the Job's uid, which Kubernetes
        expands from the container's env ($(VAR) in a command)."""
        return f"{DEFAULT_DATA_DIR}/runs/{self.job_name}-$({ENV_OWNER_UID})"


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def master_command(sub: SubmitSettings) -> list[str]:
    """`dlrover master` as the master's Job runs it: fresh the first time, resumed after."""
    command = [
        "dlrover",
        "master",
        f"{JOB_SPEC_DIR}/{JOB_SPEC_KEY}",
        "--platform",
        "k8s",
        "--host",
        "0.0.0.0",
        "--port",
        str(MASTER_PORT),
        "--run-dir",
        sub.run_dir(),
        # A master pod that finds the job running in the state resumes it (adopting its
        # pods); one that finds it ended exits with its result; else it starts the job.
        "--resume-if-started",
        # A restarted master pod keeps the job token its nodes hold (the node token secret).
        "--job-token-file",
        f"{MASTER_TOKEN_DIR}/{TOKEN_KEY}",
    ]
    if sub.state:
        command += ["--state", sub.state]
    return command


def master_objects(sub: SubmitSettings) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, ConfigMap (job YAML), Service and the master's Job.

    The Job (not its pod) owns the node pods, services and token secret: a master pod that
    dies is replaced by the Job controller and the job's objects stay.
    """
    s = sub.platform()
    name = master_name(sub.job_name)
    ns = sub.namespace
    labels = job_labels(sub.job_name, "master")
    config_map = dns_label(sub.job_name, "job")
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(name, ns, labels, None),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(name, ns, labels, None),
        "rules": [dict(rule) for rule in MASTER_ROLE_RULES],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(name, ns, labels, None),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(config_map, ns, labels, None),
        "data": {JOB_SPEC_KEY: sub.job_yaml},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, ns, labels, None),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(labels),
            "ports": [
                {"name": "grpc", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}
            ],
        },
    }
    env = [
        _field_env(ENV_NAMESPACE, "metadata.namespace"),
        _field_env(ENV_MASTER_POD_NAME, "metadata.name"),
        _field_env(ENV_MASTER_POD_UID, "metadata.uid"),
        _field_env(ENV_OWNER_UID, f"metadata.labels['{JOB_UID_LABEL}']"),
        *s.static_env(),
    ]
    container: dict[str, Any] = {
        "name": "master",
        "image": sub.image,
        "command": master_command(sub),
        "env": env,
        "ports": [{"name": "grpc", "containerPort": MASTER_PORT, "protocol": "TCP"}],
        "resources": resources(sub.master_cpu, sub.master_memory_mb),
        "volumeMounts": [
            {"name": "job-spec", "mountPath": JOB_SPEC_DIR, "readOnly": True},
            {"name": "data", "mountPath": s.data_dir},
            {"name": "job-token", "mountPath": MASTER_TOKEN_DIR, "readOnly": True},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if sub.image_pull_policy:
        container["imagePullPolicy"] = sub.image_pull_policy
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(name, ns, labels, None),
        "spec": {
            "backoffLimit": MASTER_BACKOFF_LIMIT,
            "podFailurePolicy": {
                "rules": [
                    # 1: the job failed (or the master hit an error, which fails the job);
                    # 2: bad configuration. A new master pod would change neither.
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": "master",
                            "operator": "In",
                            "values": [1, 2],
                        },
                    },
                    # Evicted or preempted: restart the master without counting it.
                    {
                        "action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    },
                ]
            },
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "serviceAccountName": name,
                    "restartPolicy": "Never",  # a dead master is a new pod (podFailurePolicy)
                    # The hostname equals the service name, so the address the master
                    # advertises (its hostname) resolves from every pod of the namespace.
                    "hostname": name,
                    "containers": [container],
                    "volumes": [
                        {"name": "job-spec", "configMap": {"name": config_map}},
                        _data_volume("data", sub.data_claim),
                        {
                            # Made by the first master for its nodes; there for later ones.
                            "name": "job-token",
                            "secret": {
                                "secretName": dns_label(sub.job_name, "token"),
                                "defaultMode": 0o440,
                                "optional": True,
                            },
                        },
                    ],
                    "securityContext": {"fsGroup": FS_GROUP},
                },
            },
        },
    }
    return [account, role, binding, config, service, job]
