"""What a spare worker imports ahead, and the CPU priority it warms up at."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from dlrover_torch import priority
from dlrover_torch.preload import modules_to_preload, preload, script_imports

SCRIPT = textwrap.dedent(
    """
    from __future__ import annotations
    import os, json as js
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from . import sibling
    try:
        import yaml
    except ImportError:
        yaml = None
    if os.environ.get("X"):
        import csv
    else:
        from email import message
    import mylib.models

    def main():
        import late_import_in_a_function
    """
)


def test_top_level_imports_are_found_in_order_without_relative_or_nested_ones():
    assert script_imports(SCRIPT) == [
        "os",
        "json",
        "torch.distributed",
        "torch.nn.parallel",
        "yaml",
        "csv",
        "email",
        "mylib.models",
    ]
    assert script_imports("this is not python(") == []


def test_the_users_own_modules_are_not_preloaded(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("")
    names = modules_to_preload(["torch"], "train.py", False, str(tmp_path), late=["late.mod"])
    assert names[0] == "torch" and names[-1] == "late.mod"
    assert "mylib.models" not in names  # next to the script: the user's code
    assert "torch.distributed" in names and "json" in names


def test_preload_skips_what_fails_and_stops_when_asked(tmp_path):
    assert preload(["json", "no_such_module_xyz", "csv"], str(tmp_path)) == ["json", "csv"]
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1

    assert preload(["json", "csv"], str(tmp_path), stop=stop) == ["json"]


def _autogroup_nice(pid: int) -> int:
    """``/autogroup-N nice K`` gives K; a process that never started a session of its own
    (as a container's init and its children) reads an empty file: the root group, nice 0."""
    with open(f"/proc/{pid}/autogroup") as f:
        text = f.read()
    return int(text.split("nice")[1]) if "nice" in text else 0


@pytest.mark.skipif(priority.lowering_method() != priority.AUTOGROUP, reason="no autogroups")
def test_a_spare_lowers_its_autogroup_and_the_agent_restores_it():
    code = "from dlrover_torch import priority as p; p.lower_self('autogroup'); print(1, flush=1)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "; import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
        start_new_session=True,  # its own autogroup, as every spare
    )
    try:
        assert proc.stdout.readline().strip() == b"1"
        assert _autogroup_nice(proc.pid) == priority.LOW_NICE
        assert _autogroup_nice(os.getpid()) != priority.LOW_NICE  # the caller's is untouched
        priority.restore(proc.pid, priority.AUTOGROUP, 0)
        deadline = time.monotonic() + 5
        while _autogroup_nice(proc.pid) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _autogroup_nice(proc.pid) == 0
    finally:
        proc.kill()
        proc.wait()
