"""In-process session recovery for `tf.estimator` PS jobs, without patching TF.

After a PS fails, every worker's session ends and TF builds a new one; a non-chief worker's new
session is ready only once the chief has restored the variables, and TF checks that every
`recovery_wait_secs` (30 s, not exposed by the estimator), so a worker that checks too early
sleeps 30 s. Here the chief announces each session it creates (a generation counter in the
master's KV store) and a worker's first readiness check (`ready_for_local_init_op`) first waits
for a chief session newer than the one its previous session used: the check then passes, and
training resumes as soon as the chief has restored. A generation names the PS set it was made
with, so a worker started with a new PS set (after a PS count change) waits for a chief session
on that set, not one the old chief made. The chief also tells the master the step
its model was loaded at, from its own readiness check (before the estimator's checkpoint saver
re-saves the restored model), so the data goes back to exactly that step: after a PS failure,
and after a chief restart, which reloads the latest checkpoint too.

The chief's checkpoint saver becomes `dlrover_tf.elastic_saver.ElasticCheckpointSaverHook`:
a rebuilt session skips the graph writing and the re-save of the checkpoint it just restored.

Wrap the model function: `Estimator(elastic_model_fn(model_fn), ...)`.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable

import tensorflow as tf

from dlrover_tf.checkpoint_watch import mark_restores_reported
from dlrover_tf.elastic_saver import ElasticCheckpointSaverHook
from master.client import (
    CHECKPOINT_REQUESTS_KEY,
    CHIEF_SESSION_KEY,
    PAUSE_KEY,
    KVClient,
    MasterClient,
    MasterError,
    checkpoint_request_key,
    pause_key,
)
from master.client.env import ENV_TF_CONFIG_DIRECT

log = logging.getLogger(__name__)

GENERATION_KEY = CHIEF_SESSION_KEY
# Past this, a worker checks readiness the TF way (its session failed for another reason).
GATE_TIMEOUT_SECONDS = 30.0
# A blocking wait for the next checkpoint request is renewed this often.
REQUEST_POLL_SECONDS = 10.0
# A paused worker goes on by itself after this, whatever the master said.
MAX_PAUSE_SECONDS = 120.0


def _generation_key(n: int) -> bytes:
    return GENERATION_KEY + b"/" + str(n).encode()


class ChiefSessionGate:
    """The chief's session generations, announced by the chief and awaited by workers."""

    def __init__(
        self, master: MasterClient, timeout: float = GATE_TIMEOUT_SECONDS, ps_set: bytes = b""
    ) -> None:
        self.master = master
        self._kv = KVClient(master)
        self._timeout = timeout
        # The PS addresses the master gave, not this node's forwarders to them (on Ray).
        direct = os.environ.get(ENV_TF_CONFIG_DIRECT) or os.environ.get("TF_CONFIG", "")
        self._ps_set = ps_set or ps_set_of(direct)
        self._seen = -1  # the chief generation this worker's current session was made after

    def report_restored(self, global_step: object) -> bool:
        """Chief, while its session is made: the model was initialised or restored at
        global_step, so the master rolls the data back to it. This runs inside the session's
        readiness check, before any hook can save a checkpoint of the restored model."""
        step = int(global_step)
        self.master.report_model_restored(step)
        log.info("model loaded at global step %d; the data position follows it", step)
        return True

    def announce(self) -> int:
        """Chief: its session is ready; workers waiting for a newer one go on. Returns its id."""
        n = self._kv.add(GENERATION_KEY, 1)
        self._kv.set(_generation_key(n), self._ps_set)
        log.info("chief session %d is ready", n)
        return n

    def wait_for_newer(self) -> bool:
        """Worker: block until the chief has a session newer than the last one seen."""
        started = time.monotonic()
        try:
            if self._seen < 0:
                self._seen = self._first_seen()
            newer = self._kv.wait([_generation_key(self._seen + 1)], self._timeout)
            self._seen = self._kv.add(GENERATION_KEY, 0)
        except MasterError as e:
            log.warning("cannot learn the chief's state (%s); checking readiness the TF way", e)
            return True
        waited = time.monotonic() - started
        if newer:
            log.info("chief session %d is ready (waited %.1f s)", self._seen, waited)
        else:
            log.warning("no new chief session after %.0f s; checking readiness anyway", waited)
        return True

    def _first_seen(self) -> int:
        """A new worker process: the chief's latest session will do if it runs on this worker's
        PS set; otherwise (the PS set changed, the chief restarts too) wait for its next one."""
        latest = self._kv.add(GENERATION_KEY, 0)
        if latest == 0:
            return 0
        made_on = self._kv.get(_generation_key(latest), 0)
        return latest - 1 if made_on in (self._ps_set, b"ready") else latest


def ps_set_of(tf_config: str) -> bytes:
    """The PS addresses of a TF_CONFIG, as the key a chief session is announced with."""
    try:
        ps = json.loads(tf_config).get("cluster", {}).get("ps", [])
    except (ValueError, AttributeError):
        ps = []
    return ",".join(ps).encode()


