"""`dlrover chaos JOB.yaml --kills N`: run a job while killing or freezing random nodes and its
master, or removing the Ray nodes holding them, then report which faults fired, what data was
missed or redone, and the time they cost."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, TextIO

from master.cli.supervisor import DEFAULT_MAX_MASTER_RESTARTS
from master.config import JobSpec
from master.job.faults import MASTER, FaultAction, parse_fault
from master.job.host_faults import FAULT_FAILED

# Faults land between these shares of the job (records, global steps or time), spaced out.
FIRST_KILL_PERCENT = 10.0
LAST_KILL_PERCENT = 85.0
# By steps or time the last lands earlier: while a killed master restarts, nodes train on
# unobserved (a torch job went 94 steps, a quarter of it), and faults due meanwhile bunch up.
LAST_KILL_PERCENT_MEASURED = 70.0
# How likely each kind of target is, among the ones the job has.
TARGET_WEIGHTS = {"worker": 5, "ps": 2, "chief": 1, "evaluator": 1, MASTER: 2}


class ChaosAction(Enum):
    """What a fault does to its target. A platform's own action (a Ray node removed) is added
    here, with its targets in `targets` and its `--kill` suffix in `suffix`."""

    KILL = "kill"  # SIGKILL: the platform sees the exit at once
    FREEZE = "freeze"  # SIGSTOP: alive and silent, found by the heartbeat timeout
    # The target's Ray node removed (its raylet SIGKILLed): every rank on it lost at once.
    REMOVE_NODE = "node"

    @property
    def targets(self) -> tuple[str, ...]:
        """The node types it may hit: a freeze only nodes that send heartbeats; a removal
        never the master's Ray node."""
        if self == ChaosAction.FREEZE:
            return ("worker", "chief")
        if self == ChaosAction.REMOVE_NODE:
            return ("worker", "ps", "chief", "evaluator")
        return ("worker", "ps", "chief", "evaluator", MASTER)

    @property
    def suffix(self) -> str:
        """What follows TYPE:RANK@WHEN in the `--kill` value."""
        return {ChaosAction.FREEZE: ":freeze", ChaosAction.REMOVE_NODE: ":node"}.get(self, "")

    @property
    def weight(self) -> float:
        """How likely the action is against another on the same target: a lost host is rarer
        than a crashed process, and each costs the cluster a Ray node."""
        return ACTION_WEIGHTS[self]


ACTION_WEIGHTS = {ChaosAction.KILL: 1.0, ChaosAction.FREEZE: 1.0, ChaosAction.REMOVE_NODE: 0.5}


class Trigger(Enum):
    """What the faults' times are shares of: RECORDS (of all records; needs a dataset), STEPS
    (of the global step a fault-free run reached) or TIME (of its wall time)."""

    RECORDS = "records"
    STEPS = "steps"
    TIME = "time"


@dataclass(frozen=True)
class JobScale:
    """What a fault-free run of the job measured: its size in each trigger's unit."""

    records: int
    global_step: int
    wall_seconds: float

    def trigger(self) -> Trigger:
        """The finest measure the job has: records, else global steps, else time."""
        if self.records > 0:
            return Trigger.RECORDS
        return Trigger.STEPS if self.global_step > 0 else Trigger.TIME


@dataclass(frozen=True)
class ChaosPlan:
    """The faults to inject, as `--kill` values in the order they fire."""

    seed: int
    kills: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    trigger: Trigger = Trigger.RECORDS
    notes: tuple[str, ...] = ()

    @property
    def removes_nodes(self) -> bool:
        """Whether a fault removes a Ray node (`:node`)."""
        return any(parse_fault(k).action == FaultAction.REMOVE_NODE for k in self.kills)


@dataclass
class ChaosReport:
    """What a chaos run found; a fault counts as fired only if the job's events say it did."""

    job: str
    seed: int
    trigger: str
    kills_planned: int
    kills_fired: int
    kills_skipped: int  # due, but the target was not running (or its Ray node not removable)
    kills_failed: int  # due and tried, but did not take (a Ray node that stayed)
    kills_not_fired: int  # never due before the job's end
    status: str
    reason: str
    records_total: int
    records_done: int
    records_missing: int
    records_redone: int
    relaunches: int
    master_restarts: int
    freezes_detected: int  # frozen nodes the master found (heartbeat lost) and ended
    freezes_thawed: int  # frozen nodes resumed at the end of their freeze: never found
    ray_nodes_removed: int  # Ray nodes removed (each fired :node fault)
    global_step: int
    wall_seconds: float
    baseline_wall_seconds: float | None = None
    seconds_lost: float | None = None
    kills: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    command: str = ""


