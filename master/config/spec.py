"""The job spec: frozen dataclasses of a training job, its node groups and autoscale settings.

Every spec is validated (and normalised) when it is built, whatever built it: the YAML reader,
code, or `JobSpec.with_overrides`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from master.config.errors import kind_of, spec_error
from master.config.field_checks import (
    as_command,
    as_env,
    as_int,
    as_number,
    as_seconds,
    check_name,
    check_workdir,
)

NODE_TYPES = ("ps", "chief", "worker", "evaluator")
STRAGGLER_ACTIONS = ("report", "replace", "off")
# When a job has succeeded (as in Kubeflow's TFJob): its chief (worker 0 without a chief) exited
# 0, or every chief and worker did.
SUCCESS_POLICIES = ("chief", "all_workers")
# What a job that looks stuck (no step report, processes near idle) does: say so, or fail.
STUCK_ACTIONS = ("report", "fail")


@dataclass(frozen=True)
class NodeGroupSpec:
    """How many nodes of one type to run, and how to run them."""

    replicas: int = 0
    max_relaunches: int = 3  # per rank
    # Overrides JobSpec.command for this group (ps defaults to the built-in PS server).
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # merged over JobSpec.env
    cpu: float = 0.0  # requested cores, 0 = unset (platforms may use it)
    memory_mb: int = 0  # 0 = unset
    # Most ranks run-time scaling may reach; 0 = max(2 * replicas, replicas + 2).
    max_replicas: int = 0
    # List every slot up to the slots in TF_CONFIG from the start, so TF processes can reach
    # workers added later (a TF2 coordinator waits for every listed worker). Also implied by
    # an explicit max_replicas. Off: TF_CONFIG lists exactly the nodes that run.
    reserve_slots: bool = False

    @property
    def slots(self) -> int:
        """How many ranks this group may ever have (max_replicas, or its default)."""
        return self.max_replicas or max(2 * self.replicas, self.replicas + 2)

    @property
    def reserves_slots(self) -> bool:
        """Whether TF_CONFIG lists all `slots` ranks rather than the ones that run."""
        return self.reserve_slots or self.max_replicas > 0


@dataclass(frozen=True)
class AutoscaleSpec:
    """The job YAML's `autoscale:` section: when the master may add or remove workers and
    migrate a hot PS on its own (master.job.autoscaler decides; off unless enabled)."""

    enabled: bool = False
    min_workers: int = 1
    max_workers: int = 0  # 0 = worker.max_replicas (the worker slots of the cluster spec)
    interval_seconds: float = 10.0  # how often throughput and node loads are sampled
    window: int = 3  # samples a measurement takes (their median); also how long a PS must be hot
    settle_seconds: float = 30.0  # after a change, how long before measuring again
    # An added worker must bring at least this fraction of the per-worker rate before it.
    marginal_gain: float = 0.7
    ps_cpu_percent: float = 90.0  # a PS above this share of its cores is CPU-bound
    ps_memory_percent: float = 85.0  # a PS above this share of its memory limit is memory-bound
    ps_growth: float = 1.5  # a migrated PS gets this factor more of the bound resource
    ps_max_cpu: float = 0.0  # most cores a migrated PS may get; 0 = never migrate for CPU
    ps_max_memory_mb: int = 0  # most memory a migrated PS may get; 0 = never for memory
    max_total_cpu: float = 0.0  # budget of cores requested by all nodes; 0 = none
    max_total_memory_mb: int = 0  # budget of memory requested by all nodes; 0 = none


@dataclass(frozen=True)
class JobSpec:
    """A whole training job: what to run, how many nodes of each type, and failure budgets."""

    name: str
    command: tuple[str, ...]  # run by chief/worker/evaluator
    workdir: str  # absolute; relative paths in YAML are resolved against the file's directory
    env: Mapping[str, str]
    ps: NodeGroupSpec
    chief: NodeGroupSpec
    worker: NodeGroupSpec
    evaluator: NodeGroupSpec
    max_relaunches: int = 10  # job-wide budget
    heartbeat_timeout_seconds: float = 15.0
    # After training ends, how long evaluators may keep running before being stopped.
    evaluator_grace_seconds: float = 60.0
    # A chief or worker that holds shards but reports no step for this long is hung: it is
    # restarted and its shards re-queued. 0 turns hang detection off.
    hang_timeout_seconds: float = 300.0
    # Workers whose steps take over twice their peers' median: "report" them (an event),
    # "replace" them (killed and relaunched), or "off". Judged after straggler_min_steps steps.
    stragglers: str = "report"
    straggler_min_steps: int = 20
    # When the job has succeeded: "chief" (the chief, or worker 0 without a chief, exited 0;
    # the nodes still running are then stopped) or "all_workers" (every chief and worker did).
    success_policy: str = "chief"
    # A job whose nodes report no step and stay near idle for this long is "possibly stuck";
    # stuck_action "report" says so (status, events, display), "fail" fails the job. 0: off.
    stuck_timeout_seconds: float = 180.0
    stuck_action: str = "report"
    # Port of the master's HTTP endpoint (Prometheus /metrics and the dashboard); 0 = any free.
    metrics_port: int = 0
    # Automatic worker scaling and PS migration (master.job.autoscaler); off by default.
    autoscale: AutoscaleSpec = field(default_factory=AutoscaleSpec)
    source: str = "<spec>"  # file it came from, for messages

    def __post_init__(self) -> None:
        # Validates and normalises (list -> tuple, numbers -> str in env), so programmatic specs
        # and `with_overrides` get the same checks as YAML.
        _validate_job(self)

    def group(self, node_type: str) -> NodeGroupSpec:
        """The group spec of one node type ('ps', 'chief', 'worker' or 'evaluator')."""
        if node_type not in NODE_TYPES:
            raise ValueError(
                f"unknown node type {node_type!r}; expected one of {', '.join(NODE_TYPES)}"
            )
        return getattr(self, node_type)

    @property
    def max_nodes(self) -> int:
        """The most nodes the job may ever run at once (every group at its slots)."""
        return sum(self.group(t).slots for t in NODE_TYPES)

    @property
    def worker_limit(self) -> int:
        """The most workers run-time scaling may reach: the worker slots, except in a job with
        PS that reserves none, whose TF processes know only the workers listed at launch."""
        if self.ps.replicas and not self.worker.reserves_slots:
            return self.worker.replicas
        return self.worker.slots

    def with_overrides(self, **changes: Any) -> JobSpec:
        """A copy with some fields replaced (e.g. from CLI flags), validated again."""
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# Validation (shared by YAML loading, direct construction and with_overrides)


def _validate_job(spec: JobSpec) -> None:
    src = spec.source

    def setf(name: str, value: Any) -> None:
        object.__setattr__(spec, name, value)

    if not isinstance(spec.source, str):
        raise TypeError(f"JobSpec.source must be a str, got {kind_of(spec.source)}")
    setf("name", check_name(spec.name, src))
    command = as_command(spec.command, src, "command")
    if not command:
        raise spec_error(
            src, "command", "is empty", "Give the program to run, e.g. [python, train.py]"
        )
    setf("command", command)
    setf("workdir", check_workdir(spec.workdir, src))
    setf("env", as_env(spec.env, src, "env"))
    for node_type in NODE_TYPES:
        setf(node_type, _validate_group(getattr(spec, node_type), src, node_type))
    setf("max_relaunches", as_int(spec.max_relaunches, src, "max_relaunches", minimum=0))
    setf(
        "heartbeat_timeout_seconds",
        as_seconds(spec.heartbeat_timeout_seconds, src, "heartbeat_timeout_seconds", zero_ok=False),
    )
    setf(
        "evaluator_grace_seconds",
        as_seconds(spec.evaluator_grace_seconds, src, "evaluator_grace_seconds", zero_ok=True),
    )
    setf(
        "hang_timeout_seconds",
        as_seconds(spec.hang_timeout_seconds, src, "hang_timeout_seconds", zero_ok=True),
    )
    if spec.stragglers not in STRAGGLER_ACTIONS:
        raise spec_error(
            src,
            "stragglers",
            f"{spec.stragglers!r} is not a straggler action",
            f"Use one of: {', '.join(STRAGGLER_ACTIONS)}",
        )
    setf(
        "straggler_min_steps",
        as_int(spec.straggler_min_steps, src, "straggler_min_steps", minimum=1),
    )
    for name, allowed in (("success_policy", SUCCESS_POLICIES), ("stuck_action", STUCK_ACTIONS)):
        if getattr(spec, name) not in allowed:
            raise spec_error(
                src,
                name,
                f"{getattr(spec, name)!r} is not one of {', '.join(allowed)}",
                f"Use one of: {', '.join(allowed)}",
            )
    setf(
        "stuck_timeout_seconds",
        as_seconds(spec.stuck_timeout_seconds, src, "stuck_timeout_seconds", zero_ok=True),
    )
    setf("metrics_port", as_int(spec.metrics_port, src, "metrics_port", minimum=0))
    if spec.metrics_port > 65535:
        raise spec_error(
            src, "metrics_port", f"{spec.metrics_port} is out of range", "Use 0..65535 (0: any)"
        )

    setf("autoscale", _validate_autoscale(spec.autoscale, spec, src))

    if spec.chief.replicas > 1:
        raise spec_error(
            src,
            "chief.replicas",
            f"{spec.chief.replicas} chiefs requested but a job has at most one chief",
            "Set chief.replicas to 1 and put the other replicas in worker.replicas",
        )
    if spec.chief.replicas == 0 and spec.worker.replicas == 0:
        raise spec_error(
            src,
            "chief.replicas, worker.replicas",
            "no chief and no worker, so nothing would train",
            "Set 'chief: {replicas: 1}' and/or 'worker: {replicas: N}' with N >= 1",
        )


def _validate_group(group: object, src: str, node_type: str) -> NodeGroupSpec:
    if not isinstance(group, NodeGroupSpec):
        raise spec_error(
            src,
            node_type,
            f"expected a NodeGroupSpec, got {kind_of(group)}",
            f"Pass {node_type}=NodeGroupSpec(replicas=...)",
        )
    p = f"{node_type}."
    if group.reserve_slots and node_type != "worker":
        raise spec_error(
            src,
            p + "reserve_slots",
            f"a {node_type} has no slots to reserve: only workers are added at run time",
            "Remove it, or set it under 'worker:'",
        )
    return NodeGroupSpec(
        replicas=as_int(group.replicas, src, p + "replicas", minimum=0),
        max_relaunches=as_int(group.max_relaunches, src, p + "max_relaunches", minimum=0),
        command=as_command(group.command, src, p + "command"),
        env=as_env(group.env, src, p + "env"),
        cpu=as_number(group.cpu, src, p + "cpu", "a number of cores, e.g. 2 or 0.5"),
        memory_mb=as_int(group.memory_mb, src, p + "memory_mb", minimum=0),
        max_replicas=_check_max_replicas(group, src, p + "max_replicas"),
        reserve_slots=_check_bool(group.reserve_slots, src, p + "reserve_slots"),
    )


def _validate_autoscale(auto: object, spec: JobSpec, src: str) -> AutoscaleSpec:
    if not isinstance(auto, AutoscaleSpec):
        raise spec_error(
            src,
            "autoscale",
            f"expected an AutoscaleSpec, got {kind_of(auto)}",
            "Pass autoscale=AutoscaleSpec(enabled=True, ...)",
        )
    p = "autoscale."
    if not isinstance(auto.enabled, bool):
        raise spec_error(
            src, p + "enabled", f"expected true or false, got {kind_of(auto.enabled)}", "Use true"
        )
    slots = spec.worker.slots
    a = AutoscaleSpec(
        enabled=auto.enabled,
        min_workers=as_int(auto.min_workers, src, p + "min_workers", minimum=0),
        max_workers=as_int(auto.max_workers, src, p + "max_workers", minimum=0),
        interval_seconds=as_seconds(
            auto.interval_seconds, src, p + "interval_seconds", zero_ok=False
        ),
        window=as_int(auto.window, src, p + "window", minimum=1),
        settle_seconds=as_seconds(auto.settle_seconds, src, p + "settle_seconds", zero_ok=True),
        marginal_gain=as_number(auto.marginal_gain, src, p + "marginal_gain", "e.g. 0.7"),
        ps_cpu_percent=as_number(auto.ps_cpu_percent, src, p + "ps_cpu_percent", "e.g. 90"),
        ps_memory_percent=as_number(
            auto.ps_memory_percent, src, p + "ps_memory_percent", "e.g. 85"
        ),
        ps_growth=as_number(auto.ps_growth, src, p + "ps_growth", "e.g. 1.5"),
        ps_max_cpu=as_number(auto.ps_max_cpu, src, p + "ps_max_cpu", "a number of cores, e.g. 4"),
        ps_max_memory_mb=as_int(auto.ps_max_memory_mb, src, p + "ps_max_memory_mb", minimum=0),
        max_total_cpu=as_number(
            auto.max_total_cpu, src, p + "max_total_cpu", "a number of cores, e.g. 16"
        ),
        max_total_memory_mb=as_int(
            auto.max_total_memory_mb, src, p + "max_total_memory_mb", minimum=0
        ),
    )
    if not 0 < a.marginal_gain <= 1:
        raise spec_error(
            src,
            p + "marginal_gain",
            f"{a.marginal_gain:g} is not a fraction in (0, 1]",
            "Use e.g. 0.7: an added worker must bring 70% of the per-worker rate",
        )
    for name in ("ps_cpu_percent", "ps_memory_percent"):
        value = getattr(a, name)
        if not 0 < value <= 100:
            raise spec_error(
                src, p + name, f"{value:g} is not a percentage in (0, 100]", "Use e.g. 90"
            )
    if a.ps_growth <= 1:
        raise spec_error(
            src,
            p + "ps_growth",
            f"{a.ps_growth:g} would not give a migrated PS more",
            "Use a factor above 1, e.g. 1.5",
        )
    if a.max_workers > slots:
        raise spec_error(
            src,
            p + "max_workers",
            f"{a.max_workers} is above the job's {slots} worker slots",
            f"Lower it to {slots}, or raise worker.max_replicas to {a.max_workers}",
        )
    top = a.max_workers or slots
    if a.min_workers > top:
        raise spec_error(
            src,
            p + "min_workers",
            f"{a.min_workers} is above the most workers the job may have ({top})",
            f"Use a number <= {top}",
        )
    if a.enabled and a.min_workers == 0 and spec.chief.replicas == 0:
        raise spec_error(
            src,
            p + "min_workers",
            "0 with no chief would let the autoscaler stop all training",
            "Use min_workers: 1 or more, or add 'chief: {replicas: 1}'",
        )
    return a


def _check_bool(value: object, src: str, path: str) -> bool:
    if not isinstance(value, bool):
        raise spec_error(src, path, f"expected true or false, got {kind_of(value)}", "Use true")
    return value


def _check_max_replicas(group: NodeGroupSpec, src: str, path: str) -> int:
    value = as_int(group.max_replicas, src, path, minimum=0)
    if 0 < value < group.replicas:
        raise spec_error(
            src,
            path,
            f"{value} is below replicas ({group.replicas})",
            f"Use a number >= {group.replicas}, or leave it out for the default",
        )
    return value
