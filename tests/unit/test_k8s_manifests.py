"""Every Kubernetes manifest we ship or print loads strictly into the `kubernetes` client's models.

The client's models (pydantic) refuse unknown fields, wrong types and missing required fields;
on top of that each object must survive a round trip unchanged (nothing silently dropped), and
the objects of one file must reference each other consistently (volumes, accounts, roles,
selectors, the job YAML inside the ConfigMap).

`python -m tests.unit.test_k8s_manifests` prints examples/k8s/node-pod-reference.yaml.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import os
import subprocess
import sys
from typing import Any

import pytest
import yaml

from master.config import parse_job_spec
from master.platform.api import NodeLaunchSpec
from master.platform.k8s_resources import (
    ENV_PREFIX,
    JOB_UID_LABEL,
    MASTER_ROLE_RULES,
    K8sConfigError,
    K8sSettings,
    dns_label,
    node_pod,
    node_service,
    pod_name,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "k8s")
REFERENCE = os.path.join(EXAMPLES, "node-pod-reference.yaml")
RBAC_GV = "rbac.authorization.k8s.io/v1"


def model_class(obj: dict[str, Any]):
    from kubernetes import client

    models = {
        ("v1", "Pod"): client.V1Pod,
        ("v1", "Service"): client.V1Service,
        ("v1", "ConfigMap"): client.V1ConfigMap,
        ("v1", "Secret"): client.V1Secret,
        ("v1", "ServiceAccount"): client.V1ServiceAccount,
        ("v1", "PersistentVolumeClaim"): client.V1PersistentVolumeClaim,
        (RBAC_GV, "Role"): client.V1Role,
        (RBAC_GV, "RoleBinding"): client.V1RoleBinding,
        ("batch/v1", "Job"): client.V1Job,
    }
    key = (obj.get("apiVersion"), obj.get("kind"))
    assert key in models, f"unexpected apiVersion/kind {key}"
    return models[key]


def check_object(obj: dict[str, Any]) -> None:
    """Strict model validation, a lossless round trip, and the fields a cluster requires."""
    from kubernetes.client import ApiClient

    model = model_class(obj).model_validate(obj)  # raises on unknown/mistyped/missing fields
    assert ApiClient().sanitize_for_serialization(model) == obj, "fields lost in the round trip"
    meta = obj["metadata"]
    assert meta.get("name"), f"{obj['kind']} without metadata.name"
    assert dns_label(meta["name"]) == meta["name"], f"{meta['name']!r} is not a DNS label"
    kind = obj["kind"]
    if kind == "Job":
        spec = obj["spec"]
        policy = spec["template"]["spec"]["restartPolicy"]
        assert policy in ("Never", "OnFailure"), policy
        if spec.get("podFailurePolicy"):
            assert policy == "Never", "podFailurePolicy needs restartPolicy Never"
            containers = {c["name"] for c in spec["template"]["spec"]["containers"]}
            for rule in spec["podFailurePolicy"]["rules"]:
                if "onExitCodes" in rule:
                    assert rule["onExitCodes"]["containerName"] in containers
        _check_pod_spec(spec["template"]["spec"], pod_restart_policy=policy)
    elif kind == "Pod":
        _check_pod_spec(obj["spec"])
    elif kind == "Service":
        assert obj["spec"]["selector"] and obj["spec"]["ports"]
    elif kind == "Role":
        for rule in obj["rules"]:
            assert rule["verbs"] and rule["resources"] and rule["apiGroups"] is not None
    elif kind == "RoleBinding":
        assert obj["roleRef"]["kind"] == "Role" and obj["subjects"]


def _check_pod_spec(spec: dict[str, Any], pod_restart_policy: str = "Never") -> None:
    assert spec["containers"], "a pod needs containers"
    volumes = {v["name"] for v in spec.get("volumes", [])}
    for c in spec["containers"]:
        assert c["name"] and c["image"] and c.get("command"), c
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"mount of undeclared volume {m['name']!r}"
        names = {e["name"] for e in c.get("env", [])}
        for e in c.get("env", []):
            assert ("value" in e) != ("valueFrom" in e), e
        for arg in c["command"]:
            for ref in _var_refs(arg):
                assert ref in names, f"$({ref}) in the command is not in the env"
    assert spec.get("restartPolicy") == pod_restart_policy


def _var_refs(arg: str) -> list[str]:
    refs, rest = [], arg
    while "$(" in rest:
        rest = rest[rest.index("$(") + 2 :]
        refs.append(rest[: rest.index(")")])
    return refs


def resolved_env(pod: dict[str, Any]) -> dict[str, str]:
    """The container env with downward-API fields replaced the way the kubelet would."""
    env = {}
    for e in pod["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            if path.startswith("metadata.labels['"):
                label = path[len("metadata.labels['") : -2]
                assert label == JOB_UID_LABEL, f"the Job controller sets no label {label!r}"
                env[e["name"]] = f"<{label}>"
                continue
            section, field = path.split(".")
            assert section == "metadata" and field in ("name", "namespace", "uid"), e
            env[e["name"]] = pod["metadata"].get(field) or f"<{field}>"
    return env


def master_pod_of(by_kind: dict[str, dict[str, dict]]) -> dict[str, Any]:
    """The master pod: a bare Pod, or the pod template of the master's Job."""
    if "Job" in by_kind:
        (job,) = by_kind["Job"].values()
        template = job["spec"]["template"]
        return {"metadata": {"name": job["metadata"]["name"], **template["metadata"]}, **template}
    (pod,) = by_kind["Pod"].values()
    return pod


