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
# A torch node agent's events (hangs, restarts, flags it replaced) are the keys
# "<AGENT_EVENTS_KEY>/<run id>/<node rank>/<n>", each a JSON object with "kind" and "reason";
# the master turns each into a job event.
AGENT_EVENTS_KEY = b"dlrover/events"
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


# The chief's session generations (dlrover_tf.elastic_ps): a counter, then one key per session.
CHIEF_SESSION_KEY = b"dlrover/tf/chief_session"
# A PS task serving: "<PS_SERVING_KEY>/<rank>" holds {"node_id": N, "at": unix time} (JSON).
PS_SERVING_KEY = b"dlrover/tf/ps_serving"
# A standby PS says ".../<node id>/ready" once TensorFlow is loaded and waits for
# ".../<node id>/promote": the TF_CONFIG of the task it becomes, or {"retire": true} (it ends).
PS_STANDBY_KEY = b"dlrover/tf/ps_standby"
# The chief checkpoints every this many steps (decimal text, set by the master); its measured
# cost of one checkpoint goes under CHECKPOINT_COST_KEY (seconds, decimal text).
CHECKPOINT_INTERVAL_KEY = b"dlrover/tf/checkpoint_interval"
CHECKPOINT_COST_KEY = b"dlrover/tf/checkpoint_cost"


def ps_serving_key(rank: int) -> bytes:
    """The KV key a PS task of `rank` sets once its server is up."""
    return PS_SERVING_KEY + b"/" + str(rank).encode()


def ps_standby_key(node_id: int, suffix: str) -> bytes:
    """The KV key of standby PS `node_id` (suffix: "promote", "ready")."""
    return PS_STANDBY_KEY + b"/" + str(node_id).encode() + b"/" + suffix.encode()