def when(trigger: Trigger, percent: float, scale: JobScale | None) -> str:
    """The WHEN of a `--kill` value at `percent` of the job in `trigger`'s unit."""
    if trigger == Trigger.RECORDS:
        return f"{percent:.1f}%"
    if scale is None:
        raise ValueError(f"planning by {trigger.value} needs a fault-free run's measures")
    if trigger == Trigger.STEPS:
        return f"step={max(1, round(scale.global_step * percent / 100))}"
    return f"{scale.wall_seconds * percent / 100:.1f}s"


def _check_measurable(trigger: Trigger, scale: JobScale | None) -> None:
    """Refuse a trigger the fault-free run showed the job never reaches."""
    if scale is None:
        return
    if trigger == Trigger.RECORDS and scale.records == 0:
        raise ValueError("the fault-free run read no dataset of the master: use --by steps or time")
    if trigger == Trigger.STEPS and scale.global_step == 0:
        raise ValueError("the fault-free run reported no global step: use --by time")


def plan_kills(
    spec: JobSpec,
    kills: int,
    seed: int,
    actions: tuple[ChaosAction, ...] = (ChaosAction.KILL,),
    trigger: Trigger = Trigger.RECORDS,
    scale: JobScale | None = None,
    max_master_restarts: int = DEFAULT_MAX_MASTER_RESTARTS,
    spare_ray_nodes: int = 0,
) -> ChaosPlan:
    """Random (action, target) pairs weighted by TARGET_WEIGHTS and the actions' weights at
    evenly spread shares of the job, within the relaunch budgets where they allow: a target
    whose budget is spent is not drawn again while another one is left. At most
    `spare_ray_nodes` Ray node removals (the Ray nodes the job can lose and go on)."""
    if kills < 1:
        raise ValueError(f"--kills must be at least 1, got {kills}")
    if not actions:
        raise ValueError("chaos needs at least one action")
    if ChaosAction.REMOVE_NODE in actions and spare_ray_nodes < 1:
        raise ValueError(
            "no Ray node to spare for a removal (node): the job must be able to go on on the "
            "Ray nodes left; add Ray nodes to the cluster, or leave node out of --actions"
        )
    _check_measurable(trigger, scale)
    rng = random.Random(seed)
    replicas = {t: spec.group(t).replicas for t in ("worker", "ps", "chief", "evaluator")}
    replicas[MASTER] = 1
    budget = {t: spec.group(t).max_relaunches for t in replicas if t != MASTER}
    options = [
        (action, node_type, rank)
        for action in actions
        for node_type in action.targets
        for rank in range(replicas[node_type])
    ]
    if not options:
        raise ValueError(f"the job has no node {'/'.join(a.value for a in actions)} can hit")
    if kills > spare_ray_nodes and all(a == ChaosAction.REMOVE_NODE for a, _, _ in options):
        raise ValueError(
            f"{kills} Ray node removals, but the job can lose only {spare_ray_nodes} Ray nodes "
            "and go on: fewer --kills, or add kill or freeze to --actions"
        )
    spent: Counter[tuple[str, int]] = Counter()
    last = LAST_KILL_PERCENT if trigger == Trigger.RECORDS else LAST_KILL_PERCENT_MEASURED
    step = (last - FIRST_KILL_PERCENT) / max(1, kills - 1)
    out, capped, removals = [], 0, 0
    for i in range(kills):
        allowed = [
            o for o in options if o[0] != ChaosAction.REMOVE_NODE or removals < spare_ray_nodes
        ]
        left = [o for o in allowed if _within_budget(o, spent, budget, spec, max_master_restarts)]
        pool = left or allowed
        capped += len(pool) < len(allowed)
        weights = [a.weight * TARGET_WEIGHTS[t] / replicas[t] for a, t, _ in pool]
        action, node_type, rank = rng.choices(pool, weights)[0]
        spent[(node_type, rank)] += 1
        removals += action == ChaosAction.REMOVE_NODE
        at = when(trigger, FIRST_KILL_PERCENT + i * step, scale)
        out.append(f"{node_type}:{rank}@{at}{action.suffix}")
    notes = (
        (f"{capped} faults drawn among the targets whose relaunch budgets were not spent",)
        if capped
        else ()
    )
    if removals:
        notes += (
            f"{removals} Ray node removals (at most {spare_ray_nodes}, the Ray nodes the job can "
            "lose): each ends every rank on that Ray node, and each of them counts against "
            "its relaunch budget",
        )
    warnings = budget_warnings(spec, out, max_master_restarts)
    return ChaosPlan(seed, tuple(out), warnings, trigger, notes)