def check_job_objects(objects: list[dict[str, Any]], extra_accounts: set[str] = frozenset()):
    """One job's objects: each valid, and consistent with each other and the platform."""
    for obj in objects:
        check_object(obj)
    by_kind: dict[str, dict[str, dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    pod = master_pod_of(by_kind)
    spec = pod["spec"]
    accounts = set(by_kind.get("ServiceAccount", {})) | set(extra_accounts)
    assert spec["serviceAccountName"] in accounts
    for v in spec["volumes"]:
        if "configMap" in v:
            assert v["configMap"]["name"] in by_kind["ConfigMap"]
        if "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] in by_kind["PersistentVolumeClaim"]
    (service,) = by_kind["Service"].values()
    selector = service["spec"]["selector"]
    assert selector.items() <= pod["metadata"]["labels"].items(), "service misses the pod"
    assert service["metadata"]["name"] == spec["hostname"], "master hostname must resolve"
    for binding in by_kind.get("RoleBinding", {}).values():
        assert binding["roleRef"]["name"] in by_kind["Role"]
    # The platform accepts the pod's env, and the job YAML is a valid job of the same name.
    env = resolved_env(pod)
    unknown = {k for k in env if k.startswith(ENV_PREFIX)} - {
        v for k, v in vars(sys.modules[K8sSettings.__module__]).items() if k.startswith("ENV_")
    }
    assert not unknown, f"unknown platform variables {unknown}"
    settings = K8sSettings.from_env(env)
    assert settings.master_service == service["metadata"]["name"]
    (config,) = by_kind["ConfigMap"].values()
    job = parse_job_spec(yaml.safe_load(config["data"]["job.yaml"]), "configmap", "/")
    assert job.name == settings.job_name
    command = pod["spec"]["containers"][0]["command"]
    assert (
        command[:2] == ["dlrover", "master"] and command[command.index("--platform") + 1] == "k8s"
    )
    mounted = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert os.path.dirname(command[2]) in mounted, "the job YAML path is not mounted"
    return by_kind


def load(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


# -- shipped examples ------------------------------------------------------------------------


def test_examples_exist():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(EXAMPLES, "*.yaml"))}
    assert {"rbac.yaml", "tf-ps-job.yaml", "torch-job.yaml", "node-pod-reference.yaml"} <= names


@pytest.mark.parametrize("name", ["tf-ps-job.yaml", "torch-job.yaml"])
def test_job_examples_are_valid(name):
    by_kind = check_job_objects(load(os.path.join(EXAMPLES, name)), {"dlrover-master"})
    env = resolved_env(master_pod_of(by_kind))
    assert K8sSettings.from_env(env).shm_size, "node /dev/shm must be sized for flash checkpoints"


def test_tf_example_shares_the_model_dir_through_a_read_write_many_claim():
    by_kind = check_job_objects(load(os.path.join(EXAMPLES, "tf-ps-job.yaml")), {"dlrover-master"})
    (claim,) = by_kind["PersistentVolumeClaim"].values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    pod = master_pod_of(by_kind)
    settings = K8sSettings.from_env(resolved_env(pod))
    assert settings.data_claim == claim["metadata"]["name"]
    # Its master is a Job that owns the nodes and restarts the master, which resumes from the
    # state on the claim, in one run dir per Job.
    assert (settings.owner_kind, settings.owner_name) == ("Job", "wide-deep-master")
    command = pod["spec"]["containers"][0]["command"]
    assert "--resume-if-started" in command and "--state" not in command
    assert command[command.index("--run-dir") + 1].startswith(settings.data_dir + "/")
    assert "$(DLROVER_K8S_OWNER_UID)" in command[command.index("--run-dir") + 1]


def test_rbac_example_grants_what_the_platform_needs():
    objects = load(os.path.join(EXAMPLES, "rbac.yaml"))
    for obj in objects:
        check_object(obj)
    kinds = {o["kind"]: o for o in objects}
    granted = {
        (r, v) for rule in kinds["Role"]["rules"] for r in rule["resources"] for v in rule["verbs"]
    }
    needed = {
        (r, v) for rule in MASTER_ROLE_RULES for r in rule["resources"] for v in rule["verbs"]
    }
    assert needed <= granted
    assert (
        kinds["RoleBinding"]["subjects"][0]["name"] == kinds["ServiceAccount"]["metadata"]["name"]
    )


# -- `dlrover submit --platform k8s --dry-run` ---------------------------------------------------


def test_dry_run_prints_valid_objects(tmp_path, monkeypatch):
    from master.cli.main import main

    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(
        "name: my-job\ncommand: [python, train.py]\n# a comment kept verbatim\n"
        "ps: {replicas: 1, memory_mb: 512}\nworker: {replicas: 2}\n"
    )
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    argv = ["submit", str(job_yaml), "--platform", "k8s", "--dry-run", "--namespace", "ml"]
    argv += ["--state", "etcd://etcd.ml.svc:2379"]
    assert main([*argv, "--image", "reg.example/dl:3"]) == 0
    objects = [d for d in yaml.safe_load_all(out.getvalue()) if d]
    assert [o["kind"] for o in objects] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Service",
        "Job",
    ]
    by_kind = check_job_objects(objects)
    assert all(o["metadata"]["namespace"] == "ml" for o in objects)
    assert by_kind["ConfigMap"]["my-job-job"]["data"]["job.yaml"] == job_yaml.read_text()
    assert by_kind["Role"]["my-job-master"]["rules"] == [dict(r) for r in MASTER_ROLE_RULES]
    pod = master_pod_of(by_kind)
    assert pod["spec"]["containers"][0]["image"] == "reg.example/dl:3"
    settings = K8sSettings.from_env(resolved_env(pod))
    assert settings.image == "reg.example/dl:3"
    # The nodes are owned by the master's Job (its uid: the label the Job controller sets).
    assert (settings.owner_kind, settings.owner_name) == ("Job", "my-job-master")
    assert settings.owner_uid == f"<{JOB_UID_LABEL}>"
    command = pod["spec"]["containers"][0]["command"]
    assert "--resume-if-started" in command
    assert command[command.index("--state") + 1] == "etcd://etcd.ml.svc:2379"
    assert "|" in out.getvalue(), "the job YAML should print as a readable block"


