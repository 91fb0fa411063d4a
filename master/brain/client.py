"""How a master reaches the Brain: an embedded SQLite history, or a shared `dlrover brain serve`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from master.brain.history import HistoryStore, JobRecord, SQLiteHistoryStore
from master.brain.optimizer import Proposal, propose

if TYPE_CHECKING:
    from master.config import JobSpec
    from master.job.master import JobMaster

log = logging.getLogger(__name__)

OFF = "off"
HTTP_TIMEOUT_SECONDS = 10.0
HISTORY_RUNS = 50


class BrainError(RuntimeError):
    """The Brain could not be reached or refused a request."""


class Brain:
    """Records finished runs and proposes resources, locally or through a Brain service."""

    def __init__(self, location: str) -> None:
        self.location = location
        self._url = location.rstrip("/") if location.startswith(("http://", "https://")) else ""
        self._store: HistoryStore | None = None if self._url else open_history(location)

    def record(self, record: JobRecord) -> None:
        """Keep a finished run in the history."""
        if self._store is not None:
            self._store.add(record)
        else:
            self._post("/v1/runs", record.to_dict())

    def propose(self, spec: JobSpec) -> Proposal:
        """Resources for the next run of `spec`'s job, from its past runs."""
        if self._store is not None:
            runs = self._store.runs(spec.name, HISTORY_RUNS)
            return propose(
                spec.name, spec.ps.memory_mb, spec.ps.replicas, spec.worker.replicas, runs
            )
        reply = self._post(
            "/v1/propose",
            {
                "job": spec.name,
                "ps_memory_mb": spec.ps.memory_mb,
                "ps_replicas": spec.ps.replicas,
                "worker_replicas": spec.worker.replicas,
            },
        )
        return Proposal.from_dict(reply)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self._url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_SECONDS) as reply:
                return json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise BrainError(f"the Brain at {self._url} refused {path}: {e.read()[:300]!r}") from e
        except (OSError, ValueError) as e:
            raise BrainError(
                f"cannot reach the Brain at {self._url} ({e}); start it with `dlrover brain "
                "serve`, or run with --brain off"
            ) from e


def open_history(location: str) -> HistoryStore:
    """A history store from a location: a SQLite file path, or a postgresql:// URL."""
    if location.startswith(("postgresql://", "postgres://")):
        from master.brain.postgres import PostgresHistoryStore

        return PostgresHistoryStore(location)
    if "://" in location:
        raise ValueError(
            f"unknown Brain location {location!r}: give a SQLite file path, a postgresql:// "
            "URL (for `dlrover brain serve`) or an http:// URL of a Brain service"
        )
    return SQLiteHistoryStore(location)


def default_location(spec: JobSpec) -> str:
    """The embedded history of a job's workdir: runs of the same job share it."""
    return os.path.join(spec.workdir, "runs", "brain.sqlite")


def record_of(job: JobMaster) -> JobRecord:
    """What a finished JobMaster used and achieved."""
    final: dict[str, int] = {}
    peak: dict[str, int] = {}
    ooms: dict[str, int] = {}
    for n in job.nodes.history():
        final[n.type] = max(final.get(n.type, 0), n.memory_mb)
        peak[n.type] = max(peak.get(n.type, 0), n.memory_rss_bytes // 2**20)
        if n.exit_reason.value == "oom":
            ooms[n.type] = ooms.get(n.type, 0) + 1
    stats = job.sharding.stats()
    done = sum(s.records_done for s in stats)
    wall = job.wall_seconds or job.elapsed()
    return JobRecord(
        job=job.spec.name,
        run_dir=job.runtime.run_dir,
        finished_at=time.time(),
        status=job.state.value,
        wall_seconds=round(wall, 3),
        replicas=dict(job.replicas),
        memory_mb={t: job.spec.group(t).memory_mb for t in job.replicas},
        final_memory_mb=final,
        peak_rss_mb={t: v for t, v in peak.items() if v},
        ooms=ooms,
        relaunches=sum(1 for n in job.nodes.history() if n.relaunches),
        records_done=done,
        records_per_second=round(done / wall, 3) if wall > 0 else 0.0,
    )


def consult(spec: JobSpec, location: str) -> tuple[JobSpec, Brain | None, list[str]]:
    """Ask the Brain about a job before it starts: the spec to run (PS memory raised when past
    runs ran out of it), the Brain to report the run to at its end, and lines to show.

    A Brain that is off or unreachable leaves the spec as it is: a master works without it.
    """
    if not location or location == OFF:
        return spec, None, []
    try:
        brain = Brain(location)
        proposal = brain.propose(spec)
    except (BrainError, ValueError, OSError) as e:
        log.warning("brain unavailable: %s", e)
        return spec, None, [f"brain: unavailable, running the spec as given ({e})"]
    notes = [f"brain: {reason}" for reason in proposal.reasons]
    if proposal.ps_memory_mb > spec.ps.memory_mb and spec.ps.replicas:
        notes.append(f"brain: ps memory {spec.ps.memory_mb} -> {proposal.ps_memory_mb} MB")
        spec = spec.with_overrides(ps=dataclasses.replace(spec.ps, memory_mb=proposal.ps_memory_mb))
    if proposal.worker_replicas or proposal.ps_replicas:
        notes.append(
            f"brain: suggests {proposal.ps_replicas} ps and {proposal.worker_replicas} workers "
            "(set them in the job YAML to use them)"
        )
    return spec, brain, notes


def report(brain: Brain | None, job: JobMaster) -> None:
    """Record a finished run in the Brain's history (failures are logged, never raised)."""
    if brain is None:
        return
    if not job.state.ended:  # a master that was replaced (fenced) leaves it to its successor
        brain.close()
        return
    try:
        brain.record(record_of(job))
    except (BrainError, ValueError, OSError) as e:
        log.warning("could not record the run in the brain: %s", e)
    finally:
        brain.close()
