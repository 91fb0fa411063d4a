"""Checks of single job spec values: each returns the value normalised, or raises a SpecError
naming the file, the field and the fix."""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping

from master.config.errors import kind_of, spec_error

# Kubernetes DNS label (RFC 1123): the job name becomes part of pod and service names.
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NAME_MAX_LEN = 63
_NAME_RULE = (
    "it becomes part of pod names, so use only lowercase letters, digits and '-', "
    f"starting and ending with a letter or digit, at most {_NAME_MAX_LEN} characters"
)


def check_name(name: object, src: str) -> str:
    """The job name, if it is a valid Kubernetes DNS label (it becomes part of pod names)."""
    if not isinstance(name, str):
        raise spec_error(
            src, "name", f"expected a string, got {kind_of(name)}", "Use e.g. 'name: my-job'"
        )
    if len(name) <= _NAME_MAX_LEN and _NAME_RE.match(name):
        return name
    suggestion = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:_NAME_MAX_LEN].strip("-")
    fix = f"Rename it, e.g. {suggestion!r}" if suggestion else "Rename it, e.g. 'my-job'"
    raise spec_error(src, "name", f"{name!r} is not a valid job name: {_NAME_RULE}", fix)


def check_workdir(workdir: object, src: str) -> str:
    """The workdir, if it is an absolute path."""
    if not isinstance(workdir, str) or not workdir:
        raise spec_error(
            src,
            "workdir",
            f"expected a directory path, got {kind_of(workdir)}",
            "Use a path such as '.' or '/data/job'",
        )
    if not os.path.isabs(workdir):
        raise spec_error(
            src,
            "workdir",
            f"{workdir!r} is not an absolute path",
            "Pass an absolute path (YAML specs resolve relative ones against the file's directory)",
        )
    return workdir


def as_command(value: object, src: str, path: str) -> tuple[str, ...]:
    """A command as a tuple of strings, from a list of strings or a shell-quoted string."""
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as e:
            raise spec_error(
                src, path, f"cannot split the command string: {e}", "Fix the quoting"
            ) from None
    if not isinstance(value, list | tuple):
        raise spec_error(
            src,
            path,
            f"expected a list of strings or a string, got {kind_of(value)}",
            "Use e.g. [python, train.py, --epochs, '2'] or 'python train.py --epochs 2'",
        )
    for i, item in enumerate(value):
        if not isinstance(item, str):
            scalar = isinstance(item, int | float | bool)
            raise spec_error(
                src,
                f"{path}[{i}]",
                f"expected a string, got {kind_of(item)} {item!r}",
                f'Quote it in the YAML: "{item}"' if scalar else "Make every item a plain string",
            )
    if value and not value[0]:
        raise spec_error(src, f"{path}[0]", "the program name is empty", "Give the program to run")
    return tuple(value)


def as_env(value: object, src: str, path: str) -> dict[str, str]:
    """Environment variables as a dict of strings (numbers are converted; None is empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise spec_error(
            src,
            path,
            f"expected a mapping of variable names to values, got {kind_of(value)}",
            "Write it as {NAME: value, ...}",
        )
    env: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise spec_error(
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
            raise spec_error(
                src,
                item_path,
                f"a boolean ({item}) is ambiguous as an environment value",
                f'Quote the value you mean, e.g. "{str(item).lower()}" or "1"',
            )
        elif item is None:
            raise spec_error(src, item_path, "has no value", 'Give a value, or "" for empty')
        else:
            raise spec_error(
                src,
                item_path,
                f"expected a string, got {kind_of(item)}",
                "Environment values must be plain strings or numbers; quote or flatten it",
            )
        if "\0" in env[key]:
            raise spec_error(src, item_path, "contains a NUL byte", "Remove it")
    return env


def as_int(value: object, src: str, path: str, *, minimum: int) -> int:
    """A whole number >= minimum (a float with no fraction is accepted)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise spec_error(
                src, path, f"expected a whole number, got {kind_of(value)} {value!r}", "Use e.g. 2"
            )
    if value < minimum:
        raise spec_error(src, path, f"{value} is negative", f"Use a number >= {minimum}")
    return value


def as_number(value: object, src: str, path: str, example: str) -> float:
    """A finite number >= 0, as a float; example names a good value in the fix."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise spec_error(
            src, path, f"expected a number, got {kind_of(value)} {value!r}", f"Use {example}"
        )
    if value < 0:
        raise spec_error(src, path, f"{value} is negative", f"Use 0 (unset) or {example}")
    return float(value)


def as_seconds(value: object, src: str, path: str, *, zero_ok: bool) -> float:
    """A duration in seconds >= 0 (> 0 unless zero_ok), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise spec_error(
            src,
            path,
            f"expected a number of seconds, got {kind_of(value)} {value!r}",
            "Use e.g. 10",
        )
    if value < 0 or (value == 0 and not zero_ok):
        problem = f"{value} is negative" if value < 0 else "0 would time out at once"
        fix = "Use a number of seconds >= 0" if zero_ok else "Use a positive number of seconds"
        raise spec_error(src, path, problem, fix)
    return float(value)
