"""KV keys the master and the TensorFlow side share: checkpoint requests, pauses for a
migration, and the TF2 PS coordinator's flag."""

from __future__ import annotations

# The n-th checkpoint request is the key "<CHECKPOINT_REQUESTS_KEY>/<n>" (the master counts
# requests under the key itself), the chief answers under ".../<n>/done" with the step it saved
# at, then waits for ".../<n>/release".
CHECKPOINT_REQUESTS_KEY = b"dlrover/tf/checkpoint_requests"


# Workers pause at a step boundary while the chief checkpoints for a migration: the n-th pause
# is "<PAUSE_KEY>/<n>", each worker acks with ".../<n>/ack/<TYPE>-<RANK>", the master ends it
# with ".../<n>/release".
PAUSE_KEY = b"dlrover/tf/pause"
# Set by a TF2 PS coordinator (dlrover_tf.keras_ps): the master restarts it when a PS is lost.
COORDINATOR_KEY = b"dlrover/tf/coordinator"


def pause_key(n: int, suffix: str = "") -> bytes:
    """The KV key of the n-th pause (suffix: "ack/worker-0", "release")."""
    return PAUSE_KEY + b"/" + str(n).encode() + (b"/" + suffix.encode() if suffix else b"")


def checkpoint_request_key(n: int, suffix: str = "") -> bytes:
    """The KV key of the n-th checkpoint request (suffix: "done", the chief's answer;
    "release", the master letting the chief go on)."""
    key = CHECKPOINT_REQUESTS_KEY + b"/" + str(n).encode()
    return key + b"/" + suffix.encode() if suffix else key
