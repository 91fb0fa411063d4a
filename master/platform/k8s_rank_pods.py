"""Every pod of the job as the pod watch last saw it, by rank: which ones may still run.

The platform asks it before creating a rank's next pod: a pod of an earlier incarnation that is
neither gone, nor ended (a terminal phase), nor on a node confirmed lost may still run, and the
rank must not have two. Stale reads (a list answered before a newer watch event) are ignored by
resourceVersion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from master.platform.k8s_pod_end import TERMINAL_PHASES
from master.platform.k8s_resources import LABEL_RANK, LABEL_TYPE


def _version(pod: Mapping[str, Any]) -> int:
    try:
        return int((pod.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0  # not a number: never taken as stale


@dataclass(frozen=True)
class SeenPod:
    """What the rank check needs of one pod."""

    name: str
    uid: str
    node_type: str
    rank: str  # the rank label ("standby" for a standby)
    ended: bool  # a terminal phase: its containers run no more
    version: int
    lost: bool = False  # its node is confirmed lost

    @property
    def may_run(self) -> bool:
        return not (self.ended or self.lost)


class RankPods:
    """The job's pods by name, kept from the pod watch; waits for a rank's old pods to go."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._pods: dict[str, SeenPod] = {}
        self._gone_at: dict[str, int] = {}  # name -> resourceVersion of its deletion
        self.synced = False  # a first list was read

    def update(self, pod: Mapping[str, Any], deleted: bool = False) -> None:
        """A pod as listed, added, modified or deleted (its last state)."""
        meta = pod.get("metadata") or {}
        name = str(meta.get("name") or "")
        version = _version(pod)
        with self._changed:
            old = self._pods.get(name)
            if old is not None and version and old.version > version:
                return  # a stale read
            if not old and version and self._gone_at.get(name, 0) >= version:
                return  # a read from before its deletion
            if deleted:
                self._pods.pop(name, None)
                self._gone_at[name] = version
            else:
                labels = meta.get("labels") or {}
                phase = (pod.get("status") or {}).get("phase")
                uid = str(meta.get("uid") or "")
                self._pods[name] = SeenPod(
                    name=name,
                    uid=uid,
                    node_type=str(labels.get(LABEL_TYPE, "")),
                    rank=str(labels.get(LABEL_RANK, "")),
                    ended=phase in TERMINAL_PHASES,
                    version=version,
                    lost=bool(old and old.uid == uid and old.lost),
                )
            self._changed.notify_all()

    def replace_all(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A (re)list: exactly these pods exist now."""
        listed = list(pods)
        names = {str((p.get("metadata") or {}).get("name") or "") for p in listed}
        with self._changed:
            for name in set(self._pods) - names:
                del self._pods[name]
            self.synced = True
            self._changed.notify_all()
        for pod in listed:
            self.update(pod)

    def mark_lost(self, name: str) -> None:
        """The pod's node is confirmed lost: it no longer counts as running."""
        with self._changed:
            seen = self._pods.get(name)
            if seen is not None:
                self._pods[name] = replace(seen, lost=True)
                self._changed.notify_all()

    def may_run(self, node_type: str, rank: str, exclude: str = "") -> list[SeenPod]:
        """The pods of (type, rank label) that may still run, other than `exclude`."""
        with self._changed:
            return [
                p
                for p in self._pods.values()
                if p.node_type == node_type and p.rank == rank and p.name != exclude and p.may_run
            ]

    def wait_synced(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.synced, timeout)

    def wait_gone(self, names: Iterable[str], timeout: float) -> list[str]:
        """Wait until none of `names` may run; the names that still may after `timeout`."""
        wanted = set(names)
        deadline = time.monotonic() + timeout

        def running() -> list[str]:
            return sorted(n for n in wanted if n in self._pods and self._pods[n].may_run)

        with self._changed:
            while True:
                left = running()
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    return left
                self._changed.wait(remaining)
