"""Every private torch name dlrover_torch touches, in one list: tests/unit/test_torch_privates.py
checks that each exists in the installed torch and that the code touches no other."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

LOCAL_ELASTIC_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent"
SUBPROCESS_CONTEXT = "torch.distributed.elastic.multiprocessing.api.SubprocessContext"


class Kind(Enum):
    """Where a private name lives, which is how its presence is checked."""

    CLASS = "class"  # a method or class attribute of the class ``owner``
    INSTANCE = "instance"  # an attribute the constructor of the class ``owner`` sets
    MODULE = "module"  # a name in the module ``owner``, or a submodule of it
    STATE_DICT = "state_dict"  # an attribute of the OrderedDict ``owner.state_dict()`` returns


@dataclass(frozen=True)
class TorchPrivate:
    """One private torch name, where it lives and which of our modules touches it."""

    owner: str  # the dotted path of a torch class or module
    name: str
    kind: Kind
    user: str  # the dlrover_torch module that touches it, and how


def _agent(name: str, kind: Kind, how: str) -> TorchPrivate:
    return TorchPrivate(LOCAL_ELASTIC_AGENT, name, kind, f"agent.py: {how}")


def _context(name: str, kind: Kind, how: str) -> TorchPrivate:
    return TorchPrivate(SUBPROCESS_CONTEXT, name, kind, f"worker_pool.py: {how}")


TORCH_PRIVATES: tuple[TorchPrivate, ...] = (
    # The template methods of torch's agent loop the agent overrides or calls.
    _agent("_rendezvous", Kind.CLASS, "overrides (a fresh worker store per round)"),
    _agent("_initialize_workers", Kind.CLASS, "overrides (the node check first)"),
    _agent("_start_workers", Kind.CLASS, "overrides (workers from spares)"),
    _agent("_monitor_workers", Kind.CLASS, "overrides (hangs, membership verdicts)"),
    _agent("_restart_workers", Kind.CLASS, "overrides (refunds a lost node's restart)"),
    _agent("_shutdown", Kind.CLASS, "overrides (the stop reason)"),
    _agent("_set_local_rank_env", Kind.CLASS, "calls (torch's LOCAL_RANK rules)"),
    _agent("_setup_local_watchdog", Kind.CLASS, "calls from _start_workers"),
    _agent("_setup_healthcheck", Kind.CLASS, "calls from _start_workers"),
    # The agent's state torch's loop reads.
    _agent("_remaining_restarts", Kind.INSTANCE, "reads; gives back a lost node's restart"),
    _agent("_pcontext", Kind.INSTANCE, "sets to its own process context"),
    _agent("_logs_specs", Kind.INSTANCE, "reads for its process context"),
    _agent("_log_line_prefix_template", Kind.INSTANCE, "reads for its process context"),
    # torch's process context, which the pooled and hooked contexts extend.
    _context("_start", Kind.CLASS, "overrides (hands workers to spares)"),
    _context("_capture_process_failures", Kind.CLASS, "overrides (cut-short error files)"),
    _context("_running_local_ranks", Kind.INSTANCE, "reads"),
    # Module-level names.
    TorchPrivate(
        "torch.distributed.elastic.multiprocessing.errors",
        "_NOT_AVAILABLE",
        Kind.MODULE,
        "run.py: a failure without an error file",
    ),
    TorchPrivate(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        Kind.MODULE,
        "checkpoint/persister.py: DCP's .metadata",
    ),
    TorchPrivate(
        "torch.distributed.checkpoint._nested_dict",
        "flatten_state_dict",
        Kind.MODULE,
        "checkpoint/sharded.py: DCP's flattened keys",
    ),
    TorchPrivate("torch", "_dynamo", Kind.MODULE, "preload.py: LATE_PRELOAD imports it"),
    TorchPrivate(
        "torch.nn.Module",
        "_metadata",
        Kind.STATE_DICT,
        "checkpoint/layout.py: saved and restored with a state dict",
    ),
)
