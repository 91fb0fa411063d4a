"""`--state :memory:` is honoured: the master keeps its state in memory, says that nothing of it
is durable, and writes no state file."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from master.cli.run_layout import STATE_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _master(tmp_path, *args: str) -> subprocess.CompletedProcess:
    job = {"name": "mem", "command": [sys.executable, "-c", "pass"], "worker": {"replicas": 1}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    argv = [sys.executable, "-m", "master.cli", "master", str(tmp_path / "job.yaml")]
    argv += ["--run-dir", str(tmp_path / "run"), "--brain", "off", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_an_in_memory_state_is_kept_in_memory_and_said_to_have_no_durability(tmp_path):
    proc = _master(tmp_path, "--state", ":memory:")
    assert proc.returncode == 0, proc.stderr
    assert "the state is in memory (--state :memory:): no durability" in proc.stderr
    assert not (tmp_path / "run" / STATE_FILE).exists()
    assert not (tmp_path / ":memory:").exists() and not os.path.exists(
        os.path.join(ROOT, ":memory:")
    )


def test_without_state_the_run_dir_keeps_a_durable_state_file(tmp_path):
    proc = _master(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no durability" not in proc.stderr
    assert (tmp_path / "run" / STATE_FILE).exists()
