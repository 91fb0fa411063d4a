"""Kubernetes objects of a job as plain dicts: node pods and services, the master's Job and RBAC.

Pure functions, no `kubernetes` import: `dlrover submit --platform k8s --dry-run` works without
the client installed, and tests check every object against the client's models. The settings
the master pod passes to the platform (`DLROVER_K8S_*`) are in `k8s_settings`, re-exported here.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from master.platform.api import NodeLaunchSpec
from master.platform.k8s_settings import (  # noqa: F401 (re-exported: the names callers know)
    DEFAULT_DATA_DIR,
    DEFAULT_GRACE_SECONDS,
    DEFAULT_IMAGE,
    ENV_DATA_CLAIM,
    ENV_DATA_DIR,
    ENV_GRACE_SECONDS,
    ENV_IMAGE,
    ENV_IMAGE_PULL_POLICY,
    ENV_JOB_NAME,
    ENV_MASTER_POD_NAME,
    ENV_MASTER_POD_UID,
    ENV_MASTER_SERVICE,
    ENV_NAMESPACE,
    ENV_OWNER_API_VERSION,
    ENV_OWNER_KIND,
    ENV_OWNER_NAME,
    ENV_OWNER_UID,
    ENV_PREFIX,
    ENV_SHM_SIZE,
    JOB_UID_LABEL,
    MASTER_BACKOFF_LIMIT,
    MASTER_TOKEN_DIR,
    K8sConfigError,
    K8sSettings,
    owner_reference,
)
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
                    # 2: bad configuration; 3: the user stopped the job. A new master pod would
                    # change none of them.
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": "master",
                            "operator": "In",
                            "values": [1, 2, 3],
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
