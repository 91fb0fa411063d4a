"""The private torch names dlrover_torch touches (dlrover_torch/torch_privates.py): each exists
in the installed torch, and the code touches none the list leaves out."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SubprocessContext
from torch.distributed.elastic.rendezvous import RendezvousHandler

import dlrover_torch
from dlrover_torch.torch_privates import (
    LOCAL_ELASTIC_AGENT,
    SUBPROCESS_CONTEXT,
    TORCH_PRIVATES,
    Kind,
    TorchPrivate,
)

PACKAGE = pathlib.Path(dlrover_torch.__file__).parent
TORCH_MODULE_PATH = re.compile(r"^torch(\.\w+)+$")


class _Handler(RendezvousHandler):
    """Enough of a rendezvous handler to construct torch's agent."""

    def get_backend(self) -> str:
        return "stub"

    def next_rendezvous(self) -> Any:
        raise NotImplementedError

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "stub"

    def shutdown(self) -> bool:
        return True


def _agent(log_dir: str) -> object:
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=_Handler(), entrypoint="x")
    return LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=log_dir))


def _context(log_dir: str) -> object:
    return SubprocessContext("trainer", "x", {0: ()}, {0: {}}, DefaultLogsSpecs(log_dir=log_dir))


# How to get an instance of each owner with instance attributes, as cheaply as possible (nothing
# is started: constructing sets the attributes).
INSTANCES: dict[str, Callable[[str], object]] = {
    LOCAL_ELASTIC_AGENT: _agent,
    SUBPROCESS_CONTEXT: _context,
}


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return {owner: make(str(tmp_path_factory.mktemp("logs"))) for owner, make in INSTANCES.items()}


def _resolve(path: str) -> Any:
    """The torch module, class or function at a dotted path."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _exists(entry: TorchPrivate, instances: dict[str, object]) -> bool:
    try:
        owner = _resolve(entry.owner)
    except (ImportError, AttributeError):
        return False
    if entry.kind is Kind.CLASS:
        return hasattr(owner, entry.name)
    if entry.kind is Kind.INSTANCE:
        return hasattr(instances[entry.owner], entry.name)
    if entry.kind is Kind.MODULE:  # a submodule is found without importing it (torch._dynamo)
        package = hasattr(owner, "__path__")
        if package and importlib.util.find_spec(f"{entry.owner}.{entry.name}") is not None:
            return True
        return hasattr(owner, entry.name)
    return hasattr(owner().state_dict(), entry.name)  # Kind.STATE_DICT


def _id(entry: TorchPrivate) -> str:
    return f"{entry.owner}.{entry.name}"


def test_the_list_has_no_duplicates_and_instances_for_instance_attributes():
    paths = [_id(e) for e in TORCH_PRIVATES]
    assert len(paths) == len(set(paths))
    missing = {e.owner for e in TORCH_PRIVATES if e.kind is Kind.INSTANCE} - set(INSTANCES)
    assert not missing, f"add a way to construct {missing} to INSTANCES"


@pytest.mark.parametrize("entry", TORCH_PRIVATES, ids=_id)
def test_each_private_torch_name_exists(entry: TorchPrivate, instances: dict[str, object]):
    assert _exists(entry, instances), (
        f"torch {torch.__version__} has no {entry.kind.value} member {entry.name!r} of "
        f"{entry.owner}; dlrover_torch/{entry.user}"
    )


@pytest.mark.parametrize("entry", TORCH_PRIVATES, ids=_id)
def test_each_listed_name_is_still_touched(entry: TorchPrivate):
    user = entry.user.split(":")[0]
    assert entry.name in (PACKAGE / user).read_text(), (
        f"dlrover_torch/{user} no longer mentions {entry.name!r}: drop {_id(entry)} from the list"
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _modules() -> Iterator[Any]:
    for info in pkgutil.walk_packages(dlrover_torch.__path__, "dlrover_torch."):
        yield importlib.import_module(info.name)


def _names_used_by_class(cls: type) -> set[str]:
    """The private names a class defines or reaches through ``self`` or ``super()``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(cls))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            is_self = isinstance(base, ast.Name) and base.id == "self"
            is_super = (
                isinstance(base, ast.Call)
                and isinstance(base.func, ast.Name)
                and base.func.id == "super"
            )
            if is_self or is_super:
                names.add(node.attr)
    return names


def _touched_through_subclasses(instances: dict[str, object]) -> set[str]:
    """Private names of torch classes our subclasses override, call or set."""
    found: set[str] = set()
    for module in _modules():
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            bases = [b for b in cls.__mro__ if b.__module__.split(".")[0] == "torch"]
            if not bases:
                continue
            owner = f"{bases[0].__module__}.{bases[0].__qualname__}"
            instance = instances.get(owner)
            for name in _names_used_by_class(cls):
                if hasattr(bases[0], name) or (instance is not None and hasattr(instance, name)):
                    found.add(f"{owner}.{name}")
    return found


def _touched_by_path() -> set[str]:
    """Private torch names imported, or named as modules in strings (e.g. preloaded)."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "torch_privates.py":  # the list itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            paths: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                paths = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                paths = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                paths = [node.value] if TORCH_MODULE_PATH.match(node.value) else []
            found.update(p for p in paths if any(_private(part) for part in p.split(".")))
    return found


def test_the_list_names_every_private_torch_name_the_code_touches(instances):
    listed = {_id(e) for e in TORCH_PRIVATES}
    touched = _touched_through_subclasses(instances) | _touched_by_path()
    assert not touched - listed, (
        f"dlrover_torch touches private torch names missing from "
        f"dlrover_torch/torch_privates.py: {sorted(touched - listed)}"
    )
    # The scan cannot see attributes of torch objects that are no subclass of ours.
    unseen = {"torch.nn.Module._metadata"}
    assert listed - touched == unseen, f"listed but not found by the scan: {listed - touched}"
