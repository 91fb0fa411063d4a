"""Kubeflow manifests run locally as they are: a TFJob with the TF estimator example's command
and an elastic PyTorchJob whose script runs under dlrover-run (the images are ignored here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDE_DEEP = os.path.join(ROOT, "examples", "tf", "wide_deep.py")
TORCH_TRAIN = os.path.join(ROOT, "examples", "torch", "train.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]


def replica(replicas: int, image: str, command: list[str], restart: str = "OnFailure") -> dict:
    """One replica spec as Kubeflow's examples write it."""
    container = {"name": "tensorflow", "image": image, "command": command[:2]}
    container["args"] = command[2:]
    return {
        "replicas": replicas,
        "restartPolicy": restart,
        "template": {"spec": {"containers": [container]}},
    }


def submit(tmp_path, manifest: dict) -> tuple[dict, str]:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "master.cli", "submit", str(path), "--summary-json", str(summary)]
        + ["--status-interval", "5", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(summary.read_text()), proc.stderr


def test_a_tfjob_manifest_runs_locally_as_it_is(tmp_path):
    command = ["python", WIDE_DEEP, "--records", "4096", "--epochs", "1", "--batch-size", "128"]
    command += ["--eval-records", "256"]
    image = "registry.example.com/wide-deep:1.0"
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": "wide-deep-tfjob"},
        "spec": {
            "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "Running"},
            "tfReplicaSpecs": {
                "PS": replica(1, image, command),
                "Chief": replica(1, image, command),
                "Worker": replica(1, image, command),
            },
        },
    }
    summary, err = submit(tmp_path, manifest)
    assert summary["status"] == "succeeded", summary
    assert summary["datasets"]["train"]["records_done"] == 4096
    assert err.count("registry.example.com/wide-deep:1.0") == 1  # said once: image ignored
    assert "runs as a process here" in err
    kinds = sorted((n["type"], n["rank"]) for n in summary["nodes"])
    assert kinds == [("chief", 0), ("ps", 0), ("worker", 0)]


def test_an_elastic_pytorchjob_manifest_runs_locally_under_dlrover_run(tmp_path):
    events = tmp_path / "events.jsonl"
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "elastic-example"},
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": 1,
                "maxReplicas": 2,
                "maxRestarts": 3,
                "nProcPerNode": 1,
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "pytorch",
                                    "image": "kubeflow/pytorch-elastic-example:latest",
                                    "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                                    "command": ["python", "-m", "torch.distributed.run"],
                                    "args": [TORCH_TRAIN, "--steps", "20", "--hidden", "16"]
                                    + ["--events", str(events)],
                                }
                            ]
                        }
                    },
                }
            },
        },
    }
    summary, _ = submit(tmp_path, manifest)
    assert summary["status"] == "succeeded", summary
    assert sorted((n["type"], n["rank"]) for n in summary["nodes"]) == [
        ("worker", 0),
        ("worker", 1),
    ]
    done = [json.loads(line) for line in events.read_text().splitlines() if '"done"' in line]
    assert done and {e["world"] for e in done} == {2}, done
