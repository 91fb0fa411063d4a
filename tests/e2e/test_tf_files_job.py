"""The TF example job reading its records from 8 TFRecord files (`wide_deep.py --files`,
ShardedDataset.from_files, shuffled): a worker SIGKILLed half way, and separately the PS
SIGKILLed; every record is trained `epochs` times, at most one batch more per worker failure
(plus what a PS loss rolls back), none missing. The ids are those the training program logs,
read from the files it trained on."""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.e2e.test_tf_job import BATCH, EPOCHS, RECORDS, ROOT, check_trained_ids, write_job

pytestmark = pytest.mark.slow

FILES = 8


def _files_job(tmp_path, records, *args):
    """The example's job.yaml reading from FILES TFRecord files in tmp_path/data (written by
    the job itself); `args` are more flags. Returns the ids folder."""
    flags = ["--eval-records", "1024", "--files", str(tmp_path / "data")]
    flags += ["--num-files", str(FILES), *args]
    return write_job(tmp_path, records=records, args=flags)


def _submit(tmp_path, *args):
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml"), *args]
    cmd += ["--summary-json", str(summary_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "succeeded"
    return summary


def _check_files(tmp_path):
    """The job wrote FILES files, each indexed next to it, and left no temporary file."""
    data = tmp_path / "data"
    paths = sorted(glob.glob(str(data / "train-*.tfrecord")))
    assert len(paths) == FILES, paths
    assert len(glob.glob(str(data / ".train-*.tfrecord.dlrover-index"))) == FILES
    assert not glob.glob(str(data / ".*.tmp"))  # no half-written file left


def test_a_worker_killed_half_way_through_files_loses_no_record(tmp_path):
    ids = _files_job(tmp_path, RECORDS)
    summary = _submit(tmp_path, "--kill", "worker:1@50%")
    assert summary["datasets"]["train"]["records_done"] == RECORDS * EPOCHS
    worker_1 = [n for n in summary["nodes"] if (n["type"], n["rank"]) == ("worker", 1)]
    assert worker_1[0]["exit_reason"] == "killed" and len(worker_1) == 2, worker_1
    _check_files(tmp_path)
    files = check_trained_ids(ids, RECORDS, extra_batches=1)
    assert len(files) >= 3, files


def test_a_ps_killed_rolls_the_file_records_back_with_the_model(tmp_path):
    records = 2 * RECORDS  # 750 steps: checkpoints every 200
    ids = _files_job(tmp_path, records, "--checkpoint-steps", "200")
    summary = _submit(tmp_path, "--kill", "ps:0@step=500")
    assert summary["datasets"]["train"]["records_done"] == records * EPOCHS
    rollback = [e for e in summary["events"] if e["kind"] == "rollback"]
    assert len(rollback) == 1, summary["events"]
    redo = rollback[0]["details"]["records_to_redo"]
    assert redo > 0, rollback
    _check_files(tmp_path)
    trained = np.concatenate(
        [np.fromfile(f, dtype=np.int64) for f in glob.glob(str(ids / "trained.*.ids"))]
    )
    counts = np.bincount(trained, minlength=records)
    assert len(counts) == records, "a trained id outside the dataset"
    assert counts.min() == EPOCHS, f"{int((counts < EPOCHS).sum())} records trained too few times"
    extra = int((counts - EPOCHS).sum())
    # Trained again: what the rollback redid, up to one in-flight batch per trainer.
    assert abs(extra - redo) <= 3 * BATCH, (extra, redo)
