"""Kubeflow TFJob and PyTorchJob manifests, written as Kubeflow's documentation shows them,
read into job specs; unsupported fields named with their path; `dlrover convert`."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from master.cli.main import main
from master.config import SpecError, load_job_spec, parse_job_spec

# Kubeflow's dist-mnist TFJob, with the container command its image runs.
TFJOB = """
apiVersion: "kubeflow.org/v1"
kind: "TFJob"
metadata:
  name: "dist-mnist-for-e2e-test"
spec:
  runPolicy:
    backoffLimit: 4
    cleanPodPolicy: Running
  successPolicy: AllWorkers
  tfReplicaSpecs:
    PS:
      replicas: 2
      restartPolicy: Never
      template:
        spec:
          containers:
            - name: tensorflow
              image: kubeflow/tf-dist-mnist-test:latest
              command: ["python", "/var/tf_dist_mnist/dist_mnist.py"]
              args: ["--train_steps=100"]
    Chief:
      replicas: 1
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: tensorflow
              image: kubeflow/tf-dist-mnist-test:latest
              command: ["python", "/var/tf_dist_mnist/dist_mnist.py"]
              args: ["--train_steps=100"]
              workingDir: /var/tf_dist_mnist
              env:
                - name: LOG_LEVEL
                  value: "1"
              resources:
                requests: {cpu: 500m, memory: 1Gi}
                limits: {cpu: "2", memory: 2Gi}
    Worker:
      replicas: 4
      restartPolicy: ExitCode
      template:
        spec:
          containers:
            - name: tensorflow
              image: kubeflow/tf-dist-mnist-test:latest
              imagePullPolicy: IfNotPresent
              command: ["python", "/var/tf_dist_mnist/dist_mnist.py"]
              args: ["--train_steps=100"]
              ports:
                - containerPort: 2222
                  name: tfjob-port
    Evaluator:
      replicas: 1
      template:
        spec:
          containers:
            - name: tensorflow
              image: kubeflow/tf-dist-mnist-test:latest
              command: ["python", "/var/tf_dist_mnist/dist_mnist.py", "--eval"]
"""

# Kubeflow's elastic PyTorchJob example (echo).
PYTORCHJOB = """
apiVersion: "kubeflow.org/v1"
kind: PyTorchJob
metadata:
  name: elastic-example-echo
spec:
  elasticPolicy:
    rdzvBackend: c10d
    minReplicas: 1
    maxReplicas: 3
    maxRestarts: 100
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
              imagePullPolicy: IfNotPresent
              env:
                - name: LOGLEVEL
                  value: DEBUG
              command:
                - python
                - -m
                - torch.distributed.run
                - /workspace/examples/echo.py
"""

# A PyTorchJob without elasticPolicy: a Master and Workers running the script themselves.
PYTORCHJOB_PLAIN = """
apiVersion: "kubeflow.org/v1"
kind: PyTorchJob
metadata:
  name: pytorch-simple
spec:
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: pytorch
              image: docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727
              command: ["python3", "/opt/pytorch-mnist/mnist.py", "--epochs=1"]
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: pytorch
              image: docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727
              command: ["python3", "/opt/pytorch-mnist/mnist.py", "--epochs=1"]
