"""The Kubernetes platform against an API server that fails calls as real ones do.

The fake API server (`tests/k8s_fake`) injects 429s with Retry-After, 503s, cut connections and
403s from quota, Pod Security and RBAC; a real `JobMaster` runs the job. What must hold: a call
that can heal is retried and the job goes on; one that cannot fails the job naming its cause; a
rank never has two pods that may run, even when deleting the old one fails.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import pytest

from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime, JobState
from master.platform.k8s_errors import FailureKind, K8sApiError
from master.state.sqlite import SQLiteStateStore
from tests.integration.test_k8s_platform import (
    JOB,
    SEL,
    launch_spec,
    make_platform,
    pod_of,
)
from tests.k8s_fake import FakeKubeApiServer
from tests.k8s_fake.faults import (
    POD_SECURITY_MESSAGE,
    QUOTA_MESSAGE,
    RBAC_MESSAGE,
    RESET,
    RESET_AFTER,
)

PODS_PATH = r"/namespaces/default/pods$"
SAMPLE_SECONDS = 0.002


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


class RunningJob:
    """A JobMaster on the Kubernetes platform, run on a thread; `result` once it ended."""

    def __init__(self, job: JobMaster, platform) -> None:
        self.job = job
        self.platform = platform
        self.result: list[JobState] = []
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result.append(self.job.run())
        except BaseException as e:  # the job core fails the job, then raises
            self.error.append(e)

    def wait(self, timeout: float = 20.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the job did not end"


@contextlib.contextmanager
def running_job(api, master_pod, tmp_path, token_file, job: dict, **settings):
    """Run `job` (job spec fields) with platform `settings`; stop it at the end."""
    spec = parse_job_spec(
        {"name": JOB, "command": ["python", "train.py"], **job},
        source="test",
        base_dir=str(tmp_path),
    )
    platform = make_platform(api, master_pod, **settings)
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    runtime = JobRuntime(str(tmp_path), "tfjob-master:50051", token_file)
    running = RunningJob(JobMaster(spec, platform, store, runtime), platform)
    api.store.sigterm_exit_code = 0  # the PS server exits 0 on SIGTERM
    running.thread.start()
    try:
        yield running
    finally:
        running.job.request_stop("test over")
        running.thread.join(timeout=20)
        store.close()


def rank_pods(api, node_type: str, rank: int) -> list[dict]:
    return api.pods(f"{SEL},dlrover.io/node-type={node_type},dlrover.io/rank={rank}")


class RankSampler:
    """Counts, continuously, the pods of each rank label that may run (Pending or Running)."""

    def __init__(self, api) -> None:
        self.api = api
        self.most: Counter = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            live: Counter = Counter()
            for pod in self.api.pods(SEL):
                labels = pod["metadata"]["labels"]
                if pod["status"].get("phase") in ("Pending", "Running"):
                    live[(labels["dlrover.io/node-type"], labels["dlrover.io/rank"])] += 1
            for key, count in live.items():
                self.most[key] = max(self.most[key], count)
            self.samples += 1
            self._stop.wait(SAMPLE_SECONDS)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- transient failures are retried, the job goes on ---------------------------------------


def test_pod_create_429_then_503_during_a_relaunch_keeps_the_job_running(
    api, master_pod, tmp_path, token_file
):
    api.kubelet.auto_run()
    job = {"ps": {"replicas": 1}, "worker": {"replicas": 2, "max_relaunches": 2}}
    with running_job(api, master_pod, tmp_path, token_file, job) as run:
        w1 = pod_of(api, "worker", 1, 3)
        # Every pod of the job's start answered (the pod exists a moment before its answer).
        api.wait_for(lambda: len(api.served("POST", PODS_PATH)) == 3, what="3 pods created")
        api.faults.add("POST", PODS_PATH, 429, retry_after_seconds=1)
        api.faults.add("POST", PODS_PATH, 503)

        api.kubelet.exit(w1["metadata"]["name"], 1, message="boom")  # relaunched at once
        old = w1["metadata"]["name"]
        relaunched = api.wait_for(
            lambda: [p for p in rank_pods(api, "worker", 1) if p["metadata"]["name"] != old],
            timeout=15,
            what="worker-1 relaunched through a 429 and a 503",
        )[0]
        assert run.job.state == JobState.RUNNING and not run.error
        answers = api.served("POST", PODS_PATH)[3:]
        assert [code for _, code in answers] == [429, 503, 201]
        assert answers[1][0] - answers[0][0] >= 0.95  # the server's Retry-After: 1 honoured
        notices = "\n".join(run.platform.notices())
        assert "429" in notices and "retrying" in notices and "503" in notices

        # The job carries on to its end as if nothing happened.
        api.wait_for(
            lambda: api.pod(relaunched["metadata"]["name"])["status"]["phase"] == "Running"
        )
        api.kubelet.exit(pod_of(api, "worker", 0, 2)["metadata"]["name"], 0)
        api.kubelet.exit(relaunched["metadata"]["name"], 0)
        run.wait()
    assert run.result == [JobState.SUCCEEDED], run.job.reason
    assert [e.kind for e in run.job.events].count("relaunch") == 1


def test_a_create_whose_answer_was_lost_is_the_pod_made(api, master_pod, token_file):
    """A cut connection before the answer: the retried create finds the pod (409) and keeps it."""
    platform = make_platform(api, master_pod)
    try:
        api.faults.add("POST", PODS_PATH, RESET)  # cut before the pod is made
        api.faults.add("POST", PODS_PATH, RESET_AFTER)  # made, but the answer is lost
        platform.launch(launch_spec("worker", 0, 1, token_file))
        (pod,) = api.pods(SEL)
        assert platform.handle(1) == {"pod": "tfjob-worker-0-1", "uid": pod["metadata"]["uid"]}
        assert [code for _, code in api.served("POST", PODS_PATH)] == [RESET, RESET, 409]
    finally:
        platform.shutdown(0)


# -- a failed delete never leaves two pods of a rank ----------------------------------------


def test_delete_failing_three_times_during_a_heartbeat_kill_never_runs_two_pods_of_a_rank(
    api, master_pod, tmp_path, token_file
):
    api.kubelet.auto_run()
    sampler = RankSampler(api)
    job = {
        "ps": {"replicas": 1},
        "worker": {"replicas": 2, "max_relaunches": 2},
        "heartbeat_timeout_seconds": 1,
    }
    try:
        with running_job(api, master_pod, tmp_path, token_file, job) as run:
            old = pod_of(api, "worker", 1, 3)["metadata"]["name"]
            api.wait_for(lambda: api.pod(old)["status"]["phase"] == "Running", what="worker-1")
            api.faults.add("DELETE", f"/pods/{old}$", 503, times=3)
            # worker-1 registers, then never beats again: the master kills it.
            run.job.nodes.on_register(run.job.nodes.current("worker", 1))

            new = api.wait_for(
                lambda: [
                    p
                    for p in rank_pods(api, "worker", 1)
                    if p["metadata"]["name"] != old and p["status"]["phase"] == "Running"
                ],
                timeout=20,
                what="worker-1 relaunched after its kill",
            )[0]
            sampler.stop()
            assert sampler.samples > 50
            assert sampler.most[("worker", "1")] == 1, sampler.most
            answers = [code for _, code in api.served("DELETE", f"/pods/{old}$")]
            assert answers == [503, 503, 503, 200]
            assert run.job.state == JobState.RUNNING
            killed = [n for n in run.job.nodes.history() if n.id == 3]
            assert killed[0].exit_reason.value == "heartbeat_lost"
            assert new["metadata"]["labels"]["dlrover.io/node-id"] != "3"
    finally:
        sampler.stop()


# -- failures that cannot heal fail the job, naming their cause ------------------------------


def test_a_quota_403_fails_the_job_and_the_error_says_quota(api, master_pod, tmp_path, token_file):
    api.faults.add("POST", PODS_PATH, 403, message=QUOTA_MESSAGE, times=None)
    job = {"ps": {"replicas": 1}, "worker": {"replicas": 1}}
    with running_job(api, master_pod, tmp_path, token_file, job, api_retry_budget_seconds=1) as run:
        run.wait()
    assert run.job.state == JobState.FAILED
    assert "ResourceQuota" in run.job.reason and "exceeded quota" in run.job.reason
    assert "RBAC" not in run.job.reason
    # A quota frees up as other pods end: retried within the budget, then given up.
    assert len(api.served("POST", PODS_PATH)) >= 2
    assert not api.pods(SEL)


@pytest.mark.parametrize(
    "message, cause",
    [(POD_SECURITY_MESSAGE, "Pod Security"), (RBAC_MESSAGE, "RBAC")],
    ids=["pod-security", "rbac"],
)
def test_a_403_that_cannot_heal_fails_at_once_naming_its_cause(
    api, master_pod, token_file, message, cause
):
    platform = make_platform(api, master_pod)
    try:
        api.faults.add("POST", PODS_PATH, 403, message=message, times=None)
        with pytest.raises(K8sApiError) as e:
            platform.launch(launch_spec("worker", 0, 1, token_file))
        assert cause in str(e.value)
        assert e.value.failure.kind in (FailureKind.POD_SECURITY, FailureKind.RBAC)
        assert len(api.served("POST", PODS_PATH)) == 1  # not retried
    finally:
        platform.shutdown(0)


def test_time_between_retries_grows_and_a_spent_budget_names_itself(api, master_pod, token_file):
    platform = make_platform(api, master_pod, api_retry_budget_seconds=1.5)
    try:
        api.faults.add("POST", PODS_PATH, 503, times=None)
        started = time.monotonic()
        with pytest.raises(K8sApiError) as e:
            platform.launch(launch_spec("worker", 0, 1, token_file))
        assert time.monotonic() - started < 3.0
        assert "DLROVER_K8S_API_RETRY_BUDGET_SECONDS" in str(e.value)
        times = [t for t, _ in api.served("POST", PODS_PATH)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert len(gaps) >= 3 and gaps[2] > gaps[0]
    finally:
        platform.shutdown(0)
