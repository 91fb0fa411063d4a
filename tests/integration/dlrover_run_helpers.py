"""Helpers for the dlrover-run tests: start launchers, read the script's milestones, clean up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("dlrover_run_script.py"))
DLROVER_RUN = [sys.executable, "-m", "dlrover_torch.run"]


def base_env(**extra: str) -> dict[str, str]:
    """The launcher's environment: the repo importable, no inherited dlrover identity."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "PET_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def script_args(tmp: Path, *extra: str) -> list[str]:
    return [SCRIPT, "--ckpt", str(tmp / "ckpt.pt"), "--events", str(tmp / "events.jsonl"), *extra]


def run_launcher(
    flags: Sequence[str], argv: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run dlrover-run to the end; its stdout+stderr come back as text."""
    return subprocess.run(
        [*DLROVER_RUN, *flags, *argv],
        env=env or base_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def start_launcher(
    flags: Sequence[str], argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start dlrover-run in the background (its own session), output to a log file."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*DLROVER_RUN, *flags, *argv],
            env=env or base_env(),
            cwd=str(REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher's whole session (agent, workers, spares)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def events(tmp: Path) -> list[dict]:
    path = tmp / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written right now
    return out


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> object:
    """Poll cond until truthy; fail the test with `what` when it never is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
