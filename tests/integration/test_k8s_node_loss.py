"""A Kubernetes node lost mid-job (fake API server, real master, fake trainers as processes).

The node's loss as Kubernetes shows it, in its two forms: the taint manager deletes the pod
with its node NotReady and no container exit code ever comes; or the node only goes NotReady
and nothing is deleted, until the master's node-lost grace ends it. Either way the outcome is
the one on Ray (tests/integration/test_ray_multinode.py): the node ends as `node_lost`, its rank
is relaunched on another node using the job's relaunch budget, a lost ps-0 rolls the data back
and a `recovery` event follows, no record is lost and the job succeeds; a standby PS lost with
ps-0 does not take its place. One difference is Kubernetes' own: a rank keeps its address (its
service) wherever its pod runs, so a relaunched ps-0 changes no TF_CONFIG and no trainer is
restarted, where on Ray a ps-0 moved to another Ray node restarts them with the new address.
The lost node's processes keep running here (frozen, then let go): when they come back they
are refused as a stale incarnation and cannot count anything, and their kubelet kills them once
it returns.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml

from master.platform.k8s_resources import (
    ENV_JOB_NAME,
    ENV_MASTER_POD_NAME,
    ENV_MASTER_POD_UID,
    ENV_MASTER_SERVICE,
    ENV_NAMESPACE,
)
from master.platform.k8s_settings import ENV_NODE_LOST_GRACE_SECONDS
from tests.integration.test_k8s_platform import JOB, ROOT, SEL, env_of, write_kubeconfig
from tests.k8s_fake import FakeKubeApiServer
from tests.k8s_fake.process_kubelet import PodProcess, ProcessKubelet

pytest.importorskip("kubernetes")

HERE = os.path.dirname(os.path.abspath(__file__))
# Enough that each relaunch finds an empty node (the master pod runs on fake-node-1).
NODES = ("node-a", "node-b", "node-c", "node-d", "node-e")
SIZE, EPOCHS, BATCH = 2000, 2, 16
STEP_SECONDS = 0.03
NODE_LOST_GRACE_SECONDS = 2.0
DEADLINE_SECONDS = 60.0


def write_job(tmp_path, ps_standby: bool) -> str:
    ids = tmp_path / "ids"
    ids.mkdir()
    job = {
        "name": JOB,
        "command": ["python", os.path.join(HERE, "fake_trainer.py")],
        "env": {
            "FAKE_IDS_DIR": str(ids),
            "FAKE_SIZE": str(SIZE),
            "FAKE_EPOCHS": str(EPOCHS),
            "FAKE_BATCH": str(BATCH),
            "FAKE_STEP_SECONDS": str(STEP_SECONDS),
        },
        "ps_standby": ps_standby,
        "ps": {"replicas": 1},
        "worker": {"replicas": 2, "max_relaunches": 2},
        # Far beyond the test: a loss can only be learned from Kubernetes.
        "heartbeat_timeout_seconds": 600,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


class K8sJob:
    """`dlrover master --platform k8s` as in its pod, its node pods run by a ProcessKubelet."""

    def __init__(self, api, tmp_path, ps_standby: bool, place: dict[str, str]) -> None:
        self.api = api
        self.tmp = tmp_path
        self.run_dir = tmp_path / "run"
        (tmp_path / "pods").mkdir()
        master = api.create(
            "pods",
            {
                "metadata": {"name": f"{JOB}-master", "labels": {"dlrover.io/job": JOB}},
                "spec": {"containers": [{"name": "master", "image": "img:1"}]},
            },
        )
        api.kubelet.run(master["metadata"]["name"])
        self.kubelet = ProcessKubelet(api, str(tmp_path / "pods"), NODES)
        self.kubelet.placement.update(place)
        self.kubelet.program = without_tensorflow
        env = dict(os.environ)
        env.update(
            {
                "KUBECONFIG": write_kubeconfig(tmp_path, api),
                ENV_JOB_NAME: JOB,
                ENV_NAMESPACE: "default",
                ENV_MASTER_POD_NAME: master["metadata"]["name"],
                ENV_MASTER_POD_UID: master["metadata"]["uid"],
                ENV_MASTER_SERVICE: f"{JOB}-master",
                "DLROVER_K8S_GRACE_SECONDS": "1",
                ENV_NODE_LOST_GRACE_SECONDS: str(NODE_LOST_GRACE_SECONDS),
            }
        )
        env.pop("KUBERNETES_SERVICE_HOST", None)
        cmd = [
            sys.executable,
            "-m",
            "master.cli",
            "master",
            write_job(tmp_path, ps_standby),
        ]
        cmd += ["--platform", "k8s", "--run-dir", str(self.run_dir)]
        cmd += ["--summary-json", str(tmp_path / "summary.json")]
        self.log_path = tmp_path / "master.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
        self.frozen_ids: dict[str, int] = {}  # ids file of a lost process -> bytes at the loss

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.kubelet.close()

    # -- waiting for states, with deadlines ----------------------------------------------

    def wait(self, predicate, what: str, timeout: float = DEADLINE_SECONDS):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            assert self.proc.poll() is None, f"the master ended before {what}: {self.output()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
            time.sleep(0.05)

    def output(self) -> str:
        """The tail of the master's log."""
        return self.log_path.read_text(errors="replace")[-4000:]

    def events(self) -> list[dict]:
        try:
            text = (self.run_dir / "events.jsonl").read_text()
        except OSError:
            return []
        return [json.loads(ln) for ln in text.splitlines() if ln.strip()]

    def rank_pods(self, node_type: str, rank: int) -> list[dict]:
        sel = f"{SEL},dlrover.io/node-type={node_type},dlrover.io/rank={rank}"
        return self.api.pods(sel)

    def running_pod(self, node_type: str, rank: int, not_id: int = 0) -> dict:
        """The Running pod of (type, rank), other than incarnation `not_id`."""

        def found():
            for pod in self.rank_pods(node_type, rank):
                if pod["metadata"]["labels"]["dlrover.io/node-id"] == str(not_id):
                    continue
                if pod["status"].get("phase") == "Running":
                    return pod
            return None

        return self.wait(found, f"a running pod of {node_type}-{rank}")

    def trained(self, node_type: str, rank: int) -> int:
        """Batches the current trainers of (type, rank) trained so far (their ids files)."""
        files = glob.glob(str(self.tmp / "ids" / f"{node_type}.{rank}.*.ids"))
        return sum(os.path.getsize(f) for f in files) // (8 * BATCH)

    # -- a node lost ------------------------------------------------------------------------

    def lose_node_of(self, pod: dict, deleted: bool) -> tuple[str, list[PodProcess], float]:
        """Lose the node running `pod` (`deleted`: the taint manager deletes that pod): the
        node, its processes, when it was lost."""
        node = pod["spec"]["nodeName"]
        lost = self.kubelet.on_node(node)
        at = time.time()
        self.kubelet.lose_node(node, deleted=(pod["metadata"]["name"],) if deleted else ())
        for p in lost:  # frozen now: what each trained before counts, nothing after
            for pid in trainer_pids(p):
                for f in glob.glob(str(self.tmp / "ids" / f"*.*.{pid}.ids")):
                    self.frozen_ids[f] = os.path.getsize(f)
        return node, lost, at

    def node_failed(self, node_id: int) -> dict:
        return self.wait(
            lambda: next(
                (
                    e
                    for e in self.events()
                    if e["kind"] == "node_failed" and e["node_id"] == node_id
                ),
                None,
            ),
            f"the end of node id {node_id}",
        )

    def counts(self) -> np.ndarray:
        """Times each record was trained, by the job's processes: what a lost one trained
        after its node was lost is left out (it must not have counted)."""
        parts = []
        for f in glob.glob(str(self.tmp / "ids" / "*.ids")):
            ids = np.fromfile(f, dtype=np.int64)
            if f in self.frozen_ids:
                ids = ids[: self.frozen_ids[f] // 8]
            parts.append(ids)
        return np.bincount(np.concatenate(parts), minlength=SIZE)


def without_tensorflow(command: list[str]) -> list[str]:
    """The standby PS's command, run as a fake that reports ready at once."""
    if command[-2:] == ["-m", "dlrover_tf.ps_standby"]:
        return [sys.executable, os.path.join(HERE, "fake_ps_standby.py")]
    return command


def trainer_pids(p: PodProcess) -> list[int]:
    try:
        root = psutil.Process(p.proc.pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.Error:
        return []


def cluster_of(pod: dict) -> dict:
    return json.loads(env_of(pod)["TF_CONFIG"])["cluster"]


def node_id(pod: dict) -> int:
    return int(pod["metadata"]["labels"]["dlrover.io/node-id"])


@pytest.fixture
def start_job(tmp_path):
    """Starts the job (with or without a standby PS; pods whose name starts with a key of
    `place` go to that node)."""
    with FakeKubeApiServer() as api:
        jobs: list[K8sJob] = []

        def start(ps_standby: bool = False, place: dict[str, str] | None = None) -> K8sJob:
            jobs.append(K8sJob(api, tmp_path, ps_standby, place or {}))
            return jobs[-1]

        try:
            yield start
        finally:
            for j in jobs:
                j.close()


def lose_and_check(job: K8sJob, node_type: str, rank: int, deleted: bool):
    """Lose the node of (type, rank) mid-training and check its end and its relaunch on
    another node. The node_failed event, the lost node and its processes."""
    old = job.running_pod(node_type, rank)
    node, lost, lost_at = job.lose_node_of(old, deleted=deleted)
    failed = job.node_failed(node_id(old))
    detected = failed["time"] - lost_at
    how = "its pod deleted by the taint manager" if deleted else "NotReady, nothing deleted"
    print(f"{node_type}-{rank}'s node lost ({how}): its end seen after {detected:.2f} s")
    assert failed["reason"] == "node_lost", failed  # ExitReason.NODE_LOST, as on Ray
    assert failed["details"]["exit_code"] == -9, failed  # no exit code ever came
    assert "NodeLost" in failed["details"]["excerpt"], failed
    if deleted:  # the deletion with its node NotReady says it all: no grace to wait for
        assert detected < NODE_LOST_GRACE_SECONDS, detected
    else:  # only the master's node-lost grace ends it
        assert detected >= NODE_LOST_GRACE_SECONDS - 0.1, detected
    # The rank runs again in a new pod (a standby PS may be promoted), on a Ready node.
    new = job.running_pod(node_type, rank, not_id=node_id(old))
    assert node_id(new) > node_id(old)
    assert new["spec"]["nodeName"] != node, new["spec"]["nodeName"]
    # The lost pod is gone from the API (its deletion forced), though its processes still run.
    old_uid = old["metadata"]["uid"]
    job.wait(
        lambda: all(p["metadata"]["uid"] != old_uid for p in job.api.pods()), "lost pod deleted"
    )
    assert lost and all(p.proc.poll() is None for p in lost)
    return failed, node, lost


def wait_event(job: K8sJob, what: str, match) -> dict:
    return job.wait(lambda: next((e for e in job.events() if match(e)), None), what)


def check_ps_recovery(job: K8sJob, failed_ps: dict) -> dict:
    """The data went back with the lost PS's variables and training resumed: a `recovery`."""
    recovery = wait_event(
        job,
        "the recovery of ps-0",
        lambda e: e["kind"] == "recovery" and e["time"] >= failed_ps["time"],
    )
    print(f"ps-0's node lost: {recovery['message']}")
    assert (recovery["reason"], recovery["details"]["ps"]) == ("ps_failure", "ps-0")
    assert {"detected", "ps_started", "first_step"} <= set(recovery["details"]["phases"])
    assert any(e["kind"] == "rollback" and e["time"] >= failed_ps["time"] for e in job.events())
    return recovery


def check_end(job: K8sJob) -> dict:
    """The job succeeded, every record counted once per epoch and trained at least as often
    (not counting what lost processes did after their node was lost). The summary."""
    job.proc.wait(timeout=DEADLINE_SECONDS)
    assert job.proc.returncode == 0, job.output()
    summary = json.loads((job.tmp / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    d = summary["datasets"]["train"]
    assert d["records_done"] == d["size"] * d["epochs"] == SIZE * EPOCHS
    counts = job.counts()
    assert counts.min() >= EPOCHS, int((counts < EPOCHS).sum())
    return summary


def ends_by_rank(summary: dict) -> dict[tuple[str, int], list[str]]:
    out: dict[tuple[str, int], list[str]] = {}
    for n in summary["nodes"]:
        out.setdefault((n["type"], n["rank"]), []).append(n["exit_reason"])
    return out


def explain(job: K8sJob, summary: dict, name: str) -> str:
    """For a failed check on `name`'s ends: each incarnation's end and the master's lines on
    it."""
    ends = [
        f"{n['type']}-{n['rank']} id={n['id']} {n['exit_reason']}: {n.get('diagnosis', '')} "
        f"{n.get('excerpt', '')!r}"
        for n in summary["nodes"]
    ]
    said = [ln for ln in job.log_path.read_text(errors="replace").splitlines() if name in ln]
    return "\n".join(ends + said[-40:])


def lose_worker_and_check(job: K8sJob, deleted: bool) -> tuple[dict, dict]:
    """Lose worker-1's node; its process comes back while the job runs and is refused as an
    old incarnation (nothing it trains then counts: check_end). Its end, its new pod."""
    failed, node, lost = lose_and_check(job, "worker", 1, deleted)
    new = job.running_pod("worker", 1, not_id=failed["node_id"])
    assert job.proc.poll() is None, "the job ended before the lost worker came back"
    (zombie,) = lost
    job.kubelet.resume_node(node)
    job.wait(lambda: zombie.proc.poll() is not None, "the lost worker fenced")
    assert zombie.proc.returncode != 0
    assert "is an old incarnation" in open(zombie.log_path).read()
    job.kubelet.node_back(node)
    return failed, new


def wait_standby_ready(job: K8sJob) -> None:
    """The trainers pause until the standby PS is ready: the job outlasts its start."""
    wait_event(job, "the standby PS started", lambda e: "standby PS started" in e["message"])
    workers = [p for p in job.kubelet.processes if p.node_type == "worker"]
    for p in workers:
        job.kubelet.freeze(p)
    wait_event(job, "the standby PS ready", lambda e: "standby PS ready" in e["message"])
    for p in workers:
        job.kubelet.freeze(p, frozen=False)


@pytest.mark.parametrize(
    "ps_deleted", [False, True], ids=["ps_not_ready-worker_deleted", "ps_deleted-worker_not_ready"]
)
def test_the_lost_nodes_of_ps_0_and_of_a_worker_end_as_on_ray(start_job, ps_deleted):
    """Kubernetes loses the node of ps-0, then the node of worker-1, each in one of its two
    ways: each ends as node_lost and runs again in a new pod on another node at its address.
    Where ps-0's pod is deleted first, the standby PS beside it (only NotReady yet) may not
    take its place: it is lost too (as on Ray, where the standby is placed beside ps-0)."""
    ps_node = NODES[0]
    job = start_job(ps_standby=ps_deleted, place={f"{JOB}-ps-": ps_node})
    job.wait(lambda: job.trained("worker", 1) >= 15, "worker-1 training")
    if ps_deleted:
        wait_standby_ready(job)
    w0, w1 = job.running_pod("worker", 0), job.running_pod("worker", 1)

    # (b) ps-0's node: the data goes back with the PS's variables, training resumes.
    failed_ps, lost_node, ps_lost = lose_and_check(job, "ps", 0, ps_deleted)
    assert lost_node == ps_node
    assert len(ps_lost) == (2 if ps_deleted else 1), ps_lost  # with the standby, if any
    new_ps = job.running_pod("ps", 0, not_id=failed_ps["node_id"])
    assert "standby" not in new_ps["metadata"]["name"], new_ps["metadata"]["name"]
    check_ps_recovery(job, failed_ps)
    # ps-0 kept its address (its rank's service): the trainers go on in their pods with the
    # same cluster spec. (On Ray a ps-0 moved to a new address restarts them.)
    for pod in (w0, w1):
        assert job.api.pod(pod["metadata"]["name"])["status"]["phase"] == "Running"
    if ps_deleted:  # the lost standby ends after the node-lost grace; a new one starts
        wait_event(
            job,
            "a new standby",
            lambda e: e["kind"] == "ps_standby" and e["time"] > failed_ps["time"]
            and "started" in e["message"],
        )  # fmt: skip
    job.kubelet.node_back(ps_node)  # its kubelet returns: the lost PS processes are killed
    job.wait(lambda: all(p.proc.poll() is not None for p in ps_lost), "the lost PS killed")

    # (a) worker-1's node, the other way.
    job.wait(lambda: job.trained("worker", 1) >= 25, "worker-1 training on")
    failed, new_w1 = lose_worker_and_check(job, not ps_deleted)
    assert cluster_of(new_w1) == cluster_of(w0)  # the same TF cluster: the same addresses

    summary = check_end(job)
    ends = ends_by_rank(summary)
    assert ends[("ps", 0)] == ["node_lost", "stopped"], explain(job, summary, "ps-0")
    # worker-0 was never restarted.
    assert ends[("worker", 0)] == ["succeeded"], explain(job, summary, "worker-0")
    assert ends[("worker", 1)] == ["node_lost", "succeeded"], explain(job, summary, "worker-1")
    # Each relaunch used the job's relaunch budget, as a lost Ray node's does.
    relaunches = [e["details"] for e in job.events() if e["kind"] == "relaunch"]
    assert [(r["previous_id"], r["job_relaunches"]) for r in relaunches] == [
        (failed_ps["node_id"], 1),
        (failed["node_id"], 2),
    ], relaunches


def test_a_standby_pod_on_a_node_not_ready_cannot_stand_in(tmp_path):
    """The platform alone: the standby's pod stands in again once its node is Ready again;
    ended, never."""
    from tests.integration.test_k8s_platform import launch_spec, make_platform

    token = tmp_path / ".job_token"
    token.write_text("t")
    with FakeKubeApiServer() as api:
        master = api.create("pods", {"metadata": {"name": f"{JOB}-master"}, "spec": {}})
        platform = make_platform(api, master)
        try:
            platform.launch(launch_spec("ps", -1, 2, str(token)))
            api.kubelet.run(f"{JOB}-ps-standby-2", node="node-b")
            assert platform.can_stand_in(2, "ps", 0)
            api.kubelet.node_not_ready("node-b")
            api.wait_for(lambda: not platform.can_stand_in(2, "ps", 0), what="not Ready seen")
            api.kubelet.node_ready("node-b")
            api.wait_for(lambda: platform.can_stand_in(2, "ps", 0), what="Ready again seen")
            api.kubelet.exit(f"{JOB}-ps-standby-2", 1)
            assert platform.events.get(timeout=10).id == 2
            assert not platform.can_stand_in(2, "ps", 0)
        finally:
            platform.shutdown(0)