def _in_force(kv: KVClient, key: Callable[..., bytes], n: int, answered: str) -> bool:
    """Whether request n (a pause or a checkpoint) is still open: asked, neither answered nor
    released by the master."""
    return (
        n > 0
        and kv.check([key(n)])
        and not kv.check([key(n, answered)])
        and not kv.check([key(n, "release")])
    )


class _CheckpointOnRequestHook(tf.estimator.SessionRunHook):
    """Chief: checkpoints at the next step boundary when the master asks (a PS migration).

    A thread waits on the master's KV store for the next request, so a step costs nothing
    more than reading a flag. The ledger snapshots go first, then the checkpoint, then its
    report: the master moves on once the report arrives."""

    def __init__(self, master: MasterClient, model_dir: str) -> None:
        self._master = master
        self._kv = KVClient(master)
        self._model_dir = model_dir
        self._requested = threading.Event()
        self._request_number = 0
        self._stop = threading.Event()

    def begin(self) -> None:
        self._global_step = tf.compat.v1.train.get_global_step()
        self._saver = tf.compat.v1.train.Saver(sharded=True)
        served = self._kv.add(CHECKPOINT_REQUESTS_KEY, 0)
        if _in_force(self._kv, checkpoint_request_key, served, "done"):
            # Asked before this chief started (it replaced one that died): answer it too.
            self._request_number = served
            self._requested.set()
        threading.Thread(
            target=self._watch, args=(served,), name="dlrover-ckpt-requests", daemon=True
        ).start()

    def _watch(self, served: int) -> None:
        while not self._stop.is_set():
            try:
                if self._kv.wait([checkpoint_request_key(served + 1)], REQUEST_POLL_SECONDS):
                    served += 1
                    self._request_number = served
                    self._requested.set()
            except MasterError as e:
                log.warning("watching for checkpoint requests: %s", e)
                self._stop.wait(1.0)

    def after_run(self, run_context: tf.estimator.SessionRunContext, run_values: object) -> None:
        if not self._requested.is_set():
            return
        self._requested.clear()
        session = run_context.session
        step = int(session.run(self._global_step))
        self._master.save_ledgers(step)
        # No meta graph: the restoring chief builds its own graph, and exporting this one is
        # most of the save's time (example model at load ~10: 0.05-0.18 s with it, 0.005 s without).
        path = self._saver.save(
            session,
            os.path.join(self._model_dir, "model.ckpt"),
            global_step=step,
            write_meta_graph=False,
        )
        self._master.report_checkpoint(step, path, ())
        # The answer the master waits for before it acts (e.g. retires a PS).
        n = self._request_number
        self._kv.set(checkpoint_request_key(n, "done"), str(step).encode())
        log.info("checkpoint on request at global step %d: %s", step, path)
        # Stay at this step boundary until the master is done (it replaces a PS meanwhile):
        # a step taken now would be lost with the restore.
        released = self._kv.wait([checkpoint_request_key(n, "release")], MAX_PAUSE_SECONDS)
        log.info("the master %s the chief", "released" if released else "did not release")

    def end(self, session: tf.compat.v1.Session) -> None:
        self._stop.set()


class _PauseHook(tf.estimator.SessionRunHook):
    """Worker: when the master asks (a PS migration), stop at the next step boundary, say so,
    and wait until the master releases the pause, so the chief's checkpoint holds every step."""

    def __init__(self, master: MasterClient, name: str) -> None:
        self._kv = KVClient(master)
        self._name = name
        self._asked = threading.Event()
        self._number = 0
        self._stop = threading.Event()

    def begin(self) -> None:
        served = self._kv.add(PAUSE_KEY, 0)
        if _in_force(self._kv, pause_key, served, f"ack/{self._name}"):
            # A pause began before this worker started: it pauses at its first step too.
            self._number = served
            self._asked.set()
        threading.Thread(
            target=self._watch, args=(served,), name="dlrover-pause", daemon=True
        ).start()

    def _watch(self, served: int) -> None:
        while not self._stop.is_set():
            try:
                if self._kv.wait([pause_key(served + 1)], REQUEST_POLL_SECONDS):
                    served += 1
                    self._number = served
                    self._asked.set()
            except MasterError as e:
                log.warning("watching for pause requests: %s", e)
                self._stop.wait(1.0)

    def before_run(self, run_context: tf.estimator.SessionRunContext) -> None:
        if not self._asked.is_set():
            return None
        self._asked.clear()
        n = self._number
        try:
            self._kv.set(pause_key(n, f"ack/{self._name}"), b"1")
            started = time.monotonic()
            released = self._kv.wait([pause_key(n, "release")], MAX_PAUSE_SECONDS)
            log.info(
                "paused %.1f s for the master (%s)",
                time.monotonic() - started,
                "released" if released else "timed out",
            )
        except MasterError as e:
            log.warning("pause: %s; going on", e)
        return None

    def end(self, session: tf.compat.v1.Session) -> None:
        self._stop.set()


