"""The dashboard's login: every page but /healthz needs the dashboard token, a browser logs in
once with ?token= (cookie, redirect without the token), HTTPS under --tls, no token in logs, and
`dlrover status` says how to open it."""

from __future__ import annotations

import gc
import http.client
import json
import logging
import os
import ssl
import stat

import pytest

from master.cli import main as cli
from master.client.tls import make_job_certificates
from master.observability.dashboard.auth import TOKEN_FILE
from master.observability.endpoint import Observability
from tests.integration.conftest import TOKEN

PAGES = ("/", "/metrics", "/api/status", "/api/events?since=0", "/api/series", "/nowhere")


@pytest.fixture
def dashboard(harness, request):
    """Start the harness job's dashboard (over HTTPS when request.param is a ServerTLS)."""

    def start(tls=None) -> Observability:
        obs = Observability(harness.job, "127.0.0.1", 0, tls=tls)
        obs.start("127.0.0.1")
        request.addfinalizer(obs.stop)
        return obs

    return start


def get(
    obs: Observability, path: str, headers: dict | None = None, ca: str = ""
) -> http.client.HTTPResponse:
    port = obs.server.port
    if obs.server.scheme == "https":
        context = ssl.create_default_context(cafile=ca)
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    reply = conn.getresponse()
    reply.body = reply.read()
    conn.close()
    return reply


def bearer(obs: Observability) -> dict:
    return {"Authorization": f"Bearer {obs.token}"}


def test_every_page_but_healthz_refuses_a_request_without_the_token(dashboard):
    obs = dashboard()
    for path in PAGES:
        reply = get(obs, path)
        assert reply.status == 401, path
        assert b"dashboard token" in reply.body and b"--show-dashboard-token" in reply.body
        assert reply.getheader("WWW-Authenticate").startswith("Bearer")
        wrong = get(obs, path, {"Authorization": "Bearer " + "x" * len(obs.token)})
        assert wrong.status == 401, path
        assert get(obs, path, {"Cookie": f"{obs.server.auth.cookie_name}=forged"}).status == 401
    assert get(obs, "/?token=not-the-token").status == 401
    assert get(obs, "/healthz").status == 200


def test_a_bearer_token_reads_metrics_and_status(dashboard):
    obs = dashboard()
    metrics = get(obs, "/metrics", bearer(obs))
    assert metrics.status == 200 and b"dlrover_job_state" in metrics.body
    gc.collect()  # a started endpoint times the master's collections
    scanned = get(obs, "/metrics", bearer(obs)).body
    full = b'dlrover_gc_pause_seconds_count{generation="2"} '
    assert full in scanned
    assert float(scanned.split(full)[1].split(b"\n")[0]) >= 1
    status = get(obs, "/api/status", bearer(obs))
    assert status.status == 200 and json.loads(status.body)["name"] == "harness"
    assert get(obs, "/nowhere", bearer(obs)).status == 404


def test_a_browser_logs_in_once_and_the_token_leaves_the_address(dashboard, caplog):
    caplog.set_level(logging.DEBUG)
    obs = dashboard()
    login = get(obs, f"/api/events?since=3&token={obs.token}")
    assert login.status == 303
    assert login.getheader("Location") == "/api/events?since=3"  # the token is gone
    cookie = login.getheader("Set-Cookie")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
    assert obs.token not in cookie  # the cookie holds a derived value, not the token
    session = cookie.split(";")[0]
    page = get(obs, "/", {"Cookie": f"other=1; {session}"})
    assert page.status == 200 and b"<html" in page.body.lower()
    # A login link cannot send the browser to another site.
    location = get(obs, f"//evil.example/?token={obs.token}").getheader("Location")
    assert location.startswith("/") and not location.startswith("//")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "token=<redacted>" in logged and obs.token not in logged


def test_the_token_file_is_private_and_kept_by_a_restarted_master(harness, dashboard, tmp_path):
    first = dashboard()
    path = tmp_path / TOKEN_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first.stop()
    again = dashboard()  # what a restarted master does: the same run dir, the same token
    assert again.token == first.token
    assert get(again, "/api/status", bearer(again)).status == 200


def test_with_tls_the_dashboard_is_https_with_the_master_certificate(dashboard, tmp_path):
    server_tls, client_tls = make_job_certificates(str(tmp_path / "tls"), ["127.0.0.1"])
    obs = dashboard(server_tls)
    assert obs.url.startswith("https://127.0.0.1:")
    ca = client_tls.ca_file
    assert get(obs, "/api/status", ca=ca).status == 401
    assert get(obs, "/api/status", bearer(obs), ca=ca).status == 200
    login = get(obs, f"/?token={obs.token}", ca=ca)
    assert "Secure" in login.getheader("Set-Cookie")
    # Plain HTTP to the HTTPS port gets no page.
    conn = http.client.HTTPConnection("127.0.0.1", obs.server.port, timeout=10)
    with pytest.raises((http.client.HTTPException, OSError)):
        conn.request("GET", "/healthz")
        conn.getresponse().read()
    conn.close()


def test_status_says_how_to_open_the_dashboard_and_shows_the_token_only_when_asked(
    harness, dashboard, tmp_path, capsys
):
    obs = dashboard()
    token_file = tmp_path / ".job_token"
    token_file.write_text(TOKEN)
    args = ["status", "--addr", harness.addr, "--token-file", str(token_file)]
    assert cli.main(args) == 0
    screen = capsys.readouterr().out
    assert "job harness: pending" in screen
    assert f"dashboard {obs.url}\n" in screen and "--show-dashboard-token" in screen
    assert obs.token not in screen
    assert cli.main([*args, "--show-dashboard-token"]) == 0
    screen = capsys.readouterr().out
    assert f"dashboard {obs.url}?token={obs.token}\n" in screen
    os.remove(tmp_path / TOKEN_FILE)
    assert cli.main([*args, "--show-dashboard-token"]) == 2
    assert "no dashboard token at" in capsys.readouterr().err
