"""HeartbeatThread's schedule: its own calls, the beats that progress reports carry, and how
often a node beats for the job's heartbeat timeout."""

from __future__ import annotations

import pytest

from master.client import heartbeat as heartbeat_module
from master.client.heartbeat import CARRIED_FRESH_INTERVALS, COMMAND_POLL_SECONDS, HeartbeatThread
from master.nodes.policy import BEATS_PER_TIMEOUT, heartbeat_interval


def test_the_heartbeat_thread_calls_when_no_report_carried_a_beat_and_for_commands():
    beat = HeartbeatThread(client=None, interval=1.0)
    assert beat._call_due(100.0)  # nothing carried yet
    beat._last_call = 100.0
    beat._last_carried = 100.5
    assert not beat._call_due(101.0)
    # A trainer that stopped stepping (hung, paused) carries no beat: the thread beats again.
    assert beat._call_due(100.5 + CARRIED_FRESH_INTERVALS + 0.01)
    beat._last_carried = 100.0 + COMMAND_POLL_SECONDS - 0.1
    assert beat._call_due(100.0 + COMMAND_POLL_SECONDS)  # commands are fetched every few s


class _Clock:
    """A fake monotonic clock that the thread's waits advance."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Client:
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.calls: list[float] = []

    def heartbeat(self, stats, global_step) -> list:
        self.calls.append(self.clock.now)
        return []


class _Wait:
    """Stands for the thread's stop event: each wait advances the clock; `script` maps the
    wait's number to something to do once it has passed; the waits end the run."""

    def __init__(self, clock: _Clock, waits: int, script: dict) -> None:
        self.clock, self.waits, self.script, self.count = clock, waits, script, 0

    def is_set(self) -> bool:
        return self.count >= self.waits

    def wait(self, seconds: float) -> bool:
        self.clock.now += seconds
        self.count += 1
        if self.count in self.script:
            self.script[self.count]()
        return self.is_set()


def test_once_carried_beats_stop_the_thread_beats_when_the_last_one_goes_stale(monkeypatch):
    """A beat carried just before the thread's regular call defers that call; once no more
    are carried (the trainer hung, or waits with no shard), the thread's own beat follows the
    last carried one within CARRIED_FRESH_INTERVALS intervals, not a whole interval later."""
    clock = _Clock()
    monkeypatch.setattr(heartbeat_module, "time", clock)
    client = _Client(clock)
    beat = HeartbeatThread(client, interval=1.0)
    beat.sample = lambda: None
    carried_at = []

    def carry() -> None:  # a progress flush carried a beat 0.9 s after the thread's call
        clock.now += 0.9
        carried_at.append(clock.now)
        beat.carried()

    beat._stop_event = _Wait(clock, waits=4, script={1: carry})
    beat.run()
    assert client.calls[0] == 0.0
    # The wait that took the carried beat ended at 1.9 s: the call waited for its staleness.
    second = client.calls[1]
    assert second == pytest.approx(carried_at[0] + CARRIED_FRESH_INTERVALS * 1.0)
    assert second - carried_at[0] < 2.0  # on an interval grid it came 2.0 s after it


@pytest.mark.parametrize(
    ("configured", "timeout", "expected"),
    [(2.0, 15.0, 2.0), (2.0, 3.0, 1.0), (0.5, 0.9, 0.3)],
)
def test_nodes_beat_at_least_three_times_per_heartbeat_timeout(configured, timeout, expected):
    assert BEATS_PER_TIMEOUT == 3
    assert heartbeat_interval(configured, timeout) == pytest.approx(expected)
