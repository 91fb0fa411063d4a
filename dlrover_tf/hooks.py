"""Step-granular progress reporting for tf.estimator (a SessionRunHook) and Keras (a callback)."""

from __future__ import annotations

import logging
import os

import numpy as np
import tensorflow as tf

from dlrover_tf.checkpoint_watch import CheckpointWatch, is_chief_task, restores_reported
from dlrover_tf.dataset import ShardedDataset
from master.client import MasterError

log = logging.getLogger(__name__)


class ShardProgressHook(tf.estimator.SessionRunHook):
    """Tells the master, after every completed step, which records that step trained on.

    On the chief it also keeps the data position with the model, with nothing else to set up:
    each checkpoint the chief saves in `model_dir` (default: $DLROVER_MODEL_DIR) is reported
    with the dataset's ledger (saved just before the checkpoint), and each session the chief
    creates reports the step its model was loaded at (from the session's readiness check,
    right after the restore), so after a PS failure the data goes back to the checkpoint TF
    restored.
    """

    def __init__(self, dataset: ShardedDataset, model_dir: str = "") -> None:
        self._dataset = dataset
        self._model_dir = model_dir
        self._global_step = None
        self._watch: CheckpointWatch | None = None
        self._reports_restores = False
        self._restores_in_ready_op = False
        self._loaded_step: int | None = None  # of the chief's current session
        self._ledger_saved_at: int | None = None  # the step of the last pre-save snapshot

    def begin(self) -> None:
        self._global_step = tf.compat.v1.train.get_global_step()
        self._watch = None
        self._reports_restores = self._restores_in_ready_op = False
        self._loaded_step = self._ledger_saved_at = None
        if not is_chief_task(os.environ.get("TF_CONFIG", "")) or self._global_step is None:
            return
        if not self._dataset.checkpoints_reported_elsewhere:
            model_dir = self._model_dir or os.environ.get("DLROVER_MODEL_DIR", "")
            if model_dir:
                self._watch = CheckpointWatch(model_dir)
            else:
                log.warning(
                    "ShardProgressHook on the chief without a model dir: checkpoints are not "
                    "reported, so a PS failure rolls the data back to the start. Pass "
                    "ShardProgressHook(ds, model_dir=...) or set DLROVER_MODEL_DIR"
                )
        self._reports_restores = not restores_reported(tf.compat.v1.get_default_graph())
        ready_ops = tf.compat.v1.GraphKeys.READY_OP
        if self._reports_restores and not tf.compat.v1.get_collection(ready_ops):
            # The session's readiness check runs right after the restore, before any hook
            # (the saver re-saves the model first) and before workers train on it: the
            # step is reported there. A ready op of the program's own: after the session.
            tf.compat.v1.add_to_collection(ready_ops, self._reporting_ready_op())
            self._restores_in_ready_op = True
        # Not when this hook learns the loaded step only after the saver re-saved the model
        # (its position then would count steps taken since the restore). elastic_model_fn
        # holds workers until that re-save is done.
        if self._watch is not None and (self._restores_in_ready_op or not self._reports_restores):
            self._save_ledger_before_checkpoints()

    def _save_ledger_before_checkpoints(self) -> None:
        """Save the ledger just before each checkpoint the estimator's saver writes, as
        CheckpointLedgerListener does: saved after it, the position would count the steps
        workers take during the save, which the checkpoint does not hold. The saver is the
        one the estimator puts in the SAVERS collection for its Scaffold (none when the
        model_fn brings its own: the ledger is then saved just after each checkpoint)."""
        savers = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SAVERS)
        if len(savers) != 1:
            return
        saver, save = savers[0], savers[0].save

        def save_with_ledger(sess, save_path, global_step=None, *args, **kwargs):
            if global_step is not None:
                self._save_ledger(_step_value(sess, global_step))
            return save(sess, save_path, global_step, *args, **kwargs)

        saver.save = save_with_ledger  # this graph's saver only, not TF's class

    def _save_ledger(self, step: int) -> None:
        # The saver re-saves the checkpoint a session loaded: its position is the one the
        # master went back to (or the start), kept as it is.
        if step == self._loaded_step:
            return
        try:
            self._dataset.client.save_ledger(self._dataset.name, step)
            self._ledger_saved_at = step
        except MasterError as e:
            log.warning("cannot save the data position of checkpoint %d: %s", step, e)

    def _reporting_ready_op(self) -> tf.Tensor:
        """TF's default readiness report, first telling the master the step the model was
        loaded at."""
        reported = tf.compat.v1.py_func(
            self._report_restored, [self._global_step], tf.bool, stateful=True
        )
        with tf.control_dependencies([reported]):
            return tf.compat.v1.report_uninitialized_variables(name="dlrover_reporting_ready_op")

    def _report_restored(self, step: object) -> bool:
        self._loaded_step = int(step)
        try:
            self._dataset.client.report_model_restored(int(step))
            log.info("model loaded at global step %d; the data position follows it", int(step))
        except MasterError as e:
            log.warning("cannot tell the master the model's step %d: %s", int(step), e)
        return True

    def after_create_session(self, session, coord) -> None:
        if not (self._reports_restores or self._watch):
            return
        step = int(session.run(self._global_step))
        if self._reports_restores and not self._restores_in_ready_op:
            self._report_restored(step)  # the model was initialised or restored at `step`
        if self._watch is not None:
            seen = self._watch.poll()  # the estimator saves the loaded model at once
            if step == 0:
                # The dataset's start position was saved when it was created: a snapshot
                # saved now could count steps workers already took on this session.
                try:
                    self._dataset.client.report_checkpoint(
                        0, seen.path if seen else "", [self._dataset.name]
                    )
                except MasterError as e:
                    log.warning("cannot report the checkpoint at step 0: %s", e)
            self._watch.restored_at(step)

    def before_run(self, run_context):
        if self._global_step is None:
            return None
        return tf.estimator.SessionRunArgs(self._global_step)

    def after_run(self, run_context, run_values) -> None:
        step = run_values.results if self._global_step is not None else 0
        self._dataset.step_done(int(step or 0))
        if self._watch is None:
            return
        self._report_new_checkpoint()  # the estimator's saver ran just before this hook

    def _report_new_checkpoint(self) -> None:
        saved = self._watch.poll() if self._watch else None
        if saved is not None:
            try:
                self._report_checkpoint(saved.global_step, saved.path)
            except MasterError as e:
                log.warning("cannot report checkpoint %s: %s", saved.path, e)

    def _report_checkpoint(self, step: int, path: str) -> None:
        ds = self._dataset
        if step != self._ledger_saved_at:  # not saved before the checkpoint: now, then
            ds.client.save_ledger(ds.name, step)
        ds.client.report_checkpoint(step, path, [ds.name])

    def end(self, session) -> None:
        self._dataset.flush()
        self._report_new_checkpoint()  # the saver saves once more as training ends


