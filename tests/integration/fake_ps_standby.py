"""A standby PS without TensorFlow, for tests about where a standby may stand in.

Like `dlrover_tf.ps_standby` it says it is ready, then waits for the master's promotion message:
retired, it exits 0; promoted, it serves nothing (as fake_trainer's PS) until SIGTERM.
"""

import os
import signal
import sys
import time

from dlrover_tf.ps_standby import promotion
from master.client import KVClient, MasterClient, MasterError, ps_standby_key

WAIT_SECONDS = 5.0


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    node_id = int(os.environ["DLROVER_NODE_ID"])
    kv = KVClient(MasterClient.from_env())
    kv.set(ps_standby_key(node_id, "ready"), repr(time.time()).encode())
    promote = ps_standby_key(node_id, "promote")
    while True:
        try:
            if kv.wait([promote], WAIT_SECONDS):
                break
        except MasterError:
            time.sleep(1.0)
    if promotion(kv.get(promote, 0)) is None:
        return 0  # retired
    print(f"standby PS id {node_id} promoted", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
