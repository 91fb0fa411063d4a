"""Stuck detection for programs that report nothing: quiet (no step, every node near idle) for
stuck_timeout, with each node's CPU and last log line and the likely cause where it is known."""

from __future__ import annotations

from master.job.stuck import (
    NodeActivity,
    cpu_percent,
    is_quiet,
    likely_cause,
    read_last_line,
    stuck_verdict,
)
from master.nodes.model import Node, NodeState

R = NodeState.RUNNING


def test_cpu_percent_is_the_share_of_one_core_between_two_samples():
    assert cpu_percent(None, 10.0, 5.0) is None
    assert cpu_percent((8.0, 4.0), 10.0, None) is None
    assert cpu_percent((8.0, 4.0), 10.0, 5.0) == 50.0
    assert cpu_percent((8.0, 4.0), 10.0, 3.0) == 0.0  # a new process group: never negative


def test_quiet_only_when_every_running_node_is_measured_and_near_idle():
    idle = [NodeActivity("ps-0", "running", 0.2), NodeActivity("chief-0", "running", 1.0)]
    assert is_quiet(idle)
    assert not is_quiet([*idle, NodeActivity("worker-0", "running", 80.0)])
    assert not is_quiet([*idle, NodeActivity("worker-0", "running", None)])  # unknown
    assert is_quiet([*idle, NodeActivity("worker-0", "succeeded", None)])
    assert not is_quiet([])


def test_the_likely_cause_names_listed_workers_that_do_not_run():
    nodes = [Node("ps", 0, id=1, state=R), Node("chief", 0, id=2, state=R)]
    nodes += [Node("worker", r, id=3 + r, state=R) for r in range(2)]
    listed = {"ps": 1, "chief": 1, "worker": 4}
    cause = likely_cause(nodes, listed, reserved_slots=True)
    assert cause.startswith("worker-2, worker-3 are listed in TF_CONFIG but not running")
    assert "a TF2 coordinator waits for every worker TF_CONFIG lists" in cause
    assert "remove worker.reserve_slots" in cause
    assert likely_cause(nodes, {**listed, "worker": 2}, reserved_slots=False) == ""
    nodes[0].state = NodeState.FAILED
    assert likely_cause(nodes, {"ps": 1}, False).startswith("ps-0 is listed in TF_CONFIG")


def test_a_verdict_after_the_timeout_with_each_nodes_cpu_and_last_line():
    acts = [
        NodeActivity("ps-0", "running", 0.3, "ps 0 serving"),
        NodeActivity("chief-0", "running", 1.5, "Epoch 1/2"),
    ]
    assert stuck_verdict(acts, 19.0, 20.0, "", "report") is None
    assert stuck_verdict(acts, 500.0, 0.0, "", "report") is None  # off
    v = stuck_verdict(acts, 21.0, 20.0, "worker-2 is listed in TF_CONFIG but not running", "report")
    first, *rest = v.message.splitlines()
    assert first.startswith("possibly stuck: no step report and every node near idle for 21s")
    assert first.endswith("likely cause: worker-2 is listed in TF_CONFIG but not running")
    assert rest == [
        "  ps-0 running, cpu 0.3%, last log line: 'ps 0 serving'",
        "  chief-0 running, cpu 1.5%, last log line: 'Epoch 1/2'",
    ]
    assert not v.fail and v.details["nodes"][0] == {
        "name": "ps-0",
        "cpu_percent": 0.3,
        "last_line": "ps 0 serving",
    }
    failing = stuck_verdict(acts, 21.0, 20.0, "", "fail")
    assert failing.fail and failing.message.endswith("failing the job (stuck_action: fail)")


def test_the_last_log_line_of_a_node(tmp_path):
    log = tmp_path / "n.log"
    log.write_text("one\ntwo\n\n")
    assert read_last_line(str(log)) == "two"
    assert read_last_line(str(tmp_path / "missing.log")) == ""
    assert read_last_line("") == ""


def test_process_group_cpu_is_summed_from_proc(tmp_path):
    from master.platform.proc_stats import _TICKS, process_groups_cpu_seconds

    def proc(pid, comm, pgid, utime, stime):
        (tmp_path / str(pid)).mkdir()
        rest = ["S", "1", str(pgid)] + ["0"] * 8 + [str(utime), str(stime), "0", "0"]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(rest))

    proc(10, "python", 10, 3 * _TICKS, _TICKS)
    proc(11, "a (weird) name", 10, _TICKS, 0)  # spaces and parentheses in the command
    proc(12, "other", 12, 7 * _TICKS, 0)
    (tmp_path / "self").mkdir()
    assert process_groups_cpu_seconds([10, 99], str(tmp_path)) == {10: 5.0}
    assert process_groups_cpu_seconds([], str(tmp_path)) == {}
