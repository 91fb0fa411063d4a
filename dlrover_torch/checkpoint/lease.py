"""Ownership of flash-checkpoint shared memory: a lease file in a folder beside the segments.

The owner (a standalone training rank, or the node agent for its whole namespace) holds an
exclusive ``flock`` on its lease for its whole life. The kernel drops the lock when the owner
ends, SIGKILL included and across pid namespaces, so segments whose leases are all free have no
owner left. The file's JSON says who owned them (pid, checkpoint dir, job) and, once a sweeper
has seen them ownerless, since when (``orphaned_at``), so a grace period counts from the death.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from typing import Any

log = logging.getLogger(__name__)

LEASE_SUFFIX = ".lease"
AGENT_LEASE = "agent"  # the lease name part of a namespace owned by a node agent


def lease_dir(directory: str) -> str:
    """This user's lease folder beside the segments (hidden: ``ls`` shows memory, not leases)."""
    return os.path.join(directory, f".dlrover-fc-leases-{os.getuid()}")


def lease_path(namespace: str, rank: int | None, directory: str) -> str:
    """The lease of one rank's segments (``rank``) or of a whole agent namespace (None)."""
    part = AGENT_LEASE if rank is None else f"r{rank:05d}"
    return os.path.join(lease_dir(directory), f"{namespace}-{part}{LEASE_SUFFIX}")


def _ensure_dir(path: str) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.stat(folder).st_uid != os.getuid():
        raise PermissionError(f"{folder} belongs to another user; remove it")


def owner_info(kind: str, **extra: Any) -> dict[str, Any]:
    """What a lease records about its owner."""
    return {
        "kind": kind,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.time(),
        **extra,
    }


def try_lock(fd: int) -> bool:
    """Take an exclusive lock without waiting; False when a live process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def read_info(path: str) -> dict[str, Any]:
    """The JSON a lease file holds; empty when it is missing or unreadable."""
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read() or b"{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def write_info(fd: int, info: dict[str, Any]) -> None:
    """Replace the JSON of a lease file open (and locked) as ``fd``."""
    data = json.dumps(info, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def open_locked(path: str, create: bool) -> int | None:
    """Open and exclusively lock ``path``; None when it is held or (without create) missing.

    A sweeper may remove the file between our open and our lock; the lock then sits on a file
    nobody else can find, so that case retries on the new one.
    """
    if create:
        _ensure_dir(path)
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            return None
        if not try_lock(fd):
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    return None


class Lease:
    """A held lease: the segments it covers stay while this process lives."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: str, info: dict[str, Any]) -> Lease | None:
        """Take the lease at ``path`` and record ``info``; None when a live process holds it."""
        fd = open_locked(path, create=True)
        if fd is None:
            return None
        write_info(fd, info)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lease."""
        return self._fd is not None

    def release(self, remove: bool) -> None:
        """Give the lease up; ``remove`` deletes the file too (its segments are gone)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(fd)  # also drops the lock
