"""A plain TensorFlow parameter server: ``python -m dlrover_tf.ps``.

Reads ``TF_CONFIG`` (a cluster and a ``ps`` task), serves the variables placed on it over gRPC
and blocks until SIGTERM or SIGINT, then exits with code 0. PS servers never stop by themselves:
whoever launched them (the master) stops them when the job ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

EXIT_CONFIG_ERROR = 2
EXIT_SERVER_ERROR = 1
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class TFConfigError(ValueError):
    """TF_CONFIG is missing or does not describe a ps task."""


@dataclass(frozen=True)
class PSTask:
    """The cluster (job name -> addresses) and the index of this ps task in it."""

    cluster: dict[str, list[str]]
    index: int

    @property
    def address(self) -> str:
        """host:port this ps task listens on."""
        return self.cluster["ps"][self.index]


def parse_tf_config(raw: str | None) -> PSTask:
    """Parse a TF_CONFIG value for a ps task; raise TFConfigError saying what is wrong."""
    if raw is None or not raw.strip():
        raise TFConfigError("TF_CONFIG is not set; the launcher must set it for the ps task")
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as err:
        raise TFConfigError(f"TF_CONFIG is not valid JSON ({err})") from None
    if not isinstance(config, Mapping):
        raise TFConfigError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    cluster = _parse_cluster(config.get("cluster"))
    task = config.get("task")
    if not isinstance(task, Mapping):
        raise TFConfigError("TF_CONFIG has no 'task' object ({'type': 'ps', 'index': N})")
    task_type = task.get("type")
    if task_type != "ps":
        raise TFConfigError(f"TF_CONFIG task type is {task_type!r}, expected 'ps'")
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise TFConfigError(f"TF_CONFIG task index must be an integer, got {index!r}")
    num_ps = len(cluster.get("ps", []))
    if not 0 <= index < num_ps:
        raise TFConfigError(
            f"TF_CONFIG task index {index} is out of range: cluster 'ps' has {num_ps} address(es)"
        )
    return PSTask(cluster=cluster, index=index)


def _parse_cluster(cluster: Any) -> dict[str, list[str]]:
    """Validate the 'cluster' part of TF_CONFIG: job name -> list of host:port."""
    if not isinstance(cluster, Mapping) or not cluster:
        raise TFConfigError("TF_CONFIG has no 'cluster' object (job name -> list of host:port)")
    parsed: dict[str, list[str]] = {}
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise TFConfigError(f"TF_CONFIG cluster job {job!r} must be a list of 'host:port'")
        parsed[str(job)] = list(addresses)
    return parsed


def serve(task: PSTask) -> NoReturn:
    """Start the ps server, block until SIGTERM/SIGINT, then exit the process with code 0."""
    block_stop_signals()
    server = start_server(task)  # noqa: F841 (kept alive while the process serves)
    wait_for_stop(f"ps task {task.index}")


def block_stop_signals() -> None:
    """Block SIGTERM/SIGINT before TensorFlow starts any thread: every thread inherits the
    mask, so the signal is only delivered to sigwait() in wait_for_stop. A Python signal
    handler would never run while the main thread sits in TensorFlow's C++ code."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


def start_server(task: PSTask, env: Mapping[str, str] | None = None) -> object:
    """Start the TF server of `task` (exit the process if it cannot) and tell the master it
    serves, from a thread (the report never delays the server)."""
    import tensorflow as tf

    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec(task.cluster),
            job_name="ps",
            task_index=task.index,
            protocol="grpc",
            start=True,
        )
    except tf.errors.OpError as err:
        print(
            f"dlrover_tf.ps: cannot serve ps task {task.index} at {task.address} "
            f"(from TF_CONFIG): {err.message} (is the port already in use?)",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(EXIT_SERVER_ERROR)
    logger.info(
        "ps task %d serving at %s (target %s); cluster jobs: %s",
        task.index,
        task.address,
        server.target,
        {job: len(addrs) for job, addrs in task.cluster.items()},
    )
    serving_at = time.time()
    threading.Thread(
        target=report_serving,
        args=(task, serving_at, dict(os.environ if env is None else env)),
        name="dlrover-ps-serving",
        daemon=True,
    ).start()
    return server


def report_serving(task: PSTask, at: float, env: Mapping[str, str]) -> None:
    """Set this PS task's serving key in the master's KV store (for its recovery timeline),
    then beat: a PS that freezes (stopped, swapping, its host cut off) goes silent and the
    master's heartbeat timeout replaces it. Without a master (a PS run by hand) there is nobody
    to tell."""
    if not env.get("DLROVER_MASTER_ADDR"):
        return
    try:
        from master.client import (
            KVClient,
            MasterClient,
            MasterError,
            process_heartbeat,
            ps_serving_key,
        )

        client = MasterClient.from_env(env)
        value = json.dumps({"node_id": int(env.get("DLROVER_NODE_ID", "0")), "at": at})
        KVClient(client).set(ps_serving_key(task.index), value.encode())
        client.close()
        beat = process_heartbeat(env)
    except (MasterError, ValueError) as err:
        logger.warning("cannot tell the master that ps task %d serves: %s", task.index, err)
        return
    if beat is not None:
        logger.info("ps task %d beats to the master every %.1f s", task.index, beat.interval)


def wait_for_stop(name: str) -> NoReturn:
    """Block until SIGTERM/SIGINT, then leave the process at once with code 0."""
    received = signal.sigwait(_STOP_SIGNALS)
    logger.info("%s stopping on %s", name, signal.Signals(received).name)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The gRPC server cannot be stopped cleanly (Server.stop is unimplemented) and interpreter
    # teardown with its threads running can hang, so leave at once.
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dlrover_tf.ps``."""
    argparse.ArgumentParser(
        prog="python -m dlrover_tf.ps",
        description="TensorFlow parameter server configured by the TF_CONFIG environment variable "
        "(task type 'ps'). Runs until SIGTERM.",
    ).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        task = parse_tf_config(os.environ.get("TF_CONFIG"))
    except TFConfigError as err:
        print(f"dlrover_tf.ps: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return serve(task)


if __name__ == "__main__":
    # Quiet TensorFlow's C++ logging unless the user asked otherwise (read at its first log line).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
