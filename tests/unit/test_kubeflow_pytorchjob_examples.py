"""Kubeflow's PyTorchJob examples that ship with a command, read as they are; every
`elasticPolicy` field mapped to dlrover-run flags, or refused with its path and the fix."""

from __future__ import annotations

import pytest
import yaml

from master.config import SpecError, parse_job_spec

RUN = ("python", "-m", "dlrover_torch.run")


def container(image: str, command: list[str], **more: object) -> dict:
    return {"name": "pytorch", "image": image, "command": command, **more}


def replica(replicas: int, box: dict, **more: object) -> dict:
    return {"replicas": replicas, **more, "template": {"spec": {"containers": [box]}}}


def pytorchjob(name: str, spec: dict, **meta: object) -> dict:
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, **meta},
        "spec": spec,
    }


def echo() -> dict:
    """examples/pytorch/elastic/echo/echo.yaml's shape."""
    box = container(
        "kubeflow/pytorch-elastic-example-echo:1.0.0",
        ["python", "-m", "torch.distributed.run", "--rdzv_backend=c10d", "./echo.py"],
        imagePullPolicy="IfNotPresent",
        env=[{"name": "LOGLEVEL", "value": "DEBUG"}],
    )
    elastic = {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 2, "maxRestarts": 100}
    return pytorchjob(
        "elastic-example-echo",
        {"elasticPolicy": elastic, "pytorchReplicaSpecs": {"Worker": replica(2, box)}},
    )


def imagenet(metrics: bool) -> dict:
    """examples/pytorch/elastic/imagenet/imagenet.yaml's shape (its HPA metrics optional)."""
    command = ["python", "-m", "torch.distributed.run", "/workspace/examples/imagenet.py"]
    command += ["--arch=resnet18", "--epochs=1", "--batch-size=32", "--workers=0"]
    command += ["/workspace/data/tiny-imagenet-200"]
    box = container(
        "quay.io/example/pytorch-elastic-example-imagenet:0.1",
        command,
        imagePullPolicy="IfNotPresent",
        resources={"requests": {"cpu": 4}},
        env=[{"name": "LOGLEVEL", "value": "DEBUG"}],
    )
    elastic: dict = {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 3}
    elastic["maxRestarts"] = 100
    if metrics:
        target = {"type": "Utilization", "averageUtilization": 80}
        resource = {"name": "cpu", "target": target}
        elastic["metrics"] = [{"type": "Resource", "resource": resource}]
    worker = replica(2, box, restartPolicy="OnFailure")
    return pytorchjob(
        "elastic-example-imagenet",
        {"elasticPolicy": elastic, "pytorchReplicaSpecs": {"Worker": worker}},
    )


def cpu_demo() -> dict:
    """examples/pytorch/cpu-demo/demo.yaml's shape: nprocPerNode in the spec, torchrun."""
    box = container("pytorch-cpu:py3.8", ["torchrun", "demo.py"])
    specs = {"Master": replica(1, box, restartPolicy="OnFailure")}
    specs["Worker"] = replica(1, box, restartPolicy="OnFailure")
    return pytorchjob("torchrun-cpu", {"nprocPerNode": "2", "pytorchReplicaSpecs": specs})


def mnist(command: bool = True) -> dict:
    """examples/pytorch/simple.yaml and mnist2's shape; mnist/v1's gloo job has args only."""
    image = "docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727"
    if command:
        box = container(image, ["python3", "/opt/pytorch-mnist/mnist.py", "--epochs=1"])
        box["resources"] = {"requests": {"cpu": 1, "memory": "200Mi"}}
    else:
        box = {"name": "pytorch", "image": image, "args": ["--backend", "gloo"]}
    specs = {"Master": replica(1, box, restartPolicy="OnFailure")}
    specs["Worker"] = replica(1, box, restartPolicy="OnFailure")
    return pytorchjob("pytorch-simple", {"pytorchReplicaSpecs": specs}, namespace="kubeflow")


def parse(data: dict, tmp_path):
    return parse_job_spec(yaml.safe_load(yaml.safe_dump(data)), "job.yaml", str(tmp_path))


