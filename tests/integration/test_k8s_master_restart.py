"""A master pod killed mid-job on Kubernetes (fake API server and kubelet, real master processes).

`dlrover submit --platform k8s` creates the master's Job; the test plays the Job controller
(it starts the Job's pods), the kubelet (runs, fails and finishes pods) and the pod's
downward API (the master's env, the job token secret mounted as a file). The masters are
real `dlrover master` processes started with the command of the Job's pod template.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from master.cli.main import main
from tests.integration.test_k8s_platform import ROOT, SEL, env_of, write_kubeconfig
from tests.k8s_fake import FakeKubeApiServer
from tests.k8s_fake.store import BATCH, RBAC

pytest.importorskip("kubernetes")

JOB = "tfjob"
MASTER = f"{JOB}-master"


@pytest.fixture
def api():
    with FakeKubeApiServer() as server:
        yield server


def write_job(tmp_path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(
        f"name: {JOB}\n"
        "command: [python, train.py]\n"
        "workdir: /opt/dlrover/examples/tf\n"
        "ps: {replicas: 1}\n"
        "worker: {replicas: 2, max_relaunches: 2}\n"
    )
    return str(path)


def pod_env(pod) -> dict[str, str]:
    """The master container's env as the kubelet gives it (downward API fields resolved)."""
    env = {}
    for e in pod["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        path = e["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
        if label:
            env[e["name"]] = pod["metadata"]["labels"].get(label.group(1), "")
        else:
            section, field = path.split(".")
            env[e["name"]] = pod[section][field]
    return env


class MasterPod:
    """One pod of the master's Job, its container run as a local `dlrover master` process."""

    def __init__(self, api, tmp_path, job_yaml: str) -> None:
        self.pod = api.jobs.start_pod(MASTER)
        self.name = self.pod["metadata"]["name"]
        api.kubelet.run(self.name)
        command = self.pod["spec"]["containers"][0]["command"]
        assert command[:2] == ["dlrover", "master"], command
        env = pod_env(api.pod(self.name))
        # The kubelet expands $(VAR) in the command from the container's env.
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in command[2:]]
        args[0] = job_yaml  # the ConfigMap's job.yaml, mounted
        # The claim mounted at /var/dlrover is a directory shared by every master pod here.
        args = [a.replace("/var/dlrover", str(tmp_path / "claim")) for a in args]
        args[args.index("--port") + 1] = "0"  # no fixed port on a shared test machine
        # The token secret, mounted (optional: absent until the first master creates it).
        token_dir = tmp_path / f"token-{self.name}"
        token_dir.mkdir()
        secrets = api.objects("secrets")
        if secrets:
            (token_dir / "token").write_bytes(base64.b64decode(secrets[0]["data"]["token"]))
        i = args.index("--job-token-file")
        args[i + 1] = str(token_dir / "token")
        self.run_dir = args[args.index("--run-dir") + 1]
        summary = tmp_path / f"summary-{self.name}.json"
        self.summary_path = summary
        env = {**os.environ, **env}
        env.update(
            {
                "KUBECONFIG": write_kubeconfig(tmp_path, api),
                "DLROVER_K8S_GRACE_SECONDS": "1",
            }
        )
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "master.cli", "master", *args, "--summary-json", str(summary)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def summary(self) -> dict:
        return json.loads(self.summary_path.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


def pod_of(api, node_type: str, rank: int, node_id: int, timeout: float = 90.0):
    """The pod of one incarnation, waiting for a master process to start (slow when loaded)."""
    sel = f"{SEL},dlrover.io/node-type={node_type},dlrover.io/node-id={node_id}"
    return api.wait_for(
        lambda: next(iter(api.pods(sel)), None),
        timeout=timeout,
        what=f"pod of {node_type}-{rank} id {node_id}",
    )


def uids(api) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.pods(SEL)}


