"""List and free flash-checkpoint shared memory whose owner is gone.

Segments are files ``/dev/shm/dlrover-fc-<uid>-<name>-r<rank>-s<slot>``: ``<name>`` is the
checkpoint dir's name and a hash of its path when a process runs standalone, or the agent's key
under ``dlrover-run``. A group (one rank's slots) is *held* while its owner's lease (in
``/dev/shm/.dlrover-fc-leases-<uid>/``) is locked, *orphaned* once not; orphans are removed when
their grace period (counted from when a sweeper first saw them ownerless) has passed, at once
with ``gc --now``, or by ``gc`` when their step is on disk. An orphan whose newest step is not
on disk is first written to its checkpoint dir (*rescued*); one that cannot be is *kept* and
reported until ``gc --now``.

    dlrover checkpoint ls            (or python -m dlrover_torch.checkpoint.shm_clean ls)
    dlrover checkpoint gc [--now]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

from dlrover_torch.checkpoint import lease, shm, storage
from dlrover_torch.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

PREFIX = "dlrover-fc-"
_SLOT_RE = re.compile(r"^(dlrover-fc-.+)-r(\d{5})-s(\d+)$")
_LEASE_RE = re.compile(r"^(dlrover-fc-.+)-(r\d{5}|agent)" + re.escape(lease.LEASE_SUFFIX) + "$")


@dataclass
class Group:
    """The slots of one rank in one namespace, and what is known of their owner."""

    namespace: str
    rank: int
    paths: list[str] = field(default_factory=list)
    size: int = 0
    step: int | None = None
    checkpoint_dir: str | None = None
    persisted: bool | None = None  # the newest step is committed on disk
    newest: str | None = None  # the slot holding the newest step
    state: str = "orphaned"  # held | orphaned | kept | removed
    owner: dict[str, object] = field(default_factory=dict)
    orphaned_for: float = 0.0

    def describe(self) -> str:
        """One line for ``ls`` and logs."""
        where = self.checkpoint_dir or "?"
        step = "no committed step" if self.step is None else f"step {self.step}"
        disk = {True: "on disk", False: "NOT on disk", None: ""}[self.persisted]
        owner = f"pid {self.owner.get('pid')}" if self.owner.get("pid") else "no lease"
        extra = f" for {self.orphaned_for:.0f} s" if self.orphaned_for > 0 else ""
        return (
            f"{self.state}{extra}  {self.namespace} rank {self.rank}  {len(self.paths)} slot(s) "
            f"{shm.fmt_bytes(self.size)}  {step} {disk}  dir {where}  owner {owner}"
        )


def _slot_step(group: Group, path: str) -> None:
    """Fold a slot's committed step and checkpoint dir into ``group``."""
    try:
        found = shm.peek(path, timeout=0.2)
    except CheckpointError:
        return
    if found is None or found[1] is None:
        return
    header, meta = found
    if group.step is not None and header.step <= group.step:
        return
    group.step = header.step
    group.newest = path
    try:
        persist = json.loads(meta).get("persist") or {}
        group.checkpoint_dir = persist.get("dir")
    except (ValueError, AttributeError):
        group.checkpoint_dir = None


def scan(directory: str = shm.SHM_DIR) -> list[Group]:
    """This user's checkpoint segments in ``directory``, grouped by rank (without locking)."""
    groups: dict[tuple[str, int], Group] = {}
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        match = _SLOT_RE.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid():
            continue
        key = (match.group(1), int(match.group(2)))
        group = groups.setdefault(key, Group(*key))
        group.paths.append(path)
        group.size += st.st_size
        _slot_step(group, path)
    for group in groups.values():
        _check_persisted(group)
    return list(groups.values())


def _check_persisted(group: Group) -> None:
    if group.step is not None and group.checkpoint_dir:
        tracker = storage.read_tracker(group.checkpoint_dir)
        group.persisted = tracker is not None and tracker >= group.step


def _lease_paths(group: Group, directory: str) -> list[str]:
    return [
        lease.lease_path(group.namespace, None, directory),
        lease.lease_path(group.namespace, group.rank, directory),
    ]


def _claim(group: Group, directory: str, now: float) -> list[int] | None:
    """Lock the group's leases (None: its owner lives, the group is held); stamp when first
    seen ownerless and set how long it has been."""
    agent_path, rank_path = _lease_paths(group, directory)
    fds: list[int] = []
    for path, create in ((agent_path, False), (rank_path, True)):
        if not os.path.exists(path) and not create:
            continue
        fd = lease.open_locked(path, create)
        if fd is None:
            if os.path.exists(path):  # locked: its owner lives
                group.state = "held"
                group.owner = lease.read_info(path)
                for opened in fds:
                    os.close(opened)
                return None
            continue
        fds.append(fd)
        group.owner = lease.read_info(path) or group.owner
    info = lease.read_info(rank_path)
    stamp = info.get("orphaned_at")
    if not isinstance(stamp, int | float):
        stamp = now
        lease.write_info(fds[-1], {**info, "orphaned_at": now})
    group.orphaned_for = now - float(stamp)
    return fds


