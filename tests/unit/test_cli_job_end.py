"""A job the user stopped is reported as stopped, not failed: summary, screen and exit code."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from master.cli.exit_codes import EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED, job_exit_code
from master.cli.main import build_parser, main
from master.cli.run_layout import run_layout
from master.cli.submit import build_summary, print_summary
from master.config import load_job_spec
from master.job.model import JobState
from master.state.factory import open_state_store
from master.state.job_record import JOB_TABLE


def _ended_job(state: JobState, reason: str) -> SimpleNamespace:
    """What build_summary reads of a job that ended in `state`, with no nodes or data."""
    return SimpleNamespace(
        state=state,
        reason=reason,
        global_step=7,
        sharding=SimpleNamespace(stats=list),
        nodes=SimpleNamespace(history=list),
        events=[],
        runtime=SimpleNamespace(run_dir="/runs/x", dashboard_url=""),
        wall_seconds=1.5,
    )


@pytest.mark.parametrize(
    ("state", "code"),
    [
        (JobState.SUCCEEDED, EXIT_SUCCEEDED),
        (JobState.FAILED, EXIT_FAILED),
        (JobState.STOPPED, EXIT_STOPPED),
        (JobState.RUNNING, EXIT_FAILED),  # the master ended with its job still going
    ],
)
def test_the_summary_and_exit_code_say_how_the_job_ended(state, code):
    summary = build_summary(_ended_job(state, "why"))
    assert summary["status"] == (state.value if state.ended else "failed")
    assert job_exit_code(summary["status"]) == code


def test_a_stopped_job_is_reported_stopped_on_screen():
    out = io.StringIO()
    print_summary(build_summary(_ended_job(JobState.STOPPED, "interrupted by SIGINT")), out)
    assert out.getvalue().startswith("\n== job stopped in 1.5s: interrupted by SIGINT\n")


def test_the_help_of_submit_and_master_names_the_exit_codes():
    parser = build_parser()
    for cmd in ("submit", "master"):
        sub = parser._subparsers._group_actions[0].choices[cmd]
        text = " ".join(sub.format_help().split())
        assert f"{EXIT_STOPPED} it was stopped (Ctrl-C, SIGTERM)" in text, text
        assert f"{EXIT_FAILED} it failed" in text


def test_a_master_pod_restarted_after_the_job_was_stopped_ends_with_the_stopped_code(
    tmp_path, capsys
):
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text("name: halted\ncommand: [python, -c, pass]\nworker: {replicas: 1}\n")
    run_dir = tmp_path / "runs" / "halted-1"
    layout = run_layout(load_job_spec(str(job_yaml)), str(run_dir))
    store = open_state_store(layout.state, job=layout.namespace)
    store.put(JOB_TABLE, "runtime", b"{}")
    store.put(JOB_TABLE, "status", json.dumps({"state": "stopped", "reason": "by user"}).encode())
    store.close()
    argv = ["master", str(job_yaml), "--run-dir", str(run_dir), "--resume-if-started"]
    assert main(argv) == EXIT_STOPPED
    assert "the job already ended (stopped)" in capsys.readouterr().err
