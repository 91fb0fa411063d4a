"""Metrics, diagnosis and events of whole local jobs (fake trainer)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_local_job import DLROVER, start_submit, submit, write_job

STREAMED = "dlrover_rpc_stream_messages_total"


def read_header(proc: subprocess.Popen) -> dict[str, str]:
    """The master address, run dir and dashboard URL `dlrover submit` prints at start."""
    found: dict[str, str] = {}
    for line in proc.stdout:
        if line.startswith("== job ") and "master at" in line:
            found["addr"] = line.split("master at ")[1].split(",")[0]
            found["run_dir"] = line.split("run dir ")[1].strip()
        if line.strip().startswith("dashboard "):
            found["dashboard"] = line.split()[1]
            return found
    raise AssertionError(f"submit ended without printing its dashboard URL: {found}")


def dashboard_token(run_dir: str) -> str:
    """The job's dashboard token, as a user or a Prometheus credentials_file reads it."""
    with open(os.path.join(run_dir, ".dashboard_token")) as f:
        return f.read().strip()


def scrape(dashboard: str, token: str) -> dict[tuple[str, frozenset], float]:
    """One Prometheus scrape (bearer token), parsed by prometheus_client's own text parser."""
    request = urllib.request.Request(
        dashboard + "metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def rpc_calls(samples: dict) -> float:
    return sum(v for (n, _), v in samples.items() if n == "dlrover_rpc_duration_seconds_count")


def scrape_until(header: dict[str, str], token: str, condition, timeout: float = 60.0) -> dict:
    """Scrape the job's metrics until `condition` holds of a scrape; fails at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(header["dashboard"], token)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, f"no scrape in {timeout:g} s met {condition}"
        time.sleep(0.05)


def test_prometheus_scrapes_during_a_job_parse_and_move_and_a_straggler_is_replaced(tmp_path):
    job = write_job(
        tmp_path,
        env={
            # Long enough for worker-1's step time to rest on a few coalesced reports
            "FAKE_SIZE": "24000",
            "FAKE_EPOCHS": "1",
            "FAKE_STEP_SECONDS": "0.01",
            "FAKE_SLOW_RANK": "1:0.08:once",  # worker-1's first incarnation is slow
        },
        straggler_min_steps=10,
        stragglers="replace",
    )
    proc = start_submit(job, tmp_path, "--status-interval", "0.5")
    watch = None
    try:
        header = read_header(proc)
        token_file = os.path.join(header["run_dir"], ".job_token")
        watch = subprocess.Popen(
            [*DLROVER, "status", "--addr", header["addr"], "--token-file", token_file]
            + ["--watch", "0.2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        token = dashboard_token(header["run_dir"])
        first = scrape_until(header, token, lambda s: value(s, "dlrover_global_step") > 0)

        def moved_on(second: dict) -> bool:
            # Steps taken, unary RPCs (shard requests) answered and progress reports streamed
            # between the two scrapes: a step may reach the master in a heartbeat first.
            return (
                value(second, "dlrover_global_step") > value(first, "dlrover_global_step")
                and rpc_calls(second) > rpc_calls(first)
                and value(second, STREAMED, method="StreamProgress")
                > value(first, STREAMED, method="StreamProgress")
            )

        second = scrape_until(header, token, moved_on)
        out, _ = proc.communicate(timeout=120)
        watched, watch_err = watch.communicate(timeout=60)
    finally:
        proc.kill()
        if watch is not None:
            watch.kill()
    assert proc.returncode == 0, out
    # The live view redrew while the job ran and ended with it.
    assert watch.returncode == 0, watch_err
    assert watched.count("\x1b[H\x1b[2J") >= 2 and "job fake: running" in watched
    assert value(first, "dlrover_nodes", type="worker", state="running") == 2
    assert value(first, "dlrover_nodes", type="ps", state="running") == 0
    assert value(first, "dlrover_job_state", job="fake", state="running") == 1
    done = ("dlrover_dataset_records", {"dataset": "train", "queue": "done"})
    assert value(second, done[0], **done[1]) >= value(first, done[0], **done[1])
    assert value(second, "dlrover_global_step") > value(first, "dlrover_global_step")
    assert rpc_calls(second) > rpc_calls(first) > 0
    # Shard asks on the workers' streams are timed one by one, as unary calls are.
    asks = value(second, "dlrover_rpc_duration_seconds_count", method="ShardStream", code="OK")
    assert asks > 0 and value(second, STREAMED, method="ShardStream") >= asks
    assert value(second, "dlrover_node_memory_rss_bytes", type="worker", rank="0") > 0
    assert value(second, STREAMED, method="StreamProgress") > value(
        first, STREAMED, method="StreamProgress"
    )
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["dashboard_url"] == header["dashboard"]
    with open(os.path.join(summary["run_dir"], "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert stragglers, [e["kind"] for e in events]
    assert [(e["node_type"], e["node_rank"]) for e in stragglers] == [("worker", 1)]
    assert stragglers[0]["details"]["slowdown"] > 2
    assert stragglers[0]["details"]["action"] == "replace"
    replaced = [e for e in events if e["reason"] == "straggler" and e["kind"] != "straggler"]
    assert [e["kind"] for e in replaced] == ["node_failed", "relaunch"]
    assert replaced[0]["node_id"] == stragglers[0]["node_id"]
    d = summary["datasets"]["train"]
    assert summary["status"] == "succeeded" and d["records_done"] == d["size"] * d["epochs"]


def test_script_raising_at_start_fails_on_first_attempt_with_the_traceback(tmp_path):
    job = write_job(tmp_path, workers=1, env={"FAKE_RAISE": "bad learning rate"})
    proc, summary = submit(job, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert summary["status"] == "failed"
    assert [(n["type"], n["rank"], n["relaunches"]) for n in summary["nodes"]] == [("worker", 0, 0)]
    assert "before its first step" in summary["reason"]
    assert "Traceback (most recent call last):" in summary["reason"]
    assert "RuntimeError: deliberate start-up error: bad learning rate" in summary["reason"]
    node = summary["nodes"][0]
    assert node["exit_reason"] == "user_error"
    assert node["excerpt"].splitlines()[-1] == (
        "RuntimeError: deliberate start-up error: bad learning rate"
    )
    failed = [e for e in summary["events"] if e["kind"] == "node_failed"]
    assert failed[0]["reason"] == "user_error" and failed[0]["details"]["deterministic"] is True
    assert "relaunch" not in {e["kind"] for e in summary["events"]}


def test_a_closed_rendezvous_round_is_a_job_event(harness, tmp_path):
    from tests.integration.test_master_rendezvous import make_handler, rendezvous_all

    made = [make_handler(harness.client(i)) for i in range(3)]
    try:
        rendezvous_all(made)
    finally:
        for h in made:
            h.shutdown()
    rounds = [e for e in harness.job.events if e.kind == "rendezvous_round"]
    assert len(rounds) == 1 and rounds[0].reason == "round_closed"
    assert rounds[0].details["members"] == ["worker-0", "worker-1", "worker-2"]
    current = harness.job.rendezvous.current_round("job")
    assert rounds[0].details["round"] == current and rounds[0].details["processes"] == 3
    with open(tmp_path / "events.jsonl") as f:
        assert [json.loads(line)["kind"] for line in f] == ["rendezvous_round"]
