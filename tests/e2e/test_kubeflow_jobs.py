"""Kubeflow manifests run locally as they are: a TFJob with the TF estimator example's command,
an elastic PyTorchJob whose script runs under dlrover-run (the images are ignored here), and
Kubeflow's elastic echo PyTorchJob, whose c10d flags give way to the master's rendezvous."""

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


def submit(tmp_path, manifest: dict, *extra: str, ok: bool = True) -> tuple[dict, str]:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "master.cli", "submit", str(path), "--summary-json", str(summary)]
        + ["--status-interval", "5", "--run-dir", str(tmp_path / "run"), *extra],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert (proc.returncode == 0) == ok, proc.stdout[-4000:] + proc.stderr[-4000:]
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


# Kubeflow's elastic echo example's script: its torchrun variables, a gloo group, a barrier;
# here also an optional stretch of training (all-reduces) and one JSON line per event in out.jsonl.
ECHO_PY = """
import json, os, sys, time
import torch
import torch.distributed as dist

def say(**fields):
    with open("out.jsonl", "a") as f:
        f.write(json.dumps(fields) + "\\n")

names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
env = {k: os.environ.get(k) for k in names}
print(env, flush=True)
dist.init_process_group(backend="gloo")
dist.barrier()
rank, world = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of world size {world}", flush=True)
say(event="barrier", rank=rank, world=world, env=env)
seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
start = time.time()
while time.time() - start < seconds:
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.2)
say(event="done", rank=rank, world=world, port=env["MASTER_PORT"])
dist.destroy_process_group()
"""


def echo_job(command: list[str], replicas: int = 2) -> dict:
    """Kubeflow's elastic echo PyTorchJob, as its docs write it (examples/pytorch/elastic/echo)."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "elastic-example-echo"},
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": 1,
                "maxReplicas": 2,
                "maxRestarts": 100,
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "pytorch",
                                    "image": "kubeflow/pytorch-elastic-example-echo:1.0.0",
                                    "imagePullPolicy": "IfNotPresent",
                                    "env": [{"name": "LOGLEVEL", "value": "DEBUG"}],
                                    "command": command,
                                }
                            ]
                        }
                    },
                }
            },
        },
    }


def read_out(tmp_path) -> list[dict]:
    out = tmp_path / "out.jsonl"
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def node_log_text(tmp_path) -> str:
    """Every node's log of the run, concatenated."""
    return "\n".join(
        p.read_text(errors="replace") for p in sorted((tmp_path / "run").rglob("*.log"))
    )


def test_kubeflows_elastic_echo_job_runs_on_the_masters_rendezvous(tmp_path):
    (tmp_path / "echo.py").write_text(ECHO_PY)
    command = ["python", "-m", "torch.distributed.run", "--rdzv_backend=c10d", "./echo.py"]
    summary, _ = submit(tmp_path, echo_job(command))
    assert summary["status"] == "succeeded", summary
    barriers = [e for e in read_out(tmp_path) if e["event"] == "barrier"]
    assert sorted(e["rank"] for e in barriers) == [0, 1], barriers
    assert {e["world"] for e in barriers} == {2}
    for e in barriers:  # torchrun's variables, as under torchrun
        assert e["env"]["WORLD_SIZE"] == "2" and e["env"]["RANK"] == str(e["rank"])
        assert e["env"]["MASTER_ADDR"] and e["env"]["MASTER_PORT"].isdigit()
        assert e["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
    logs = node_log_text(tmp_path)
    assert "replaced: --rdzv-backend c10d" in logs, logs[-3000:]
    # Said once per node in the job's own events too.
    said = [
        e for e in summary["events"] if e["kind"] == "agent" and "--rdzv-backend" in e["message"]
    ]
    assert sorted(e["node_rank"] for e in said) == [0, 1], summary["events"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rdzv_bakend=c10d", "./echo.py"], "unrecognized arguments: --rdzv_bakend=c10d"),
        (["--rdzv_backend=c10d", "./ehco.py"], "training script './ehco.py' not found"),
    ],
    ids=["bad-flag", "missing-script"],
)
def test_launcher_errors_fail_the_job_in_one_attempt_with_its_message(tmp_path, args, message):
    (tmp_path / "echo.py").write_text(ECHO_PY)
    command = ["python", "-m", "torch.distributed.run", *args]
    summary, _ = submit(tmp_path, echo_job(command), ok=False)
    assert summary["status"] == "failed", summary
    assert message in summary["reason"], summary["reason"]
    assert "at start-up" in summary["reason"], summary["reason"]
    assert read_out(tmp_path) == []
    # one incarnation per worker: nothing relaunched
    assert [n["relaunches"] for n in summary["nodes"]] == [0, 0], summary["nodes"]
    assert len({n["id"] for n in summary["nodes"]}) == 2, summary["nodes"]
    failed = [e for e in summary["events"] if e["kind"] == "node_failed"]
    assert len(failed) == 1 and failed[0]["details"]["deterministic"], failed


def test_the_echo_job_training_20s_survives_a_worker_killed_half_way(tmp_path):
    (tmp_path / "echo.py").write_text(ECHO_PY)
    command = ["python", "-m", "torch.distributed.run", "--rdzv_backend=c10d", "./echo.py", "20"]
    # the workers meet about 10 s after the start and train for 20 s: 20 s is half way
    summary, _ = submit(tmp_path, echo_job(command), "--kill", "worker:1@20s")
    assert summary["status"] == "succeeded", summary
    kinds = [e["kind"] for e in summary["events"]]
    assert "fault" in kinds, kinds
    by_id = {n["id"]: n for n in summary["nodes"]}
    # worker-0 is one incarnation that went on; worker-1 was killed, relaunched and rejoined
    assert [(n["rank"], n["status"]) for n in by_id.values() if n["rank"] == 0] == [
        (0, "succeeded")
    ], by_id
    last = max((n for n in by_id.values() if n["rank"] == 1), key=lambda n: n["id"])
    assert last["relaunches"] == 1 and last["status"] == "succeeded", by_id
    rounds = [e["message"] for e in summary["events"] if e["kind"] == "rendezvous_round"]
    assert any("with 1 nodes" in r for r in rounds), rounds  # the survivor alone, in bounds
    out = read_out(tmp_path)
    done = [e for e in out if e["event"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1] and {e["world"] for e in done} == {2}, out
    barriers = [e for e in out if e["event"] == "barrier"]
    # The survivor went on alone, then the relaunched worker rejoined it in a new group of two.
    # (The kill is timed: on a loaded machine it can land before the first group of two met.)
    assert any(e["world"] == 1 for e in barriers), out
    assert barriers[0]["env"]["MASTER_PORT"] != done[0]["port"], out
