"""The chief's checkpoint saver for elastic PS jobs: the estimator's, made cheap after a recovery
and with an interval the master may set.

TF's `CheckpointSaverHook` writes the whole graph (twice, as text and as a meta graph) and saves
a checkpoint every time a session is created: after a PS failure that is seconds spent before
the chief steps again, to save the very checkpoint it just restored. This one does that for the
first session of the process only. It also tells the master what each save costs (KV key
`CHECKPOINT_COST_KEY`), and checkpoints every N steps once the master sets N
(`CHECKPOINT_INTERVAL_KEY`, see master.job.checkpoint_interval).
"""

from __future__ import annotations

import logging
import threading
import time

import tensorflow as tf

from dlrover_tf.checkpoint_watch import checkpoint_step
from master.client import CHECKPOINT_COST_KEY, CHECKPOINT_INTERVAL_KEY, KVClient, MasterError

log = logging.getLogger(__name__)

# How often the chief reads the interval the master asks for (not on the recovery path).
INTERVAL_POLL_SECONDS = 5.0


def interval_from(value: bytes | None) -> int | None:
    """The interval in steps the master set (None: none, or not a positive integer)."""
    try:
        steps = int(value or b"")
    except ValueError:
        return None
    return steps if steps > 0 else None


def effective_interval(master_steps: int | None, job_steps: object) -> int | None:
    """The interval to follow: the master's when it is shorter than the job's own step
    interval (or the job saves by time only); None: keep the job's."""
    if master_steps is None:
        return None
    if isinstance(job_steps, int) and job_steps > 0 and master_steps >= job_steps:
        return job_steps
    return master_steps


class ElasticCheckpointSaverHook(tf.compat.v1.train.CheckpointSaverHook):
    """`CheckpointSaverHook` that skips the graph writing and the re-save of a restored
    checkpoint on every session after the first, reports each save's cost, and follows the
    checkpoint interval the master sets."""

    def __init__(self, kv: KVClient | None, checkpoint_dir: str, **kwargs: object) -> None:
        super().__init__(checkpoint_dir, **kwargs)
        self._kv = kv
        self._sessions = 0
        self._interval: int | None = None  # the master's
        self._job_steps = kwargs.get("save_steps")  # the job's own, never lengthened
        self._stop = threading.Event()

    def begin(self) -> None:
        super().begin()
        if self._kv is not None:
            threading.Thread(
                target=self._watch_interval, name="dlrover-ckpt-interval", daemon=True
            ).start()

    def after_create_session(self, session: tf.compat.v1.Session, coord: object) -> None:
        self._sessions += 1
        if self._sessions == 1:
            super().after_create_session(session, coord)
            return
        step = int(session.run(self._global_step_tensor))
        if checkpoint_step(tf.train.latest_checkpoint(self._checkpoint_dir)) != step:
            self._save(session, step)
        self._timer.update_last_triggered_step(step)

    def after_run(self, run_context: tf.compat.v1.train.SessionRunContext, run_values) -> None:
        wanted = effective_interval(self._interval, self._job_steps)
        if wanted is not None and self._timer._every_steps != wanted:  # noqa: SLF001
            last = self._timer.last_triggered_step()
            self._timer = tf.compat.v1.train.SecondOrStepTimer(every_steps=wanted)
            if last is not None:
                self._timer.update_last_triggered_step(last)
            log.info("checkpointing every %d steps (set by the master)", wanted)
        super().after_run(run_context, run_values)

    def _save(self, session: tf.compat.v1.Session, step: int) -> bool:
        started = time.monotonic()
        should_stop = super()._save(session, step)
        cost = time.monotonic() - started
        if self._kv is not None:
            try:
                self._kv.set(CHECKPOINT_COST_KEY, f"{cost:.3f}".encode())
            except MasterError as e:
                log.warning("cannot report the checkpoint's cost: %s", e)
        return should_stop

    def end(self, session: tf.compat.v1.Session) -> None:
        self._stop.set()
        super().end(session)

    def _watch_interval(self) -> None:
        while not self._stop.wait(INTERVAL_POLL_SECONDS):
            try:
                self._interval = interval_from(self._kv.get(CHECKPOINT_INTERVAL_KEY, 0))
            except MasterError as e:
                log.warning("reading the checkpoint interval: %s", e)