def test_dry_run_of_a_bad_job_yaml_is_one_clear_error(tmp_path, capsys):
    from master.cli.main import main

    bad = tmp_path / "job.yaml"
    bad.write_text("name: Bad_Name\ncommand: [python, t.py]\nworker: {replicas: 1}\n")
    assert main(["submit", str(bad), "--platform", "k8s", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "name" in err and "Traceback" not in err


def test_cli_does_not_import_the_kubernetes_client():
    code = "import sys, master.cli.main; sys.exit('kubernetes' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


# -- node pods -----------------------------------------------------------------------------------


def reference_objects() -> list[dict[str, Any]]:
    """worker-0 (id 3) of examples/k8s/tf-ps-job.yaml as the platform creates it, + service."""
    objects = load(os.path.join(EXAMPLES, "tf-ps-job.yaml"))
    by_kind: dict[str, dict[str, dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    env = resolved_env(master_pod_of(by_kind))
    env.update({"DLROVER_K8S_OWNER_UID": "<uid of Job wide-deep-master>"})
    settings = K8sSettings.from_env(env, namespace="default")
    cluster = (
        '{"cluster": {"ps": ["wide-deep-ps-0.default.svc:2222"], "chief": '
        '["wide-deep-chief-0.default.svc:2222"], "worker": ["wide-deep-worker-0.default.svc:2222", '
        '"wide-deep-worker-1.default.svc:2222"]}, "task": {"type": "worker", "index": 0}, '
        '"environment": "cloud"}'
    )
    run_dir = "/var/dlrover/runs/wide-deep-<uid of Job wide-deep-master>"
    node_env = {
        "DLROVER_MASTER_ADDR": "wide-deep-master.default.svc:50051",
        "DLROVER_JOB_TOKEN_FILE": "/var/run/dlrover/token/token",
        "DLROVER_NODE_TYPE": "worker",
        "DLROVER_NODE_RANK": "0",
        "DLROVER_NODE_ID": "3",
        "DLROVER_JOB_NAME": "wide-deep",
        "DLROVER_RUN_DIR": run_dir,
        "DLROVER_MODEL_DIR": run_dir + "/model",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_CONFIG": cluster,
    }
    spec = NodeLaunchSpec(
        type="worker",
        rank=0,
        id=3,
        command=("/usr/local/bin/python", "wide_deep.py", "--input", "dlrover"),
        env=node_env,
        workdir="/opt/dlrover/examples/tf",
        log_path="",
        cpu=2,
        memory_mb=4096,
    )
    return [
        node_pod(settings, spec, node_env, token_secret="wide-deep-token"),
        node_service(settings, "worker", 0),
    ]


def render_reference() -> str:
    header = (
        "# NOT FOR kubectl apply: what the master of examples/k8s/tf-ps-job.yaml creates for\n"
        "# worker-0 (incarnation id 3), for reading. Generated by\n"
        "#   python -m tests.unit.test_k8s_manifests > examples/k8s/node-pod-reference.yaml\n"
        "# and checked by tests/unit/test_k8s_manifests.py against what the platform builds\n"
        "# (master/platform/k8s_resources.py).\n"
    )
    return header + yaml.safe_dump_all(reference_objects(), sort_keys=False, explicit_start=True)


def test_node_pod_reference_is_what_the_platform_creates():
    objects = load(REFERENCE)
    for obj in objects:
        check_object(obj)
    assert objects == reference_objects(), (
        "examples/k8s/node-pod-reference.yaml is stale; regenerate it with "
        "`python -m tests.unit.test_k8s_manifests > examples/k8s/node-pod-reference.yaml`"
    )
    pod, service = objects
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "wide-deep-data"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_node_pod_without_resources_token_or_owner_is_still_valid():
    settings = K8sSettings(job_name="7up")  # starts with a digit: names get a letter first
    spec = NodeLaunchSpec("evaluator", 0, 12, ("run",), {}, "", "", 0.0, 0)
    pod = node_pod(settings, spec, {})
    check_object(pod)
    assert pod["metadata"]["name"] == pod_name("7up", "evaluator", 0, 12) == "j-7up-evaluator-0-12"
    assert "ownerReferences" not in pod["metadata"]
    container = pod["spec"]["containers"][0]
    assert "resources" not in container and "workingDir" not in container
    assert pod["spec"]["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    check_object(node_service(settings, "evaluator", 0))


def test_trainer_pods_of_the_jobs_image_start_under_the_pod_guard():
    """Nodes that may train, in the job's own image (which has this package), start under the
    guard that hands their last data positions to the master; a PS, or a node in a user's image
    (which may not have it), runs its command as given."""
    settings = K8sSettings(job_name="j", image="dlrover:1")
    command = ("python", "train.py")

    def pod_command(node_type: str, image: str = "") -> list[str]:
        spec = NodeLaunchSpec(node_type, 0, 1, command, {}, "", "", 0.0, 0, image=image)
        if image:
            spec = dataclasses.replace(spec, image_command=command)
        return node_pod(settings, spec, {})["spec"]["containers"][0]["command"]

    guarded = ["python", "-m", "master.platform.pod_guard", "--", *command]
    assert pod_command("worker") == pod_command("chief") == pod_command("evaluator") == guarded
    assert pod_command("ps") == list(command)
    assert pod_command("worker", image="tensorflow/tensorflow:2.15.0") == list(command)


def test_long_job_names_are_shortened_to_dns_labels():
    job = "a" * 60
    name = pod_name(job, "worker", 12, 12345)
    assert len(name) == 63 and name == dns_label(name)
    assert name != pod_name(job, "worker", 12, 12346)  # the hash keeps incarnations apart


def test_settings_from_env_say_what_is_missing():
    with pytest.raises(K8sConfigError, match="DLROVER_K8S_JOB_NAME"):
        K8sSettings.from_env({})
    with pytest.raises(K8sConfigError, match="DLROVER_K8S_GRACE_SECONDS"):
        K8sSettings.from_env({"DLROVER_K8S_JOB_NAME": "j", "DLROVER_K8S_GRACE_SECONDS": "x"})
    with pytest.raises(K8sConfigError, match="unknown Kubernetes platform option"):
        K8sSettings.from_env({"DLROVER_K8S_JOB_NAME": "j"}, namespce="x")
    s = K8sSettings.from_env({"DLROVER_K8S_JOB_NAME": "j"}, namespace="ml", grace_seconds="4")
    assert (s.namespace, s.grace_seconds, s.image) == ("ml", 4, "dlrover-elastic:latest")


if __name__ == "__main__":
    sys.stdout.write(render_reference())
