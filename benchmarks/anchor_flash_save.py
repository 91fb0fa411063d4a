"""DLRover 0.6.1's flash checkpoint, timed like ours: run by the anchors' Python (see anchors.py).

``anchor_flash_save.py GIB DIR SAVES [SETTLE]`` saves the benchmark state to memory SAVES times with
``DdpCheckpointer.save_checkpoint(..., StorageType.MEMORY)`` and prints one JSON line with the
time each call blocked (the first one included: no warm-up, as a training job's first save),
SETTLE seconds after the state was built (see checkpoint.py: cold memory for every first save).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from ckpt_state import make_state

GIB = 1 << 30


def main() -> None:
    logging.disable(logging.INFO)
    size, directory, saves = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    settle = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    state = make_state(int(size * GIB))
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    ck = DdpCheckpointer(directory)
    time.sleep(settle)
    times, results = [], []
    for step in range(1, saves + 1):
        start = time.perf_counter()
        results.append(ck.save_checkpoint(step, state, storage_type=StorageType.MEMORY))
        times.append(time.perf_counter() - start)
    print(json.dumps({"save_s": times, "returned": [repr(r) for r in results]}), flush=True)
    os._exit(0)  # its saver process is a daemon of this one; the caller kills the session


if __name__ == "__main__":
    main()
