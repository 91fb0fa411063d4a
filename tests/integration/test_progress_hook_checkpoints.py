"""ShardProgressHook on a chief's real MonitoredTrainingSession, against a live master: each
checkpoint TF saves is reported with the dataset's position, and a session restoring one
takes the data back to exactly it (no elastic_model_fn, no CheckpointLedgerListener)."""

import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dlrover_tf  # noqa: E402
from dlrover_tf.checkpoint_watch import (  # noqa: E402
    CheckpointWatch,
    checkpoint_step,
    is_chief_task,
)
from dlrover_tf.dataset import ShardedDataset  # noqa: E402
from tests.integration.dlrover_run_helpers import wait_for  # noqa: E402

SIZE, BATCH = 640, 8


def records_done_reaches(job, expected: int, timeout: float = 5.0) -> None:
    """A session's last progress report is on its stream when it ends, applied a moment later:
    wait for it."""
    wait_for(lambda: job.sharding.stats()[0].records_done == expected, timeout, f"{expected} done")


def train(ds, model_dir, steps, estimators_saver=True):
    """A chief's training session: one batch per step, checkpoints every 5 steps; with the
    saver an estimator puts in the SAVERS collection, or (not) the one the Scaffold makes."""
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        if estimators_saver:
            saver = tf.compat.v1.train.Saver(sharded=True, defer_build=True)
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, saver)
        batch = tf.compat.v1.data.make_one_shot_iterator(
            ds.to_tf_dataset(python_reader=lambda idx: idx.astype(np.float32))
        ).get_next()
        with tf.control_dependencies([batch]):
            train_op = tf.compat.v1.assign_add(step, 1)
        with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=model_dir,
            save_checkpoint_steps=5,
            save_summaries_steps=None,
            log_step_count_steps=None,
            hooks=[dlrover_tf.ShardProgressHook(ds, model_dir=model_dir)],
        ) as session:
            for _ in range(steps):
                session.run(train_op)


@pytest.mark.parametrize("estimators_saver", [True, False])
def test_checkpoints_are_reported_and_a_restore_takes_the_data_back(
    harness, tmp_path, estimators_saver
):
    job = harness.job
    ds = ShardedDataset("ckpt", size=SIZE, batch_size=BATCH, client=harness.client(0))
    model_dir = str(tmp_path / "model")
    saved_before = []  # (step, whether its checkpoint existed when its position was saved)
    save_ledger = ds.client.save_ledger

    def recording_save_ledger(name, step):
        written = os.path.exists(os.path.join(model_dir, f"model.ckpt-{step}.index"))
        saved_before.append((step, not written))
        return save_ledger(name, step)

    ds.client.save_ledger = recording_save_ledger
    train(ds, model_dir, 12, estimators_saver)
    # Just before each checkpoint with the estimator's saver, just after it with another;
    # not at step 0 (the dataset's start position, saved when it was created).
    assert saved_before == [(5, estimators_saver), (10, estimators_saver), (12, estimators_saver)]
    # Every 5 steps, at the start and at the end (the saver's last save as the session closes).
    assert job.sharding.snapshot_steps("ckpt") == [0, 5, 10, 12]
    assert job.checkpoints.latest().global_step == 12
    assert job.checkpoints.latest().path.endswith("model.ckpt-12")
    # The job's step (the summary's) is the final checkpoint's: a step is reported before it runs.
    assert job.global_step == 12
    records_done_reaches(job, 12 * BATCH)
    # The chief's next session restores step 10 (say 12 was lost): the data goes back to it.
    tf.compat.v1.train.update_checkpoint_state(model_dir, os.path.join(model_dir, "model.ckpt-10"))
    train(ds, model_dir, 1, estimators_saver)
    rollbacks = [e.details for e in job.events if e.kind == "rollback"]
    assert [(d["checkpoint_step"], d["position_step"]) for d in rollbacks] == [(10, 10)]
    # The chief reports the step that triggers a save after the saver ran: a position saved
    # just before the checkpoint lacks that step, which is trained again (none is skipped).
    behind = 1 if estimators_saver else 0
    expected = (11 - behind) * BATCH
    try:
        records_done_reaches(job, expected)
    except AssertionError:
        # Step 11 trained a batch the new session prefetched before its restore report (seen
        # under load): that batch's shard went back with the rollback, so its records are
        # trained again later: one batch redone (the bound), none lost.
        stats = job.sharding.stats()[0]
        assert stats.records_done == expected - BATCH, stats
        assert stats.records_done + stats.records_todo + stats.records_doing == SIZE, stats
    assert job.rollback.chief_reports_restores  # a PS loss now waits for the chief's report
    # The checkpoint saved as that session ended (step 11, older than 12) is reported too.
    assert job.sharding.snapshot_steps("ckpt") == [0, 5, 10, 11, 12]


def test_the_watch_returns_each_new_checkpoint_once_and_restarts_at_a_restore(tmp_path):
    model_dir = str(tmp_path)

    def saved(step):
        path = os.path.join(model_dir, f"model.ckpt-{step}")
        tf.compat.v1.train.update_checkpoint_state(model_dir, path)
        return path

    watch = CheckpointWatch(model_dir)
    assert watch.poll() is None  # no state file yet
    path = saved(5)
    assert (watch.poll().global_step, watch.poll()) == (5, None)
    assert watch.poll() is None and path.endswith("model.ckpt-5")
    saved(10)
    assert watch.poll().global_step == 10
    watch.restored_at(5)  # a session loaded step 5: its saves at 6.. 10 are new ones
    saved(8)
    assert watch.poll().path == os.path.join(model_dir, "model.ckpt-8")
    saved(8)  # the same checkpoint written again (a rebuilt session re-saves what it loaded)
    assert watch.poll() is None


def test_the_chief_is_told_by_tf_config():
    chief = '{"cluster": {"chief": ["a"], "worker": ["b"]}, "task": {"type": "chief"}}'
    worker0 = '{"cluster": {"chief": ["a"], "worker": ["b"]}, "task": {"type": "worker"}}'
    lone = '{"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 0}}'
    assert is_chief_task(chief) and not is_chief_task(worker0) and is_chief_task(lone)
    assert is_chief_task("")  # one process, no cluster
    assert checkpoint_step("/m/model.ckpt-500") == 500 and checkpoint_step("/m/x") is None
