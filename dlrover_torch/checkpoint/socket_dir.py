"""A checkpoint service's socket folder in the temp dir, and the sweep of folders whose owner died.

The process that serves a folder's socket holds an exclusive lock on a file in it for its whole
life; the kernel drops the lock when that process ends, SIGKILL included. A folder whose lock
can be taken has no owner left, so making a new folder first removes such leftovers."""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import shutil
import tempfile
from typing import IO

log = logging.getLogger(__name__)

PREFIX = "dlrover-ckpt-"
SOCKET_NAME = "service.sock"
LOCK_NAME = "owner.lock"


def make_socket_dir(kind: str = "") -> str:
    """A new folder for a service's socket (after sweeping orphans); returns the socket's path."""
    sweep_orphans()
    return os.path.join(tempfile.mkdtemp(prefix=PREFIX + kind), SOCKET_NAME)


def hold_owner_lock(socket_path: str) -> IO[bytes]:
    """Mark the socket's folder as owned by this process while the returned file stays open."""
    folder = os.path.dirname(socket_path)
    # Locked under another name, then renamed: a sweeper never sees the lock file unlocked.
    fd, path = tempfile.mkstemp(prefix=".owner-", dir=folder)
    lock = os.fdopen(fd, "ab")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(path, os.path.join(folder, LOCK_NAME))
    return lock


def sweep_orphans(root: str | None = None) -> int:
    """Remove this user's socket folders under `root` whose owner is gone; how many went."""
    removed = 0
    pattern = os.path.join(root or tempfile.gettempdir(), PREFIX + "*", LOCK_NAME)
    for lock_path in glob.glob(pattern):
        folder = os.path.dirname(lock_path)
        try:
            if os.stat(lock_path).st_uid != os.getuid():
                continue
            with open(lock_path, "ab") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: the owner is alive
                shutil.rmtree(folder, ignore_errors=True)
            removed += 1
        except OSError:  # locked by its live owner, or removed meanwhile by another sweeper
            continue
    if removed:
        log.info("removed %d checkpoint service folder(s) whose owner died", removed)
    return removed
