"""A torch agent's events stored in the KV store become job events."""

from __future__ import annotations

import json

from master.job.agent_events import agent_event


def test_an_agent_event_key_is_read_with_its_details():
    value = json.dumps(
        {"kind": "launcher_flags_replaced", "reason": "replaced: --rdzv-backend c10d",
         "node_rank": 1, "time": 5.0, "flags": ["--rdzv-backend"], "node": "x"}
    ).encode()  # fmt: skip
    event = agent_event(b"dlrover/events/run/1/3", value)
    assert event is not None and event.kind == "launcher_flags_replaced"
    assert event.reason == "replaced: --rdzv-backend c10d" and event.node_rank == 1
    assert event.details == {"flags": ["--rdzv-backend"]}  # "time" and "node" are not details


def test_other_keys_and_unreadable_values_are_not_agent_events():
    assert agent_event(b"dlrover/tf/pause/1", b"{}") is None
    assert agent_event(b"dlrover/events/run/0/1", b"not json") is None
    assert agent_event(b"dlrover/events/run/0/1", b'{"kind": "hang"}') is None
    assert agent_event(b"dlrover/events/run/0/1", b"[1, 2]") is None


def test_the_torch_reporter_writes_under_the_key_the_master_reads():
    from dlrover_torch.reporting import AgentReporter

    stored = {}

    class _KV:
        def set(self, key: bytes, value: bytes) -> None:
            stored[key] = value

    AgentReporter("run-1", 2, _KV()).event("hang", "local rank 1 made no step")
    [(key, value)] = stored.items()
    event = agent_event(key, value)
    assert event is not None and event.kind == "hang" and event.node_rank == 2
