"""What a node is launched with: its command, TF_CONFIG, environment and launch spec."""

from __future__ import annotations

import json

from master.config import parse_job_spec
from master.job.launch import (
    PS_SERVER_COMMAND,
    launch_spec,
    node_command,
    node_env,
    node_log_path,
    tf_cluster_spec,
    tf_config,
)
from master.job.model import JobRuntime
from master.nodes.model import Node

RUNTIME = JobRuntime(
    run_dir="/runs/j1",
    master_addr="127.0.0.1:5000",
    token_file="/runs/j1/token",
    node_env={"DLROVER_TLS_CA": "/runs/j1/ca.pem"},
)


def _spec(**fields):
    data = {"name": "j1", "command": ["python", "train.py", "--lr", "0.1"], **fields}
    return parse_job_spec(data, "job.yaml", "/work")


def _address(node_type: str, rank: int) -> str:
    return f"{node_type}-{rank}.svc:2222"


def test_a_python_command_runs_with_the_masters_interpreter():
    spec = _spec(worker={"replicas": 1})
    assert node_command(spec, "worker", python="/venv/bin/python") == (
        "/venv/bin/python",
        "train.py",
        "--lr",
        "0.1",
    )


def test_ps_runs_the_built_in_server_unless_its_group_names_a_command():
    assert PS_SERVER_COMMAND == ("python", "-m", "dlrover_tf.ps")
    spec = _spec(ps={"replicas": 1}, worker={"replicas": 1})
    assert node_command(spec, "ps", python="/py") == ("/py", "-m", "dlrover_tf.ps")
    own = _spec(
        ps={"replicas": 1, "command": ["/opt/tf/ps-server", "--port", "0"]}, chief={"replicas": 1}
    )
    assert node_command(own, "ps", python="/py") == ("/opt/tf/ps-server", "--port", "0")
    assert node_command(own, "chief", python="/py") == ("/py", "train.py", "--lr", "0.1")


def test_the_cluster_lists_every_worker_slot_and_no_evaluator():
    spec = _spec(
        ps={"replicas": 2},
        chief={"replicas": 1},
        worker={"replicas": 1, "max_replicas": 3},
        evaluator={"replicas": 1},
    )
    replicas = {"ps": 2, "chief": 1, "worker": 1, "evaluator": 1}
    assert tf_cluster_spec(spec, replicas, _address) == {
        "ps": ["ps-0.svc:2222", "ps-1.svc:2222"],
        "chief": ["chief-0.svc:2222"],
        "worker": ["worker-0.svc:2222", "worker-1.svc:2222", "worker-2.svc:2222"],
    }


def test_a_type_with_no_replicas_is_left_out_and_addresses_are_asked_in_cluster_order():
    spec = _spec(worker={"replicas": 2, "max_replicas": 2})
    asked = []

    def address(node_type, rank):
        asked.append((node_type, rank))
        return _address(node_type, rank)

    cluster = tf_cluster_spec(spec, {"ps": 0, "chief": 0, "worker": 2, "evaluator": 0}, address)
    assert list(cluster) == ["worker"]
    assert asked == [("worker", 0), ("worker", 1)]


def test_tf_config_names_the_task_in_the_cluster():
    cluster = {"ps": ["ps-0.svc:2222"], "worker": ["worker-0.svc:2222"]}
    assert json.loads(tf_config(cluster, "worker", 0)) == {
        "cluster": cluster,
        "task": {"type": "worker", "index": 0},
        "environment": "cloud",
    }


