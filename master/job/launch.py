"""What a node is launched with: its command, environment, `TF_CONFIG` and launch spec.

Pure functions of the job spec and the node; master.job.lifecycle launches what they build."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping

from master.client import (
    ENV_JOB_TOKEN_FILE,
    ENV_MASTER_ADDR,
    ENV_NODE_ID,
    ENV_NODE_RANK,
    ENV_NODE_TYPE,
)
from master.config import JobSpec
from master.job.model import JobRuntime
from master.nodes.model import Node
from master.platform.api import NodeLaunchSpec

# The types TF_CONFIG lists (an evaluator is a task of its own, outside the cluster).
TF_CLUSTER_TYPES = ("ps", "chief", "worker")
PS_SERVER_COMMAND = ("python", "-m", "dlrover_tf.ps")  # the built-in PS when none is given


def node_command(spec: JobSpec, node_type: str, python: str = sys.executable) -> tuple[str, ...]:
    """The command a node of `node_type` runs; a leading `python` is this interpreter."""
    group = spec.group(node_type)
    if group.command:
        command = group.command
    elif node_type == "ps":
        command = PS_SERVER_COMMAND
    else:
        command = spec.command
    if command and command[0] in ("python", "python3"):
        command = (python, *command[1:])
    return tuple(command)


def tf_cluster_spec(
    spec: JobSpec, replicas: Mapping[str, int], address: Callable[[str, int], str]
) -> dict[str, list[str]]:
    """The TF cluster: exactly the nodes that run (`replicas`), or, for a job that reserves
    worker slots (worker.reserve_slots, or an explicit worker.max_replicas), every worker slot,
    so TF processes can reach workers added later. `address(type, rank)` is a node's address;
    it is asked in cluster order."""
    cluster = {}
    for node_type in TF_CLUSTER_TYPES:
        n = replicas[node_type]
        if node_type == "worker" and spec.worker.reserves_slots:
            n = spec.worker.slots
        if n:
            cluster[node_type] = [address(node_type, r) for r in range(n)]
    return cluster


def tf_config(cluster: Mapping[str, list[str]], node_type: str, rank: int) -> str:
    """The `TF_CONFIG` of task (node_type, rank) in `cluster`, as JSON."""
    return json.dumps(
        {
            "cluster": cluster,
            "task": {"type": node_type, "index": rank},
            "environment": "cloud",
        }
    )


# TF's gRPC channels try a refused peer again after 1 s (jittered) by default, so a chief or
# worker whose PS was replaced at the same address (a standby promoted in a few tens of ms)
# sat idle for most of that second. 100 ms, growing 1.6x per attempt up to TF's 1 s cap.
TF_GRPC_OPTIONS_ENV = "TF_GRPC_DEFAULT_OPTIONS"
TF_GRPC_RECONNECT_OPTIONS = "grpc.initial_reconnect_backoff_ms=100"


def node_env(
    spec: JobSpec,
    runtime: JobRuntime,
    node: Node,
    cluster: Mapping[str, list[str]],
    inherited: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A node's environment: `inherited` (the master's, on platforms that pass it on), the
    job's and its group's variables, then its identity, the master's address and TF_CONFIG.
    The job token travels as a file only, never as a variable."""
    env = dict(inherited or {})
    env.update(spec.env)
    env.update(spec.group(node.type).env)
    env.update(
        {
            ENV_MASTER_ADDR: runtime.master_addr,
            **runtime.node_env,
            ENV_JOB_TOKEN_FILE: runtime.token_file,
            ENV_NODE_TYPE: node.type,
            ENV_NODE_RANK: str(node.rank),
            ENV_NODE_ID: str(node.id),
            "DLROVER_JOB_NAME": spec.name,
            "DLROVER_RUN_DIR": runtime.run_dir,
            "DLROVER_MODEL_DIR": os.path.join(runtime.run_dir, "model"),
            "PYTHONUNBUFFERED": "1",
            "TF_CONFIG": tf_config(cluster, node.type, node.rank),
        }
    )
    env.pop("DLROVER_JOB_TOKEN", None)
    # The user's own TF gRPC options come after ours: the later setting wins.
    env[TF_GRPC_OPTIONS_ENV] = ",".join(
        filter(None, (TF_GRPC_RECONNECT_OPTIONS, env.get(TF_GRPC_OPTIONS_ENV, "")))
    )
    return env


def node_log_path(run_dir: str, node: Node) -> str:
    """Where a node incarnation's output goes: one file per incarnation."""
    return os.path.join(run_dir, "logs", f"{node.name}.{node.id}.log")


def launch_spec(spec: JobSpec, node: Node, env: Mapping[str, str], log_path: str) -> NodeLaunchSpec:
    """What the platform needs to launch (or, with an empty env, adopt) a node incarnation."""
    group = spec.group(node.type)
    return NodeLaunchSpec(
        type=node.type,
        rank=node.rank,
        id=node.id,
        command=node_command(spec, node.type),
        env=env,
        workdir=spec.workdir,
        log_path=log_path,
        cpu=node.cpu or group.cpu,
        memory_mb=node.memory_mb,
        image=group.image,
        image_command=(group.command or spec.command) if group.image else (),
        image_workdir=group.image_workdir,
    )
