"""torchrun's flags and PET_* variables under a dlrover job: honoured as torchrun honours them,
except the rendezvous ones, which the job's master owns and which are replaced (and named)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from torch.distributed.argparse_util import check_env, env

DLROVER_BACKEND = "dlrover"
# Launcher arguments (dest) the job's master owns, with the value they take under it and the
# flag's name as torchrun's help spells it.
MASTER_OWNED: dict[str, tuple[str, object]] = {
    "rdzv_backend": ("--rdzv-backend", DLROVER_BACKEND),
    "rdzv_endpoint": ("--rdzv-endpoint", ""),
    "rdzv_id": ("--rdzv-id", "none"),
    "standalone": ("--standalone", False),
    "master_addr": ("--master-addr", "127.0.0.1"),
    "master_port": ("--master-port", None),
    "node_rank": ("--node-rank", 0),
}
_UNSET = object()


class UsageError(ValueError):
    """argparse found an unknown flag or a bad value; the message is argparse's."""


def pet_name(dest: str) -> str:
    """The PET_* variable torchrun reads as the default of a flag (e.g. PET_NPROC_PER_NODE)."""
    return f"PET_{dest.upper()}"


def apply_pet_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Make the PET_* variables of `environ` the defaults of torchrun's flags, as torchrun does
    with os.environ (its parser reads them when built)."""
    for action in parser._actions:
        name = pet_name(action.dest)
        if name not in environ:
            continue
        if isinstance(action, check_env):
            try:
                action.default = bool(int(environ[name]))
            except ValueError:
                raise UsageError(f"{name}={environ[name]!r}: give 0 or 1") from None
        elif isinstance(action, env) or action.dest == "rdzv_backend":
            action.default, action.required = environ[name], False


def raise_usage_errors(parser: argparse.ArgumentParser) -> None:
    """argparse errors (unknown flag, bad value) raised as UsageError instead of exit(2), so
    the launcher reports them as its other start-up errors."""

    def error(message: str) -> None:
        raise UsageError(f"{message} (see {parser.prog} --help)")

    parser.error = error  # type: ignore[method-assign]


def parse_under_master(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
    master_addr: str,
) -> tuple[argparse.Namespace, tuple[str, ...]]:
    """Parse argv for a node of a dlrover job: the rendezvous flags and PET_* variables the
    master owns take the master's values; returns the args and what was replaced, e.g.
    ("--rdzv-backend c10d", "PET_RDZV_ENDPOINT=host:29400")."""
    saved = {a.dest: a.default for a in parser._actions if a.dest in MASTER_OWNED}
    for action in parser._actions:
        if action.dest in MASTER_OWNED:
            action.default = _UNSET
    try:
        args = parser.parse_args(argv)
    finally:
        for action in parser._actions:
            if action.dest in saved:
                action.default = saved[action.dest]
    replaced: list[str] = []
    for dest, (flag, value) in MASTER_OWNED.items():
        given = getattr(args, dest)
        setattr(args, dest, value)
        if given is _UNSET or given == value:
            continue
        if dest == "master_addr" and given == master_addr:
            continue  # the master's own address, given as dlrover-run's --master-addr
        replaced.append(flag if given is True else f"{flag} {given}")
    for dest in MASTER_OWNED:
        name = pet_name(dest)
        if environ.get(name, "") not in ("", str(MASTER_OWNED[dest][1])):
            replaced.append(f"{name}={environ[name]}")
    return args, tuple(replaced)