@pytest.mark.slow  # three master processes: 10-60 s on a loaded 2-core machine
def test_a_killed_master_pod_is_replaced_and_adopts_every_node_pod(api, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path, api))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    job_yaml = write_job(tmp_path)
    assert main(["submit", job_yaml, "--platform", "k8s", "--data-claim", "shared"]) == 0
    api.store.sigterm_exit_code = 0  # the PS exits 0 when the master stops it

    first = MasterPod(api, tmp_path, job_yaml)
    masters = [first]
    try:
        ps, w0, w1 = (
            pod_of(api, "ps", 0, 1),
            pod_of(api, "worker", 0, 2),
            pod_of(api, "worker", 1, 3),
        )
        for pod in (ps, w0, w1):
            api.kubelet.run(pod["metadata"]["name"])
            assert pod["metadata"]["ownerReferences"][0]["kind"] == "Job"
        api.wait_for(lambda: api.objects("secrets"), what="the job token secret")
        before = uids(api)

        # The master dies; its pod fails, and the Job controller starts another one.
        first.proc.send_signal(signal.SIGKILL)
        out1, _ = first.proc.communicate(timeout=30)
        api.kubelet.exit(first.name, 137, reason="Error")
        # worker-1 fails while no master watches.
        api.kubelet.exit(w1["metadata"]["name"], 1, message="boom")
        posts_before = len(api.requests("POST"))

        second = MasterPod(api, tmp_path, job_yaml)
        masters.append(second)
        # Every master pod of the Job shares one run dir, named by the Job's uid.
        job_uid = api.store.get(BATCH, "jobs", "default", MASTER)["metadata"]["uid"]
        assert second.run_dir == first.run_dir and first.run_dir.endswith(f"{JOB}-{job_uid}")
        # worker-1 comes back at rank 1 (a new incarnation, id 4), behind the same service.
        w1b = pod_of(api, "worker", 1, 4)
        assert env_of(w1b)["TF_CONFIG"] == env_of(w1)["TF_CONFIG"]
        api.kubelet.run(w1b["metadata"]["name"])
        # The healthy pods are the same objects: nothing deleted or recreated.
        now = uids(api)
        for name in (ps["metadata"]["name"], w0["metadata"]["name"]):
            assert now[name] == before[name]
        deletes = [r for r in api.requests("DELETE") if "/pods/" in r[1]]
        assert deletes == []
        new_posts = [r for r in api.requests("POST")[posts_before:] if r[1].endswith("/pods")]
        assert len(new_posts) == 1  # only worker-1's relaunch

        api.kubelet.exit(w0["metadata"]["name"], 0)
        api.kubelet.exit(w1b["metadata"]["name"], 0)
        out2, _ = second.proc.communicate(timeout=60)
        assert second.proc.returncode == 0, out1 + out2
        summary = second.summary()
        assert summary["status"] == "succeeded"
        nodes = [(n["type"], n["rank"], n["id"], n["exit_reason"]) for n in summary["nodes"]]
        assert nodes == [
            ("ps", 0, 1, "stopped"),
            ("worker", 0, 2, "succeeded"),
            ("worker", 1, 3, "user_error"),
            ("worker", 1, 4, "succeeded"),
        ]
        restarted = [e for e in summary["events"] if e["kind"] == "master_restarted"]
        assert len(restarted) == 1 and "adopted 3 running nodes" in restarted[0]["message"]

        # A master pod started after the end (its predecessor died as it exited) does nothing.
        third = MasterPod(api, tmp_path, job_yaml)
        masters.append(third)
        out3, _ = third.proc.communicate(timeout=60)
        assert third.proc.returncode == 0, out3
        assert "the job already ended (succeeded)" in out3
        assert len(api.pods(SEL)) == 3  # w0, w1 and w1b kept for their logs; PS deleted

        # `kubectl delete job tfjob-master` (background cascade) removes every object.
        api.delete("jobs", MASTER, gv=BATCH, propagation="Background")
        api.wait_for(
            lambda: (
                not any(api.objects(r) for r in ("pods", "services", "secrets", "configmaps"))
                and not api.objects("serviceaccounts")
                and not api.objects("roles", gv=RBAC)
                and not api.objects("rolebindings", gv=RBAC)
            ),
            what="every object of the job to be collected",
        )
    finally:
        for m in masters:
            m.kill()


