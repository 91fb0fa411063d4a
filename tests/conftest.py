"""Suite-wide options: ``--stress`` runs the tests marked ``stress`` (left out by default)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress",
        action="store_true",
        help="run the stress tests (@pytest.mark.stress: many repetitions, minutes each)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--stress"):
        return
    kept = [item for item in items if "stress" not in item.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if "stress" in i.keywords])
        items[:] = kept
