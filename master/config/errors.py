"""The job spec's error type and its one message format: '<file>: <field>: <problem>. <fix>'."""

from __future__ import annotations

from collections.abc import Mapping


class SpecError(ValueError):
    """A job spec problem; str() is one clear message: '<file>: <field>: <what is wrong>. <fix>'."""

    def __init__(self, message: str, *, source: str = "", field: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.field = field


def spec_error(source: str, path: str, problem: str, fix: str) -> SpecError:
    """Build a SpecError in the one message format: '<file>: <field>: <problem>. <fix>'."""
    where = f"{source}: {path}" if path else source
    message = f"{where}: {problem.rstrip('.')}."
    if fix:
        message += f" {fix.rstrip('.')}."
    return SpecError(message, source=source, field=path)


def kind_of(value: object) -> str:
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
