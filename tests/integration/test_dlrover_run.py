"""dlrover-run on one node (with the local master it starts): restarts, resume, hangs, env."""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.dlrover_run_helpers import (
    events,
    kill_tree,
    run_launcher,
    script_args,
    start_launcher,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)


def _done(evs: list[dict], steps: int) -> list[dict]:
    return [e for e in evs if e["event"] == "done" and e["step"] == steps]


def test_worker_sigkill_restarts_group_and_resumes_from_checkpoint(tmp_path):
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    out = run_launcher(flags, script_args(tmp_path, "--steps", "30", "--kill-at-step", "8"), 150)
    assert out.returncode == 0, out.stdout[-3000:]
    evs = events(tmp_path)
    first_loop = [e for e in evs if e["event"] == "loop" and e["restart"] == 1]
    assert sorted(e["rank"] for e in first_loop) == [0, 1]
    # The new group resumed from the script's own checkpoint, not from step 0.
    assert all(e["step"] >= 7 for e in first_loop), first_loop
    assert sorted(e["rank"] for e in _done(evs, 30)) == [0, 1]
    assert all(e["restart"] == 1 for e in _done(evs, 30))
    assert "worker_failure" in out.stdout


def test_torchrun_environment_module_mode_and_no_spares(tmp_path):
    """The variables a torchrun script reads, in module mode, with fresh processes, and logs."""
    flags = ["--standalone", "--nproc-per-node", "2", "--no-spare-workers", "--rdzv-id", "envjob"]
    flags += ["--log-dir", str(tmp_path / "logs"), "--tee", "1"]
    argv = ["-m", "tests.integration.dlrover_run_script", *script_args(tmp_path)[1:]]
    out = run_launcher(flags, argv, 120)
    assert out.returncode == 0, out.stdout[-3000:]
    # --tee 1: stdout both in the console (prefixed) and in the per-rank log files.
    assert "script rank 1 of 2 starting" in out.stdout
    logs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(logs) == 2 and "script rank 0 of 2 starting" in logs[0].read_text()
    starts = sorted((e for e in events(tmp_path) if e["event"] == "start"), key=lambda e: e["rank"])
    assert [e["env"]["RANK"] for e in starts] == ["0", "1"]
    assert [e["env"]["LOCAL_RANK"] for e in starts] == ["0", "1"]
    for e in starts:
        env = e["env"]
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == "envjob"
        assert env["ROLE_NAME"] == "default"
        assert e["argv"][:2] == ["--ckpt", str(tmp_path / "ckpt.pt")]


def test_spare_workers_write_redirected_logs(tmp_path):
    flags = ["--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs")]
    flags += ["--redirects", "3"]
    out = run_launcher(flags, script_args(tmp_path, "--steps", "3"), 120)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "script rank" not in out.stdout  # redirected, not on the console
    logs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert [p.parent.name for p in logs] == ["0", "1"]
    assert "script rank 1 of 2 starting" in logs[1].read_text()


def test_sigterm_stops_workers_and_exits(tmp_path):
    proc = start_launcher(
        ["--standalone", "--nproc-per-node", "2"],
        script_args(tmp_path, "--steps", "100000", "--step-seconds", "0.05"),
        tmp_path / "launcher.log",
    )
    try:
        loops = lambda: [e for e in events(tmp_path) if e["event"] == "loop"]  # noqa: E731
        wait_for(lambda: len(loops()) == 2, 120, "both ranks in the loop")
        pids = [e["pid"] for e in events(tmp_path) if e["event"] == "loop"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 1  # as torchrun: SignalException ends the launcher with 1
        for pid in pids:
            wait_for(lambda pid=pid: not _alive(pid), 30, f"worker {pid} to exit")
    finally:
        kill_tree(proc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hung_rank_is_restarted_with_a_reason(tmp_path):
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    flags += ["--hang-timeout", "3"]
    argv = script_args(tmp_path, "--steps", "20", "--hang-at-step", "5")
    out = run_launcher(flags, argv, 150)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "[hang] local rank" in out.stdout and "reported no step" in out.stdout
    evs = events(tmp_path)
    assert any(e["event"] == "hang" for e in evs)
    assert sorted(e["rank"] for e in _done(evs, 20)) == [0, 1]
    assert all(e["restart"] == 1 for e in _done(evs, 20))


def test_hang_without_step_reports_is_found_from_cpu_activity(tmp_path):
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    flags += ["--hang-timeout", "3", "--hang-cpu-percent", "5"]
    argv = script_args(tmp_path, "--steps", "15", "--hang-at-step", "5", "--no-report")
    out = run_launcher(flags, argv, 150)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "[hang] local rank" in out.stdout and "CPU" in out.stdout
    assert sorted(e["rank"] for e in _done(events(tmp_path), 15)) == [0, 1]


def test_failures_beyond_max_restarts_fail_the_run_with_a_summary(tmp_path):
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
    out = run_launcher(flags, script_args(tmp_path, "--steps", "20", "--exit-at-step", "3"), 120)
    assert out.returncode == 1
    assert "the workers failed" in out.stdout and "exit code 3" in out.stdout
    assert not _done(events(tmp_path), 20)


@pytest.mark.slow
def test_twenty_crash_and_restart_cycles_never_hang(tmp_path):
    """20 SIGKILLs of a worker in one run: every restart must come back (no hang)."""
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "20"]
    flags += ["--hang-timeout", "30"]
    argv = script_args(tmp_path, "--steps", "84", "--crash-every", "4", "--max-crashes", "20")
    argv += ["--step-seconds", "0.1"]
    out = run_launcher(flags, argv, 170)
    assert out.returncode == 0, out.stdout[-3000:]
    evs = events(tmp_path)
    restarts = {e["restart"] for e in evs if e["event"] == "loop"}
    assert restarts == set(range(21)), sorted(restarts)
    assert sorted(e["rank"] for e in _done(evs, 84)) == [0, 1]
    assert "[hang]" not in out.stdout