"""


def write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_tfjob_becomes_the_same_job_spec(tmp_path):
    spec = load_job_spec(write(tmp_path, TFJOB))
    command = ("python", "/var/tf_dist_mnist/dist_mnist.py", "--train_steps=100")
    assert spec.name == "dist-mnist-for-e2e-test"
    assert spec.command == command
    assert spec.workdir == str(tmp_path)  # local processes run beside the manifest
    assert (spec.ps.replicas, spec.ps.command, spec.ps.max_relaunches) == (2, command, 0)
    chief = spec.chief
    assert (chief.replicas, chief.max_relaunches, chief.env) == (1, 3, {"LOG_LEVEL": "1"})
    assert (chief.cpu, chief.memory_mb) == (2.0, 2048)  # limits win (requests = limits)
    assert (chief.image, chief.image_workdir) == (
        "kubeflow/tf-dist-mnist-test:latest",
        "/var/tf_dist_mnist",
    )
    assert (spec.worker.replicas, spec.worker.max_replicas, spec.worker.slots) == (4, 4, 4)
    assert spec.evaluator.command[-1] == "--eval"
    assert spec.max_relaunches == 4
    assert spec.success_policy == "all_workers"


def test_a_tfjob_without_success_policy_ends_with_its_chief(tmp_path):
    data = yaml.safe_load(TFJOB)
    del data["spec"]["successPolicy"]
    spec = parse_job_spec(data, "tfjob.yaml", str(tmp_path))
    assert spec.success_policy == "chief"


def test_an_elastic_pytorchjob_runs_its_script_under_dlrover_run(tmp_path):
    spec = load_job_spec(write(tmp_path, PYTORCHJOB))
    assert spec.worker.replicas == 2 and spec.worker.max_replicas == 3
    assert spec.command == (
        "python", "-m", "dlrover_torch.run",
        "--nnodes", "1:3", "--nproc-per-node", "2", "--max-restarts", "100",
        "/workspace/examples/echo.py",
    )  # fmt: skip
    assert spec.worker.env == {"LOGLEVEL": "DEBUG"}
    assert spec.worker.image == "kubeflow/pytorch-elastic-example-echo:latest"
    assert spec.chief.replicas == 0 and spec.ps.replicas == 0


def test_a_pytorchjob_master_and_workers_are_one_group_of_nodes(tmp_path):
    spec = load_job_spec(write(tmp_path, PYTORCHJOB_PLAIN))
    assert spec.worker.replicas == 3  # the Master is the rank-0 node
    assert spec.command == (
        "python", "-m", "dlrover_torch.run", "--nnodes", "3", "--nproc-per-node", "1",
        "/opt/pytorch-mnist/mnist.py", "--epochs=1",
    )  # fmt: skip


def test_torchrun_flags_in_the_command_win_over_the_elastic_policy(tmp_path):
    data = yaml.safe_load(PYTORCHJOB)
    container = data["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["command"] = ["torchrun", "--nproc_per_node=4", "--rdzv-backend", "c10d", "t.py"]
    container["args"] = ["--lr", "0.1"]
    spec = parse_job_spec(data, "j.yaml", str(tmp_path))
    assert spec.command == (
        "python", "-m", "dlrover_torch.run", "--nnodes", "1:3", "--max-restarts", "100",
        "--nproc_per_node=4", "--rdzv-backend", "c10d", "t.py", "--lr", "0.1",
    )  # fmt: skip


@pytest.mark.parametrize(
    "edit, path, fix",
    [
        (
            lambda d: d["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"].update(
                volumes=[{"name": "data"}]
            ),
            "spec.tfReplicaSpecs.Worker.template.spec.volumes",
            "Remove it",
        ),
        (
            lambda d: d["spec"]["runPolicy"].update(ttlSecondsAfterFinished=60),
            "spec.runPolicy.ttlSecondsAfterFinished",
            "Remove it",
        ),
        (
            lambda d: d["spec"]["runPolicy"].update(cleanPodPolicy="None"),
            "spec.runPolicy.cleanPodPolicy",
            "Use Running or All",
        ),
        (
            lambda d: d["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0][
                "resources"
            ].update(limits={"nvidia.com/gpu": 1}),
            "spec.tfReplicaSpecs.PS.template.spec.containers[0].resources.nvidia.com/gpu",
            "Give cpu",
        ),
        (
            lambda d: d["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0][
                "env"
            ].append({"name": "X", "valueFrom": {"secretKeyRef": {"name": "s"}}}),
            "spec.tfReplicaSpecs.Chief.template.spec.containers[0].env[1].valueFrom",
            "Give the value itself",
        ),
        (
            lambda d: d["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
                0
            ].pop("command"),
            "spec.tfReplicaSpecs.Worker.template.spec.containers[0].command",
            "Give the container's command",
        ),
        (
            lambda d: d["spec"].update(successPolicy="AnyWorker"),
            "spec.successPolicy",
            "Use AllWorkers",
        ),
    ],
)
def test_unsupported_fields_are_named_with_their_path_and_the_fix(tmp_path, edit, path, fix):
    data = yaml.safe_load(TFJOB)
    data["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]["resources"] = {}
    edit(data)
    with pytest.raises(SpecError) as e:
        parse_job_spec(data, "tfjob.yaml", str(tmp_path))
    assert f"tfjob.yaml: {path}:" in str(e.value) and fix in str(e.value), str(e.value)


def test_an_unknown_kind_is_refused_with_the_kinds_read(tmp_path):
    data = yaml.safe_load(TFJOB) | {"kind": "MPIJob"}
    with pytest.raises(SpecError, match="Use apiVersion kubeflow.org/v1 with kind TFJob or"):
        parse_job_spec(data, "j.yaml", str(tmp_path))


@pytest.mark.parametrize(
    "manifest", [TFJOB, PYTORCHJOB, PYTORCHJOB_PLAIN], ids=["tfjob", "elastic", "pytorchjob"]
)
def test_convert_prints_a_job_yaml_that_reads_back_to_the_same_spec(tmp_path, capsys, manifest):
    path = write(tmp_path, manifest)
    assert main(["convert", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# dlrover job YAML converted from")
    converted = write(tmp_path, out, "converted.yaml")
    assert load_job_spec(converted).with_overrides(source=path) == load_job_spec(path)


def test_convert_of_a_refused_manifest_is_one_clear_error(tmp_path, capsys):
    data = yaml.safe_load(PYTORCHJOB)
    data["spec"]["elasticPolicy"]["metrics"] = [{"type": "Resource"}]
    path = write(tmp_path, yaml.safe_dump(data))
    assert main(["convert", path]) == 2
    err = capsys.readouterr().err
    assert "spec.elasticPolicy.metrics: not supported by dlrover" in err


def test_submit_to_k8s_defaults_to_the_manifest_namespace(tmp_path, capsys):
    data = yaml.safe_load(PYTORCHJOB)
    data["metadata"]["namespace"] = "kubeflow"
    path = write(tmp_path, yaml.safe_dump(data))
    argv = ["submit", "--platform", "k8s", path, "--data-claim", "data", "--dry-run"]
    assert main(argv) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {o["metadata"]["namespace"] for o in objects} == {"kubeflow"}
    assert main([*argv, "--namespace", "ml"]) == 0  # the flag wins
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {o["metadata"]["namespace"] for o in objects} == {"ml"}


def test_success_policy_is_one_of_two(tmp_path):
    job = {"name": "j", "command": ["true"], "worker": {"replicas": 1}}
    assert parse_job_spec(job | {"success_policy": "all_workers"}, "j.yaml", str(tmp_path))
    with pytest.raises(SpecError, match="success_policy: 'any' is not one of chief, all_workers"):
        parse_job_spec(job | {"success_policy": "any"}, "j.yaml", str(tmp_path))


def _torch_command(tmp_path, command):
    data = yaml.safe_load(PYTORCHJOB)
    container = data["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["command"] = command
    return parse_job_spec(data, "j.yaml", str(tmp_path)).command


def test_a_module_runs_in_dlrover_runs_module_mode_and_a_shell_is_refused(tmp_path):
    assert _torch_command(tmp_path, ["python", "-m", "trainer.main", "--lr", "1"])[-5:] == (
        "100",
        "-m",
        "trainer.main",
        "--lr",
        "1",
    )
    with pytest.raises(SpecError) as e:
        _torch_command(tmp_path, ["bash", "-c", "python train.py"])
    assert "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].command:" in str(e.value)
    assert "torchrun [flags] train.py" in str(e.value)
