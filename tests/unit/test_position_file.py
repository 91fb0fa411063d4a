"""Coalesced progress: the node-local position file, its merge, and step times spread over
the steps a report covers."""

import os
import signal
import subprocess
import sys
import time

from master.client.position import (
    PositionFile,
    collect_positions,
    decode_positions,
    encode_positions,
    read_positions,
    stream_position_path,
)
from master.nodes.manager import NodeManager
from master.sharding.ledger import DatasetSpec
from master.sharding.service import ShardingService
from master.state.sqlite import SQLiteStateStore


def test_the_last_record_wins_and_a_shorter_one_hides_an_older_longer_tail(tmp_path):
    path = str(tmp_path / "p")
    f = PositionFile(path)
    f.write({"d": {1: 10, 2: 20, 3: 30}})
    f.write({"d": {4: 5}})
    assert read_positions(path) == {"d": [(4, 5)]}
    f.close()
    assert read_positions(str(tmp_path / "missing")) == {}
    with open(path, "wb") as g:
        g.write(b"\x01\x00")  # torn or foreign: ignored
    assert read_positions(path) == {}


def test_streams_of_a_node_are_merged_to_the_highest_position_and_removed(tmp_path):
    base = str(tmp_path / "worker-0.3.log.position")
    a, b = PositionFile(stream_position_path(base)), PositionFile(stream_position_path(base))
    a.write({"d": {1: 10, 2: 64}})
    b.write({"d": {1: 30}, "e": {7: 1}})
    merged = collect_positions(base)
    assert merged == {"d": [(1, 30), (2, 64)], "e": [(7, 1)]}
    assert collect_positions(base) == {}  # read once
    assert decode_positions(encode_positions(merged)) == merged
    assert decode_positions("not json") == {}


def test_a_sigkilled_writer_leaves_its_last_whole_record(tmp_path):
    path = str(tmp_path / "p")
    code = (
        "import sys, time\n"
        "from master.client.position import PositionFile\n"
        f"f = PositionFile({path!r})\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1\n"
        "    f.write({'d': {s: i for s in range(i % 50)}})\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    record = read_positions(path)
    values = {c for pairs in record.values() for _, c in pairs}
    assert len(values) <= 1  # one write's record, never a mix of two


def test_a_report_of_several_steps_spreads_its_time_over_them(tmp_path):
    nodes = NodeManager(SQLiteStateStore(":memory:"))
    node = nodes.new_incarnation("worker", 0, 0, 0)
    nodes.note_progress(node)  # the first step: no gap yet
    node.last_step_at -= 1.0  # a second ago
    nodes.note_progress(node, steps=10)  # ten steps in that second
    assert node.steps == 11
    assert 0.09 <= node.step_seconds <= 0.12
    node.last_step_at -= 0.5
    nodes.note_progress(node)  # a single step keeps counting as one
    assert node.steps == 12


def test_positions_an_ended_holder_left_are_applied_unless_stale(tmp_path):
    svc = ShardingService(SQLiteStateStore(":memory:"), flush_seconds=3600)
    svc.create(DatasetSpec("d", size=1000, batch_size=10, records_per_shard=100))
    mine = svc.get_shard("d", holder=1).shard
    other = svc.get_shard("d", holder=2).shard
    applied = svc.apply_positions(
        1, {"d": [(mine.shard_id, 70), (other.shard_id, 50)], "gone": [(1, 1)]}
    )
    assert applied == 1  # the other holder's shard and an unknown dataset are skipped
    assert svc.release("d", 1) == 30  # only the unconsumed remainder goes back
    svc.close()


def test_a_torn_record_is_ignored(tmp_path):
    path = str(tmp_path / "p")
    f = PositionFile(path)
    f.write({"d": {5: 640}})
    with open(path, "r+b") as g:  # a reader racing the writer sees one byte of the next record
        g.seek(-3, os.SEEK_END)
        g.write(b"7")
    assert read_positions(path) == {}
    f.write({"d": {5: 704}})
    assert read_positions(path) == {"d": [(5, 704)]}
    f.close()
