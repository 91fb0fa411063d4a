"""Diagnosis rules: exit status + log tail + timing -> classified cause with an excerpt."""

from __future__ import annotations

import signal

import pytest

from master.job.diagnosis import diagnose_exit, exception_excerpt, find_stragglers
from master.job.events import EventLog, JobEvent, read_events
from master.nodes.model import ExitReason, Node
from master.nodes.policy import Action, decide_on_exit

TRACEBACK = """\
I1122 step 0 starting
Traceback (most recent call last):
  File "/job/train.py", line 40, in <module>
    main()
  File "/job/train.py", line 12, in main
    cfg = load(path)
KeyError: 'learning_rate'
"""

SYNTAX_ERROR = """\
  File "/job/train.py", line 3
    def main(:
             ^
SyntaxError: invalid syntax
"""


def test_startup_exception_is_a_deterministic_user_error_with_the_traceback():
    d = diagnose_exit(1, TRACEBACK, started=False)
    assert d.reason == ExitReason.USER_ERROR and d.deterministic
    assert d.excerpt.startswith("Traceback (most recent call last):")
    assert d.excerpt.endswith("KeyError: 'learning_rate'")
    assert "step 0 starting" not in d.excerpt
    assert "KeyError" in d.summary and "start-up" in d.summary


def test_the_same_exception_after_training_started_is_not_deterministic():
    d = diagnose_exit(1, TRACEBACK, started=True)
    assert d.reason == ExitReason.USER_ERROR and not d.deterministic


def test_syntax_error_without_traceback_header_is_found():
    d = diagnose_exit(1, "log line\n" + SYNTAX_ERROR, started=False)
    assert d.reason == ExitReason.USER_ERROR and d.deterministic
    assert d.excerpt.splitlines()[0].startswith('  File "/job/train.py", line 3')
    assert d.excerpt.endswith("SyntaxError: invalid syntax")


def test_communication_error_at_start_is_relaunched_not_failed():
    tail = (
        'Traceback (most recent call last):\n  File "t.py", line 1, in <module>\n'
        "tensorflow.python.framework.errors_impl.UnavailableError: failed to connect to all "
        "addresses\n"
    )
    d = diagnose_exit(1, tail, started=False)
    assert d.reason == ExitReason.COMM_ERROR and not d.deterministic
    assert "UnavailableError" in d.excerpt


def test_oom_patterns_and_memory_limit():
    assert diagnose_exit(1, "Traceback (most recent call last):\nMemoryError\n").reason == (
        ExitReason.OOM
    )
    assert diagnose_exit(-9, "", oom_killed=True).reason == ExitReason.OOM
    near_limit = diagnose_exit(-9, "", memory_limit_mb=1000, last_rss_bytes=950 * 2**20)
    assert near_limit.reason == ExitReason.OOM and "1000 MB limit" in near_limit.summary
    far_from_limit = diagnose_exit(-9, "", memory_limit_mb=1000, last_rss_bytes=100 * 2**20)
    assert far_from_limit.reason == ExitReason.KILLED


def test_signals_hardware_and_plain_exits():
    assert diagnose_exit(-signal.SIGKILL, "Connection refused\n").reason == ExitReason.KILLED
    assert diagnose_exit(137, "").reason == ExitReason.KILLED
    assert diagnose_exit(-signal.SIGBUS, "").reason == ExitReason.HARDWARE
    assert diagnose_exit(1, "CUDA error: uncorrectable ECC error encountered\n").reason == (
        ExitReason.HARDWARE
    )
    assert diagnose_exit(3, "fatal: deliberate failure\n").reason == ExitReason.UNKNOWN
    assert diagnose_exit(0, TRACEBACK).reason == ExitReason.SUCCEEDED
    assert diagnose_exit(1, TRACEBACK, stop_requested=True).reason == ExitReason.STOPPED


def test_a_node_report_wins_over_the_exit_code():
    d = diagnose_exit(1, TRACEBACK, reported=ExitReason.OOM)
    assert d.reason == ExitReason.OOM and "KeyError" in d.excerpt


def test_long_tracebacks_are_cut_to_the_innermost_frames():
    frames = "".join(f'  File "m{i}.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(40))
    excerpt = exception_excerpt("Traceback (most recent call last):\n" + frames + "ValueError: x")
    lines = excerpt.splitlines()
    assert lines[0].startswith("Traceback") and lines[1] == "  ..." and lines[-1] == "ValueError: x"
    assert len(lines) <= 15 and "m39.py" in excerpt
    assert exception_excerpt("all good\nno errors here\n") == ""


def test_deterministic_failure_fails_the_job_without_relaunch():
    node = Node("worker", 0, 1, exit_code=1)
    decision = decide_on_exit(node, ExitReason.USER_ERROR, 3, 0, 10, False, deterministic=True)
    assert decision.action == Action.FAIL_JOB and "fail the same way" in decision.reason
    again = decide_on_exit(node, ExitReason.USER_ERROR, 3, 0, 10, False, deterministic=False)
    assert again.action == Action.RELAUNCH
    evaluator = Node("evaluator", 0, 2, exit_code=1)
    assert (
        decide_on_exit(evaluator, ExitReason.USER_ERROR, 3, 0, 10, False, True).action
        == Action.NONE
    )


def test_stragglers_are_measured_against_their_peers_median():
    found = find_stragglers({1: 0.01, 2: 0.011, 3: 0.05})
    assert list(found) == [3] and round(found[3], 3) == round(0.05 / 0.0105, 3)
    assert find_stragglers({1: 0.01, 2: 0.03}) == {2: 3.0}
    assert find_stragglers({1: 0.01, 2: 0.015}) == {}
    assert find_stragglers({1: 0.5}) == {}


def test_stragglers_match_each_peers_median_taken_one_by_one():
    import random
    import statistics

    rng = random.Random(7)
    for n in (2, 3, 4, 5, 8, 51, 200):
        # Ties too (times drawn from a few values), and a few slow ones.
        times = {i: rng.choice([0.01, 0.01, 0.012, 0.02, 0.05, 0.3]) for i in range(n)}
        expected = {}
        for i, t in times.items():
            median = statistics.median([s for j, s in times.items() if j != i])
            if t > 2.0 * median:
                expected[i] = t / median
        assert find_stragglers(times) == pytest.approx(expected), n


def test_events_round_trip_through_the_jsonl_file(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"))
    seen = []
    log.add_listener(seen.append)
    log.add_listener(lambda e: 1 / 0)  # a broken listener is logged, not fatal
    event = JobEvent(1.5, "node_failed", "worker-1 killed", "worker", 1, 7, "killed", {"x": 1})
    log.append(event)
    assert seen == [event] and len(log) == 1 and log.since(1) == []
    assert read_events(str(tmp_path)) == [event]
    assert event.node == "worker-1"


def test_node_side_memory_limit_from_cgroup_files(tmp_path):
    from master.client import cgroup_memory_limit

    limit = tmp_path / "memory.max"
    limit.write_text("268435456\n")
    assert cgroup_memory_limit((str(tmp_path / "absent"), str(limit))) == 256 * 2**20
    limit.write_text("max\n")
    assert cgroup_memory_limit((str(limit),)) == 0
    limit.write_text(str(2**63 - 4096))  # cgroup v1 "unlimited"
    assert cgroup_memory_limit((str(limit),)) == 0
