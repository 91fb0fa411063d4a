"""The Kubernetes platform through the real `kubernetes` client against a fake API server.

No API server can run here, so `tests/k8s_fake` serves the REST and watch protocol on loopback
and the tests play the kubelet (run, exit, OOM-kill, evict, lose the node). What these tests
cannot show: real scheduling, DNS of the headless services, image pulls, RBAC enforcement and
the garbage collector's real timing.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime, JobState
from master.platform.api import NodeEvent, NodeLaunchSpec
from master.platform.k8s_resources import (
    ENV_IMAGE,
    ENV_JOB_NAME,
    ENV_MASTER_POD_NAME,
    ENV_MASTER_POD_UID,
    ENV_MASTER_SERVICE,
    ENV_NAMESPACE,
    MASTER_ROLE_RULES,
    K8sSettings,
)
from master.platform.kubernetes import KubernetesPlatform
from master.state.sqlite import SQLiteStateStore
from tests.k8s_fake import FakeKubeApiServer
from tests.k8s_fake.store import BATCH, RBAC

JOB = "tfjob"
SEL = f"dlrover.io/job={JOB},dlrover.io/role=node"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def api():
    with FakeKubeApiServer() as server:
        yield server


@pytest.fixture
def master_pod(api):
    api.create(
        "pods",
        {
            "metadata": {"name": f"{JOB}-master", "labels": {"dlrover.io/job": JOB}},
            "spec": {"containers": [{"name": "master", "image": "img:1"}]},
        },
    )
    return api.kubelet.run(f"{JOB}-master")


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / ".job_token"
    path.write_text("s3cret-token")
    return str(path)


@pytest.fixture
def platform(api, master_pod):
    p = make_platform(api, master_pod)
    yield p
    p.shutdown(0)
    # The platform's watch ends with it (the server sees the stream closed).
    api.wait_for(lambda: api.store.open_watch_count() == 0, timeout=3, what="watch closed")


def make_platform(api, master_pod, host: str = "tfjob-master", **overrides) -> KubernetesPlatform:
    """A platform of the master pod `master_pod`; `overrides`: K8sSettings fields."""
    settings = K8sSettings(
        job_name=JOB,
        namespace="default",
        image="registry.example/dlrover:1",
        master_pod_name=master_pod["metadata"]["name"],
        master_pod_uid=master_pod["metadata"]["uid"],
        master_service=f"{JOB}-master",
        shm_size="1Gi",
        grace_seconds=7,
        **overrides,
    )
    return KubernetesPlatform(host=host, settings=settings, api_client=api.api_client())


def launch_spec(node_type, rank, node_id, token_file, cpu=0.0, memory_mb=0, env=None):
    base = {
        "DLROVER_MASTER_ADDR": "tfjob-master:50051",
        "DLROVER_JOB_TOKEN_FILE": token_file,
        "DLROVER_NODE_TYPE": node_type,
        "DLROVER_NODE_RANK": str(rank),
        "DLROVER_NODE_ID": str(node_id),
    }
    return NodeLaunchSpec(
        type=node_type,
        rank=rank,
        id=node_id,
        command=("/usr/local/bin/python", "-m", "dlrover_tf.ps"),
        env=base | (env or {}),
        workdir="/opt/dlrover/examples/tf",
        log_path="/unused/on/k8s.log",
        cpu=cpu,
        memory_mb=memory_mb,
    )


def pod_of(api, node_type, rank, node_id, timeout: float = 10.0):
    return api.wait_for(
        lambda: next(
            iter(api.pods(f"{SEL},dlrover.io/node-type={node_type},dlrover.io/node-id={node_id}")),
            None,
        ),
        timeout=timeout,
        what=f"pod of {node_type}-{rank} id {node_id}",
    )


def next_event(platform, timeout: float = 10.0) -> NodeEvent:
    return platform.events.get(timeout=timeout)


def verbs_used(api) -> set[tuple[str, str]]:
    """(resource, RBAC verb) of every request the fake server answered."""
    used = set()
    for method, path, params in api.requests():
        parts = [p for p in path.split("/") if p]
        rest = parts[parts.index("namespaces") + 2 :] if "namespaces" in parts else parts[2:]
        if method == "GET":
            verb = "get" if len(rest) > 1 else ("watch" if params.get("watch") else "list")
        else:
            verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}[method]
        used.add((rest[0], verb))
    return used


def assert_allowed_by_master_role(api) -> None:
    granted = {
        (r, v) for rule in MASTER_ROLE_RULES for r in rule["resources"] for v in rule["verbs"]
    }
    assert verbs_used(api) <= granted, verbs_used(api) - granted


def env_of(pod) -> dict:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


# -- job start --------------------------------------------------------------------------


def test_launch_creates_owned_pod_and_rank_service(api, master_pod, platform, token_file):
    os.environ["KUBERNETES_SERVICE_HOST"] = "10.96.0.1"  # the master pod's own; not for nodes
    try:
        spec = launch_spec("ps", 0, 1, token_file, cpu=1.5, memory_mb=2048, env={"A": "b"})
        spec = NodeLaunchSpec(**{**spec.__dict__, "env": {**spec.env, **os.environ}})
        platform.launch(spec)
    finally:
        del os.environ["KUBERNETES_SERVICE_HOST"]
    assert platform.address_for("ps", 0) == "tfjob-ps-0.default.svc:2222"

    pod = api.pod("tfjob-ps-0-1")
    owner = master_pod["metadata"]
    assert pod["metadata"]["labels"] == {
        "dlrover.io/job": JOB,
        "dlrover.io/role": "node",
        "app.kubernetes.io/managed-by": "dlrover",
        "dlrover.io/node-type": "ps",
        "dlrover.io/rank": "0",
        "dlrover.io/node-id": "1",
    }
    assert [(r["kind"], r["name"], r["uid"]) for r in pod["metadata"]["ownerReferences"]] == [
        ("Pod", owner["name"], owner["uid"])
    ]
    pspec = pod["spec"]
    assert pspec["restartPolicy"] == "Never"
    assert pspec["terminationGracePeriodSeconds"] == 7
    container = pspec["containers"][0]
    assert container["image"] == "registry.example/dlrover:1"
    assert container["command"] == ["/usr/local/bin/python", "-m", "dlrover_tf.ps"]
    assert container["workingDir"] == "/opt/dlrover/examples/tf"
    assert container["resources"] == {
        "requests": {"cpu": "1500m", "memory": "2048Mi"},
        "limits": {"cpu": "1500m", "memory": "2048Mi"},
    }
    env = env_of(pod)
    assert env["A"] == "b" and env["DLROVER_NODE_ID"] == "1"
    # The master is reached through its service; the token through a mounted secret.
    assert env["DLROVER_MASTER_ADDR"] == "tfjob-master.default.svc:50051"
    assert env["DLROVER_JOB_TOKEN_FILE"] == "/var/run/dlrover/token/token"
    assert "KUBERNETES_SERVICE_HOST" not in env
    assert "s3cret-token" not in str(pod)
    volumes = {v["name"]: v for v in pspec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/var/run/dlrover/token"] == "job-token"
    secret = api.objects("secrets")[0]
    assert volumes["job-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-token"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == owner["uid"]

    (svc,) = api.objects("services")
    assert svc["metadata"]["name"] == "tfjob-ps-0"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {
        "dlrover.io/job": JOB,
        "dlrover.io/role": "node",
        "app.kubernetes.io/managed-by": "dlrover",
        "dlrover.io/node-type": "ps",
        "dlrover.io/rank": "0",
    }
    assert svc["metadata"]["ownerReferences"][0]["uid"] == owner["uid"]

    # The next incarnation of the rank: a new pod behind the same service.
    platform.launch(launch_spec("ps", 0, 5, token_file))
    assert api.pod("tfjob-ps-0-5")["metadata"]["labels"]["dlrover.io/rank"] == "0"
    assert len(api.objects("services")) == 1 and len(api.objects("secrets")) == 1
    assert_allowed_by_master_role(api)


# -- exit reasons -----------------------------------------------------------------------


def test_pod_exit_reasons_become_node_events(api, platform, token_file):
    names = {}
    for i, node_type in enumerate(("worker", "ps", "chief", "evaluator", "worker", "worker")):
        rank = i if node_type == "worker" else 0
        platform.launch(launch_spec(node_type, rank, 10 + i, token_file))
        names[10 + i] = pod_of(api, node_type, rank, 10 + i)["metadata"]["name"]
        api.kubelet.run(names[10 + i])

    api.kubelet.exit(names[10], 1, message="Traceback ...\nValueError: bad input")
    ev = next_event(platform)
    assert (ev.type, ev.rank, ev.id, ev.exit_code, ev.oom_killed) == ("worker", 0, 10, 1, False)
    assert ev.message.splitlines()[-1] == "ValueError: bad input"

    api.kubelet.oom_kill(names[11])
    ev = next_event(platform)
    assert (ev.type, ev.id, ev.exit_code, ev.oom_killed) == ("ps", 11, 137, True)
    assert ev.details["reason"] == "OOMKilled"

    api.kubelet.evict(names[12], "The node was low on resource: memory.")
    ev = next_event(platform)
    assert (ev.id, ev.exit_code, ev.oom_killed) == (12, -signal.SIGKILL, False)
    assert ev.details["reason"] == "Evicted"
    assert "k8s event Evicted: The node was low on resource: memory." in ev.message

    api.kubelet.exit(names[13], 0)
    ev = next_event(platform)
    assert (ev.id, ev.exit_code) == (13, 0)

    # Node lost: the pod would stay Terminating forever; the platform reports and force-deletes.
    api.kubelet.node_lost(names[14])
    ev = next_event(platform)
    assert (ev.id, ev.exit_code, ev.details["reason"]) == (14, -signal.SIGKILL, "NodeLost")
    api.wait_for(lambda: not api.pods("dlrover.io/node-id=14"), what="lost pod force-deleted")

    # Deleted by someone else (kubectl delete --force).
    api.delete("pods", names[15], grace_seconds=0)
    ev = next_event(platform)
    assert (ev.id, ev.exit_code, ev.details["reason"]) == (15, -signal.SIGKILL, "Deleted")
    assert "outside the master" in ev.message

    assert platform.events.empty()  # exactly one event per incarnation
    assert ("events", "list") in verbs_used(api)
    assert_allowed_by_master_role(api)


def test_image_pull_backoff_past_its_limit_ends_the_incarnation(api, master_pod, token_file):
    platform = make_platform(api, master_pod, image_pull_timeout_seconds=1)
    try:
        platform.launch(launch_spec("worker", 0, 3, token_file))
        name = pod_of(api, "worker", 0, 3)["metadata"]["name"]
        started = time.monotonic()
        api.kubelet.image_pull_backoff(name, "registry.example/dlrover:1")
        ev = next_event(platform)
        assert time.monotonic() - started >= 1.0  # a state first, an end only past the limit
        assert (ev.id, ev.exit_code, ev.details["reason"]) == (3, 1, "ImagePullBackOff")
        assert "DLROVER_K8S_IMAGE_PULL_TIMEOUT_SECONDS" in ev.message
        api.wait_for(lambda: not api.pods("dlrover.io/node-id=3"), what="stuck pod deleted")
    finally:
        platform.shutdown(0)


def test_signal_and_stop_delete_the_pod(api, platform, token_file):
    for node_id in (1, 2, 3):
        platform.launch(launch_spec("worker", node_id, node_id, token_file))
        api.kubelet.run(pod_of(api, "worker", node_id, node_id)["metadata"]["name"])

    assert platform.signal_node(1, signal.SIGKILL)
    ev = next_event(platform)
    assert (ev.id, ev.exit_code) == (1, -signal.SIGKILL)
    deletes = [r for r in api.requests("DELETE") if r[1].endswith("/pods/tfjob-worker-1-1")]
    assert deletes[0][2]["gracePeriodSeconds"] == "0"

    assert platform.signal_node(2, signal.SIGTERM)  # graceful: the container gets SIGTERM
    ev = next_event(platform)
    assert (ev.id, ev.exit_code) == (2, 143)
    deletes = [r for r in api.requests("DELETE") if r[1].endswith("/pods/tfjob-worker-2-2")]
    assert "gracePeriodSeconds" not in deletes[0][2]  # the pod's own grace period

    api.store.sigterm_exit_codes["tfjob-worker-3-3"] = 0  # e.g. a PS that exits cleanly
    platform.stop_node(3, grace_seconds=2.5)
    ev = next_event(platform)
    assert (ev.id, ev.exit_code) == (3, 0)
    deletes = [r for r in api.requests("DELETE") if r[1].endswith("/pods/tfjob-worker-3-3")]
    assert deletes[0][2]["gracePeriodSeconds"] == "3"

    assert not platform.signal_node(1, signal.SIGKILL)  # already ended
    assert not platform.signal_node(99, signal.SIGKILL)  # unknown


def test_a_standby_pod_takes_over_a_failed_ps_rank_through_its_service(api, platform, token_file):
    platform.launch(launch_spec("ps", 0, 1, token_file, cpu=1, memory_mb=1024))
    ps = api.kubelet.run("tfjob-ps-0-1")["metadata"]["name"]
    platform.launch(launch_spec("ps", -1, 2, token_file, cpu=1, memory_mb=1024))
    standby = api.pod("tfjob-ps-standby-2")
    assert standby["metadata"]["labels"]["dlrover.io/rank"] == "standby"  # no address yet
    assert (
        standby["spec"]["containers"][0]["resources"]
        == api.pod(ps)["spec"]["containers"][0]["resources"]
    )
    assert [svc["metadata"]["name"] for svc in api.objects("services")] == ["tfjob-ps-0"]
    api.kubelet.run("tfjob-ps-standby-2")

    api.kubelet.exit(ps, 137, reason="Error")
    assert next_event(platform).id == 1
    platform.take_over(2, "ps", 0)
    (svc,) = api.objects("services")
    selector = ",".join(f"{k}={v}" for k, v in svc["spec"]["selector"].items())
    serving = [p for p in api.pods(selector) if p["status"].get("phase") == "Running"]
    assert [p["metadata"]["name"] for p in serving] == ["tfjob-ps-standby-2"]
    # Still the same node id to the platform: its end is reported as the promoted node's.
    api.kubelet.exit("tfjob-ps-standby-2", 137, reason="Error")
    event = next_event(platform)
    assert (event.id, event.type, event.rank) == (2, "ps", 0)
    assert_allowed_by_master_role(api)


# -- watch recovery -----------------------------------------------------------------------


@pytest.mark.parametrize("abrupt", [False, True], ids=["clean-end", "cut-connection"])
def test_dropped_watch_resumes_without_losing_an_event(api, platform, token_file, abrupt):
    platform.launch(launch_spec("worker", 0, 1, token_file))
    name = pod_of(api, "worker", 0, 1)["metadata"]["name"]
    api.kubelet.run(name)
    api.wait_for(lambda: api.store.open_watch_count() == 1, what="the platform's watch")
    watches_before = len(api.requests("GET", watch=True))

    api.store.drop_watches(abrupt=abrupt)
    api.kubelet.exit(name, 3)  # while the platform may be between two watches

    ev = next_event(platform)
    assert (ev.id, ev.exit_code) == (1, 3)
    api.wait_for(lambda: len(api.requests("GET", watch=True)) > watches_before, what="re-watch")
    resumed = api.requests("GET", watch=True)[watches_before]
    assert int(resumed[2]["resourceVersion"]) > 0  # resumed where it was, no relist needed
    assert platform.relists == 1
    assert platform.events.empty()


def test_expired_resource_version_relists_and_reconciles(api, platform, token_file):
    for node_id in (1, 2, 3):
        platform.launch(launch_spec("worker", node_id, node_id, token_file))
        api.kubelet.run(pod_of(api, "worker", node_id, node_id)["metadata"]["name"])
    api.wait_for(lambda: api.store.open_watch_count() == 1, what="the platform's watch")

    # The master loses the API server for a while; meanwhile pods change and history is compacted.
    api.store.refuse_watches = True
    api.store.drop_watches()
    api.wait_for(lambda: api.store.open_watch_count() == 0, what="watch dropped")
    api.kubelet.exit("tfjob-worker-1-1", 3)
    api.delete("pods", "tfjob-worker-2-2", grace_seconds=0)  # gone without a trace
    api.store.compact()
    api.store.refuse_watches = False

    events = {ev.id: ev for ev in (next_event(platform), next_event(platform))}
    assert events[1].exit_code == 3
    assert events[2].exit_code == -signal.SIGKILL and events[2].details["reason"] == "Deleted"
    assert platform.relists == 2  # the first sync, and the one after 410 Gone
    expired = [r for r in api.requests("GET", watch=True) if r[2].get("resourceVersion")]
    assert any(int(r[2]["resourceVersion"]) < api.store.horizon for r in expired)

    # The watch works again after the relist, and node 3 was not reported by mistake.
    api.kubelet.exit("tfjob-worker-3-3", 0)
    assert next_event(platform).id == 3
    assert platform.events.empty()


# -- job deletion --------------------------------------------------------------------------


def test_deleting_the_master_pod_removes_everything_owned(api, master_pod, platform, token_file):
    for node_type, rank, node_id in (("ps", 0, 1), ("worker", 0, 2), ("worker", 1, 3)):
        platform.launch(launch_spec(node_type, rank, node_id, token_file))
        api.kubelet.run(pod_of(api, node_type, rank, node_id)["metadata"]["name"])
    api.kubelet.exit("tfjob-worker-1-3", 0)  # an ended pod is kept for its logs, until now
    assert next_event(platform).id == 3
    assert len(api.pods(SEL)) == 3 and len(api.objects("services")) == 3

    api.delete("pods", master_pod["metadata"]["name"])  # kubectl delete pod tfjob-master

    api.wait_for(
        lambda: not api.pods(SEL) and not api.objects("services") and not api.objects("secrets"),
        what="the garbage collector to remove pods, services and the token secret",
    )
    ended = {next_event(platform).id for _ in range(2)}
    assert ended == {1, 2}


# -- a real JobMaster control loop ------------------------------------------------------------


def test_job_master_relaunches_failed_and_oom_nodes_on_k8s(api, master_pod, tmp_path, token_file):
    spec = parse_job_spec(
        {
            "name": JOB,
            "command": ["python", "train.py"],
            "ps": {"replicas": 1, "memory_mb": 1000, "cpu": 1},
            "worker": {"replicas": 2, "max_relaunches": 2},
        },
        source="test",
        base_dir=str(tmp_path),
    )
    platform = make_platform(api, master_pod)
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    job = JobMaster(
        spec, platform, store, JobRuntime(str(tmp_path), "tfjob-master:50051", token_file)
    )
    api.store.sigterm_exit_code = 0  # the PS server exits 0 on SIGTERM
    result: list[JobState] = []
    thread = threading.Thread(target=lambda: result.append(job.run()), daemon=True)
    thread.start()
    try:
        ps = pod_of(api, "ps", 0, 1)
        w0, w1 = pod_of(api, "worker", 0, 2), pod_of(api, "worker", 1, 3)
        for pod in (ps, w0, w1):
            api.kubelet.run(pod["metadata"]["name"])
        cluster = yaml.safe_load(env_of(w1)["TF_CONFIG"])["cluster"]
        assert cluster["ps"] == ["tfjob-ps-0.default.svc:2222"]
        assert cluster["worker"][:2] == [
            "tfjob-worker-0.default.svc:2222",
            "tfjob-worker-1.default.svc:2222",
        ]

        # worker-1 fails: relaunched with the same rank, behind the same service.
        api.kubelet.exit(w1["metadata"]["name"], 1, message="boom")
        w1b = api.wait_for(
            lambda: [
                p
                for p in api.pods(f"{SEL},dlrover.io/node-type=worker,dlrover.io/rank=1")
                if p["metadata"]["name"] != w1["metadata"]["name"]
            ],
            what="worker-1 relaunched",
        )[0]
        assert w1b["metadata"]["labels"]["dlrover.io/node-id"] != "3"
        assert env_of(w1b)["TF_CONFIG"] == env_of(w1)["TF_CONFIG"]
        api.kubelet.run(w1b["metadata"]["name"])

        # The PS is OOM-killed: relaunched with 1.5x the memory.
        api.kubelet.oom_kill(ps["metadata"]["name"])
        ps_b = api.wait_for(
            lambda: [
                p
                for p in api.pods(f"{SEL},dlrover.io/node-type=ps")
                if p["metadata"]["name"] != ps["metadata"]["name"]
            ],
            what="ps-0 relaunched",
        )[0]
        limits = ps_b["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"cpu": "1", "memory": "1500Mi"}
        assert ps["spec"]["containers"][0]["resources"]["limits"]["memory"] == "1000Mi"
        api.kubelet.run(ps_b["metadata"]["name"])

        # The workers finish; the master stops the PS and the job succeeds.
        api.kubelet.exit(w0["metadata"]["name"], 0)
        api.kubelet.exit(w1b["metadata"]["name"], 0)
        thread.join(timeout=20)
        assert not thread.is_alive()
    finally:
        job.request_stop("test over")
        thread.join(timeout=20)
        store.close()
    assert result == [JobState.SUCCEEDED], job.reason
    history = [(n.type, n.rank, n.exit_reason.value) for n in job.nodes.history()]
    assert history == [
        ("ps", 0, "oom"),
        ("worker", 0, "succeeded"),
        ("worker", 1, "user_error"),
        ("worker", 1, "succeeded"),
        ("ps", 0, "stopped"),
    ]
    kinds = [e.kind for e in job.events]
    assert kinds.count("relaunch") == 2
    assert any("relaunch with 1500 MB" in e.message for e in job.events)
    # At shutdown the platform removed the services and the token secret. Pods that ended by
    # themselves stay for their logs; the stopped PS was deleted to stop it.
    assert not api.objects("services") and not api.objects("secrets")
    assert len(api.pods(SEL)) == 4
    assert_allowed_by_master_role(api)


# -- the commands: submit to a cluster, and the master inside its pod -------------------------


def write_kubeconfig(tmp_path, api) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "users": [{"name": "me", "user": {"token": "not-checked"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
                "current-context": "fake",
            }
        )
    )
    return str(path)


def write_job(tmp_path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: tfjob\n"
        "command: [python, train.py]\n"
        "workdir: /opt/dlrover/examples/tf\n"
        "ps: {replicas: 1}\n"
        "worker: {replicas: 1}\n"
    )
    return str(path)


def resolved_env(pod) -> dict[str, str]:
    """The master container's env as the kubelet would give it (downward API resolved)."""
    from tests.integration.test_k8s_master_restart import pod_env

    return pod_env(pod)


