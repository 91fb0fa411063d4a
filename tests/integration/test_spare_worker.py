"""A spare worker is indistinguishable from ``python -u script.py``: status, output, files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from dlrover_torch.worker_pool import SparePool, WorkerCommand

SCRIPT = textwrap.dedent(
    """
    import atexit, os, signal, sys, threading, time
    import noisy_module

    out = open(os.environ["UNCLOSED"], "w")
    out.write("written, never closed")
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
    print("main", __name__, os.path.basename(__file__), sys.argv[1:], flush=True)
    mode = sys.argv[1]
    if mode == "exit3":
        sys.exit(3)
    if mode == "message":
        sys.exit("a message instead of a code")
    if mode == "raise":
        raise ValueError("boom")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    """
)
MODES = {"end": 0, "exit3": 3, "message": 1, "raise": 1, "interrupt": -2, "segv": -11}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "noisy_module.py").write_text("print('noisy import', flush=True)\n")
    (tmp_path / "train.py").write_text(SCRIPT)
    # the spares see it too: they import the script's imports before their job arrives
    monkeypatch.setenv("PYTHONPATH", f"{lib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _outcome(tmp, name: str, code: int) -> dict:
    def read(path):
        return (tmp / path).read_text() if (tmp / path).exists() else None

    return {
        "code": code,
        "stdout": read(f"{name}.out"),
        "stderr": read(f"{name}.err"),
        "unclosed": read(f"{name}.unclosed"),
    }


def _fresh(tmp, mode: str) -> dict:
    env = dict(os.environ, UNCLOSED=str(tmp / "fresh.unclosed"))
    with open(tmp / "fresh.out", "w") as out, open(tmp / "fresh.err", "w") as err:
        code = subprocess.run(
            [sys.executable, "-u", "train.py", mode], env=env, stdout=out, stderr=err, timeout=60
        ).returncode
    return _outcome(tmp, "fresh", code)


def _spare(tmp, pool: SparePool, mode: str) -> dict:
    env = dict(os.environ, UNCLOSED=str(tmp / "spare.unclosed"))
    proc = pool.run_job(
        "train.py", [mode], env, stdout=str(tmp / "spare.out"), stderr=str(tmp / "spare.err")
    )
    return _outcome(tmp, "spare", proc.wait(60))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_spare_ends_exactly_like_a_fresh_process(workdir, mode):
    pool = SparePool(1, preload=(), late_preload=(), command=WorkerCommand("train.py", ()))
    pool.fill()
    try:
        fresh = _fresh(workdir, mode)
        spare = _spare(workdir, pool, mode)
    finally:
        pool.close()
    assert fresh["code"] == MODES[mode]
    # Same status, output, flushed files; tracebacks name the script's frames only.
    assert spare == fresh
    assert spare["stdout"].count("noisy import") == 1  # printed at warm-up, replayed here once


def test_stdin_of_the_launcher_reaches_the_worker(workdir):
    (workdir / "echo.py").write_text("import sys; print(sys.stdin.read().strip())\n")
    (workdir / "feed.py").write_text(
        textwrap.dedent(
            """
            import sys
            from dlrover_torch.worker_pool import SparePool, WorkerCommand
            pool = SparePool(1, preload=(), late_preload=(), command=WorkerCommand("echo.py", ()))
            pool.fill()
            proc = pool.run_job("echo.py", [], dict(__import__("os").environ))
            sys.exit(proc.wait(60))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "feed.py"], input="piped to the launcher", capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "piped to the launcher"


def test_closing_the_pool_gives_low_priority_spares_their_priority_back_before_they_exit(
    workdir, monkeypatch
):
    """On a busy machine a spare at nice 19 takes tens of seconds to exit; the agent, whose
    node's work is done, must not wait that long (seen: a node killed as silent meanwhile)."""
    from dlrover_torch import priority

    if priority.lowering_method() == priority.NONE:
        pytest.skip("this machine lets no process lower its priority and raise it back")
    order = []
    real_restore = priority.restore
    monkeypatch.setattr(
        priority, "restore", lambda pid, *a: (order.append(("restore", pid)), real_restore(pid, *a))
    )
    pool = SparePool(1, preload=(), late_preload=(), command=WorkerCommand("train.py", ()))
    pool.refill()  # at low priority, as after every group start
    (spare,) = pool._idle
    real_close = spare.stdin.close
    monkeypatch.setattr(
        spare.stdin, "close", lambda: (order.append(("eof", spare.pid)), real_close())
    )
    pool.close()
    assert order[:2] == [("restore", spare.pid), ("eof", spare.pid)]
    # close() waits a bounded time for the SIGKILLed spare; on a loaded machine its exit may
    # take longer (seen: more than 5 s), and it must still come.
    deadline = time.monotonic() + 60
    while spare.poll() is None:
        assert time.monotonic() < deadline, f"spare {spare.pid} still running 60 s after close"
        time.sleep(0.1)