def given_plan(spec: JobSpec, kills: list[str], seed: int = 0) -> ChaosPlan:
    """The faults given with `dlrover chaos --kill` (checked, FaultSpecError), as a plan; by the
    first one's trigger."""
    faults = [parse_fault(k) for k in kills]
    first = faults[0]
    trigger = (
        Trigger.RECORDS
        if first.at_percent is not None
        else Trigger.TIME
        if first.at_seconds is not None
        else Trigger.STEPS
    )
    kills = [k.strip() for k in kills]
    return ChaosPlan(seed, tuple(kills), budget_warnings(spec, kills), trigger)


def _within_budget(
    option: tuple[ChaosAction, str, int],
    spent: Counter[tuple[str, int]],
    budget: dict[str, int],
    spec: JobSpec,
    max_master_restarts: int,
) -> bool:
    _, node_type, rank = option
    if node_type == MASTER:
        return spent[(MASTER, 0)] < max_master_restarts
    node_kills = sum(n for (t, _), n in spent.items() if t != MASTER)
    return spent[(node_type, rank)] < budget[node_type] and node_kills < spec.max_relaunches


def budget_warnings(
    spec: JobSpec, kills: list[str], max_master_restarts: int = DEFAULT_MAX_MASTER_RESTARTS
) -> tuple[str, ...]:
    """Faults the job's relaunch budgets cannot absorb: the job is then expected to fail."""
    targets = Counter(k.split("@")[0] for k in kills)
    per_node = {node: n for node, n in targets.items() if not node.startswith(MASTER)}
    out = []
    for node, n in sorted(per_node.items()):
        node_type = node.split(":")[0]
        budget = spec.group(node_type).max_relaunches
        if n > budget:
            out.append(
                f"{node.replace(':', '-')} is hit {n} times but {node_type}.max_relaunches is "
                f"{budget}: expect the job to fail"
            )
    total = sum(per_node.values())
    if total > spec.max_relaunches:
        out.append(
            f"{total} node faults but the job's max_relaunches is {spec.max_relaunches}: "
            "expect the job to fail"
        )
    masters = targets.get(f"{MASTER}:0", 0)
    if masters > max_master_restarts:
        out.append(
            f"the master is killed {masters} times but is restarted at most "
            f"{max_master_restarts} times: expect the job to fail"
        )
    return tuple(out)


@dataclass(frozen=True)
class FaultCount:
    """The faults of a run as its events tell them."""

    fired: list[str]
    skipped: list[str]
    not_fired: list[str]
    thawed: int
    detected_freezes: int
    failed: list[str] = field(default_factory=list)  # tried, did not take
    removed: int = 0  # Ray nodes removed


def count_faults(events: list[dict[str, Any]]) -> FaultCount:
    """Sort a run's `fault` events: fired (reason fault_injection), skipped (due, target not
    running, or its Ray node not removable), failed (tried: the Ray node stayed), not fired
    (never due); frozen nodes thawed unfound, and those found (a lost heartbeat of the
    incarnation a freeze hit); Ray nodes removed."""
    faults = [e for e in events if e["kind"] == "fault"]
    by_reason: dict[str, list[str]] = {}
    for e in faults:
        by_reason.setdefault(e.get("reason", ""), []).append(e["message"])
    frozen = {
        e["node_id"]
        for e in faults
        if e.get("reason") == "fault_injection" and e["details"].get("action") == "freeze"
    }
    lost = {e["node_id"] for e in events if e["kind"] == "heartbeat_lost"}
    return FaultCount(
        fired=by_reason.get("fault_injection", []),
        skipped=by_reason.get("skipped", []),
        not_fired=by_reason.get("not_fired", []),
        thawed=len(by_reason.get("fault_thawed", [])),
        detected_freezes=len(frozen & lost),
        failed=by_reason.get(FAULT_FAILED, []),
        removed=sum(
            1
            for e in faults
            if e.get("reason") == "fault_injection"
            and e["details"].get("action") == FaultAction.REMOVE_NODE.value
        ),
    )


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


