"""Typed configuration: the job spec (from YAML) and the master's own settings.

Both are frozen dataclasses built once at the entry point and passed down. Every problem a user can
cause is a `SpecError` whose message names the file, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

NODE_TYPES = ("ps", "chief", "worker", "evaluator")
STRAGGLER_ACTIONS = ("report", "replace", "off")

# Kubernetes DNS label (RFC 1123): the job name becomes part of pod and service names.
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NAME_MAX_LEN = 63
_NAME_RULE = (
    "it becomes part of pod names, so use only lowercase letters, digits and '-', "
    f"starting and ending with a letter or digit, at most {_NAME_MAX_LEN} characters"
)


class SpecError(ValueError):
    """A job spec problem; str() is one clear message: '<file>: <field>: <what is wrong>. <fix>'."""

    def __init__(self, message: str, *, source: str = "", field: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.field = field


def _spec_error(source: str, path: str, problem: str, fix: str) -> SpecError:
    """Build a SpecError in the one message format: '<file>: <field>: <problem>. <fix>'."""
    where = f"{source}: {path}" if path else source
    message = f"{where}: {problem.rstrip('.')}."
    if fix:
        message += f" {fix.rstrip('.')}."
    return SpecError(message, source=source, field=path)


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
    # Most ranks run-time scaling may reach; 0 = max(2 * replicas, replicas + 2). TF needs every
    # worker slot in the cluster spec from the start, so a PS can reach workers added later.
    max_replicas: int = 0

    @property
    def slots(self) -> int:
        """How many ranks this group may ever have (max_replicas, or its default)."""
        return self.max_replicas or max(2 * self.replicas, self.replicas + 2)


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

    def with_overrides(self, **changes: Any) -> JobSpec:
        """A copy with some fields replaced (e.g. from CLI flags), validated again."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MasterConfig:
    """Settings of the master process itself (not of the job it runs)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    # "" = generate (secrets.token_urlsafe(32)); kept out of repr so it never lands in logs.
    job_token: str = field(default="", repr=False)
    state_path: str = ":memory:"  # SQLite file of the job's durable state
    heartbeat_interval_seconds: float = 2.0
    # gRPC server threads, made as needed: torch agents each hold one or two in blocking calls.
    max_workers: int = 512
    # TLS: tls_auto makes a per-job CA with mutual TLS; or give the master's cert and key
    # and the CA that nodes must trust (server-side TLS only).
    tls_auto: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(
                f"MasterConfig.port: {self.port} is out of range. "
                "Use 0..65535 (0 picks a free port)."
            )
        if not (
            self.heartbeat_interval_seconds > 0 and math.isfinite(self.heartbeat_interval_seconds)
        ):
            raise ValueError(
                f"MasterConfig.heartbeat_interval_seconds: {self.heartbeat_interval_seconds} "
                "must be a positive number of seconds. Use e.g. 2.0."
            )
        if self.max_workers < 1:
            raise ValueError(
                f"MasterConfig.max_workers: {self.max_workers} must be at least 1. Use e.g. 128."
            )
        if not self.state_path:
            raise ValueError(
                "MasterConfig.state_path: empty. Use a file path, or ':memory:' for no durability."
            )
        manual = [f for f in ("tls_cert", "tls_key", "tls_ca") if getattr(self, f)]
        if manual and self.tls_auto:
            raise ValueError(
                "--tls makes the job's own certificates: drop it, or drop "
                + ", ".join("--" + f.replace("_", "-") for f in manual)
            )
        if manual and len(manual) != 3:
            missing = sorted({"tls_cert", "tls_key", "tls_ca"} - set(manual))
            raise ValueError(
                "TLS needs --tls-cert, --tls-key and --tls-ca together (the CA nodes trust); "
                f"missing: {', '.join('--' + f.replace('_', '-') for f in missing)}"
            )
        if not self.job_token:
            object.__setattr__(self, "job_token", secrets.token_urlsafe(32))


# ---------------------------------------------------------------------------------------------
# Loading


_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(JobSpec) if f.name != "source")
_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(NodeGroupSpec))
_AUTOSCALE_FIELDS = tuple(f.name for f in dataclasses.fields(AutoscaleSpec))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_job_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a job spec YAML file; any problem is a SpecError naming file and field."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise _spec_error(
            source, "", "job spec file not found", "Check the path, or create the file there"
        ) from None
    except IsADirectoryError:
        raise _spec_error(
            source, "", "is a directory, not a job spec file", "Pass the path of the YAML file"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _spec_error(
            source, "", f"cannot read job spec: {reason}", "Make it a readable UTF-8 YAML file"
        ) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        raise _yaml_error(source, e) from None
    base_dir = os.path.dirname(os.path.abspath(source))
    return parse_job_spec(data, source, base_dir)


def _yaml_error(source: str, e: yaml.YAMLError) -> SpecError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    parts = [p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p]
    detail = ", ".join(parts) if parts else str(e).replace("\n", " ")
    problem = str(getattr(e, "problem", "") or "")
    if problem.startswith("found duplicate key"):
        return _spec_error(source, where, detail, "Keep only one of them")
    return _spec_error(
        source, where, f"malformed YAML: {detail}", "Fix the YAML syntax at that position"
    )


def parse_job_spec(data: object, source: str, base_dir: str) -> JobSpec:
    """Validate an already-parsed spec (e.g. from YAML) into a JobSpec.

    Relative paths are resolved against base_dir; source names the input in error messages."""
    if data is None:
        raise _spec_error(
            source,
            "",
            "the job spec is empty",
            "Write at least 'name: my-job', 'command: [python, train.py]' "
            "and 'worker: {replicas: 1}'",
        )
    if not isinstance(data, Mapping):
        raise _spec_error(
            source,
            "(top level)",
            f"expected a mapping of fields, got {_kind(data)}",
            "Write the spec as 'field: value' lines such as 'name: my-job'",
        )
    _check_known_fields(data, _JOB_FIELDS, source, "")
    for required, example in (("name", "name: my-job"), ("command", "command: [python, train.py]")):
        if data.get(required) is None:
            raise _spec_error(source, required, "missing", f"Add '{example}'")

    kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in NODE_TYPES}
    kwargs["autoscale"] = _parse_autoscale(data.get("autoscale"), source)
    for node_type in NODE_TYPES:
        raw = data.get(node_type)
        if raw is None:
            kwargs[node_type] = NodeGroupSpec()
            continue
        if not isinstance(raw, Mapping):
            raise _spec_error(
                source,
                node_type,
                f"expected a mapping, got {_kind(raw)}",
                f"Write it as '{node_type}: {{replicas: 1}}'",
            )
        _check_known_fields(raw, _GROUP_FIELDS, source, node_type)
        # Values stay raw here: JobSpec validation checks them with the full field path.
        kwargs[node_type] = NodeGroupSpec(**raw)

    workdir = kwargs.get("workdir")
    base_dir = os.path.abspath(base_dir)
    if workdir is None:
        kwargs["workdir"] = base_dir
    elif isinstance(workdir, str) and workdir:
        kwargs["workdir"] = os.path.normpath(os.path.join(base_dir, os.path.expanduser(workdir)))
    kwargs.setdefault("env", {})
    return JobSpec(**kwargs, source=source)


def _parse_autoscale(raw: object, source: str) -> AutoscaleSpec:
    if raw is None:
        return AutoscaleSpec()
    if not isinstance(raw, Mapping):
        raise _spec_error(
            source,
            "autoscale",
            f"expected a mapping, got {_kind(raw)}",
            "Write it as 'autoscale: {enabled: true, max_workers: 4}'",
        )
    _check_known_fields(raw, _AUTOSCALE_FIELDS, source, "autoscale")
    # Values stay raw here: JobSpec validation checks them with the full field path.
    return AutoscaleSpec(**raw)


def _check_known_fields(
    data: Mapping[Any, Any], known: tuple[str, ...], source: str, prefix: str
) -> None:
    for key in data:
        name = str(key)
        if isinstance(key, str) and key in known:
            continue
        path = f"{prefix}.{name}" if prefix else name
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            problem = f"unknown field {name!r} (did you mean {close[0]!r}?)"
            fix = f"Rename it to {close[0]!r} or remove it"
        else:
            problem = f"unknown field {name!r}"
            fix = f"Remove it; known fields here are: {', '.join(known)}"
        raise _spec_error(source, path, problem, fix)


# ---------------------------------------------------------------------------------------------
# Validation (shared by YAML loading, direct construction and with_overrides)


def _validate_job(spec: JobSpec) -> None:
    src = spec.source

    def setf(name: str, value: Any) -> None:
        object.__setattr__(spec, name, value)

    if not isinstance(spec.source, str):
        raise TypeError(f"JobSpec.source must be a str, got {_kind(spec.source)}")
    setf("name", _check_name(spec.name, src))
    command = _as_command(spec.command, src, "command")
    if not command:
        raise _spec_error(
            src, "command", "is empty", "Give the program to run, e.g. [python, train.py]"
        )
    setf("command", command)
    setf("workdir", _check_workdir(spec.workdir, src))
    setf("env", _as_env(spec.env, src, "env"))
    for node_type in NODE_TYPES:
        setf(node_type, _validate_group(getattr(spec, node_type), src, node_type))
    setf("max_relaunches", _as_int(spec.max_relaunches, src, "max_relaunches", minimum=0))
    setf(
        "heartbeat_timeout_seconds",
        _as_seconds(
            spec.heartbeat_timeout_seconds, src, "heartbeat_timeout_seconds", zero_ok=False
        ),
    )
    setf(
        "evaluator_grace_seconds",
        _as_seconds(spec.evaluator_grace_seconds, src, "evaluator_grace_seconds", zero_ok=True),
    )
    setf(
        "hang_timeout_seconds",
        _as_seconds(spec.hang_timeout_seconds, src, "hang_timeout_seconds", zero_ok=True),
    )
    if spec.stragglers not in STRAGGLER_ACTIONS:
        raise _spec_error(
            src,
            "stragglers",
            f"{spec.stragglers!r} is not a straggler action",
            f"Use one of: {', '.join(STRAGGLER_ACTIONS)}",
        )
    setf(
        "straggler_min_steps",
        _as_int(spec.straggler_min_steps, src, "straggler_min_steps", minimum=1),
    )
    setf("metrics_port", _as_int(spec.metrics_port, src, "metrics_port", minimum=0))
    if spec.metrics_port > 65535:
        raise _spec_error(
            src, "metrics_port", f"{spec.metrics_port} is out of range", "Use 0..65535 (0: any)"
        )

    setf("autoscale", _validate_autoscale(spec.autoscale, spec, src))

    if spec.chief.replicas > 1:
        raise _spec_error(
            src,
            "chief.replicas",
            f"{spec.chief.replicas} chiefs requested but a job has at most one chief",
            "Set chief.replicas to 1 and put the other replicas in worker.replicas",
        )
    if spec.chief.replicas == 0 and spec.worker.replicas == 0:
        raise _spec_error(
            src,
            "chief.replicas, worker.replicas",
            "no chief and no worker, so nothing would train",
            "Set 'chief: {replicas: 1}' and/or 'worker: {replicas: N}' with N >= 1",
        )


def _validate_group(group: object, src: str, node_type: str) -> NodeGroupSpec:
    if not isinstance(group, NodeGroupSpec):
        raise _spec_error(
            src,
            node_type,
            f"expected a NodeGroupSpec, got {_kind(group)}",
            f"Pass {node_type}=NodeGroupSpec(replicas=...)",
        )
    p = f"{node_type}."
    return NodeGroupSpec(
        replicas=_as_int(group.replicas, src, p + "replicas", minimum=0),
        max_relaunches=_as_int(group.max_relaunches, src, p + "max_relaunches", minimum=0),
        command=_as_command(group.command, src, p + "command"),
        env=_as_env(group.env, src, p + "env"),
        cpu=_as_number(group.cpu, src, p + "cpu", "a number of cores, e.g. 2 or 0.5"),
        memory_mb=_as_int(group.memory_mb, src, p + "memory_mb", minimum=0),
        max_replicas=_check_max_replicas(group, src, p + "max_replicas"),
    )


def _validate_autoscale(auto: object, spec: JobSpec, src: str) -> AutoscaleSpec:
    if not isinstance(auto, AutoscaleSpec):
        raise _spec_error(
            src,
            "autoscale",
            f"expected an AutoscaleSpec, got {_kind(auto)}",
            "Pass autoscale=AutoscaleSpec(enabled=True, ...)",
        )
    p = "autoscale."
    if not isinstance(auto.enabled, bool):
        raise _spec_error(
            src, p + "enabled", f"expected true or false, got {_kind(auto.enabled)}", "Use true"
        )
    slots = spec.worker.slots
    a = AutoscaleSpec(
        enabled=auto.enabled,
        min_workers=_as_int(auto.min_workers, src, p + "min_workers", minimum=0),
        max_workers=_as_int(auto.max_workers, src, p + "max_workers", minimum=0),
        interval_seconds=_as_seconds(
            auto.interval_seconds, src, p + "interval_seconds", zero_ok=False
        ),
        window=_as_int(auto.window, src, p + "window", minimum=1),
        settle_seconds=_as_seconds(auto.settle_seconds, src, p + "settle_seconds", zero_ok=True),
        marginal_gain=_as_number(auto.marginal_gain, src, p + "marginal_gain", "e.g. 0.7"),
        ps_cpu_percent=_as_number(auto.ps_cpu_percent, src, p + "ps_cpu_percent", "e.g. 90"),
        ps_memory_percent=_as_number(
            auto.ps_memory_percent, src, p + "ps_memory_percent", "e.g. 85"
        ),
        ps_growth=_as_number(auto.ps_growth, src, p + "ps_growth", "e.g. 1.5"),
        ps_max_cpu=_as_number(auto.ps_max_cpu, src, p + "ps_max_cpu", "a number of cores, e.g. 4"),
        ps_max_memory_mb=_as_int(auto.ps_max_memory_mb, src, p + "ps_max_memory_mb", minimum=0),
        max_total_cpu=_as_number(
            auto.max_total_cpu, src, p + "max_total_cpu", "a number of cores, e.g. 16"
        ),
        max_total_memory_mb=_as_int(
            auto.max_total_memory_mb, src, p + "max_total_memory_mb", minimum=0
        ),
    )
    if not 0 < a.marginal_gain <= 1:
        raise _spec_error(
            src,
            p + "marginal_gain",
            f"{a.marginal_gain:g} is not a fraction in (0, 1]",
            "Use e.g. 0.7: an added worker must bring 70% of the per-worker rate",
        )
    for name in ("ps_cpu_percent", "ps_memory_percent"):
        value = getattr(a, name)
        if not 0 < value <= 100:
            raise _spec_error(
                src, p + name, f"{value:g} is not a percentage in (0, 100]", "Use e.g. 90"
            )
    if a.ps_growth <= 1:
        raise _spec_error(
            src,
            p + "ps_growth",
            f"{a.ps_growth:g} would not give a migrated PS more",
            "Use a factor above 1, e.g. 1.5",
        )
    if a.max_workers > slots:
        raise _spec_error(
            src,
            p + "max_workers",
            f"{a.max_workers} is above the job's {slots} worker slots",
            f"Lower it to {slots}, or raise worker.max_replicas to {a.max_workers}",
        )
    top = a.max_workers or slots
    if a.min_workers > top:
        raise _spec_error(
            src,
            p + "min_workers",
            f"{a.min_workers} is above the most workers the job may have ({top})",
            f"Use a number <= {top}",
        )
    if a.enabled and a.min_workers == 0 and spec.chief.replicas == 0:
        raise _spec_error(
            src,
            p + "min_workers",
            "0 with no chief would let the autoscaler stop all training",
            "Use min_workers: 1 or more, or add 'chief: {replicas: 1}'",
        )
    return a


def _check_max_replicas(group: NodeGroupSpec, src: str, path: str) -> int:
    value = _as_int(group.max_replicas, src, path, minimum=0)
    if 0 < value < group.replicas:
        raise _spec_error(
            src,
            path,
            f"{value} is below replicas ({group.replicas})",
            f"Use a number >= {group.replicas}, or leave it out for the default",
        )
    return value


def _check_name(name: object, src: str) -> str:
    if not isinstance(name, str):
        raise _spec_error(
            src, "name", f"expected a string, got {_kind(name)}", "Use e.g. 'name: my-job'"
        )
    if len(name) <= _NAME_MAX_LEN and _NAME_RE.match(name):
        return name
    suggestion = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:_NAME_MAX_LEN].strip("-")
    fix = f"Rename it, e.g. {suggestion!r}" if suggestion else "Rename it, e.g. 'my-job'"
    raise _spec_error(src, "name", f"{name!r} is not a valid job name: {_NAME_RULE}", fix)


def _check_workdir(workdir: object, src: str) -> str:
    if not isinstance(workdir, str) or not workdir:
        raise _spec_error(
            src,
            "workdir",
            f"expected a directory path, got {_kind(workdir)}",
            "Use a path such as '.' or '/data/job'",
        )
    if not os.path.isabs(workdir):
        raise _spec_error(
            src,
            "workdir",
            f"{workdir!r} is not an absolute path",
            "Pass an absolute path (YAML specs resolve relative ones against the file's directory)",
        )
    return workdir


def _as_command(value: object, src: str, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as e:
            raise _spec_error(
                src, path, f"cannot split the command string: {e}", "Fix the quoting"
            ) from None
    if not isinstance(value, list | tuple):
        raise _spec_error(
            src,
            path,
            f"expected a list of strings or a string, got {_kind(value)}",
            "Use e.g. [python, train.py, --epochs, '2'] or 'python train.py --epochs 2'",
        )
    for i, item in enumerate(value):
        if not isinstance(item, str):
            scalar = isinstance(item, int | float | bool)
            raise _spec_error(
                src,
                f"{path}[{i}]",
                f"expected a string, got {_kind(item)} {item!r}",
                f'Quote it in the YAML: "{item}"' if scalar else "Make every item a plain string",
            )
    if value and not value[0]:
        raise _spec_error(src, f"{path}[0]", "the program name is empty", "Give the program to run")
    return tuple(value)


def _as_env(value: object, src: str, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _spec_error(
            src,
            path,
            f"expected a mapping of variable names to values, got {_kind(value)}",
            "Write it as {NAME: value, ...}",
        )
    env: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise _spec_error(
                src,
                f"{path}.{key}",
                f"{key!r} is not a valid environment variable name",
                "Use a non-empty name without '=', e.g. MY_VAR",
            )
        item_path = f"{path}.{key}"
        if isinstance(item, str):
            env[key] = item
        elif isinstance(item, int | float) and not isinstance(item, bool):
            env[key] = str(item)
        elif isinstance(item, bool):
            raise _spec_error(
                src,
                item_path,
                f"a boolean ({item}) is ambiguous as an environment value",
                f'Quote the value you mean, e.g. "{str(item).lower()}" or "1"',
            )
        elif item is None:
            raise _spec_error(src, item_path, "has no value", 'Give a value, or "" for empty')
        else:
            raise _spec_error(
                src,
                item_path,
                f"expected a string, got {_kind(item)}",
                "Environment values must be plain strings or numbers; quote or flatten it",
            )
        if "\0" in env[key]:
            raise _spec_error(src, item_path, "contains a NUL byte", "Remove it")
    return env


def _as_int(value: object, src: str, path: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _spec_error(
                src, path, f"expected a whole number, got {_kind(value)} {value!r}", "Use e.g. 2"
            )
    if value < minimum:
        raise _spec_error(src, path, f"{value} is negative", f"Use a number >= {minimum}")
    return value


def _as_number(value: object, src: str, path: str, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _spec_error(
            src, path, f"expected a number, got {_kind(value)} {value!r}", f"Use {example}"
        )
    if value < 0:
        raise _spec_error(src, path, f"{value} is negative", f"Use 0 (unset) or {example}")
    return float(value)


def _as_seconds(value: object, src: str, path: str, *, zero_ok: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise _spec_error(
            src, path, f"expected a number of seconds, got {_kind(value)} {value!r}", "Use e.g. 10"
        )
    if value < 0 or (value == 0 and not zero_ok):
        problem = f"{value} is negative" if value < 0 else "0 would time out at once"
        fix = "Use a number of seconds >= 0" if zero_ok else "Use a positive number of seconds"
        raise _spec_error(src, path, problem, fix)
    return float(value)


def _kind(value: object) -> str:
    """A YAML-flavoured name of a value's type, for messages."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"
