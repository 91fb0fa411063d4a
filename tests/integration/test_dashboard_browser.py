"""The dashboard of a running job in a real headless browser (Debian's chromium), with the
screenshots README shows: docs/dashboard.png and docs/status.txt (`dlrover status`), rewritten
only with DLROVER_UPDATE_DOCS=1 (otherwise they go to the test's tmp dir: a test run leaves the
checkout as it was)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.integration.test_local_job import DLROVER, start_submit, write_job
from tests.integration.test_observability import dashboard_token, read_header

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")
STORY_TIMEOUT_SECONDS = 300
UPDATE_DOCS_ENV = "DLROVER_UPDATE_DOCS"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    # Lets the page's fetches and timers run before the DOM is dumped or the shot taken.
    "--virtual-time-budget=6000",
)


def chromium() -> str:
    """The chromium binary; skips outside CI when it is absent, fails in CI (CI=true)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    message = "Debian's chromium is not installed: `apt-get install -y chromium` (.ci/run does it)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def run_chromium(binary: str, profile: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def get_json(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def dlrover_status(header: dict, *args: str) -> subprocess.CompletedProcess:
    token_file = os.path.join(header["run_dir"], ".job_token")
    return subprocess.run(
        [*DLROVER, "status", "--addr", header["addr"], "--token-file", token_file, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dashboard_of_a_running_job_in_headless_chromium(tmp_path):
    binary = chromium()
    # A job that outlives the test on any machine (the test stops it): on a loaded one the
    # browser steps take minutes, and a job that ended meanwhile has no master to ask.
    # Heartbeats get 30 s: with 3 s a loaded machine loses some, and relaunches nodes the
    # story does not expect. Steps of 50 ms: scheduling delays on a loaded machine (a few ms)
    # would double 10 ms steps and make an equal worker look like a straggler.
    job = write_job(
        tmp_path,
        env={"FAKE_SIZE": "60000", "FAKE_EPOCHS": "20", "FAKE_STEP_SECONDS": "0.05"},
        heartbeat_timeout_seconds=30,
    )
    proc = start_submit(job, tmp_path, "--kill", "worker:1@step=100")
    try:
        header = read_header(proc)
        url = header["dashboard"]
        token = dashboard_token(header["run_dir"])
        # Wait for a story worth showing: the kill, the relaunch and some training after it.
        # The job is "pending" until its nodes run (long on a loaded machine), then "running".
        deadline = time.monotonic() + STORY_TIMEOUT_SECONDS
        status = get_json(url + "api/status", token)
        while not (
            any(e["kind"] == "relaunch" for e in status["events"])
            and all(n["state"] == "running" and n["steps"] > 20 for n in status["nodes"])
            and sum(s["loss"] is not None for s in get_json(url + "api/series", token)["samples"])
            >= 3
        ):
            assert status["state"] in ("pending", "running"), status
            assert time.monotonic() < deadline, f"no relaunch and training after it: {status}"
            time.sleep(0.2)
            status = get_json(url + "api/status", token)
        # Without logging in, a browser gets the 401 page that says how to.
        refused = run_chromium(binary, str(tmp_path / "profile-anon"), "--dump-dom", url)
        assert "--show-dashboard-token" in refused.stdout, refused.stdout[-2000:]
        assert 'data-loaded="true"' not in refused.stdout
        # A user logs in with the link `dlrover status --show-dashboard-token` prints; the
        # browser then holds a session cookie, and the page's own fetches carry it.
        linked = dlrover_status(header, "--show-dashboard-token")
        assert linked.returncode == 0, linked.stderr
        [link] = re.findall(r"^dashboard (\S+\?token=\S+)$", linked.stdout, re.MULTILINE)
        assert link == f"{url}?token={token}"
        for attempt in range(3):  # a loaded machine may starve the first browser start
            dom = run_chromium(binary, str(tmp_path / f"profile-dom{attempt}"), "--dump-dom", link)
            if dom.returncode == 0 and 'data-loaded="true"' in dom.stdout:
                break
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert 'data-loaded="true"' in dom.stdout, dom.stdout[-3000:] + dom.stderr[-2000:]
        rows = re.findall(r'<tr data-node="([^"]+)">', dom.stdout)
        assert rows == ["worker-0", "worker-1"], dom.stdout[-3000:]
        assert 'id="job-state" class="badge st-running">running<' in dom.stdout
        assert "relaunch" in dom.stdout  # the event list
        # A line in each chart: steps/s, records/s and the loss the trainer reports.
        assert dom.stdout.count("<path ") == 3, dom.stdout[-3000:]
        docs = DOCS if os.environ.get(UPDATE_DOCS_ENV) == "1" else str(tmp_path)
        shot = os.path.join(docs, "dashboard.png")
        if os.path.exists(shot):
            os.remove(shot)
        for attempt in range(3):  # as above: a starved browser may end without its screenshot
            shot_run = run_chromium(
                binary,
                str(tmp_path / f"profile-shot{attempt}"),
                f"--screenshot={shot}",
                "--window-size=1280,1000",
                link,
            )
            if shot_run.returncode == 0 and os.path.exists(shot):
                break
        assert shot_run.returncode == 0, shot_run.stderr[-2000:]
        assert os.path.exists(shot), shot_run.stderr[-2000:]
        with open(shot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        screen = dlrover_status(header)
        assert screen.returncode == 0, screen.stderr
        assert token not in screen.stdout and f"dashboard {url}\n" in screen.stdout
        assert re.search(r"\n  worker-1 +\d+  running +1 ", screen.stdout), screen.stdout
        # Equal workers: the relaunched one is not taken for a straggler.
        assert "straggler" not in screen.stdout, screen.stdout
        assert "steps/s" in screen.stdout and "relaunch" in screen.stdout
        with open(os.path.join(docs, "status.txt"), "w") as f:
            f.write(f"$ dlrover status --addr {header['addr']} --token-file RUN_DIR/.job_token\n")
            f.write(screen.stdout)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "job stopped" in out
    # The token was used in URLs and headers all along, and is in no output or log of the job.
    assert token not in out
    for folder, _, files in os.walk(header["run_dir"]):
        for name in files:
            if name != ".dashboard_token":
                with open(os.path.join(folder, name), "rb") as f:
                    assert token.encode() not in f.read(), name
