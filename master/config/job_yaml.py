"""Reading a job spec from YAML: strict parsing, unknown fields named with a suggestion, then a
validated JobSpec."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

import yaml

from master.config.errors import SpecError, kind_of, spec_error
from master.config.kubeflow import is_kubeflow_manifest, parse_kubeflow_job
from master.config.spec import NODE_TYPES, AutoscaleSpec, JobSpec, NodeGroupSpec

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
        raise spec_error(
            source, "", "job spec file not found", "Check the path, or create the file there"
        ) from None
    except IsADirectoryError:
        raise spec_error(
            source, "", "is a directory, not a job spec file", "Pass the path of the YAML file"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise spec_error(
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
        return spec_error(source, where, detail, "Keep only one of them")
    return spec_error(
        source, where, f"malformed YAML: {detail}", "Fix the YAML syntax at that position"
    )


def parse_job_spec(data: object, source: str, base_dir: str) -> JobSpec:
    """Validate an already-parsed spec (e.g. from YAML) into a JobSpec.

    Relative paths are resolved against base_dir; source names the input in error messages.
    A Kubeflow TFJob or PyTorchJob manifest (by apiVersion and kind) is read as such."""
    if is_kubeflow_manifest(data):
        return parse_kubeflow_job(data, source, base_dir)  # type: ignore[arg-type]
    if data is None:
        raise spec_error(
            source,
            "",
            "the job spec is empty",
            "Write at least 'name: my-job', 'command: [python, train.py]' "
            "and 'worker: {replicas: 1}'",
        )
    if not isinstance(data, Mapping):
        raise spec_error(
            source,
            "(top level)",
            f"expected a mapping of fields, got {kind_of(data)}",
            "Write the spec as 'field: value' lines such as 'name: my-job'",
        )
    _check_known_fields(data, _JOB_FIELDS, source, "")
    for required, example in (("name", "name: my-job"), ("command", "command: [python, train.py]")):
        if data.get(required) is None:
            raise spec_error(source, required, "missing", f"Add '{example}'")

    kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in NODE_TYPES}
    kwargs["autoscale"] = _parse_autoscale(data.get("autoscale"), source)
    for node_type in NODE_TYPES:
        raw = data.get(node_type)
        if raw is None:
            kwargs[node_type] = NodeGroupSpec()
            continue
        if not isinstance(raw, Mapping):
            raise spec_error(
                source,
                node_type,
                f"expected a mapping, got {kind_of(raw)}",
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
        raise spec_error(
            source,
            "autoscale",
            f"expected a mapping, got {kind_of(raw)}",
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
        raise spec_error(source, path, problem, fix)


def job_spec_document(spec: JobSpec, base_dir: str = "") -> dict[str, Any]:
    """The spec as a job YAML document: fields that differ from their defaults, in the order
    the README shows them; `workdir` relative to base_dir when it is inside it."""
    doc: dict[str, Any] = {"name": spec.name, "command": list(spec.command)}
    workdir = spec.workdir
    if base_dir and os.path.abspath(base_dir) == workdir:
        workdir = "."
    doc["workdir"] = workdir
    if spec.env:
        doc["env"] = dict(spec.env)
    default_group = NodeGroupSpec()
    for node_type in NODE_TYPES:
        group = spec.group(node_type)
        if group == default_group:
            continue
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(NodeGroupSpec):
            value = getattr(group, f.name)
            if f.name == "replicas" or value != getattr(default_group, f.name):
                fields[f.name] = (
                    list(value)
                    if isinstance(value, tuple)
                    else dict(value)
                    if isinstance(value, Mapping)
                    else value
                )
        doc[node_type] = fields
    defaults = {f.name: f.default for f in dataclasses.fields(JobSpec)}
    for name in _JOB_FIELDS:
        if name in doc or name in NODE_TYPES or name in ("autoscale", "env", "workdir"):
            continue
        if getattr(spec, name) != defaults[name]:
            doc[name] = getattr(spec, name)
    if spec.autoscale != AutoscaleSpec():
        doc["autoscale"] = dataclasses.asdict(spec.autoscale)
    return doc