def rescue(group: Group) -> str | None:
    """Write an orphan's newest step to its checkpoint dir; why it could not be (None: done,
    or nothing needed writing)."""
    from dlrover_torch.checkpoint.persister import persist_slot

    if group.persisted is not False or group.newest is None or not group.checkpoint_dir:
        return None
    if not os.path.isdir(group.checkpoint_dir):
        return None  # the checkpoint dir was deleted: its owner gave the checkpoint up
    result = persist_slot(group.newest)
    if not result.ok:
        return result.error or "the persist failed"
    log.warning(
        "wrote step %s of ownerless flash-checkpoint memory (rank %d) to %s before freeing it%s",
        group.step,
        group.rank,
        group.checkpoint_dir,
        f" ({result.skipped})" if result.skipped else "",
    )
    if result.skipped and "not a writer" in result.skipped:
        group.persisted = None  # a writer rank holds this step's data
    return None


def _remove(group: Group, directory: str) -> None:
    for path in group.paths:
        shm.unlink_quietly(path)
    shm.unlink_quietly(_lease_paths(group, directory)[1])
    group.state = "removed"


def _drop_free_leases(directory: str) -> None:
    """Remove lease files of this user that no live owner holds and no segment needs."""
    try:
        names = os.listdir(directory)
        leases = os.listdir(lease.lease_dir(directory))
    except FileNotFoundError:
        return
    slots = {m.group(1) for m in map(_SLOT_RE.match, names) if m is not None}
    for name in leases:
        match = _LEASE_RE.match(name)
        if match is None or match.group(1) in slots:
            continue
        path = os.path.join(lease.lease_dir(directory), name)
        fd = lease.open_locked(path, create=False)
        if fd is not None:
            shm.unlink_quietly(path)
            os.close(fd)


def sweep(
    directory: str = shm.SHM_DIR,
    grace_s: float = 0.0,
    namespace: str | None = None,
    remove_persisted: bool = False,
    force: bool = False,
) -> list[Group]:
    """Remove orphaned segments (all of this user's, or one namespace's); report every group.

    A group is due once it has been ownerless for ``grace_s`` seconds (a restart within the
    grace re-attaches to it), or at once when ``remove_persisted`` and its step is on disk. A
    due group whose newest step is not on disk is rescued to its checkpoint dir first; if that
    fails it is kept (and reported) unless ``force``.
    """
    now = time.time()
    groups = [g for g in scan(directory) if namespace is None or g.namespace == namespace]
    claimed: list[tuple[Group, list[int]]] = []
    try:
        for group in groups:
            fds = _claim(group, directory, now)
            if fds is not None:
                claimed.append((group, fds))
        due = [
            g for g, _ in claimed if g.orphaned_for >= grace_s or (remove_persisted and g.persisted)
        ]
        failures = {id(g): rescue(g) for g in due}
        for group in due:  # the rescues of all ranks may together have committed a step
            if group.persisted is False:
                _check_persisted(group)
        for group in due:
            if group.persisted is False and not force:
                group.state = "kept"
                why = failures[id(group)] or "its other ranks' files are not on disk yet"
                log.warning(
                    "kept ownerless flash-checkpoint memory holding the only copy of its step "
                    "(%s); free it with `dlrover checkpoint gc --now`: "
                    "%s",
                    why,
                    group.describe(),
                )
                continue
            _remove(group, directory)
            lost = (
                "" if group.persisted is not False else " (its newest step was not on disk: lost)"
            )
            log.warning("removed orphaned flash-checkpoint memory: %s%s", group.describe(), lost)
    finally:
        for _, fds in claimed:
            for fd in fds:
                os.close(fd)
    _drop_free_leases(directory)
    return groups


def reap(directory: str, namespace: str, grace_s: float, poll_s: float = 1.0) -> None:
    """After an owner's death: sweep its namespace until none of it is left ownerless."""
    deadline = time.monotonic() + grace_s + 60.0
    while True:
        groups = sweep(directory, grace_s, namespace)
        if all(g.state != "orphaned" for g in groups) or time.monotonic() >= deadline:
            return
        time.sleep(min(poll_s, max(0.05, grace_s / 4)))


def main(argv: list[str] | None = None) -> int:
    """``ls`` lists the segments and their owners; ``gc`` frees those whose owner is gone."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("ls", "gc"))
    parser.add_argument("--shm-dir", default=shm.SHM_DIR)
    parser.add_argument(
        "--now",
        action="store_true",
        help="gc: free every orphan now (a step not on disk is written there first, if it can be)",
    )
    parser.add_argument("--grace", type=float, default=300.0, help="gc: seconds ownerless")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command == "ls":
        groups = scan(args.shm_dir)
        for group in groups:
            agent_path, rank_path = _lease_paths(group, args.shm_dir)
            for path in (agent_path, rank_path):
                fd = lease.open_locked(path, create=False) if os.path.exists(path) else None
                if fd is not None:
                    os.close(fd)
                elif os.path.exists(path):
                    group.state, group.owner = "held", lease.read_info(path)
            stamp = lease.read_info(rank_path).get("orphaned_at")
            if group.state == "orphaned" and isinstance(stamp, int | float):
                group.orphaned_for = time.time() - float(stamp)
            print(group.describe())
        total = sum(g.size for g in groups)
        print(f"{len(groups)} group(s), {shm.fmt_bytes(total)} in {args.shm_dir}")
        return 0
    groups = sweep(
        args.shm_dir, 0.0 if args.now else args.grace, remove_persisted=True, force=args.now
    )
    freed = [g for g in groups if g.state == "removed"]
    for group in groups:
        print(group.describe())
    print(
        f"freed {shm.fmt_bytes(sum(g.size for g in freed))} ({len(freed)} group(s)); "
        f"{len(groups) - len(freed)} group(s) kept (held by a live owner, within the grace, or "
        "holding a step that could not be written to disk; gc --now frees every orphan)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