def test_submit_without_durable_state_is_refused_with_the_fix(tmp_path, capsys):
    job_yaml = write_job(tmp_path)
    assert main(["submit", job_yaml, "--platform", "k8s", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--state etcd://HOST:PORT" in err and "--data-claim PVC" in err
    argv = ["submit", job_yaml, "--platform", "k8s", "--dry-run", "--state", "/tmp/s.sqlite"]
    assert main(argv) == 2
    assert "must outlive the master pod" in capsys.readouterr().err


def test_a_new_master_pod_with_a_fresh_run_dir_keeps_the_nodes_token(tmp_path):
    """State elsewhere (etcd in a cluster; a SQLite file outside the run dir here) and a new
    pod's empty run dir: --resume-if-started resumes with the token from the mounted secret."""
    import argparse

    from master.cli.cmd_submit import restartable_master
    from master.cli.run_layout import TOKEN_FILE, run_layout
    from master.config import MasterConfig, parse_job_spec
    from master.state.factory import open_state_store
    from master.state.job_record import JOB_TABLE

    job = {"name": JOB, "command": ["true"], "worker": {"replicas": 1}}
    spec = parse_job_spec(job, "test", str(tmp_path))
    run_dir = tmp_path / "runs" / "tfjob-uid1"  # the new pod's emptyDir: nothing in it
    state = str(tmp_path / "elsewhere.sqlite")
    token = tmp_path / "secret" / "token"
    args = argparse.Namespace(
        resume=False,
        resume_if_started=True,
        run_dir=str(run_dir),
        state=state,
        job_token_file=str(token),
    )
    cfg = MasterConfig(state_path=state)
    layout = run_layout(spec, str(run_dir), state)
    # No job in the state and no secret yet: a fresh start with a new token.
    resume, ended, fresh = restartable_master(layout, args, cfg)
    assert (resume, ended, fresh.job_token) == (False, "", cfg.job_token)

    store = open_state_store(state, job=layout.namespace)
    store.put(JOB_TABLE, "runtime", b"{}")
    store.put(JOB_TABLE, "status", json.dumps({"state": "running", "reason": ""}).encode())
    token.parent.mkdir()
    token.write_text("the-nodes-token\n")
    resume, ended, cfg2 = restartable_master(layout, args, cfg)
    assert (resume, ended, cfg2.job_token) == (True, "", "the-nodes-token")
    assert (run_dir / TOKEN_FILE).read_text() == "the-nodes-token"
    assert oct((run_dir / TOKEN_FILE).stat().st_mode & 0o777) == "0o600"

    store.put(JOB_TABLE, "status", json.dumps({"state": "failed", "reason": "x"}).encode())
    store.close()
    assert restartable_master(layout, args, cfg)[:2] == (False, "failed")


def test_adopt_finds_each_pod_by_name_and_uid_and_reports_what_ended_unwatched(api, tmp_path):
    """The platform alone: a new instance adopts a running pod, reports one that failed and
    one that was replaced by a namesake while no master watched, and stops the adopted one."""
    from master.platform.kubernetes import KubernetesPlatform
    from tests.integration.test_k8s_platform import (
        assert_allowed_by_master_role,
        launch_spec,
        make_platform,
    )

    owner = api.create("configmaps", {"metadata": {"name": "owner"}})
    token = tmp_path / ".job_token"
    token.write_text("t")
    old = make_platform(api, owner)
    specs = [launch_spec("worker", r, r + 1, str(token)) for r in range(3)]
    for spec in specs:
        old.launch(spec)
        api.kubelet.run(old.pod_name_of(spec.id))
    handles = {spec.id: old.handle(spec.id) for spec in specs}
    assert all(h["uid"] for h in handles.values())
    old._stop_watch()  # the master process is gone: nobody watches

    api.kubelet.exit(handles[2]["pod"], 1, message="boom")
    # worker-2's pod is deleted and someone makes another pod of that name (a namesake).
    namesake = api.pod(handles[3]["pod"])
    api.delete("pods", handles[3]["pod"], grace_seconds=0)
    api.create("pods", {"metadata": namesake["metadata"] | {"uid": ""}, "spec": namesake["spec"]})

    new: KubernetesPlatform = make_platform(api, owner)
    try:
        for spec in specs:
            new.adopt(spec, handles[spec.id])
        ends = {}
        for _ in range(2):
            ev = new.events.get(timeout=10)
            ends[ev.id] = ev
        assert ends[2].exit_code == 1 and "boom" in ends[2].message
        assert ends[3].exit_code == -signal.SIGKILL and "while no master watched" in ends[3].message
        assert new.events.empty()
        assert new.handle(1) == handles[1]
        new.shutdown(1)  # stops the adopted pod like its own
        stopped = new.events.get(timeout=10)
        assert stopped.id == 1 and stopped.exit_code != 0
        assert handles[1]["pod"] not in uids(api)
        assert not api.objects("services") and not api.objects("secrets")
        assert_allowed_by_master_role(api)  # adopting needs no verb beyond the master's role
    finally:
        new.shutdown(0)
        old._api.close()  # the old instance is dead: nothing of it acts any more


def test_fake_server_serves_jobs_like_the_api_server(api):
    """The fake's Job conventions the tests above rely on (a wrong fake proves nothing)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    batch = client.BatchV1Api(api.api_client())
    template = {"spec": {"restartPolicy": "OnFailure", "containers": [{"name": "m", "image": "i"}]}}
    policy = {"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}
    body = {"metadata": {"name": "j"}, "spec": {"template": template, "podFailurePolicy": policy}}
    with pytest.raises(ApiException) as e:
        batch.create_namespaced_job("default", body)
    assert e.value.status == 422 and "podFailurePolicy" in e.value.body
    template["spec"]["restartPolicy"] = "Never"
    job = batch.create_namespaced_job("default", body)
    uid = job.metadata.uid
    assert job.spec.template.metadata.labels["controller-uid"] == uid
    assert job.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": uid}
    pod = api.jobs.start_pod("j")
    assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
    # A Job deleted without a propagation policy orphans its pods (batch/v1's default).
    batch.delete_namespaced_job("j", "default")
    orphan = api.pod(pod["metadata"]["name"])
    assert orphan["metadata"]["ownerReferences"] == []