def _step_value(session: tf.compat.v1.Session, global_step: object) -> int:
    """A saver's `global_step` argument as a number (it may be a tensor or a variable)."""
    if isinstance(global_step, (int, np.integer)):
        return int(global_step)
    return int(tf.compat.v1.train.global_step(session, global_step))


class ShardProgressCallback(tf.keras.callbacks.Callback):
    """The Keras counterpart of ShardProgressHook: reports each completed batch."""

    def __init__(self, dataset: ShardedDataset) -> None:
        super().__init__()
        self._dataset = dataset
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None) -> None:
        # A local count: reading optimizer.iterations would cost a PS round trip per batch.
        self._steps += 1
        loss = (logs or {}).get("loss")
        self._dataset.step_done(self._steps, None if loss is None else float(loss))

    def on_train_end(self, logs=None) -> None:
        self._dataset.flush()


class CheckpointLedgerListener(tf.estimator.CheckpointSaverListener):
    """Saves each dataset's shard ledger with every model checkpoint (pass it on the chief).

    The ledger is saved just before the model, tagged with the same global step, and the
    checkpoint is registered with the master once written. When a PS fails, the master rolls
    the data back to the latest registered checkpoint, the one the chief restores. Optional:
    ShardProgressHook reports each checkpoint just after it is written when this is not used.
    """

    def __init__(self, *datasets: ShardedDataset, model_dir: str = "") -> None:
        if not datasets:
            raise ValueError("CheckpointLedgerListener needs at least one ShardedDataset")
        self._datasets = datasets
        self._model_dir = model_dir
        for ds in datasets:
            ds.checkpoints_reported_elsewhere = True

    def before_save(self, session, global_step_value) -> None:
        for ds in self._datasets:
            ds.client.save_ledger(ds.name, int(global_step_value))

    def after_save(self, session, global_step_value) -> None:
        path = tf.train.latest_checkpoint(self._model_dir) if self._model_dir else ""
        client = self._datasets[0].client
        client.report_checkpoint(
            int(global_step_value), path or "", [ds.name for ds in self._datasets]
        )
