"""The DLROVER_* variables a master gives its nodes (its address, the node's identity, the job
token): read here and only here, by `MasterClient.from_env`."""

from __future__ import annotations

from collections.abc import Mapping

from master.client.errors import MasterError
from master.client.identity import NodeIdentity

ENV_MASTER_ADDR = "DLROVER_MASTER_ADDR"
ENV_NODE_TYPE = "DLROVER_NODE_TYPE"
ENV_NODE_RANK = "DLROVER_NODE_RANK"
ENV_NODE_ID = "DLROVER_NODE_ID"
ENV_JOB_TOKEN = "DLROVER_JOB_TOKEN"
ENV_JOB_TOKEN_FILE = "DLROVER_JOB_TOKEN_FILE"
# Set by a platform that reads a dead trainer's position files back (master.client.position):
# the trainer's progress stream may then coalesce its reports.
ENV_POSITION_FILE = "DLROVER_POSITION_FILE"
# Set where a node's TF_CONFIG gives its peers at forwarders (master.platform.peer_forward):
# the TF_CONFIG as the master made it, with every task at its own address.
ENV_TF_CONFIG_DIRECT = "DLROVER_TF_CONFIG_DIRECT"
# How long a node's calls wait for an unreachable master before they fail. A restarted master
# is back in seconds on an idle machine, but a platform's restart (a Ray actor, a rescheduled
# pod) on a loaded cluster has taken a minute; a node that gave up would be relaunched.
ENV_MASTER_WAIT = "DLROVER_MASTER_WAIT_SECONDS"
DEFAULT_MASTER_WAIT_SECONDS = 180.0


def read_master_addr(env: Mapping[str, str]) -> str:
    """The master's host:port; a MasterError saying how to start the node when it is unset."""
    addr = env.get(ENV_MASTER_ADDR, "")
    if not addr:
        raise MasterError(
            f"{ENV_MASTER_ADDR} is not set: this process was not started by a dlrover master. "
            "Run it through `dlrover submit JOB.yaml`, or set "
            f"{ENV_MASTER_ADDR}=host:port and {ENV_JOB_TOKEN_FILE}."
        )
    return addr


def read_node_identity(env: Mapping[str, str]) -> NodeIdentity | None:
    """This node's identity, or None where no node type is set (a command-line tool)."""
    if not env.get(ENV_NODE_TYPE):
        return None
    try:
        return NodeIdentity(
            type=env[ENV_NODE_TYPE],
            rank=int(env.get(ENV_NODE_RANK, "0")),
            id=int(env.get(ENV_NODE_ID, "0")),
        )
    except ValueError as e:
        raise MasterError(f"{ENV_NODE_RANK} and {ENV_NODE_ID} must be integers: {e}") from e


def read_token(env: Mapping[str, str]) -> str:
    """The job token from DLROVER_JOB_TOKEN_FILE (preferred) or DLROVER_JOB_TOKEN."""
    path = env.get(ENV_JOB_TOKEN_FILE, "")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise MasterError(
                f"cannot read the job token file {path!r} named by {ENV_JOB_TOKEN_FILE}: {e}"
            ) from e
    return env.get(ENV_JOB_TOKEN, "")


def read_master_wait(env: Mapping[str, str]) -> float:
    """Seconds a node's calls keep retrying an unreachable master (DLROVER_MASTER_WAIT_SECONDS)."""
    raw = env.get(ENV_MASTER_WAIT, "")
    if not raw:
        return DEFAULT_MASTER_WAIT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise MasterError(
            f"{ENV_MASTER_WAIT}={raw!r}: expected a number of seconds >= 0 "
            f"(unset: {DEFAULT_MASTER_WAIT_SECONDS:g})"
        )
    return seconds


def read_position_base(env: Mapping[str, str]) -> str:
    """Where this node's progress streams keep their position files; "" when its platform
    reads none back (each step is then reported to the master as it ends)."""
    return env.get(ENV_POSITION_FILE, "")