def measure(
    job_yaml: str, out_dir: str, out: TextIO, submit_args: tuple[str, ...] = ()
) -> tuple[JobScale, float]:
    """Run the job once without faults: its records, global step and time; and its wall time
    as `dlrover submit` took it (the baseline). `submit_args` go to `dlrover submit`."""
    summary, wall = _submit(job_yaml, os.path.join(out_dir, "baseline"), [*submit_args], out)
    if summary["status"] != "succeeded":
        raise RuntimeError(
            f"the fault-free run did not succeed ({summary['status']}: {summary['reason']}); "
            "chaos needs a job that succeeds without faults"
        )
    records = sum(d["size"] * d["epochs"] for d in summary["datasets"].values())
    scale = JobScale(records, int(summary["global_step"]), float(summary["wall_seconds"]))
    return scale, wall


def run_chaos(
    job_yaml: str,
    spec: JobSpec,
    plan: ChaosPlan,
    out_dir: str,
    baseline_wall: float | None,
    out: TextIO,
    submit_args: tuple[str, ...] = (),
) -> ChaosReport:
    """Run the job with the plan's faults (`submit_args` go to `dlrover submit`, e.g. the
    platform); report against the fault-free run's time if any."""
    os.makedirs(out_dir, exist_ok=True)
    extra = [*submit_args, *(arg for k in plan.kills for arg in ("--kill", k))]
    summary, wall = _submit(job_yaml, os.path.join(out_dir, "chaos"), extra, out)
    events = summary["events"]
    count = count_faults(events)
    datasets = summary["datasets"].values()
    total = sum(d["size"] * d["epochs"] for d in datasets)
    done = sum(d["records_done"] for d in datasets)
    return ChaosReport(
        job=spec.name,
        seed=plan.seed,
        trigger=plan.trigger.value,
        kills_planned=len(plan.kills),
        kills_fired=len(count.fired),
        kills_skipped=len(count.skipped),
        kills_failed=len(count.failed),
        kills_not_fired=len(plan.kills) - len(count.fired) - len(count.skipped) - len(count.failed),
        status=summary["status"],
        reason=summary["reason"],
        records_total=total,
        records_done=done,
        records_missing=total - done,
        records_redone=sum(d["records_redone"] for d in datasets),
        relaunches=sum(1 for n in summary["nodes"] if n["relaunches"]),
        master_restarts=sum(1 for e in events if e["kind"] == "master_restarted"),
        freezes_detected=count.detected_freezes,
        freezes_thawed=count.thawed,
        ray_nodes_removed=count.removed,
        global_step=int(summary.get("global_step", 0)),
        wall_seconds=round(wall, 1),
        baseline_wall_seconds=round(baseline_wall, 1) if baseline_wall is not None else None,
        seconds_lost=round(wall - baseline_wall, 1) if baseline_wall is not None else None,
        kills=count.fired + count.skipped + count.failed + count.not_fired,
        warnings=list(plan.warnings),
    )


def format_report(report: ChaosReport) -> str:
    """The human-readable report printed at the end."""
    lines = [
        f"== chaos report: job {report.job}, seed {report.seed}, faults by {report.trigger}",
        f"   faults: {report.kills_fired} fired of {report.kills_planned} planned; "
        f"{report.kills_skipped} skipped (target not running, or its Ray node not removable), "
        + (f"{report.kills_failed} failed (did not take), " if report.kills_failed else "")
        + f"{report.kills_not_fired} never due before the job's end",
        f"   job {report.status}" + (f": {report.reason}" if report.reason else ""),
        f"   records: {report.records_done:,}/{report.records_total:,} done, "
        f"{report.records_missing:,} missing, {report.records_redone:,} handed out again"
        if report.records_total
        else f"   records: none (the job has no dataset); global step {report.global_step:,}",
        f"   relaunched nodes: {report.relaunches}, master restarts: {report.master_restarts}"
        + (f", Ray nodes removed: {report.ray_nodes_removed}" if report.ray_nodes_removed else ""),
    ]
    if report.freezes_detected or report.freezes_thawed:
        lines.append(
            f"   frozen nodes: {report.freezes_detected} found by the heartbeat timeout, "
            f"{report.freezes_thawed} never found (thawed at the end of the freeze)"
        )
    lines.append(
        f"   wall time: {report.wall_seconds:.1f}s"
        + (
            f" (fault-free run {report.baseline_wall_seconds:.1f}s: "
            f"{report.seconds_lost:+.1f}s lost to the faults)"
            if report.baseline_wall_seconds is not None
            else ""
        )
    )
    lines += [f"     - {k}" for k in report.kills]
    lines += [f"   warning: {w}" for w in report.warnings]
    return "\n".join(lines)


def write_report(report: ChaosReport, path: str) -> None:
    """The report as JSON (for CI and comparisons)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(asdict(report), f, indent=2)
        f.write("\n")
