"""The lifeline guard ends the way its command ended: same exit code, or same signal."""

import os
import signal
import subprocess
import sys

import pytest

from master.platform.lifeline_guard import GUARD_MODULE, read_exit_file


def run_guarded(code: str, tmp_path) -> tuple[int, int | None]:
    """Run `python -c code` under the guard; its return code and the exit file's status."""
    exit_file, errors = str(tmp_path / "exit"), tmp_path / "stderr"
    read_end, write_end = os.pipe()
    cmd = [sys.executable, "-m", GUARD_MODULE, str(read_end), "--exit-file", exit_file]
    cmd += ["--", sys.executable, "-c", code]
    try:
        with open(errors, "wb") as err:
            # Its own process group: the guard's sentinel kills the group once the lifeline
            # closes; output to a file: the sentinel holds it open until then.
            proc = subprocess.Popen(
                cmd, pass_fds=(read_end,), stdout=err, stderr=err, start_new_session=True
            )
        returncode = proc.wait(timeout=60)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert errors.read_text() == ""
    return returncode, read_exit_file(exit_file)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_command_killed_by_a_signal_ends_the_guard_by_that_signal(sig, tmp_path):
    # SIGKILL to the command alone is what the OOM killer does.
    code = f"import os; os.kill(os.getpid(), {int(sig)})"
    assert run_guarded(code, tmp_path) == (-sig, -sig)


def test_the_command_exit_code_is_the_guard_exit_code(tmp_path):
    assert run_guarded("raise SystemExit(3)", tmp_path) == (3, 3)
