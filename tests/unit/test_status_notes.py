"""`dlrover status` shows a job that may be stuck, and nodes stopped because the job is done."""

from __future__ import annotations

from master.nodes.manager import NodeManager
from master.nodes.model import ExitReason
from master.observability.status_view import render_status
from master.state.sqlite import SQLiteStateStore


def _doc(**changes):
    doc = {
        "name": "tfjob",
        "state": "running",
        "reason": "",
        "stuck": "",
        "global_step": 0,
        "elapsed_seconds": 200.0,
        "started_at": 1000.0,
        "cluster_version": 1,
        "steps_per_second": 0.0,
        "records_per_second": 0.0,
        "datasets": [],
        "nodes": [
            {
                "name": "ps-0",
                "id": 1,
                "state": "deleted",
                "relaunches": 0,
                "cpu_percent": 0.0,
                "memory_rss_bytes": 0,
                "steps": 0,
                "step_seconds": 0.0,
                "straggler": False,
                "diagnosis": "stopped: job done",
                "exit_reason": "stopped",
            }
        ],
        "events": [],
        "event_count": 0,
    }
    return {**doc, **changes}


def test_the_status_screen_says_possibly_stuck_and_stopped_job_done():
    text = render_status(_doc(stuck="possibly stuck: no step report ..."), now=1200.0)
    assert text.splitlines()[2] == "  possibly stuck: no step report ..."
    assert "ps-0" in text and text.split("ps-0")[1].splitlines()[0].endswith("stopped: job done")
    assert "possibly stuck" not in render_status(_doc(), now=1200.0)


def test_why_the_master_stopped_a_node_survives_a_master_restart(tmp_path):
    path = str(tmp_path / "state.db")
    before = NodeManager(SQLiteStateStore(path))
    ps = before.new_incarnation("ps", 0, 0, 0)
    ps.stop_requested, ps.stop_cause = True, "job done"
    before.save(ps)
    before.mark_exited(ps.id, -15, ExitReason.STOPPED)
    after = NodeManager(SQLiteStateStore(path))
    after.restore()
    [restored] = [n for n in after.history() if n.id == ps.id]
    assert (restored.exit_reason, restored.stop_cause) == (ExitReason.STOPPED, "job done")