@pytest.mark.parametrize(
    "manifest, command, nodes, most",
    [
        (
            echo(),
            (*RUN, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "100")
            + ("--rdzv_backend=c10d", "./echo.py"),
            2,
            2,
        ),
        (
            imagenet(metrics=False),
            (*RUN, "--nnodes", "1:3", "--nproc-per-node", "1", "--max-restarts", "100")
            + ("/workspace/examples/imagenet.py", "--arch=resnet18", "--epochs=1")
            + ("--batch-size=32", "--workers=0", "/workspace/data/tiny-imagenet-200"),
            2,
            3,
        ),
        (cpu_demo(), (*RUN, "--nnodes", "2", "--nproc-per-node", "2", "demo.py"), 2, 2),
        (
            mnist(),
            (*RUN, "--nnodes", "2", "--nproc-per-node", "1")
            + ("/opt/pytorch-mnist/mnist.py", "--epochs=1"),
            2,
            2,
        ),
    ],
    ids=["elastic-echo", "elastic-imagenet", "cpu-demo", "mnist"],
)
def test_kubeflows_examples_with_a_command_are_read_as_they_are(
    manifest, command, nodes, most, tmp_path
):
    spec = parse(manifest, tmp_path)
    assert spec.command == command
    assert (spec.worker.replicas, spec.worker.max_replicas) == (nodes, most)
    assert spec.worker.command == command


def test_elastic_policy_fields_become_flags(tmp_path):
    data = echo()
    elastic = data["spec"]["elasticPolicy"]
    elastic |= {"minReplicas": 2, "maxReplicas": 4, "maxRestarts": 0, "nProcPerNode": 3}
    elastic |= {"rdzvHost": "w0", "rdzvPort": 29400, "rdzvId": "e", "standalone": False}
    elastic["rdzvConf"] = [{"key": "join_timeout", "value": "90"}]
    elastic["rdzvConf"].append({"key": "last_call_timeout", "value": 2})
    spec = parse(data, tmp_path)
    assert spec.command[3:13] == (
        "--nnodes", "2:4", "--nproc-per-node", "3", "--max-restarts", "0",
        "--rdzv-conf", "join_timeout=90,last_call_timeout=2",
        "--rdzv_backend=c10d", "./echo.py",
    )  # fmt: skip
    assert (spec.worker.replicas, spec.worker.max_replicas) == (2, 4)
    # nProcPerNode in elasticPolicy wins over the spec's nprocPerNode, as in Kubeflow
    data["spec"]["nprocPerNode"] = "5"
    assert parse(data, tmp_path).command[5:7] == ("--nproc-per-node", "3")
    del elastic["nProcPerNode"]
    assert parse(data, tmp_path).command[5:7] == ("--nproc-per-node", "5")
    data["spec"]["nprocPerNode"] = "auto"
    assert parse(data, tmp_path).command[5:7] == ("--nproc-per-node", "auto")


def _elastic(**fields: object) -> dict:
    data = echo()
    data["spec"]["elasticPolicy"].update(fields)
    return data


@pytest.mark.parametrize(
    "data, path, words",
    [
        (imagenet(metrics=True), "spec.elasticPolicy.metrics", "Remove metrics"),
        (_elastic(minReplicas=3), "spec.elasticPolicy", "minReplicas 3 is above maxReplicas 2"),
        (_elastic(maxReplicas="two"), "spec.elasticPolicy.maxReplicas", "'two' is not"),
        (_elastic(maxRestarts=-1), "spec.elasticPolicy.maxRestarts", "whole number >= 0"),
        (_elastic(nProcPerNode="many"), "spec.elasticPolicy.nProcPerNode", "Give 1, 2"),
        (_elastic(rdzvConf={"a": 1}), "spec.elasticPolicy.rdzvConf", "Use [{key, value}]"),
        (_elastic(scaleDownDelay=1), "spec.elasticPolicy.scaleDownDelay", "Remove it"),
        (mnist(command=False), "Master.template.spec.containers[0].command", "Give the"),
    ],
    ids=["metrics", "min-above-max", "max-text", "restarts", "nproc", "conf", "unknown", "args"],
)
def test_what_cannot_be_honoured_is_refused_with_its_path(data, path, words, tmp_path):
    with pytest.raises(SpecError) as e:
        parse(data, tmp_path)
    assert path in str(e.value) and words in str(e.value), str(e.value)
