"""The Brain: history stores, the optimizer's rules, and the HTTP service a master talks to."""

from __future__ import annotations

from master.brain.client import Brain, BrainError
from master.brain.history import JobRecord, SQLiteHistoryStore
from master.brain.optimizer import propose
from master.brain.service import BrainService
from master.config import parse_job_spec


def run(status="succeeded", ps_mem=256, final=256, ooms=0, rps=100.0, ps=1, workers=2, t=1.0):
    return JobRecord(
        job="wd",
        run_dir=f"runs/{t}",
        finished_at=t,
        status=status,
        wall_seconds=10.0,
        replicas={"ps": ps, "worker": workers},
        memory_mb={"ps": ps_mem},
        final_memory_mb={"ps": final},
        ooms={"ps": ooms} if ooms else {},
        records_per_second=rps,
    )


def test_a_ps_oom_raises_the_proposed_ps_memory():
    # The relaunch with 384 MB finished the job: 384 MB is what the next run needs.
    p = propose("wd", 256, 1, 2, [run(ooms=1, final=384)])
    assert p.ps_memory_mb == 384 and "ran out of memory" in p.reasons[0]
    # A run that failed even at 384 MB: ask for more than that.
    assert propose("wd", 256, 1, 2, [run("failed", ooms=3, final=384)]).ps_memory_mb == 576
    # No OOM, or a spec that already has enough: nothing to change.
    assert propose("wd", 256, 1, 2, [run()]).ps_memory_mb == 0
    assert propose("wd", 512, 1, 2, [run(ooms=1, final=384)]).ps_memory_mb == 0
    assert propose("wd", 256, 1, 2, []).runs_considered == 0


def test_the_fastest_past_configuration_is_proposed():
    runs = [run(rps=100, workers=2), run(rps=180, workers=4, t=2), run(rps=170, workers=4, t=3)]
    p = propose("wd", 256, 1, 2, runs)
    assert (p.ps_replicas, p.worker_replicas) == (1, 4)
    # Already running the best configuration, or no clear winner: keep the spec's.
    assert propose("wd", 256, 1, 4, runs).worker_replicas == 0
    close = [run(rps=100, workers=2), run(rps=105, workers=4, t=2)]
    assert propose("wd", 256, 1, 2, close).worker_replicas == 0


def test_sqlite_history_keeps_runs_per_job_newest_first(tmp_path):
    store = SQLiteHistoryStore(str(tmp_path / "h" / "brain.sqlite"))
    store.add(run(t=1.0))
    store.add(run(t=2.0, ooms=1))
    store.add(JobRecord("other", "r", 3.0, "failed", 1.0))
    runs = store.runs("wd")
    assert [r.finished_at for r in runs] == [2.0, 1.0] and runs[0].ooms == {"ps": 1}
    store.close()
    reopened = SQLiteHistoryStore(str(tmp_path / "h" / "brain.sqlite"))
    assert len(reopened.runs("wd")) == 2 and reopened.runs("nope") == []
    reopened.close()


def test_masters_share_a_brain_service_over_http(tmp_path):
    service = BrainService(SQLiteHistoryStore(str(tmp_path / "b.sqlite")))
    service.start()
    try:
        brain = Brain(f"http://127.0.0.1:{service.port}")
        spec = parse_job_spec(
            {
                "name": "wd",
                "command": ["true"],
                "ps": {"replicas": 1, "memory_mb": 256},
                "worker": {"replicas": 2},
            },
            "test",
            str(tmp_path),
        )
        assert brain.propose(spec).ps_memory_mb == 0
        brain.record(run(ooms=1, final=384))
        proposal = brain.propose(spec)
        assert proposal.ps_memory_mb == 384 and proposal.runs_considered == 1
    finally:
        service.stop()
    try:
        brain.propose(spec)
        raise AssertionError("a stopped Brain service must not answer")
    except BrainError as e:
        assert "--brain off" in str(e)


def test_a_master_runs_without_a_reachable_brain(tmp_path):
    from master.brain.client import consult

    spec = parse_job_spec(
        {"name": "wd", "command": ["true"], "worker": {"replicas": 1}}, "test", str(tmp_path)
    )
    same, brain, notes = consult(spec, "http://127.0.0.1:9")  # nothing listens on port 9
    assert same is spec and brain is None and "unavailable" in notes[0]
    assert consult(spec, "off") == (spec, None, [])