def test_submit_creates_the_master_and_deleting_it_removes_the_job(
    api, tmp_path, token_file, monkeypatch
):
    from master.cli.main import main

    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path, api))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    job_yaml = write_job(tmp_path)
    argv = ["submit", job_yaml, "--platform", "k8s", "--state", "etcd://etcd.db:2379"]
    assert main([*argv, "--image", "reg/dl:2"]) == 0

    job = api.store.get(BATCH, "jobs", "default", "tfjob-master")
    template = job["spec"]["template"]["spec"]
    assert template["serviceAccountName"] == "tfjob-master"
    assert template["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 5
    command = template["containers"][0]["command"]
    assert command[command.index("--state") + 1] == "etcd://etcd.db:2379"
    assert "--resume-if-started" in command
    config = api.objects("configmaps")[0]
    assert config["data"]["job.yaml"] == open(job_yaml).read()
    role = api.objects("roles", gv=RBAC)[0]
    assert {"pods", "services", "secrets", "events"} <= {
        r for rule in role["rules"] for r in rule["resources"]
    }
    owned = [
        *api.objects("serviceaccounts"),
        role,
        *api.objects("rolebindings", gv=RBAC),
        config,
        *api.objects("services"),
    ]
    assert len(owned) == 5
    for obj in owned:
        assert obj["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]

    # A second submit of the same job is refused while its master Job exists.
    assert main(argv) == 2

    # Inside the master pod (the Job controller's): the platform reads its settings from the
    # pod's env, the Job's uid among them.
    master = api.jobs.start_pod("tfjob-master")
    api.kubelet.run(master["metadata"]["name"])
    env = resolved_env(api.pod(master["metadata"]["name"]))
    assert env[ENV_JOB_NAME] == JOB and env[ENV_IMAGE] == "reg/dl:2"
    assert env[ENV_MASTER_SERVICE] == "tfjob-master" and env[ENV_NAMESPACE] == "default"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    platform = KubernetesPlatform(host="tfjob-master", api_client=api.api_client())
    try:
        assert platform.settings.owner_uid == job["metadata"]["uid"]
        assert platform.settings.master_pod_name == master["metadata"]["name"]
        platform.launch(launch_spec("worker", 0, 1, token_file))
        api.kubelet.run("tfjob-worker-0-1")
        worker = api.pod("tfjob-worker-0-1")
        assert worker["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        assert env_of(worker)["DLROVER_MASTER_ADDR"] == "tfjob-master.default.svc:50051"
        assert ENV_MASTER_POD_UID not in env_of(worker)

        # The master pod going does not take the job with it (the Job starts another) ...
        api.delete("pods", master["metadata"]["name"], grace_seconds=0)
        assert api.pod("tfjob-worker-0-1")["metadata"]["uid"] == worker["metadata"]["uid"]
        # ... deleting the Job (kubectl: background cascade) does.
        api.delete("jobs", "tfjob-master", gv=BATCH, propagation="Background")
        api.wait_for(
            lambda: (
                not any(api.objects(r) for r in ("pods", "services", "secrets", "configmaps"))
                and not api.objects("serviceaccounts")
                and not api.objects("roles", gv=RBAC)
                and not api.objects("rolebindings", gv=RBAC)
            ),
            what="every object of the job to be collected",
        )
        assert next_event(platform).id == 1
    finally:
        platform.shutdown(0)


def test_submit_to_an_unreachable_cluster_is_one_clear_error(tmp_path, monkeypatch, capsys):
    from master.cli.main import main

    with FakeKubeApiServer() as gone:
        kubeconfig = write_kubeconfig(tmp_path, gone)
    monkeypatch.setenv("KUBECONFIG", kubeconfig)  # points at a closed port now
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    argv = ["submit", write_job(tmp_path), "--platform", "k8s", "--data-claim", "shared"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Kubernetes API server at http://127.0.0.1:" in err
    assert "Traceback" not in err


def test_master_command_runs_the_job_with_the_k8s_platform(api, master_pod, tmp_path):
    """`dlrover master JOB --platform k8s` as in the master pod, driven by a fake kubelet."""
    env = dict(os.environ)
    env.update(
        {
            "KUBECONFIG": write_kubeconfig(tmp_path, api),
            ENV_JOB_NAME: JOB,
            ENV_NAMESPACE: "default",
            ENV_MASTER_POD_NAME: master_pod["metadata"]["name"],
            ENV_MASTER_POD_UID: master_pod["metadata"]["uid"],
            ENV_MASTER_SERVICE: f"{JOB}-master",
            "DLROVER_K8S_GRACE_SECONDS": "1",
        }
    )
    env.pop("KUBERNETES_SERVICE_HOST", None)
    api.store.sigterm_exit_code = 0
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "master.cli",
            "master",
            write_job(tmp_path),
            "--platform",
            "k8s",
            "--run-dir",
            str(tmp_path / "run"),
            "--summary-json",
            str(tmp_path / "summary.json"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # a master process starting on a loaded machine: seconds of imports before its pods
        ps = pod_of(api, "ps", 0, 1, timeout=90)
        worker = pod_of(api, "worker", 0, 2)
        api.kubelet.run(ps["metadata"]["name"])
        api.kubelet.run(worker["metadata"]["name"])
        assert env_of(worker)["DLROVER_MASTER_ADDR"].startswith("tfjob-master.default.svc:")
        api.kubelet.exit(worker["metadata"]["name"], 0)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    summary = yaml.safe_load((tmp_path / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    assert [(n["type"], n["exit_reason"]) for n in summary["nodes"]] == [
        ("ps", "stopped"),
        ("worker", "succeeded"),
    ]
    assert not api.objects("services")


def test_fake_server_answers_like_the_api_server(api):
    """The fake's own conventions the platform relies on (a wrong fake proves nothing)."""
    from kubernetes import client, watch
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api.api_client())
    body = {"metadata": {"name": "p", "labels": {"a": "1"}}, "spec": {"containers": []}}
    created = core.create_namespaced_pod("default", body)
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod("default", body)
    assert e.value.status == 409
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("nope", "default")
    assert e.value.status == 404
    listed = core.list_namespaced_pod("default", label_selector="a in (1,2)")
    assert [p.metadata.name for p in listed.items] == ["p"]
    assert core.list_namespaced_pod("default", label_selector="a!=1").items == []

    # A watch from before the compaction horizon: 410 Gone as an ERROR event.
    old = created.metadata.resource_version
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"b": "2"}}})
    api.store.compact()
    with pytest.raises(ApiException) as e:
        list(
            watch.Watch().stream(
                core.list_namespaced_pod, "default", resource_version=old, timeout_seconds=1
            )
        )
    assert e.value.status == 410
    # A watch without a resourceVersion starts with the current objects.
    events = list(watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=1))
    assert [(ev["type"], ev["object"].metadata.name) for ev in events] == [("ADDED", "p")]
