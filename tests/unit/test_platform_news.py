"""The platform's own news (retried API calls, held-up nodes) becomes job events, once each."""

from __future__ import annotations

from master.job.platform_news import PlatformNews, new_notices, trouble_changes
from master.nodes.manager import NodeManager
from master.state.sqlite import SQLiteStateStore


def test_only_lines_after_what_was_seen_are_new_even_when_old_ones_fell_off():
    assert new_notices([], ["a", "b"]) == ["a", "b"]
    assert new_notices(["a", "b"], ["a", "b", "c"]) == ["c"]
    assert new_notices(["a", "b", "c"], ["b", "c", "d", "e"]) == ["d", "e"]  # "a" fell off
    assert new_notices(["a", "b"], ["x", "y"]) == ["x", "y"]  # all of it is new
    assert new_notices(["a"], ["a"]) == []


def test_a_trouble_is_said_when_it_begins_changes_kind_and_ends():
    assert trouble_changes({}, {3: "image pull backing off (for 2s)"}) == [
        (3, "image pull backing off (for 2s)")
    ]
    # Only its duration grew: no change.
    assert trouble_changes({3: "image pull (for 2s)"}, {3: "image pull (for 9s)"}) == []
    assert trouble_changes({3: "image pull (for 9s)"}, {3: "unschedulable (for 1s)"}) == [
        (3, "unschedulable (for 1s)")
    ]
    assert trouble_changes({3: "unschedulable (for 1s)"}, {}) == [(3, "")]


class _Platform:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.held: dict[int, str] = {}

    def notices(self) -> list[str]:
        return list(self.lines)

    def troubles(self) -> dict[int, str]:
        return dict(self.held)


def test_the_job_emits_each_notice_and_trouble_once(monkeypatch):
    from master.job import platform_news

    clock = [0.0]
    monkeypatch.setattr(platform_news.time, "monotonic", lambda: clock[0])
    nodes = NodeManager(SQLiteStateStore(":memory:"))
    worker = nodes.new_incarnation("worker", 1, 0, 0)
    platform, events = _Platform(), []
    news = PlatformNews(
        platform, nodes, lambda kind, msg, node=None, reason="", **d: events.append((msg, reason))
    )
    platform.lines = ["create pod worker-1: 429 Too Many Requests, retrying in 1.0s"]
    platform.held = {worker.id: "image pull backing off: ErrImagePull (for 1s)"}
    news.tick()
    clock[0] += 0.5
    news.tick()  # too soon to look again
    clock[0] += 1.0
    platform.held = {worker.id: "image pull backing off: ErrImagePull (for 3s)"}
    news.tick()  # nothing new
    clock[0] += 1.0
    platform.held = {}
    news.tick()
    assert events == [
        ("create pod worker-1: 429 Too Many Requests, retrying in 1.0s", "notice"),
        ("worker-1: image pull backing off: ErrImagePull (for 1s)", "held_up"),
        ("worker-1: no longer held up", "going"),
    ]
