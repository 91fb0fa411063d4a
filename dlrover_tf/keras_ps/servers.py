"""The nodes of TF2 PS training: TF_CONFIG, the worker and PS servers that serve until the
coordinator is done, and `connect`, which gives the chief its strategy."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn

from master.client import ENV_MASTER_ADDR, KVClient, MasterClient, MasterError
from master.client.env import ENV_TF_CONFIG_DIRECT

log = logging.getLogger(__name__)

# Set by the coordinator when training is over: worker servers exit 0 when they see it.
DONE_KEY = b"dlrover/tf/coordinator/done"
# A worker server re-asks the master whether training is over this often.
DONE_POLL_SECONDS = 10.0
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def tf_config(env: dict[str, str] | None = None) -> tuple[dict[str, list[str]], str, int]:
    """(cluster, task type, task index) from TF_CONFIG; a clear error when it is unusable."""
    raw = (env if env is not None else os.environ).get("TF_CONFIG", "")
    try:
        config = json.loads(raw)
        cluster = {str(k): list(v) for k, v in config["cluster"].items()}
        task = config["task"]
        return cluster, str(task["type"]), int(task.get("index", 0))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"TF_CONFIG must be JSON with 'cluster' and 'task' ({{'type', 'index'}}); the "
            f"dlrover master sets it for every node (got {raw[:200]!r}: {err})"
        ) from None


def serve(cluster: dict[str, list[str]], task_type: str, index: int) -> NoReturn:
    """Run this node's TF server until the coordinator says training is done (exit 0) or
    SIGTERM/SIGINT arrives (exit 0). A PS or worker of TF2 PS training runs nothing else."""
    # Blocked before TF starts threads, so only sigwait() below receives them.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster),
        job_name=task_type,
        task_index=index,
        protocol="grpc",
        start=True,
    )
    log.info("%s %d serving at %s", task_type, index, cluster[task_type][index])
    if ENV_MASTER_ADDR in os.environ:
        threading.Thread(target=_exit_when_done, name="dlrover-done", daemon=True).start()
    received = signal.sigwait(_STOP_SIGNALS)
    log.info("%s %d stopping on %s", task_type, index, signal.Signals(received).name)
    del server
    exit_process(0)


def _exit_when_done() -> None:
    kv = KVClient(MasterClient.from_env())
    while True:
        try:
            if kv.wait([DONE_KEY], DONE_POLL_SECONDS):
                log.info("the coordinator finished training; exiting")
                exit_process(0)
        except MasterError as e:
            log.warning("asking the master whether training is done: %s", e)
            time.sleep(1.0)


def exit_process(code: int = 0) -> NoReturn:
    """End this process at once (after flushing logs). A coordinator's interpreter teardown
    can hang in ClusterCoordinator's destructor when a worker went away; use this to exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # A TF gRPC server cannot be stopped, and interpreter teardown with it running can hang.
    os._exit(code)


def connect(env: dict[str, str] | None = None) -> Any:
    """The strategy on the coordinator (chief); on a worker or PS, serve and never return."""
    cluster, task_type, index = tf_config(env)
    if task_type in ("worker", "ps"):
        serve(cluster, task_type, index)
    if task_type != "chief":
        raise ValueError(
            f"TF_CONFIG task type {task_type!r}: TF2 PS training runs its program on the "
            "'chief' (the coordinator); give the evaluator group 0 replicas"
        )
    direct = (env if env is not None else os.environ).get(ENV_TF_CONFIG_DIRECT)
    if direct:  # the coordinator hands its cluster to every task: the tasks' own addresses
        cluster, _, _ = tf_config({"TF_CONFIG": direct})
    import tensorflow as tf

    workers = dict(enumerate(cluster.get("worker", [])))
    if (env if env is not None else os.environ).get(ENV_MASTER_ADDR):
        # TF_CONFIG may list worker slots the job reserves for scaling; the coordinator
        # connects to each worker it lists at start, so it takes only those the master runs.
        client = MasterClient.from_env(env)
        try:
            if KVClient(client).check([DONE_KEY]):
                log.info("training is already done (a coordinator restarted after the end)")
                exit_process(0)
            ranks = _live_worker_ranks(client)
        finally:
            client.close()
        if not ranks:
            raise ValueError(
                "the master runs no worker for this coordinator: give the 'worker' group at "
                "least one replica in the job YAML"
            )
        workers = {rank: addr for rank, addr in workers.items() if rank in ranks}
    spec = {k: v for k, v in cluster.items() if k != "worker"} | {"worker": workers}
    log.info("coordinator: %d ps, workers %s", len(spec.get("ps", [])), sorted(workers))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=index, rpc_layer="grpc"
    )
    return tf.distribute.experimental.ParameterServerStrategy(resolver)


def _live_worker_ranks(client: MasterClient) -> set[int]:
    status = client.job_status()
    return {
        n.rank for n in status.nodes if n.type == "worker" and n.status in ("pending", "running")
    }
