"""A local Ray cluster that does not start says what its processes were waiting on."""

from __future__ import annotations

import os
import subprocess

import pytest

from master.platform.api import PlatformError
from master.platform.ray import connect


class _NeverStarts:
    """Stands in for the ray module: init fails the way Ray's does when no raylet registers."""

    def __init__(self) -> None:
        self.inits = 0
        self.shutdowns = 0

    def init(self, **kwargs) -> None:
        self.inits += 1
        raise Exception("The current node timed out during startup.")

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_start_that_never_succeeds_names_each_childs_state_and_the_stall_pressure(monkeypatch):
    ray = _NeverStarts()
    monkeypatch.setattr(connect, "import_ray", lambda loopback: ray)
    child = subprocess.Popen(["sleep", "30"])  # what a stuck raylet would be: a child
    try:
        with pytest.raises(PlatformError) as err:
            connect.start_local_cluster(num_cpus=1)
    finally:
        child.kill()
        child.wait()
    assert ray.inits == ray.shutdowns == connect.LOCAL_START_ATTEMPTS
    message = str(err.value)
    assert "timed out during startup" in message
    assert f"sleep[{child.pid}] S " in message  # name, pid, state, then the wait channel
    if os.path.exists("/proc/pressure/io"):  # kernels without PSI say "pressure: n/a"
        assert "io: some avg10=" in message
