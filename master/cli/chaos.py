"""`dlrover chaos JOB.yaml --kills N`: run a job while killing random nodes and its master, then
report what it survived, what data was missed or redone, and the time the kills cost."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TextIO

from master.config import JobSpec
from master.job.faults import MASTER

# Kills land between these shares of the records, spaced out, so each finds the job running.
FIRST_KILL_PERCENT = 10.0
LAST_KILL_PERCENT = 85.0
# How likely each kind of target is, among the ones the job has.
TARGET_WEIGHTS = {"worker": 5, "ps": 2, "chief": 1, "evaluator": 1, MASTER: 2}


@dataclass(frozen=True)
class ChaosPlan:
    """The kills to inject, as `--kill` values in the order they fire."""

    seed: int
    kills: tuple[str, ...]
    warnings: tuple[str, ...] = ()


@dataclass
class ChaosReport:
    """What a chaos run found."""

    job: str
    seed: int
    kills_planned: int
    kills_done: int
    kills_skipped: int
    status: str
    reason: str
    records_total: int
    records_done: int
    records_missing: int
    records_redone: int
    relaunches: int
    master_restarts: int
    wall_seconds: float
    baseline_wall_seconds: float | None = None
    seconds_lost: float | None = None
    kills: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    command: str = ""


def plan_kills(spec: JobSpec, kills: int, seed: int) -> ChaosPlan:
    """Random targets weighted by TARGET_WEIGHTS, at evenly spread shares of the records."""
    if kills < 1:
        raise ValueError(f"--kills must be at least 1, got {kills}")
    rng = random.Random(seed)
    targets = [(t, spec.group(t).replicas) for t in ("worker", "ps", "chief", "evaluator")]
    targets = [(t, n) for t, n in targets if n > 0] + [(MASTER, 1)]
    weights = [TARGET_WEIGHTS[t] for t, _ in targets]
    step = (LAST_KILL_PERCENT - FIRST_KILL_PERCENT) / max(1, kills - 1)
    out = []
    for i in range(kills):
        node_type, replicas = rng.choices(targets, weights)[0]
        rank = rng.randrange(replicas)
        out.append(f"{node_type}:{rank}@{FIRST_KILL_PERCENT + i * step:.1f}%")
    return ChaosPlan(seed, tuple(out), budget_warnings(spec, out))


def budget_warnings(spec: JobSpec, kills: list[str]) -> tuple[str, ...]:
    """Kills the job's relaunch budgets cannot absorb: the job is then expected to fail."""
    per_node = Counter(k.split("@")[0] for k in kills if not k.startswith(MASTER))
    out = []
    for node, n in sorted(per_node.items()):
        node_type = node.split(":")[0]
        budget = spec.group(node_type).max_relaunches
        if n > budget:
            out.append(
                f"{node.replace(':', '-')} is killed {n} times but {node_type}.max_relaunches is "
                f"{budget}: expect the job to fail"
            )
    total = sum(per_node.values())
    if total > spec.max_relaunches:
        out.append(
            f"{total} node kills but the job's max_relaunches is {spec.max_relaunches}: "
            "expect the job to fail"
        )
    return tuple(out)


def _submit(job_yaml: str, run_dir: str, extra: list[str], out: TextIO) -> tuple[dict, float]:
    """Run `dlrover submit` to the end; returns its summary and wall time."""
    summary_path = os.path.join(run_dir, "summary.json")
    cmd = [sys.executable, "-m", "master.cli", "submit", job_yaml, "--run-dir", run_dir]
    cmd += ["--summary-json", summary_path, "--status-interval", "5", *extra]
    out.write("$ " + " ".join(cmd[1:]) + "\n")
    out.flush()
    started = time.monotonic()
    subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    wall = time.monotonic() - started
    if not os.path.exists(summary_path):
        raise RuntimeError(f"the job left no summary ({summary_path}); see its output above")
    with open(summary_path, encoding="utf-8") as f:
        return json.load(f), wall


def run_chaos(
    job_yaml: str,
    spec: JobSpec,
    plan: ChaosPlan,
    out_dir: str,
    baseline: bool,
    out: TextIO,
) -> ChaosReport:
    """Optionally run the job once without faults, then with the plan's kills; report."""
    os.makedirs(out_dir, exist_ok=True)
    base_wall = None
    if baseline:
        _, base_wall = _submit(job_yaml, os.path.join(out_dir, "baseline"), [], out)
    extra = [arg for k in plan.kills for arg in ("--kill", k)]
    summary, wall = _submit(job_yaml, os.path.join(out_dir, "chaos"), extra, out)
    events = summary["events"]
    faults = [e for e in events if e["kind"] == "fault"]
    skipped = [e for e in faults if "skipped" in e["message"]]
    datasets = summary["datasets"].values()
    total = sum(d["size"] * d["epochs"] for d in datasets)
    done = sum(d["records_done"] for d in datasets)
    return ChaosReport(
        job=spec.name,
        seed=plan.seed,
        kills_planned=len(plan.kills),
        kills_done=len(faults) - len(skipped),
        kills_skipped=len(skipped),
        status=summary["status"],
        reason=summary["reason"],
        records_total=total,
        records_done=done,
        records_missing=total - done,
        records_redone=sum(d["records_redone"] for d in datasets),
        relaunches=sum(1 for n in summary["nodes"] if n["relaunches"]),
        master_restarts=sum(1 for e in events if e["kind"] == "master_restarted"),
        wall_seconds=round(wall, 1),
        baseline_wall_seconds=round(base_wall, 1) if base_wall is not None else None,
        seconds_lost=round(wall - base_wall, 1) if base_wall is not None else None,
        kills=[e["message"] for e in faults],
        warnings=list(plan.warnings),
    )


def format_report(report: ChaosReport) -> str:
    """The human-readable report printed at the end."""
    lines = [
        f"== chaos report: job {report.job}, seed {report.seed}",
        f"   kills: {report.kills_done} done, {report.kills_skipped} skipped "
        f"(target not running), of {report.kills_planned} planned",
        f"   job {report.status}" + (f": {report.reason}" if report.reason else ""),
        f"   records: {report.records_done:,}/{report.records_total:,} done, "
        f"{report.records_missing:,} missing, {report.records_redone:,} handed out again",
        f"   relaunched nodes: {report.relaunches}, master restarts: {report.master_restarts}",
        f"   wall time: {report.wall_seconds:.1f}s"
        + (
            f" (fault-free run {report.baseline_wall_seconds:.1f}s: "
            f"{report.seconds_lost:+.1f}s lost to the kills)"
            if report.baseline_wall_seconds is not None
            else ""
        ),
    ]
    lines += [f"     - {k}" for k in report.kills]
    lines += [f"   warning: {w}" for w in report.warnings]
    return "\n".join(lines)


def write_report(report: ChaosReport, path: str) -> None:
    """The report as JSON (for CI and comparisons)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(asdict(report), f, indent=2)
        f.write("\n")
