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
    # Block the stop signals before TensorFlow starts any thread: every thread inherits the mask,
    # so the signal is only delivered to sigwait() below. A Python signal handler would never run
    # while the main thread sits in the C++ Server.join().
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
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
    received = signal.sigwait(_STOP_SIGNALS)
    logger.info("ps task %d stopping on %s", task.index, signal.Signals(received).name)
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
