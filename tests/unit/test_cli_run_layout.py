"""One run layout for every way of submitting a job: run dir, state, host, ports, namespaces."""

from __future__ import annotations

import os

from master.cli.run_layout import STATE_FILE, TOKEN_FILE, RunLayout, run_layout
from master.config import parse_job_spec


def _spec(tmp_path):
    job = {"name": "lay", "command": ["true"], "worker": {"replicas": 1}}
    return parse_job_spec(job, "test", str(tmp_path))


def test_the_state_token_and_log_live_in_the_run_dir_unless_the_state_is_given(tmp_path):
    layout = run_layout(_spec(tmp_path), str(tmp_path / "run"))
    run_dir = str(tmp_path / "run")
    assert layout.run_dir == run_dir and layout.state == os.path.join(run_dir, STATE_FILE)
    assert layout.token_file == os.path.join(run_dir, TOKEN_FILE)
    assert layout.master_log == os.path.join(run_dir, "master.log")
    assert run_layout(_spec(tmp_path), run_dir, "etcd://h:1").state == "etcd://h:1"
    assert run_layout(_spec(tmp_path), run_dir, ":memory:").state == ":memory:"


def test_a_relative_or_missing_run_dir_becomes_an_absolute_one_under_the_workdir(tmp_path):
    assert run_layout(_spec(tmp_path), "rel").run_dir == os.path.abspath("rel")
    fresh = run_layout(_spec(tmp_path))
    assert os.path.dirname(fresh.run_dir) == os.path.join(str(tmp_path), "runs")
    assert os.path.basename(fresh.run_dir).startswith("lay-")


def test_namespaces_name_the_job_and_the_run(tmp_path):
    layout = run_layout(_spec(tmp_path), str(tmp_path / "run-7"))
    assert layout.namespace == "lay/run-7"
    assert layout.ray_namespace == "dlrover-lay-run-7"


def test_a_wildcard_bind_address_is_reached_on_loopback(tmp_path):
    for host in ("0.0.0.0", "::", "127.0.0.1"):
        assert run_layout(_spec(tmp_path), "r", host=host).host == "127.0.0.1"
    assert run_layout(_spec(tmp_path), "r", host="10.1.2.3").host == "10.1.2.3"


def test_ports_given_are_kept_and_zeros_are_picked_free(tmp_path):
    layout = run_layout(_spec(tmp_path), str(tmp_path / "r"))
    assert (layout.port, layout.metrics_port) == (0, 0)
    given = layout.with_ports(4321, 4322)
    assert isinstance(given, RunLayout) and (given.port, given.metrics_port) == (4321, 4322)
    picked = layout.with_ports(0, 0)
    assert picked.port > 0 and picked.metrics_port > 0
    assert picked.master_flags() == [
        "--run-dir",
        layout.run_dir,
        "--port",
        str(picked.port),
        "--metrics-port",
        str(picked.metrics_port),
    ]
