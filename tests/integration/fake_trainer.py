"""A TF-free trainer for integration tests: consumes ShardedDataset batches and logs their ids.

Each step "trains" on one batch: it appends the indices to an ids file, then reports the
step to the master, as the TF hooks do. Options come from the environment:
FAKE_SIZE, FAKE_BATCH, FAKE_EPOCHS, FAKE_RECORDS_PER_SHARD (0: the master paces shard sizes),
FAKE_STEP_SECONDS, FAKE_IDS_DIR, FAKE_FAIL (exit code 3 at start without a traceback, a failure
a relaunch may fix), FAKE_RAISE (an exception at start-up: a deterministic user-code error),
FAKE_HANG_AT_STEP=STEP[:RANK] (the first incarnation to reach that step, of worker RANK if
given, stops stepping but keeps its heartbeat, like a deadlocked training loop),
FAKE_SLOW_RANK=R:SECONDS[:once] (worker R sleeps that long per step: a straggler; with
`once`, only its first incarnation), FAKE_PS_SECONDS (after its own FAKE_STEP_SECONDS, each
step holds a lock shared by all trainers this long, like a PS serving one update at a time:
throughput grows with trainers up to (step + ps) / ps of them, then stays flat). Run as a PS
(`ps: {command: [python, fake_trainer.py]}`) it prints its TF_CONFIG, serves nothing and waits
to be stopped; FAKE_PS_OOM_ONCE makes the first PS incarnation die of a MemoryError (workers
wait for a PS that serves).
"""

import fcntl
import os
import signal
import sys
import time

import numpy as np

from dlrover_tf.dataset import ShardedDataset


def _first_to(ids_dir: str, what: str) -> bool:
    """True for the first process of the job to ask about `what`."""
    try:
        os.close(os.open(os.path.join(ids_dir, what), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def fake_ps(ids_dir: str) -> int:
    """A PS stand-in: waits for the master's SIGTERM (or dies of OOM once)."""
    if os.environ.get("FAKE_PS_OOM_ONCE") and _first_to(ids_dir, "ps-oom-once"):
        print("Traceback (most recent call last):\nMemoryError: fake PS out of memory", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # The cluster spec its TF server would serve, for tests of who takes a new one.
    print("TF_CONFIG", os.environ.get("TF_CONFIG", ""), flush=True)
    _first_to(ids_dir, "ps-ready")
    while True:
        time.sleep(3600)


def main() -> int:
    if os.environ["DLROVER_NODE_TYPE"] == "ps":
        return fake_ps(os.environ["FAKE_IDS_DIR"])
    while os.environ.get("FAKE_PS_OOM_ONCE") and not os.path.exists(
        os.path.join(os.environ["FAKE_IDS_DIR"], "ps-ready")
    ):
        time.sleep(0.05)  # like TF workers, wait for a PS that serves
    if os.environ.get("FAKE_FAIL"):
        print("fatal: deliberate failure", flush=True)
        return 3
    if os.environ.get("FAKE_RAISE"):
        raise RuntimeError("deliberate start-up error: " + os.environ["FAKE_RAISE"])
    ds = ShardedDataset(
        "train",
        size=int(os.environ.get("FAKE_SIZE", "2000")),
        batch_size=int(os.environ.get("FAKE_BATCH", "16")),
        epochs=int(os.environ.get("FAKE_EPOCHS", "2")),
        records_per_shard=int(os.environ.get("FAKE_RECORDS_PER_SHARD", "0")),
        shuffle=True,
        seed=7,
    )
    step_seconds = float(os.environ.get("FAKE_STEP_SECONDS", "0.002"))
    ids_dir = os.environ["FAKE_IDS_DIR"]
    slow_rank, _, slow = os.environ.get("FAKE_SLOW_RANK", "").partition(":")
    slow_seconds, _, once = slow.partition(":")
    if (
        os.environ["DLROVER_NODE_TYPE"] == "worker"
        and slow_rank == os.environ["DLROVER_NODE_RANK"]
        and (once != "once" or _first_to(ids_dir, "slow-once"))
    ):
        step_seconds = float(slow_seconds)
    hang_step, _, hang_rank = os.environ.get("FAKE_HANG_AT_STEP", "0").partition(":")
    hang_at = int(hang_step) if hang_rank in ("", os.environ["DLROVER_NODE_RANK"]) else 0
    ps_seconds = float(os.environ.get("FAKE_PS_SECONDS", "0"))
    ps_lock = (
        os.open(os.path.join(ids_dir, "ps.lock"), os.O_CREAT | os.O_RDWR) if ps_seconds else -1
    )
    node = f"{os.environ['DLROVER_NODE_TYPE']}.{os.environ['DLROVER_NODE_RANK']}.{os.getpid()}"
    steps = 0
    with open(os.path.join(ids_dir, node + ".ids"), "ab", buffering=0) as out:
        for batch in ds.batches():
            time.sleep(step_seconds)
            if ps_lock >= 0:  # the shared "PS": one trainer's update at a time
                fcntl.flock(ps_lock, fcntl.LOCK_EX)
                time.sleep(ps_seconds)
                fcntl.flock(ps_lock, fcntl.LOCK_UN)
            out.write(np.asarray(batch, dtype=np.int64).tobytes())
            steps += 1
            ds.step_done(steps, loss=0.2 + 2.0 / (1.0 + steps / 50.0))  # a falling "loss"
            if hang_at and steps == hang_at and _first_to(ids_dir, "hung-once"):
                time.sleep(3600)
    ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
