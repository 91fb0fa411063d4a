"""The job master's runtime record survives the state store as it is (a restarted master reads
what the previous instance wrote)."""

from __future__ import annotations

import json

from master.job.runtime_record import RuntimeRecord


def test_a_record_reads_back_as_it_was_written():
    record = RuntimeRecord(
        replicas={"ps": 2, "chief": 1, "worker": 3, "evaluator": 0},
        cluster_version=4,
        job_relaunches=2,
        global_step=1500,
        started_wall=1_700_000_000.5,
        fired_faults=[0, 2],
        training_done=True,
        chief_reports_restores=True,
        addresses={("worker", 1): "h:2", ("ps", 0): "h:1"},
    )
    assert RuntimeRecord.from_json(record.to_json()) == record


def test_addresses_are_stored_as_sorted_triples():
    record = RuntimeRecord(
        {"worker": 2}, 1, 0, 0, 0.0, addresses={("worker", 1): "b", ("ps", 0): "a"}
    )
    assert json.loads(record.to_json())["addresses"] == [["ps", 0, "a"], ["worker", 1, "b"]]


def test_a_record_from_before_restore_reports_reads_with_them_off():
    old = {
        "replicas": {"worker": 1},
        "cluster_version": 1,
        "job_relaunches": 0,
        "global_step": 10,
        "started_wall": 5.0,
        "fired_faults": [],
        "training_done": False,
        "addresses": [["worker", "0", "h:1"]],
    }
    record = RuntimeRecord.from_json(json.dumps(old).encode())
    assert not record.chief_reports_restores
    assert record.addresses == {("worker", 0): "h:1"}
