"""Kubeflow TFJob and PyTorchJob manifests on the Kubernetes platform (the fake API server):
the pods and services each replica gets, with the manifest's images, commands and resources."""

from __future__ import annotations

import json
import threading

import yaml

from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime, JobState
from master.state.sqlite import SQLiteStateStore
from tests.integration import test_k8s_platform as k8s
from tests.integration.test_k8s_platform import JOB, SEL, env_of, make_platform, pod_of

# The fake API server, the master pod and the token file of the platform's own tests.
api, master_pod, token_file = k8s.api, k8s.master_pod, k8s.token_file

TFJOB = f"""
apiVersion: kubeflow.org/v1
kind: TFJob
metadata:
  name: {JOB}
spec:
  runPolicy:
    backoffLimit: 2
  tfReplicaSpecs:
    PS:
      replicas: 1
      restartPolicy: Never
      template:
        spec:
          containers:
            - name: tensorflow
              image: registry.example/mnist-ps:2
              command: [python, -m, dlrover_tf.ps]
    Chief:
      replicas: 1
      template:
        spec:
          containers:
            - name: tensorflow
              image: registry.example/mnist:2
              command: [python3, dist_mnist.py]
              args: [--steps=100]
              workingDir: /app
              resources:
                limits: {{cpu: "2", memory: 4Gi}}
    Worker:
      replicas: 2
      template:
        spec:
          containers:
            - name: tensorflow
              image: registry.example/mnist:2
              command: [python, dist_mnist.py]
              args: [--steps=100]
              workingDir: /app
              env:
                - name: MODE
                  value: train
"""

PYTORCHJOB = f"""
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: {JOB}
spec:
  elasticPolicy:
    minReplicas: 1
    maxReplicas: 2
    maxRestarts: 3
    nProcPerNode: 2
  pytorchReplicaSpecs:
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: pytorch
              image: kubeflow/pytorch-elastic-example-echo:latest
              command: [python, -m, torch.distributed.run, /workspace/examples/echo.py]
"""


def run_job(api, master_pod, tmp_path, token_file, manifest):
    spec = parse_job_spec(yaml.safe_load(manifest), "manifest.yaml", "/etc/dlrover/job")
    platform = make_platform(api, master_pod)
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    job = JobMaster(
        spec, platform, store, JobRuntime(str(tmp_path), "tfjob-master:50051", token_file)
    )
    api.store.sigterm_exit_code = 0
    result: list[JobState] = []
    thread = threading.Thread(target=lambda: result.append(job.run()), daemon=True)
    thread.start()
    return job, store, thread, result


def test_a_tfjob_gets_a_pod_per_replica_in_its_images_and_a_service_per_rank(
    api, master_pod, tmp_path, token_file
):
    job, store, thread, result = run_job(api, master_pod, tmp_path, token_file, TFJOB)
    try:
        ps = pod_of(api, "ps", 0, 1)
        chief = pod_of(api, "chief", 0, 2)
        w0, w1 = pod_of(api, "worker", 0, 3), pod_of(api, "worker", 1, 4)
        for pod in (ps, chief, w0, w1):
            api.kubelet.run(pod["metadata"]["name"])
        c = chief["spec"]["containers"][0]
        assert c["image"] == "registry.example/mnist:2"
        assert c["command"] == ["python3", "dist_mnist.py", "--steps=100"]  # as written
        assert w0["spec"]["containers"][0]["command"][0] == "python"  # the image's own python
        assert c["workingDir"] == "/app"
        assert c["resources"]["limits"] == {"cpu": "2", "memory": "4096Mi"}
        p = ps["spec"]["containers"][0]
        assert p["image"] == "registry.example/mnist-ps:2"
        assert p["command"] == ["python", "-m", "dlrover_tf.ps"] and "workingDir" not in p
        assert env_of(w1)["MODE"] == "train"
        # TF_CONFIG lists exactly the replicas of the manifest, each behind its rank's service.
        cluster = json.loads(env_of(w0)["TF_CONFIG"])["cluster"]
        assert cluster == {
            "ps": ["tfjob-ps-0.default.svc:2222"],
            "chief": ["tfjob-chief-0.default.svc:2222"],
            "worker": ["tfjob-worker-0.default.svc:2222", "tfjob-worker-1.default.svc:2222"],
        }
        services = sorted(s["metadata"]["name"] for s in api.objects("services"))
        assert services == ["tfjob-chief-0", "tfjob-ps-0", "tfjob-worker-0", "tfjob-worker-1"]
        for pod in (chief, w0, w1):
            api.kubelet.exit(pod["metadata"]["name"], 0)
        thread.join(timeout=20)
        assert not thread.is_alive()
    finally:
        job.request_stop("test over")
        thread.join(timeout=20)
        store.close()
    assert result == [JobState.SUCCEEDED], job.reason
    assert job.spec.max_relaunches == 2 and job.spec.ps.max_relaunches == 0


def test_a_pytorchjob_gets_worker_pods_running_dlrover_run_in_its_image(
    api, master_pod, tmp_path, token_file
):
    job, store, thread, result = run_job(api, master_pod, tmp_path, token_file, PYTORCHJOB)
    try:
        pods = [pod_of(api, "worker", rank, rank + 1) for rank in (0, 1)]
        assert len(api.pods(SEL)) == 2  # no PS, no chief
        for pod in pods:
            c = pod["spec"]["containers"][0]
            assert c["image"] == "kubeflow/pytorch-elastic-example-echo:latest"
            assert c["command"] == [
                "python", "-m", "dlrover_torch.run", "--nnodes", "1:2",
                "--nproc-per-node", "2", "--max-restarts", "3", "/workspace/examples/echo.py",
            ]  # fmt: skip
            assert env_of(pod)["DLROVER_MASTER_ADDR"].startswith("tfjob-master.default.svc:")
            api.kubelet.run(pod["metadata"]["name"])
        for pod in pods:
            api.kubelet.exit(pod["metadata"]["name"], 0)
        thread.join(timeout=20)
        assert not thread.is_alive()
    finally:
        job.request_stop("test over")
        thread.join(timeout=20)
        store.close()
    assert result == [JobState.SUCCEEDED], job.reason
