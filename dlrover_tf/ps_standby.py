"""A standby PS: ``python -m dlrover_tf.ps_standby``, started by the master ahead of need.

It loads TensorFlow and its gRPC server runtime, says it is ready, and waits on the master's
KV store. Promoted (a PS died or is being moved), it gets the `TF_CONFIG` of the PS task it
replaces, starts that task's server at the task's address and serves from then on like any
`dlrover_tf.ps` process; retired (the job ends, a restarted master does not know it), it exits.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import NoReturn

from dlrover_tf.ps import (
    EXIT_CONFIG_ERROR,
    TFConfigError,
    block_stop_signals,
    parse_tf_config,
    start_server,
    wait_for_stop,
)

logger = logging.getLogger(__name__)

# The port of the PS being replaced is free once its process is fully gone, which may be a
# little after the master saw its end; a promotion waits this long for it.
PORT_FREE_TIMEOUT_SECONDS = 30.0
# A standby that cannot reach its master this long (the master is gone) ends.
MASTER_LOST_SECONDS = 120.0
WAIT_CHUNK_SECONDS = 10.0
# Linux's nice value is per thread: the warm-up thread alone runs at this one.
IDLE_NICE = 19


def promotion(value: bytes) -> tuple[str, int] | None:
    """(TF_CONFIG, node id) from the master's promotion message; None: retire instead."""
    doc = json.loads(value)
    if doc.get("retire"):
        return None
    return str(doc["tf_config"]), int(doc["node_id"])


def promoted_env(
    env: Mapping[str, str], tf_config: str, rank: int, node_id: int | None = None
) -> dict[str, str]:
    """The environment of the PS task this standby becomes: its TF_CONFIG, its rank and the
    node id it serves (and beats) as."""
    promoted = {**env, "TF_CONFIG": tf_config, "DLROVER_NODE_RANK": str(rank)}
    if node_id is not None:
        promoted["DLROVER_NODE_ID"] = str(node_id)
    return promoted


def wait_port_free(address: str, timeout: float = PORT_FREE_TIMEOUT_SECONDS) -> bool:
    """Wait until host:port can be bound (as gRPC binds it); whether it could in time."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host.strip("[]"), int(port)))
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.01)


def _load_tensorflow() -> None:
    import tensorflow as tf

    # Touch what a promotion uses, so its lazy imports are paid now.
    tf.train.ClusterSpec({"ps": ["127.0.0.1:1"]})
    _ = tf.distribute.Server


def at_idle_priority(work: Callable[[], None]) -> None:
    """Run `work` in a thread at the lowest CPU priority (nice 19), so warming up on a machine
    that trains takes only idle CPU; the rest of the process keeps its priority."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IDLE_NICE)
        except OSError as err:  # not Linux, or not allowed: warm up at normal priority
            logger.debug("cannot lower the warm-up's priority: %s", err)
        try:
            work()
        except BaseException as err:  # re-raised in the caller's thread
            failed.append(err)

    thread = threading.Thread(target=run, name="dlrover-standby-warm-up")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def run_standby() -> NoReturn:
    """Load TensorFlow, wait for a promotion (or retirement), then serve until SIGTERM."""
    block_stop_signals()
    started = time.monotonic()
    at_idle_priority(_load_tensorflow)
    from master.client import KVClient, MasterClient, ps_standby_key

    node_id = int(os.environ.get("DLROVER_NODE_ID", "0"))
    client = MasterClient.from_env()
    kv = KVClient(client)
    kv.set(ps_standby_key(node_id, "ready"), repr(time.time()).encode())
    logger.info("standby PS id %d ready in %.1f s", node_id, time.monotonic() - started)
    servers: list[object] = []  # the server once promoted, kept alive by this frame
    threading.Thread(
        target=_await_promotion, args=(kv, node_id, servers), name="dlrover-standby", daemon=True
    ).start()
    wait_for_stop(f"standby PS id {node_id}")


def _await_promotion(kv: object, node_id: int, servers: list[object]) -> None:
    from master.client import MasterError, ps_standby_key

    promote = ps_standby_key(node_id, "promote")
    reached = time.monotonic()
    while True:
        try:
            if kv.wait([promote], WAIT_CHUNK_SECONDS):
                message = kv.get(promote, 0)
                break
            reached = time.monotonic()
        except MasterError as err:
            if time.monotonic() - reached > MASTER_LOST_SECONDS:
                logger.error("standby PS id %d lost its master (%s); exiting", node_id, err)
                os._exit(0)
            time.sleep(1.0)
    try:
        promoted = promotion(message)
        if promoted is None:
            logger.info("standby PS id %d retired by the master", node_id)
            os._exit(0)
        tf_config = promoted[0]
        task = parse_tf_config(tf_config)
    except (TFConfigError, ValueError, KeyError, TypeError) as err:
        logger.error("standby PS id %d: bad promotion: %s", node_id, err)
        os._exit(EXIT_CONFIG_ERROR)
    logger.info("standby PS id %d promoted to ps task %d at %s", node_id, task.index, task.address)
    waited = time.monotonic()
    if not wait_port_free(task.address):
        logger.warning("%s still in use after %.0f s", task.address, PORT_FREE_TIMEOUT_SECONDS)
    elif time.monotonic() - waited > 0.005:
        logger.info("waited %.3f s for %s to be free", time.monotonic() - waited, task.address)
    env = promoted_env(os.environ, tf_config, task.index, promoted[1])
    servers.append(start_server(task, env))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_standby()
