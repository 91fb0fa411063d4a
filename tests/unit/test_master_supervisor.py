"""A supervisor's orphan reaper never takes an exit status that is not an orphan's."""

import subprocess
import sys
import textwrap

# Run in its own process: a supervisor makes its process a child subreaper for good.
SCENARIO = textwrap.dedent(
    """
    import io, subprocess, sys, threading, time
    from master.cli.supervisor import MasterSupervisor, REAP_INTERVAL_SECONDS

    # A first master that exits at once (as one whose port was taken), then what comes after
    # it in the same process: another process whose exit status is read late.
    first = MasterSupervisor(
        [sys.executable, "-c", "import sys; sys.exit(75)"], sys.argv[1], io.StringIO(),
        state=sys.argv[1] + "/none.sqlite",
    )
    print("first", first.run())
    later = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    time.sleep(4 * REAP_INTERVAL_SECONDS)  # exited meanwhile, not waited for yet
    print("later", later.wait())
    print("reapers", sum(t.name == "reaper" for t in threading.enumerate()))
    """
)


def test_the_reaper_ends_with_its_supervisor_and_leaves_later_children_alone(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCENARIO, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # Before the fix, the first supervisor's reaper went on and reaped the later process, whose
    # Popen.wait then said 0: `dlrover submit` once ended 0 when its master's port was taken.
    assert out.stdout.split("\n")[:3] == ["first 75", "later 3", "reapers 0"], out.stdout
