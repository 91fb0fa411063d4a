"""The PS failures `ps_recovery.py` measures beyond a process crash: each run trains the TF
example to its end, loses ps-0 one way at a global step, and counts what it cost.

- `frozen`: the PS process SIGSTOPped (a GC storm, swap, a stuck driver): alive to its parent,
  silent to the master, which must notice through its heartbeat timeout;
- `no_standby`: the PS SIGKILLed with no standby PS ready: a new PS process is started;
- `host_loss`: the Ray node holding ps-0 removed (every process on it at once), when the job
  runs on a multi-node Ray cluster (`remove_host` given by the caller).

Every run logs the ids each trainer trained (`--log-trained-ids`), so `records_missing` (a
record trained fewer than `epochs` times) is counted, not inferred. Detection is charged from
the failure to the master's `detected` phase; recovery to the first step that moves the data
forward again.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from collections.abc import Callable

import numpy as np
import yaml


def trained_counts(ids_prefix: str, records: int) -> np.ndarray:
    """How many times each record id was trained, from every trainer's id log."""
    files = glob.glob(f"{ids_prefix}.*.ids")
    if not files:
        return np.zeros(records, dtype=np.int64)
    ids = np.concatenate([np.fromfile(f, dtype=np.int64) for f in files])
    return np.bincount(ids, minlength=records)


def with_trained_ids(job_yaml: str, ids_prefix: str, name: str) -> str:
    """A copy of the job file whose trainers log the ids of every step they train."""
    with open(job_yaml) as f:
        job = yaml.safe_load(f)
    job["command"] = [*job["command"], "--log-trained-ids", ids_prefix]
    path = os.path.join(os.path.dirname(job_yaml), name)
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def detected_after(timeline: dict | None, failed_at: float) -> float | None:
    """Seconds from the failure to the master's `detected` phase (None: not recorded)."""
    if not timeline or "detected" not in timeline.get("phases", {}):
        return None
    return round(timeline["started"] + timeline["phases"]["detected"] - failed_at, 3)


def failure_run(
    bench: object,
    job_yaml: str,
    workdir: str,
    kind: str,
    fail_step: int,
    records: int,
    epochs: int,
    standby: bool,
    submit_args: tuple[str, ...] = (),
    remove_host: Callable[[str], float] | None = None,
) -> dict:
    """One job that loses ps-0 as `kind` says at `fail_step`; its figures. `bench` is the
    ps_recovery module (its Job, watchers and event readers); `remove_host(run_dir)` removes
    the Ray node holding ps-0 and returns when (`host_loss`, with `submit_args` for Ray)."""
    run_dir = os.path.join(workdir, kind)
    ids_prefix = os.path.join(workdir, f"{kind}-ids", "trained")
    os.makedirs(os.path.dirname(ids_prefix))
    job = bench.Job(with_trained_ids(job_yaml, ids_prefix, f"{kind}.yaml"), run_dir, *submit_args)
    job.rate_until(fail_step)
    if standby:
        bench._wait_standby_ready(job)
    step_at_failure, done_before = job.status()
    if kind == "host_loss":
        assert remove_host is not None, "host_loss needs a multi-node Ray cluster"
        failed_at = remove_host(run_dir)
    else:
        pid = bench._find_process(run_dir, "dlrover_tf.ps")
        failed_at = time.time()
        if kind == "frozen":
            os.kill(pid, signal.SIGSTOP)
        else:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    resumed = bench._watch_resume(job, done_before)
    summary = job.finish()
    timeline = bench._timeline(summary, "ps_failure")
    counts = trained_counts(ids_prefix, records)
    restored = bench._restored_step(summary)
    return {
        "detected_seconds": detected_after(timeline, failed_at),
        "recovery_seconds": round((resumed or time.time()) - failed_at, 2),
        "global_step_at_failure": step_at_failure,
        "restored_from_step": restored,
        "steps_lost": max(0, step_at_failure - restored),
        "records_to_train_again": bench._records_rolled_back(summary),
        "records_missing": int((counts < epochs).sum()),
        "records_trained_more": int(np.maximum(counts - epochs, 0).sum()),
        "job_status": summary["status"],
        "standby": standby,
        "timeline": timeline,
    }


def host_loss_run(
    bench: object,
    job_yaml: str,
    workdir: str,
    fail_step: int,
    records: int,
    epochs: int,
    standby: bool,
    worker_nodes: int = 3,
) -> dict:
    """`failure_run` of `host_loss` on a multi-node Ray cluster started here (one raylet per
    Ray node, each node 1 CPU; the job's nodes spread over them)."""
    from tests.integration.ray_cluster import ray_cluster

    with ray_cluster(worker_nodes=worker_nodes, cpus_per_node=1) as cluster:

        def remove_host(run_dir: str) -> float:
            return cluster.remove(cluster.node_of_log(os.path.join(run_dir, "logs", "ps-0.1.log")))

        result = failure_run(
            bench,
            job_yaml,
            workdir,
            "host_loss",
            fail_step,
            records,
            epochs,
            standby,
            ("--platform", "ray", "--ray-address", cluster.address),
            remove_host,
        )
    result["ray_nodes"] = worker_nodes
    return result