class _AnnounceHook(tf.estimator.SessionRunHook):
    """Chief: workers go on once the session is made, after the checkpoint saver's first
    save (a save while workers train would hold later steps than its name says)."""

    def __init__(self, gate: ChiefSessionGate) -> None:
        self._gate = gate

    def after_create_session(self, session: tf.compat.v1.Session, coord: object) -> None:
        self._gate.announce()


def _reporting_ready_op(gate: ChiefSessionGate) -> tf.Tensor:
    """TF's default readiness report on the chief, first telling the master the step the
    model was loaded at (it runs after the restore, before the session's hooks)."""
    step = tf.compat.v1.train.get_or_create_global_step()
    reported = tf.compat.v1.py_func(gate.report_restored, [step], tf.bool, stateful=True)
    with tf.control_dependencies([reported]):
        return tf.compat.v1.report_uninitialized_variables(name="dlrover_reporting_ready_op")


def _gated_ready_for_local_init_op(gate: ChiefSessionGate) -> tf.Tensor:
    """TF's default first readiness check (are the global variables initialised?), run only
    after the gate lets the worker through. It is the first check of every session attempt."""
    opened = tf.compat.v1.py_func(gate.wait_for_newer, [], tf.bool, stateful=True)
    with tf.control_dependencies([opened]):
        return tf.compat.v1.report_uninitialized_variables(
            tf.compat.v1.global_variables(), name="dlrover_gated_ready_for_local_init"
        )


def _checkpoint_saver(
    master: MasterClient, spec: tf.estimator.EstimatorSpec, config: object, scaffold: object
) -> tuple[ElasticCheckpointSaverHook, ...]:
    """The chief's checkpoint saver in place of the estimator's own (which it then does not
    add), unless the model_fn brought one or the config saves no checkpoints."""
    steps = getattr(config, "save_checkpoints_steps", None)
    secs = getattr(config, "save_checkpoints_secs", None)
    given = (*spec.training_chief_hooks, *spec.training_hooks)
    if not (steps or secs) or any(
        isinstance(h, tf.compat.v1.train.CheckpointSaverHook) for h in given
    ):
        return ()
    return (
        ElasticCheckpointSaverHook(
            KVClient(master),
            config.model_dir,
            save_secs=secs,
            save_steps=steps,
            scaffold=scaffold,
            save_graph_def=getattr(config, "checkpoint_save_graph_def", True),
        ),
    )


def elastic_model_fn(model_fn: Callable, gate: ChiefSessionGate | None = None) -> Callable:
    """Wrap an estimator model_fn so sessions rebuilt after a PS failure resume at once."""
    accepted = set(inspect.signature(model_fn).parameters)

    def wrapped(features, labels, mode, params, config):  # noqa: ANN001 (estimator's contract)
        given = {"features": features, "labels": labels, "mode": mode}
        given |= {"params": params, "config": config}
        spec = model_fn(**{k: v for k, v in given.items() if k in accepted})
        if mode != tf.estimator.ModeKeys.TRAIN or config is None or not config.cluster_spec:
            return spec
        the_gate = gate or ChiefSessionGate(MasterClient.from_env())
        if config.is_chief:
            # The progress hook leaves restore reports to the ready op below.
            mark_restores_reported(tf.compat.v1.get_default_graph())
            scaffold = tf.compat.v1.train.Scaffold(
                ready_op=_reporting_ready_op(the_gate), copy_from_scaffold=spec.scaffold
            )
            hooks = (
                *spec.training_chief_hooks,
                *_checkpoint_saver(the_gate.master, spec, config, scaffold),
                _AnnounceHook(the_gate),
                _CheckpointOnRequestHook(the_gate.master, config.model_dir),
            )
            return spec._replace(scaffold=scaffold, training_chief_hooks=hooks)
        if config.task_type != "worker":
            return spec
        scaffold = tf.compat.v1.train.Scaffold(
            ready_for_local_init_op=_gated_ready_for_local_init_op(the_gate),
            copy_from_scaffold=spec.scaffold,
        )
        pause = _PauseHook(the_gate.master, f"{config.task_type}-{config.task_id}")
        return spec._replace(scaffold=scaffold, training_hooks=(*spec.training_hooks, pause))

    return wrapped


def without_graph_rewrites(config: tf.estimator.RunConfig) -> tf.estimator.RunConfig:
    """The run config with TF's graph optimizer (Grappler) off. Every session made after a PS
    failure or move optimizes the whole graph again before its first step, seconds for a
    wide model; measure the steps/s it buys before keeping it (benchmarks/ps_recovery.py)."""
    session_config = tf.compat.v1.ConfigProto()
    if config.session_config is not None:
        session_config.CopyFrom(config.session_config)
    session_config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config.replace(session_config=session_config)
