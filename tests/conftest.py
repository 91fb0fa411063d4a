"""Suite-wide options: ``--stress`` runs the tests marked ``stress`` (left out by default); the
xdist groups of tests that must not run side by side."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress",
        action="store_true",
        help="run the stress tests (@pytest.mark.stress: many repetitions, minutes each)",
    )


# Under `pytest -n 2 --dist loadgroup` (what `make test` runs), the tests of one group run in
# one worker, one at a time: the Ray clusters (two at once would share Ray's ports and this
# user's Ray session dir), the other end-to-end jobs (each a machine's worth of processes), and
# the tests that sweep this user's shared memory (/dev/shm) machine-wide. A path's first match
# wins: a Ray end-to-end job is in `ray`.
SERIAL_GROUPS = {
    "ray": ("ray",),
    "e2e": ("tests/e2e/",),
    "shm": ("flash_checkpoint", "test_ckpt_", "torch_sharded", "torch_data"),
}


def serial_group(path: str) -> str | None:
    """The group whose tests must not run beside each other that a test file belongs to."""
    for group, parts in SERIAL_GROUPS.items():
        if any(part in path for part in parts):
            return group
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = serial_group(item.nodeid.split("::")[0])
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if config.getoption("--stress"):
        return
    kept = [item for item in items if "stress" not in item.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if "stress" in i.keywords])
        items[:] = kept
