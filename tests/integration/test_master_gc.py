"""The master runs a job (`run_job`, what `dlrover submit`'s master process runs) with the serving
collector settings, and gives the old ones back."""

from __future__ import annotations

import gc
import sys
import threading
import time

from master.cli.submit import SubmitOptions, run_job
from master.config import parse_job_spec
from master.rpc.serving_gc import YOUNG_THRESHOLD


def test_a_submitted_job_runs_with_the_serving_collector_and_ends_with_the_old_one(tmp_path):
    started, checked = tmp_path / "started", tmp_path / "checked"
    # A trainer that says it runs, then lives until the check below is done (at most 60 s).
    trainer = (
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "deadline = time.monotonic() + 60\n"
        f"while not pathlib.Path({str(checked)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
    )
    job = {
        "name": "gc-settings",
        "command": [sys.executable, "-c", trainer],
        "worker": {"replicas": 1},
    }
    spec = parse_job_spec(job, source="test", base_dir=str(tmp_path))
    before = gc.get_threshold()
    seen: dict = {}

    def watch() -> None:  # the master runs in this process: its settings are this process's
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["threshold"] = gc.get_threshold()
        seen["frozen"] = gc.get_freeze_count()
        checked.touch()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # In the main thread: the master installs its signal handlers.
    code = run_job(spec, SubmitOptions(run_dir=str(tmp_path / "run"), quiet=True, brain="off"))
    watcher.join(5)
    assert code == 0
    assert started.exists(), "the job's trainer never started"
    assert seen["threshold"][0] == YOUNG_THRESHOLD
    assert seen["frozen"] > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
