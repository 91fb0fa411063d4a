"""Shard round trips against DLRover 0.6.1's job master with DLRover's own client (run by the
anchors' Python, see benchmarks/anchors.py); one process of benchmarks/sharding.py's "dlrover"
phase.

Each client thread is a `GrpcMasterClient` of its own node (its own connection) that takes a
task (`get_task`, a shard) and reports it done (`report_task_result`) back to back, as a DLRover
worker's sharding client does. Protocol on stdin/stdout, one line each: prints "ready" once
every client is connected, reads the common start (a CLOCK_MONOTONIC time, shared by every
process of the machine), runs warm-up and window, prints one JSON line: the latencies (seconds)
of round trips ending in the window, and the errors.

    python anchor_shard_clients.py ADDR DATASET FIRST_NODE_ID CLIENTS WARMUP SECONDS [--create N]
"""

from __future__ import annotations

import json
import sys
import threading
import time

RECORDS_PER_SHARD = 1024
BATCH_SIZE = 64


def main(argv: list[str]) -> int:
    from dlrover.python.elastic_agent.master_client import GrpcMasterClient

    addr, dataset = argv[0], argv[1]
    first, count = int(argv[2]), int(argv[3])
    warmup, seconds = float(argv[4]), float(argv[5])
    clients = [GrpcMasterClient(addr, first + i, "worker", timeout=30) for i in range(count)]
    if "--create" in argv:
        size = int(argv[argv.index("--create") + 1])
        clients[0].report_dataset_shard_params(
            batch_size=BATCH_SIZE,
            num_epochs=1,
            dataset_size=size,
            shuffle=False,
            num_minibatches_per_shard=RECORDS_PER_SHARD // BATCH_SIZE,
            dataset_name=dataset,
        )
    for c in clients:  # connected (and the dataset known) before the start
        ok, task = c.get_task(dataset)
        if not ok or task.shard.end <= task.shard.start:
            print(json.dumps({"error": f"get_task gave no shard: {task}"}), flush=True)
            return 1
        c.report_task_result(dataset, task.task_id, "")
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    begin, end = start_at + warmup, start_at + warmup + seconds
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def run(client: GrpcMasterClient) -> None:
        mine = []
        clock = time.monotonic
        time.sleep(max(0.0, start_at - clock()))
        try:
            while True:
                t0 = clock()
                if t0 >= end:
                    break
                ok, task = client.get_task(dataset)
                if not ok or task.shard.end <= task.shard.start:
                    raise RuntimeError(f"get_task gave no shard: {task}")
                client.report_task_result(dataset, task.task_id, "")
                t1 = clock()
                if begin <= t1 < end:
                    mine.append(t1 - t0)
        except Exception as e:
            with lock:
                errors.append(repr(e)[:300])
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"latencies": latencies, "errors": errors[:3]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
