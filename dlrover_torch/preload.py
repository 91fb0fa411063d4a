"""What a spare worker imports ahead of its job: torch, then the training script's own imports.

Only installed modules are imported ahead, never the script's neighbours (its directory, the
launcher's working directory): those are the user's code, which may read the worker's environment
or print at import time. A module that fails to import ahead is left alone: the script imports
it again as a fresh process would, with the same outcome.
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn")
# After the script's own imports: what a script needs only once it builds its model, e.g.
# torch._dynamo, which the first optimizer imports (1-1.5 s of CPU here).
LATE_PRELOAD = ("torch.optim", "torch._dynamo")


def script_imports(source: str) -> list[str]:
    """Absolute module names imported at the top level of ``source`` (also in top-level
    ``try``/``if`` blocks), in order, without duplicates."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []

    def visit(body: Iterable[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module and node.module != "__future__":
                    names.append(node.module)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)

    visit(tree.body)
    return list(dict.fromkeys(names))


def _source_of(target: str, module: bool) -> str:
    """The text of the script, or of the module's file for ``-m``; "" when not found."""
    path = _module_file(target) if module else target
    if not path or not os.path.isfile(path):
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def _module_file(name: str) -> str:
    """The file ``python -m name`` would run, found on sys.path without importing a package."""
    parts = name.split(".")
    for directory in sys.path:
        base = os.path.join(directory or ".", *parts)
        for path in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(path):
                return path
    return ""


def _is_local(name: str, local_dirs: tuple[str, ...]) -> bool:
    """Whether ``name`` would be found outside the installed packages (the user's own code)."""
    top = name.split(".")[0]
    if top in sys.modules:
        return False
    for directory in local_dirs:
        if os.path.exists(os.path.join(directory, top + ".py")) or os.path.isdir(
            os.path.join(directory, top)
        ):
            return True
    return False


def modules_to_preload(
    base: Iterable[str],
    target: str | None,
    module: bool,
    cwd: str,
    late: Iterable[str] = LATE_PRELOAD,
) -> list[str]:
    """``base``, the installed modules the script imports at its top level, then ``late``."""
    names = list(base)
    if target:
        local = [os.path.abspath(cwd)]
        if not module:
            local.append(os.path.dirname(os.path.abspath(os.path.join(cwd, target))))
        local_dirs = tuple(dict.fromkeys(local))
        source = _source_of(target if module else os.path.join(cwd, target), module)
        for name in script_imports(source):
            if not _is_local(name, local_dirs):
                names.append(name)
    return list(dict.fromkeys([*names, *late]))


def preload(names: Iterable[str], cwd: str, stop: Callable[[], bool] = lambda: False) -> list[str]:
    """Import ``names`` with the launcher's directory off ``sys.path``; the ones that worked.
    ``stop()`` is asked between modules: a spare handed its job stops warming up."""
    saved = list(sys.path)
    here = os.path.abspath(cwd)
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != here]
    done = []
    try:
        for name in names:
            if stop():
                break
            try:
                importlib.import_module(name)
                done.append(name)
            except Exception as e:  # left for the script to meet again, as a fresh process
                log.debug("preloading %s failed: %s", name, e)
    finally:
        sys.path[:] = saved
    return done
