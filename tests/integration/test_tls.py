"""TLS on the master's gRPC port: who gets in (CA, client certificate, token) and who does not."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import grpc
import pytest

from master.client import MasterClient, MasterError, NodeIdentity
from master.client.tls import ClientTLS, ServerTLS, make_job_certificates
from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime
from master.platform.local import LocalPlatform
from master.rpc.server import start_server
from master.state.sqlite import SQLiteStateStore
from tests.integration.conftest import TOKEN
from tests.integration.test_local_job import DLROVER, HERE, write_job


@pytest.fixture
def certs(tmp_path):
    return make_job_certificates(str(tmp_path / "tls"), ["127.0.0.1"])


@pytest.fixture
def tls_master(tmp_path, request):
    """A master whose port speaks TLS; request.param says whether client certs are required."""

    def start(server_tls: ServerTLS) -> tuple[str, NodeIdentity]:
        spec = parse_job_spec(
            {"name": "tls", "command": ["true"], "worker": {"replicas": 1}},
            source="test",
            base_dir=str(tmp_path),
        )
        store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
        platform = LocalPlatform()
        job = JobMaster(spec, platform, store, JobRuntime(str(tmp_path), "", ""))
        node = job.nodes.new_incarnation("worker", 0, 0, 0)
        job.nodes.mark_running(node.id, "", "")
        server, port = start_server(job, "127.0.0.1", 0, TOKEN, 8, 1000, tls=server_tls)
        request.addfinalizer(lambda: (server.stop(0).wait(), job.sharding.close(), store.close()))
        request.addfinalizer(lambda: platform.shutdown(1))
        return f"127.0.0.1:{port}", NodeIdentity("worker", 0, node.id)

    return start


def _status(addr, node, token=TOKEN, tls=None):
    client = MasterClient(addr, token, node, retry_seconds=0.5, call_timeout=5, tls=tls)
    try:
        return client.job_status()
    finally:
        client.close()


def test_mutual_tls_lets_in_only_clients_with_a_certificate_and_the_token(certs, tls_master):
    server_tls, node_tls = certs
    addr, node = tls_master(server_tls)
    assert _status(addr, node, tls=node_tls).name == "tls"
    with pytest.raises(MasterError) as plain:
        _status(addr, node)  # no TLS at all
    assert plain.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(MasterError) as no_cert:
        _status(addr, node, tls=ClientTLS(node_tls.ca_file))  # trusts the master, no cert
    assert no_cert.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(MasterError) as bad_token:
        _status(addr, node, token="wrong", tls=node_tls)
    assert bad_token.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_server_only_tls_needs_the_ca_and_the_token(certs, tls_master, tmp_path):
    server_tls, node_tls = certs
    addr, node = tls_master(ServerTLS(server_tls.cert_file, server_tls.key_file))
    assert _status(addr, node, tls=ClientTLS(node_tls.ca_file)).name == "tls"
    other_ca, _ = make_job_certificates(str(tmp_path / "other"), ["127.0.0.1"])
    with pytest.raises(MasterError) as untrusted:
        _status(addr, node, tls=ClientTLS(other_ca.client_ca_file))  # a CA that did not sign it
    assert untrusted.value.code == grpc.StatusCode.UNAVAILABLE


def test_private_keys_are_owner_only(certs):
    server_tls, node_tls = certs
    for key in (server_tls.key_file, node_tls.key_file):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600


def test_a_missing_certificate_file_is_named_in_the_error(tmp_path):
    with pytest.raises(MasterError, match=r"DLROVER_MASTER_CA_FILE '/nope/ca.pem': cannot read"):
        MasterClient("127.0.0.1:1", TOKEN, tls=ClientTLS("/nope/ca.pem"))
    job = write_job(tmp_path)
    proc = subprocess.run(
        [*DLROVER, "submit", job, "--tls-cert", "/nope/c.pem", "--tls-key", "/nope/k.pem"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 2
    assert "missing: --tls-ca" in proc.stderr


def test_a_job_runs_over_mutual_tls_and_no_secret_is_on_a_command_line(tmp_path):
    job = write_job(tmp_path)
    summary = tmp_path / "s.json"
    proc = subprocess.run(
        [*DLROVER, "submit", job, "--tls", "--summary-json", str(summary)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(summary.read_text())
    assert data["status"] == "succeeded"
    assert data["datasets"]["train"]["records_done"] == 6000
    run_dir = data["run_dir"]
    token = open(os.path.join(run_dir, ".job_token")).read()
    logs = "".join(
        open(os.path.join(run_dir, "logs", f)).read()
        for f in os.listdir(os.path.join(run_dir, "logs"))
        if f.endswith(".log")
    )
    # Each node log starts with its command line: neither the token nor a key is in it.
    assert token not in logs and token not in proc.stdout
    assert "PRIVATE KEY" not in logs
    # The dashboard is HTTPS with the master's certificate; its token is in no output either.
    assert data["dashboard_url"].startswith("https://")
    dashboard_token = open(os.path.join(run_dir, ".dashboard_token")).read().strip()
    assert dashboard_token not in logs and dashboard_token not in proc.stdout + proc.stderr