def test_a_nodes_env_carries_its_identity_the_master_and_tf_config():
    spec = _spec(
        env={"SHARED": "job", "OVERRIDDEN": "job"},
        ps={"replicas": 1},
        worker={"replicas": 2, "env": {"OVERRIDDEN": "group"}},
    )
    node = Node("worker", 1, id=17)
    cluster = {"ps": ["ps-0.svc:2222"], "worker": ["w0:1", "w1:1", "w2:1", "w3:1"]}
    inherited = {"PATH": "/usr/bin", "SHARED": "master", "DLROVER_JOB_TOKEN": "secret"}
    env = node_env(spec, RUNTIME, node, cluster, inherited)
    assert env["PATH"] == "/usr/bin"  # the master's env, where the platform passes it on
    assert env["SHARED"] == "job" and env["OVERRIDDEN"] == "group"  # job, then group, win
    assert env["DLROVER_MASTER_ADDR"] == "127.0.0.1:5000"
    assert env["DLROVER_TLS_CA"] == "/runs/j1/ca.pem"
    assert env["DLROVER_JOB_TOKEN_FILE"] == "/runs/j1/token"
    assert "DLROVER_JOB_TOKEN" not in env  # the token travels as a file only
    assert (env["DLROVER_NODE_TYPE"], env["DLROVER_NODE_RANK"], env["DLROVER_NODE_ID"]) == (
        "worker",
        "1",
        "17",
    )
    assert env["DLROVER_JOB_NAME"] == "j1" and env["DLROVER_RUN_DIR"] == "/runs/j1"
    assert env["DLROVER_MODEL_DIR"] == "/runs/j1/model"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    assert json.loads(env["TF_CONFIG"])["cluster"] == cluster


def test_without_an_inherited_env_a_node_gets_only_the_jobs_variables():
    spec = _spec(worker={"replicas": 1})
    env = node_env(spec, RUNTIME, Node("worker", 0, id=1), {"worker": ["w0:1"]})
    assert "PATH" not in env and env["DLROVER_NODE_ID"] == "1"


def test_tf_retries_a_refused_peer_soon_and_the_users_grpc_options_come_last():
    spec = _spec(worker={"replicas": 1})
    env = node_env(spec, RUNTIME, Node("worker", 0, id=1), {"worker": ["w0:1"]})
    assert env["TF_GRPC_DEFAULT_OPTIONS"] == "grpc.initial_reconnect_backoff_ms=100"
    spec = _spec(
        env={"TF_GRPC_DEFAULT_OPTIONS": "grpc.keepalive_time_ms=60000"}, worker={"replicas": 1}
    )
    env = node_env(spec, RUNTIME, Node("worker", 0, id=1), {"worker": ["w0:1"]})
    options = env["TF_GRPC_DEFAULT_OPTIONS"].split(",")
    assert options == ["grpc.initial_reconnect_backoff_ms=100", "grpc.keepalive_time_ms=60000"]


def test_each_incarnation_logs_to_its_own_file():
    assert node_log_path("/runs/j1", Node("ps", 0, id=3)) == "/runs/j1/logs/ps-0.3.log"
    assert node_log_path("/runs/j1", Node("ps", 0, id=9)) == "/runs/j1/logs/ps-0.9.log"


def test_the_launch_spec_takes_the_nodes_resources_else_its_groups():
    spec = _spec(ps={"replicas": 1, "cpu": 2, "memory_mb": 1024}, worker={"replicas": 1})
    moved = Node("ps", 0, id=5, cpu=4.0, memory_mb=4096)
    launch = launch_spec(spec, moved, {"A": "1"}, "/runs/j1/logs/ps-0.5.log")
    assert (launch.type, launch.rank, launch.id) == ("ps", 0, 5)
    assert (launch.cpu, launch.memory_mb) == (4.0, 4096)
    assert launch.env == {"A": "1"} and launch.workdir == "/work"
    assert launch.command[1:] == ("-m", "dlrover_tf.ps")
    adopted = launch_spec(spec, Node("ps", 0, id=6, memory_mb=1024), {}, "log")
    assert adopted.cpu == 2.0 and adopted.env == {}


def test_the_cluster_lists_the_workers_that_run_unless_the_job_reserves_slots():
    replicas = {"ps": 1, "chief": 1, "worker": 2, "evaluator": 0}
    plain = _spec(ps={"replicas": 1}, chief={"replicas": 1}, worker={"replicas": 2})
    assert len(tf_cluster_spec(plain, replicas, _address)["worker"]) == 2
    reserved = _spec(
        ps={"replicas": 1}, chief={"replicas": 1}, worker={"replicas": 2, "reserve_slots": True}
    )
    assert len(tf_cluster_spec(reserved, replicas, _address)["worker"]) == 4  # default slots
    scaled_down = {**replicas, "worker": 1}
    assert len(tf_cluster_spec(plain, scaled_down, _address)["worker"]) == 1
