"""The project's import graph: circles, layer rules and module sizes, checked by the test suite.

Every import counts, also those inside functions and under `TYPE_CHECKING`: a lazy import hides a
circle from Python, not from a reader. `python tools/import_graph.py` prints what it finds.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("master", "dlrover_tf", "dlrover_torch")
GENERATED = ("master.pb",)
MAX_MODULE_LINES = 600

# What each part may import directly (besides itself). docs/architecture.md explains each rule.
ALLOWED: dict[str, tuple[str, ...]] = {
    "master.pb": (),
    "master.config": (),
    "master.state": (),
    "master.shuffle": (),
    "master.client": ("master.pb", "master.shuffle"),
    "master.nodes": ("master.pb", "master.state"),
    "master.sharding": ("master.state", "master.shuffle"),
    "master.rendezvous": ("master.state",),
    "master.kv": ("master.state",),
    "master.platform": ("master.client", "master.state"),
    "master.job": (
        "master.pb",
        "master.config",
        "master.state",
        "master.client",
        "master.nodes",
        "master.sharding",
        "master.rendezvous",
        "master.kv",
        "master.platform",
    ),
    "master.rpc": (
        "master.pb",
        "master.config",
        "master.state",
        "master.client",
        "master.nodes",
        "master.sharding",
        "master.rendezvous",
        "master.kv",
        "master.job",
    ),
    "master.observability": (
        "master.config",
        "master.client",
        "master.nodes",
        "master.job",
        "master.rpc",
    ),
    "master.brain": ("master.config", "master.job"),
    "master.cli": ("master",),
    "master": ("master.cli",),
    "dlrover_tf": ("master.client", "master.pb"),
    # `dlrover-run --standalone` serves rendezvous and KV in the launcher's own process.
    "dlrover_torch": ("master.client", "master.pb", "master.rpc.standalone"),
}
# Third-party packages a part must never import (the master stays free of training frameworks).
FORBIDDEN_EXTERNAL = {"master": ("tensorflow", "torch", "keras")}


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Every module of the project's packages, by dotted name."""
    modules: dict[str, pathlib.Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The project module an imported dotted name lives in, or None for a third-party one."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(module: str, path: pathlib.Path) -> Iterable[str]:
    """Dotted names a module imports, relative imports resolved; `from a import b` yields a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(root: pathlib.Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, project module -> top-level externals)."""
    modules = module_files(root)
    internal: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps: set[str] = set()
        others: set[str] = set()
        for name in _imported_names(module, path):
            owner = _owner(name, modules)
            if owner is not None:
                deps.add(owner)
            elif name.split(".")[0] not in PACKAGES:
                others.add(name.split(".")[0])
        deps.discard(module)
        # `from pkg import sub` names the package too; it only runs pkg/__init__, drop it when
        # the submodule is what was asked for and pkg is an ancestor of the importer.
        internal[module] = {d for d in deps if not module.startswith(d + ".")}
        external[module] = others
    return internal, external


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def part_of(module: str) -> str:
    """The part (a key of ALLOWED) a module belongs to: its longest matching prefix."""
    best = ""
    for part in ALLOWED:
        if (module == part or module.startswith(part + ".")) and len(part) > len(best):
            best = part
    return best


def _allowed(importer: str, imported: str) -> bool:
    part = part_of(importer)
    if part_of(imported) == part:
        return True
    return any(imported == rule or imported.startswith(rule + ".") for rule in ALLOWED[part])


def layer_violations(graph: dict[str, set[str]], external: dict[str, set[str]]) -> list[str]:
    """Imports that cross the parts' rules, one line each."""
    problems = []
    for module in sorted(graph):
        for dep in sorted(graph[module]):
            if not _allowed(module, dep):
                problems.append(f"{module} imports {dep} ({part_of(module)} may not)")
        for package, banned in FORBIDDEN_EXTERNAL.items():
            if module == package or module.startswith(package + "."):
                for name in sorted(external[module] & set(banned)):
                    problems.append(f"{module} imports {name} ({package} must not)")
    return problems


def oversized(root: pathlib.Path = ROOT, limit: int = MAX_MODULE_LINES) -> list[str]:
    """Hand-written modules longer than `limit` lines."""
    found = []
    for module, path in module_files(root).items():
        if any(module == g or module.startswith(g + ".") for g in GENERATED):
            continue
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{module}: {lines} lines")
    return found


def main() -> int:
    graph, external = import_graph()
    problems = [" -> ".join(c) for c in circles(graph)]
    problems += layer_violations(graph, external) + oversized()
    for line in problems:
        print(line)
    print(f"{len(graph)} modules, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
