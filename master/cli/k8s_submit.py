"""`dlrover submit --platform k8s JOB.yaml`: start a job's master pod in a cluster.

Creates the master's ServiceAccount, Role and RoleBinding (what the platform needs: pods,
services, secrets, events), a ConfigMap holding the job YAML verbatim, the master's headless
Service and the master's Job, then makes the Job the owner of the others so that
`kubectl delete job <job>-master` removes the whole job. The Job restarts a master that dies
(a new pod, which resumes the job from the state store and adopts the node pods). With
`--dry-run` it prints the same objects as YAML (for `kubectl apply -f -`) and touches no
cluster.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import yaml

from master.config import JobSpec
from master.platform.k8s_resources import (
    DEFAULT_IMAGE,
    K8sConfigError,
    SubmitSettings,
    master_objects,
    owner_reference,
)

log = logging.getLogger(__name__)


def build_objects(
    spec: JobSpec,
    job_yaml: str,
    namespace: str = "default",
    image: str = DEFAULT_IMAGE,
    state: str = "",
    data_claim: str = "",
) -> list[dict[str, Any]]:
    """Every object of a submitted job, as API dicts in creation order (the Job last)."""
    return master_objects(
        SubmitSettings(
            job_name=spec.name,
            job_yaml=job_yaml,
            namespace=namespace,
            image=image,
            state=state,
            data_claim=data_claim,
        )
    )


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the job YAML inside the ConfigMap) as readable `|` blocks."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_representer)


def render_yaml(objects: list[dict[str, Any]]) -> str:
    """A multi-document YAML stream of the objects, with a header saying how to use it."""
    job = objects[-1]["metadata"]["labels"].get("dlrover.io/job", "")
    header = (
        "# Objects of `dlrover submit --platform k8s` (dry run). Apply with: kubectl apply -f -\n"
        "# Applied this way, only the node pods, services and token secret are owned by the\n"
        "# master's Job; remove the rest with: kubectl delete job,service,configmap,"
        f"serviceaccount,role,rolebinding -l dlrover.io/job={job}\n"
        "# The Job restarts a master that dies; the new one resumes from the state, which lives\n"
        "# in etcd (--state etcd://) or on the claim mounted at /var/dlrover (--data-claim).\n"
    )
    body = yaml.dump_all(objects, Dumper=_BlockDumper, sort_keys=False, explicit_start=True)
    return header + body


class SubmitError(RuntimeError):
    """The cluster refused the job; the message says what to change."""


def submit_k8s(
    spec: JobSpec,
    job_yaml_path: str,
    namespace: str | None = None,
    image: str | None = None,
    dry_run: bool = False,
    out: TextIO | None = None,
    api_client: Any = None,
    state: str = "",
    data_claim: str = "",
) -> int:
    """Create (or with dry_run print) the job's master objects; the process exit code."""
    out = out or sys.stdout
    try:
        with open(job_yaml_path, encoding="utf-8") as f:
            job_yaml = f.read()
    except OSError as e:
        print(f"dlrover: error: {job_yaml_path}: cannot read: {e}", file=sys.stderr)
        return 2
    namespace = namespace or "default"
    try:
        objects = build_objects(
            spec, job_yaml, namespace, image or DEFAULT_IMAGE, state=state, data_claim=data_claim
        )
    except K8sConfigError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        out.write(render_yaml(objects))
        out.flush()
        return 0
    try:
        if api_client is None:
            from master.platform.k8s_api import default_api_client

            api_client = default_api_client()
        job = create_objects(objects, api_client)
    except (K8sConfigError, SubmitError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import urllib3

        if not isinstance(e, urllib3.exceptions.HTTPError):
            raise
        host = getattr(getattr(api_client, "configuration", None), "host", "?")
        print(
            f"dlrover: error: cannot reach the Kubernetes API server at {host}: {e}. "
            "Check KUBECONFIG (or ~/.kube/config) and the cluster",
            file=sys.stderr,
        )
        return 2
    name = job["metadata"]["name"]
    out.write(
        f"job {spec.name} submitted to namespace {namespace}: master Job {name}\n"
        f"  follow: kubectl logs -f -n {namespace} job/{name}\n"
        f"  delete: kubectl delete job -n {namespace} {name}   (removes every object of the job)\n"
    )
    out.flush()
    return 0


def _api_calls(api_client: Any) -> dict[str, tuple[Callable, Callable, Callable]]:
    """create, delete and patch of each kind we submit, by kind."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    rbac = client.RbacAuthorizationV1Api(api_client)
    batch = client.BatchV1Api(api_client)
    return {
        "ServiceAccount": (
            core.create_namespaced_service_account,
            core.delete_namespaced_service_account,
            core.patch_namespaced_service_account,
        ),
        "Role": (
            rbac.create_namespaced_role,
            rbac.delete_namespaced_role,
            rbac.patch_namespaced_role,
        ),
        "RoleBinding": (
            rbac.create_namespaced_role_binding,
            rbac.delete_namespaced_role_binding,
            rbac.patch_namespaced_role_binding,
        ),
        "ConfigMap": (
            core.create_namespaced_config_map,
            core.delete_namespaced_config_map,
            core.patch_namespaced_config_map,
        ),
        "Service": (
            core.create_namespaced_service,
            core.delete_namespaced_service,
            core.patch_namespaced_service,
        ),
        "Job": (
            batch.create_namespaced_job,
            batch.delete_namespaced_job,
            batch.patch_namespaced_job,
        ),
    }


def create_objects(objects: list[dict[str, Any]], api_client: Any) -> dict[str, Any]:
    """Create the objects (the master's Job last), then let the Job own the others.

    A running job of the same name is an error; objects left over from an earlier job of the
    same name (e.g. applied from --dry-run output) are replaced.
    """
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from master.platform.k8s_api import api_error_message

    calls = _api_calls(api_client)
    job_body = objects[-1]
    namespace = job_body["metadata"]["namespace"]
    job_name = job_body["metadata"]["name"]
    batch = client.BatchV1Api(api_client)
    try:
        batch.read_namespaced_job(job_name, namespace)
        raise SubmitError(
            f"a master Job {job_name!r} already exists in namespace {namespace!r}: the job is "
            f"running or was kept. Delete it first (kubectl delete job -n {namespace} "
            f"{job_name}) or rename the job"
        )
    except ApiException as e:
        if e.status != 404:
            raise SubmitError(api_error_message(f"read job {job_name}", e, namespace)) from None
    created: dict[str, Any] = {}
    for body in objects:
        kind, name = body["kind"], body["metadata"]["name"]
        create, delete, _ = calls[kind]
        try:
            try:
                obj = create(namespace, body)
            except ApiException as e:
                if e.status != 409 or kind == "Job":
                    raise
                log.info("replacing %s %s left over from an earlier job", kind, name)
                delete(name, namespace)
                obj = create(namespace, body)
        except ApiException as e:
            raise SubmitError(
                api_error_message(f"create {kind} {name} in {namespace}", e, namespace)
            ) from None
        created[kind] = api_client.sanitize_for_serialization(obj)
    job = created["Job"]
    owner = owner_reference("Job", job_name, job["metadata"]["uid"], "batch/v1")
    for body in objects[:-1]:
        kind, name = body["kind"], body["metadata"]["name"]
        _, _, patch = calls[kind]
        try:
            patch(name, namespace, {"metadata": {"ownerReferences": [owner]}})
        except ApiException as e:
            # The job runs anyway; only the cleanup on deletion is incomplete.
            log.warning("%s", api_error_message(f"set owner of {kind} {name}", e, namespace))
    return job
