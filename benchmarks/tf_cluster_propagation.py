"""Probe: can a TF1 trainer reach a PS at a new address without restarting its process?

TF's ClusterSpec propagation: a session whose `ConfigProto.cluster_def` lists the cluster makes
the session master create worker sessions with that cluster, whatever the servers booted with.
A PS process serves at one address; the trainer (this process) builds a graph with a variable on
`/job:ps/task:0`, trains a few steps, the PS is SIGKILLed and a new one starts at another
address; a new session with the new cluster_def trains again. Prints each session's time
(waiting for its PS process to start serving included).

    python benchmarks/tf_cluster_propagation.py            # trainer booted as job 'localhost'
    python benchmarks/tf_cluster_propagation.py --as-chief # booted as the job the spec names

TF refuses the second ("The ClusterSpec names the job and task index to be the same names that
were provided when the server booted"): a trainer that is to follow a moved PS in process must
boot its server under a job name the cluster_def does not use. Leaves out: an estimator's own
server and session creation (what dlrover_tf would have to change), variables' restore.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

PS_PROGRAM = """
import sys, tensorflow as tf
spec = {"ps": [sys.argv[1]], "chief": [sys.argv[2]]}
tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="ps", task_index=0).join()
"""


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_ps(ps: str, chief: str) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, "-c", PS_PROGRAM, ps, chief], env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--as-chief", action="store_true", help="boot as the spec's chief")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    first, second, chief = free_address(), free_address(), free_address()
    ps = start_ps(first, chief)
    job = "chief" if args.as_chief else "localhost"
    boot = {"ps": [first], "chief": [chief]} if args.as_chief else {job: [chief]}
    server = tf.distribute.Server(tf.train.ClusterSpec(boot), job_name=job, task_index=0)
    with tf.device("/job:ps/task:0"):
        v = tf.compat.v1.get_variable("v", initializer=0.0)
    with tf.device("/job:chief/task:0"):
        step = tf.compat.v1.assign_add(v, 1.0)
    init = tf.compat.v1.global_variables_initializer()

    def session(ps_address: str) -> tf.compat.v1.Session:
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", "/job:chief/task:0"])
        spec = tf.train.ClusterSpec({"ps": [ps_address], "chief": [chief]})
        config.cluster_def.CopyFrom(spec.as_cluster_def())
        return tf.compat.v1.Session(server.target, config=config)

    try:
        for label, address in (("first PS", first), ("PS at a new address", second)):
            if address == second:
                ps.kill()
                ps.wait()
                ps = start_ps(second, chief)
            started = time.perf_counter()
            with session(address) as s:
                s.run(init)
                for _ in range(3):
                    s.run(step)
                value = s.run(v)
            print(f"{label}: v={value:g} in {time.perf_counter() - started:.2f} s", flush=True)
    finally:
        ps.kill()


if __name__ == "__main__":
    main()
