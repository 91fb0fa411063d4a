"""A step whose worker died after it ran: its result cannot be fetched, but the step counts."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.distribute.coordinator import remote_value  # noqa: E402

from dlrover_tf.keras_ps import coordinator as coord  # noqa: E402
from dlrover_tf.keras_ps.feeder import Batch  # noqa: E402

# What fetch() raised in a loaded run when worker 1 was SIGKILLed after its step finished.
WORKER_GONE = (
    "2 root error(s) found.\n  (0) UNAVAILABLE: {{function_node __wrapped__Identity_device_/job:"
    "chief/replica:0/task:0/device:CPU:0}} Connection reset by peer\nAdditional GRPC error "
    "information from remote target /job:worker/replica:0/task:1/device:CPU:0 while calling "
    "/tensorflow.eager.EagerService/RunComponentFunction"
)
PS_GONE = WORKER_GONE.replace("/job:worker/replica:0/task:1", "/job:ps/replica:0/task:0")


class _Result:
    """Stands in for ClusterCoordinator's RemoteValueImpl: its status, error and fetch()."""

    def __init__(self, status, error=None, fetch_error=None, value=0.5):
        self._status, self._error = status, error
        self._fetch_error, self._value = fetch_error, value

    def fetch(self):
        if self._fetch_error is not None:
            raise self._fetch_error
        return self._value


class _Feeder:
    def __init__(self):
        self.done_batches = []

    def done(self, batch, global_step=0, loss=None):
        self.done_batches.append((batch.id, global_step, loss))


def _coordinator():
    c = object.__new__(coord.Coordinator)  # no cluster: only the result bookkeeping runs
    c.feeder, c.steps_run, c.restored_step, c._losses = _Feeder(), 0, 0, []
    return c


def _batch(i):
    return Batch(i, indices=None, segments=[])


READY = remote_value.RemoteValueStatus.READY


def test_a_finished_steps_result_lost_with_its_worker_counts_its_batch_without_a_loss():
    c = _coordinator()
    c._resolve(_Result(READY), _batch(1))
    lost = tf.errors.UnavailableError(None, None, WORKER_GONE)
    c._resolve(_Result(READY, fetch_error=lost), _batch(2))
    assert c.feeder.done_batches == [(1, 1, 0.5), (2, 2, None)]
    assert c.steps_run == 2


@pytest.mark.parametrize(
    "result",
    [
        # The PS is gone: the coordinator must be restarted (the caller waits for that).
        _Result(READY, fetch_error=tf.errors.UnavailableError(None, None, PS_GONE)),
        # The step itself failed (not a copy of its result): its error is the step's.
        _Result(
            READY,
            error=tf.errors.UnavailableError(None, None, WORKER_GONE),
            fetch_error=tf.errors.UnavailableError(None, None, WORKER_GONE),
        ),
        # Aborted by the coordinator: it never ran to its end.
        _Result(
            remote_value.RemoteValueStatus.ABORTED,
            fetch_error=tf.errors.CancelledError(None, None, "aborted"),
        ),
    ],
    ids=["ps-lost", "step-failed", "aborted"],
)
def test_any_other_fetch_error_is_raised_and_nothing_is_counted(result):
    c = _coordinator()
    with pytest.raises(tf.errors.OpError):
        c._resolve(result, _batch(1))
    assert c.feeder.done_batches == [] and c.steps_run == 0


def test_a_fit_steps_logs_count_as_lost_with_the_worker_only_when_every_value_finished():
    lost = tf.errors.UnavailableError(None, None, WORKER_GONE)
    finished = {"loss": _Result(READY), coord.BATCH_LOG_KEY: _Result(READY)}
    assert coord._result_lost_with_its_worker(finished, lost)
    aborted = {**finished, "loss": _Result(remote_value.RemoteValueStatus.ABORTED)}
    assert not coord._result_lost_with_its_worker(aborted, lost)
