"""The optimizer: pure rules from past runs of a job to the resources of its next run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from master.brain.history import JobRecord

# A PS that ran out of memory gets this much more than what it had when it failed.
OOM_MEMORY_GROWTH = 1.5
# Memory proposed above the largest resident set a PS was seen using.
RSS_HEADROOM = 1.25
# Another worker count is proposed only when its runs were this much faster.
THROUGHPUT_MARGIN = 1.1


@dataclass(frozen=True)
class Proposal:
    """Resources for the next run of a job, each with why; empty fields: keep the spec's."""

    job: str
    ps_memory_mb: int = 0
    ps_replicas: int = 0
    worker_replicas: int = 0
    reasons: tuple[str, ...] = field(default_factory=tuple)
    runs_considered: int = 0

    def to_dict(self) -> dict:
        """JSON form (the service's wire format)."""
        return {
            "job": self.job,
            "ps_memory_mb": self.ps_memory_mb,
            "ps_replicas": self.ps_replicas,
            "worker_replicas": self.worker_replicas,
            "reasons": list(self.reasons),
            "runs_considered": self.runs_considered,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Proposal:
        return cls(
            job=data["job"],
            ps_memory_mb=int(data.get("ps_memory_mb", 0)),
            ps_replicas=int(data.get("ps_replicas", 0)),
            worker_replicas=int(data.get("worker_replicas", 0)),
            reasons=tuple(data.get("reasons", ())),
            runs_considered=int(data.get("runs_considered", 0)),
        )


def propose(
    job: str, ps_memory_mb: int, ps_replicas: int, worker_replicas: int, runs: Sequence[JobRecord]
) -> Proposal:
    """Propose PS memory and PS/worker counts for the next run of `job` from its past `runs`.

    PS memory: enough for every past PS that ran out of memory (what it had then, times
    OOM_MEMORY_GROWTH, or what its relaunch finally ran with), and RSS_HEADROOM above the
    largest PS resident set seen. Counts: those of the past configuration with the best
    records/s among successful runs, when it beat the others by THROUGHPUT_MARGIN.
    """
    reasons: list[str] = []
    memory = 0
    for run in runs:
        if run.ooms.get("ps"):
            had = run.final_memory_mb.get("ps") or run.memory_mb.get("ps") or 0
            if not had:
                continue
            # A succeeded run's last PS memory was enough; a failed one's was not.
            need = had if run.status == "succeeded" else math.ceil(had * OOM_MEMORY_GROWTH)
            if run.status == "succeeded" and had == run.memory_mb.get("ps"):
                need = math.ceil(had * OOM_MEMORY_GROWTH)
            if need > memory:
                memory = need
                reasons.append(
                    f"ps ran out of memory {run.ooms['ps']}x in the run of {run.run_dir} "
                    f"(with {run.memory_mb.get('ps', 0)} MB, relaunched up to {had} MB): "
                    f"propose {need} MB"
                )
        rss = run.peak_rss_mb.get("ps", 0)
        if rss and math.ceil(rss * RSS_HEADROOM) > memory:
            memory = math.ceil(rss * RSS_HEADROOM)
            reasons.append(f"ps used up to {rss} MB in {run.run_dir}: propose {memory} MB")
    if memory <= ps_memory_mb:
        memory = 0
    counts = _best_counts(runs)
    ps_n = worker_n = 0
    if counts is not None:
        (best_ps, best_workers), best, runner_up = counts
        if (best_ps, best_workers) != (ps_replicas, worker_replicas) and (
            runner_up == 0 or best >= THROUGHPUT_MARGIN * runner_up
        ):
            ps_n, worker_n = best_ps, best_workers
            reasons.append(
                f"{best_ps} ps and {best_workers} workers trained fastest in past runs "
                f"({best:,.0f} records/s)"
            )
    return Proposal(job, memory, ps_n, worker_n, tuple(reasons), len(runs))


def _best_counts(runs: Sequence[JobRecord]) -> tuple[tuple[int, int], float, float] | None:
    """The (ps, workers) with the best mean records/s among succeeded runs, that rate, and the
    best rate of any other configuration (0 if none)."""
    rates: dict[tuple[int, int], list[float]] = {}
    for run in runs:
        if run.status == "succeeded" and run.records_per_second > 0:
            key = (run.replicas.get("ps", 0), run.replicas.get("worker", 0))
            rates.setdefault(key, []).append(run.records_per_second)
    if not rates:
        return None
    means = sorted(((sum(v) / len(v), k) for k, v in rates.items()), reverse=True)
    runner_up = means[1][0] if len(means) > 1 else 0.0
    return means[0][1], means[0][0], runner_up
