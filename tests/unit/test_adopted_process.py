"""An adopted node process is waited on by its reaper and by a stop at the same time."""

import subprocess
import sys
import threading

from master.platform.lifeline_guard import write_exit_file
from master.platform.local import AdoptedProcess


def _adopt_a_process_that_ends(tmp_path, code: int) -> tuple[AdoptedProcess, subprocess.Popen]:
    exit_file = str(tmp_path / "node.exit")
    write_exit_file(exit_file, code)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.05)"])
    return AdoptedProcess(proc.pid, exit_file), proc


def _wait_from_threads(adopted: AdoptedProcess, timeouts: list[float | None]) -> list[object]:
    """What each of len(timeouts) threads, started together, got from adopted.wait()."""
    results: list[object] = []
    start = threading.Barrier(len(timeouts))

    def waiter(timeout):
        start.wait()
        try:
            results.append(adopted.wait(timeout=timeout))
        except BaseException as e:  # any error here is the defect under test
            results.append(e)

    threads = [threading.Thread(target=waiter, args=(t,)) for t in timeouts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_every_concurrent_waiter_gets_the_exit_status(tmp_path):
    """The reaper (no timeout) and a stop's grace wait (a timeout) both see the end, unharmed."""
    for _ in range(40):
        adopted, proc = _adopt_a_process_that_ends(tmp_path, 7)
        results = _wait_from_threads(adopted, [None, 30, None, 30])
        proc.wait()
        assert results == [7, 7, 7, 7]
        assert adopted.wait() == 7  # a later wait returns at once


def test_a_wait_that_times_out_leaves_the_process_watched(tmp_path):
    adopted, proc = _adopt_a_process_that_ends(tmp_path, 3)
    try:
        adopted.wait(timeout=0.01)
    except subprocess.TimeoutExpired as e:
        assert str(proc.pid) in str(e.cmd)
    else:
        raise AssertionError("a 10 ms wait on a 50 ms process did not time out")
    assert adopted.wait(timeout=30) == 3
    proc.wait()
