"""Noticing the checkpoints an estimator's chief writes, without hooking into its saver.

TF writes a checkpoint's data, then replaces the small `checkpoint` state file of the model
dir (atomically, by a rename). Watching that file's identity costs one `stat` per step."""

from __future__ import annotations

import json
import os
import re
import time
import weakref
from dataclasses import dataclass

_STEP_SUFFIX = re.compile(r"-(\d+)$")
# The graphs whose chief reports restores itself (elastic_model_fn's ready op).
_RESTORES_REPORTED: weakref.WeakSet = weakref.WeakSet()
# A model dir on a remote filesystem (gs://, hdfs://) is looked at this often, not every step.
REMOTE_POLL_SECONDS = 10.0


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint found in the model dir: its global step and path prefix."""

    global_step: int
    path: str


def mark_restores_reported(graph: object) -> None:
    """elastic_model_fn: this graph's chief session reports the step it restored itself."""
    _RESTORES_REPORTED.add(graph)


def restores_reported(graph: object) -> bool:
    """Whether `graph` reports restores itself (so the progress hook need not)."""
    return graph in _RESTORES_REPORTED


def is_chief_task(tf_config: str) -> bool:
    """Whether TF_CONFIG names the estimator's chief: the chief (or master) task, worker 0 of
    a cluster without one, or a process outside any cluster."""
    try:
        config = json.loads(tf_config) if tf_config else {}
    except ValueError:
        return False
    task = config.get("task") or {}
    cluster = config.get("cluster") or {}
    kind, index = task.get("type", ""), int(task.get("index", 0) or 0)
    if not cluster or not kind:
        return True
    if kind in ("chief", "master"):
        return True
    return kind == "worker" and index == 0 and not ({"chief", "master"} & set(cluster))


def checkpoint_step(path: str | None) -> int | None:
    """The global step a checkpoint path ends with (`model.ckpt-500` -> 500), if any."""
    match = _STEP_SUFFIX.search(path or "")
    return int(match.group(1)) if match else None


class CheckpointWatch:
    """The newest checkpoint of a model dir, each returned once, by rising step."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._state_file = os.path.join(model_dir, "checkpoint")
        self._seen_file: tuple[int, int, int] | None = None
        self._reported_step = -1
        self._local = "://" not in model_dir
        self._next_remote_poll = 0.0

    def restored_at(self, step: int) -> None:
        """The model was loaded at `step`: only checkpoints past it are new (a restore to an
        older checkpoint starts a new history, whose later saves reuse older steps)."""
        self._reported_step = step

    def poll(self) -> SavedCheckpoint | None:
        """The newest checkpoint if the state file changed and it is past every one returned."""
        if self._local:
            try:
                st = os.stat(self._state_file)
            except OSError:
                return None
            identity = (st.st_ino, st.st_mtime_ns, st.st_size)
            if identity == self._seen_file:
                return None
            self._seen_file = identity
        else:
            now = time.monotonic()
            if now < self._next_remote_poll:
                return None
            self._next_remote_poll = now + REMOTE_POLL_SECONDS
        import tensorflow as tf

        state = tf.train.get_checkpoint_state(self.model_dir)
        path = state.model_checkpoint_path if state else ""
        step = checkpoint_step(path)
        if step is None or step <= self._reported_step:
            return None
        self._reported_step = step
        if not os.path.isabs(path) and self._local:
            path = os.path.join(self.model_dir, path)
        return SavedCheckpoint(step, path)
