"""A small HTTP(S) server on the master: /metrics, the dashboard page and its JSON endpoints.

Every page but /healthz needs the dashboard token (see `auth` beside this module); with TLS the
server speaks HTTPS with the master's own certificate and key (no client certificate asked:
browsers have none, the token is the credential). Request lines are logged with any token redacted.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from master.observability.dashboard.auth import TOKEN_FILE, TOKEN_PARAM, DashboardAuth
from master.observability.status_view import status_document

if TYPE_CHECKING:
    from master.client.tls import ServerTLS
    from master.job.master import JobMaster
    from master.observability.metrics import JobMetrics
    from master.observability.telemetry import JobTelemetry

log = logging.getLogger(__name__)

ROUTES = {
    "/": "the dashboard",
    "/metrics": "Prometheus metrics",
    "/api/status": "job, nodes, data progress, throughput, recent events (JSON)",
    "/api/events": "events from position ?since=N (JSON)",
    "/api/series": "time series samples after ?since=UNIX_TIME (JSON)",
    "/healthz": "liveness (the only page open without the token)",
}
OPEN_PATHS = ("/healthz",)
TLS_HANDSHAKE_TIMEOUT_S = 10.0
_TOKEN_IN_TEXT = re.compile(rf"([?&]{TOKEN_PARAM}=)[^&\s\"']*")
UNAUTHORIZED = (
    "401 Unauthorized: the dashboard needs this job's dashboard token.\n"
    f"In a browser, open the page once as URL?{TOKEN_PARAM}=TOKEN (it sets a login cookie and "
    "drops the token from the address); `dlrover status --show-dashboard-token` prints that "
    f"link. Scripts and Prometheus send the header 'Authorization: Bearer TOKEN'. The token is "
    f"in the file {TOKEN_FILE} in the job's run dir, next to .job_token.\n"
)


def redact(text: str) -> str:
    """text with the value of every ?token= / &token= replaced (for logs)."""
    return _TOKEN_IN_TEXT.sub(r"\1<redacted>", text)


def dashboard_html() -> bytes:
    """The dashboard page (one file: markup, style and script, nothing fetched from outside)."""
    return resources.files("master.observability.dashboard").joinpath("index.html").read_bytes()


class ObservabilityServer:
    """Serves one job's metrics and dashboard over HTTP on host:port (0 picks a port)."""

    def __init__(
        self,
        job: JobMaster,
        metrics: JobMetrics,
        telemetry: JobTelemetry,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str,
        tls: ServerTLS | None = None,
    ) -> None:
        self.job = job
        self.metrics = metrics
        self.telemetry = telemetry
        self._page = dashboard_html()
        context = _tls_context(tls) if tls is not None else None
        try:
            self._httpd = _Server((host, port), self._handler_class(), context)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot serve metrics and the dashboard on {host}:{port}: {e.strerror}; "
                "choose another --metrics-port (0 picks a free one)",
            ) from e
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.scheme = "https" if context is not None else "http"
        self.auth = DashboardAuth(token, self.port, secure=context is not None)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="http", kwargs={"poll_interval": 0.2}
        )
        self._thread.daemon = True

    def start(self) -> int:
        """Start serving in a background thread; returns the port."""
        self._thread.start()
        log.info("metrics and dashboard on port %d (%s)", self.port, self.scheme)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                try:
                    server._route(self)
                except BrokenPipeError:
                    pass
                except Exception as e:  # answer 500, keep serving
                    log.exception("HTTP %s failed", redact(self.path))
                    self._send(HTTPStatus.INTERNAL_SERVER_ERROR, f"error: {e}\n".encode())

            def _send(
                self,
                status: HTTPStatus,
                body: bytes,
                ctype: str = "text/plain",
                headers: tuple[tuple[str, str], ...] = (),
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                # The address may hold ?token= for one request: never pass it on.
                self.send_header("Referrer-Policy", "no-referrer")
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: %s", redact(format % args))

        return Handler

    def _route(self, req: BaseHTTPRequestHandler) -> None:
        url = urlsplit(req.path)
        query = parse_qs(url.query)
        send = req._send  # type: ignore[attr-defined]
        if url.path not in OPEN_PATHS and not self._let_in(req, url, query):
            return
        if url.path in ("/", "/index.html"):
            send(HTTPStatus.OK, self._page, "text/html; charset=utf-8")
        elif url.path == "/metrics":
            send(HTTPStatus.OK, self.metrics.render(), CONTENT_TYPE_LATEST)
        elif url.path == "/api/status":
            send(HTTPStatus.OK, _json(status_document(self.job, self.telemetry)), _JSON)
        elif url.path == "/api/events":
            since = _int_arg(query, "since")
            events = self.job.event_log.since(since)
            body = {"events": [e.to_dict() for e in events], "next": since + len(events)}
            send(HTTPStatus.OK, _json(body), _JSON)
        elif url.path == "/api/series":
            since = float(query.get("since", ["0"])[0] or 0)
            send(HTTPStatus.OK, _json({"samples": self.telemetry.series(since)}), _JSON)
        elif url.path == "/healthz":
            send(HTTPStatus.OK, b"ok\n")
        else:
            known = "\n".join(f"  {path}  {what}" for path, what in ROUTES.items())
            send(HTTPStatus.NOT_FOUND, f"no page {url.path!r}; pages:\n{known}\n".encode())

    def _let_in(self, req: BaseHTTPRequestHandler, url: Any, query: dict) -> bool:
        """Whether the request may read; if not, it has been answered (401, or the login)."""
        send = req._send  # type: ignore[attr-defined]
        given = query.get(TOKEN_PARAM)
        if given is not None:
            if not self.auth.token_ok(given[0]):
                send(HTTPStatus.UNAUTHORIZED, b"wrong token. " + UNAUTHORIZED.encode())
                return False
            # Log in: set the session cookie and reload the page without the token in it.
            rest = [
                (k, v) for k, v in parse_qsl(url.query, keep_blank_values=True) if k != TOKEN_PARAM
            ]
            path = url.path if url.path.startswith("/") and not url.path.startswith("//") else "/"
            location = path + ("?" + urlencode(rest) if rest else "")
            send(
                HTTPStatus.SEE_OTHER,
                b"logged in\n",
                headers=(("Location", location), ("Set-Cookie", self.auth.session_cookie())),
            )
            return False
        if self.auth.allows(req.headers.get("Authorization"), req.headers.get("Cookie")):
            return True
        send(
            HTTPStatus.UNAUTHORIZED,
            UNAUTHORIZED.encode(),
            headers=(("WWW-Authenticate", 'Bearer realm="dlrover dashboard"'),),
        )
        return False


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer, with the TLS handshake (if any) in the request's own thread."""

    def __init__(self, address: tuple[str, int], handler: type, context: ssl.SSLContext | None):
        self._context = context
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self._context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
        try:
            secure = self._context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as e:
            log.debug("dashboard TLS handshake with %s failed: %s", client_address, e)
            return
        try:
            super().finish_request(secure, client_address)
        finally:
            try:
                secure.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            secure.close()


def _tls_context(tls: ServerTLS) -> ssl.SSLContext:
    """HTTPS with the master's certificate and key; TLS 1.2 at least."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"cannot serve the dashboard over HTTPS with certificate {tls.cert_file} and key "
            f"{tls.key_file}: {e}; pass a PEM certificate and its key with --tls-cert/--tls-key"
        ) from None
    return context


_JSON = "application/json"


def _json(data: Any) -> bytes:
    return json.dumps(data, default=str).encode()


def _int_arg(query: dict[str, list[str]], name: str) -> int:
    try:
        return max(0, int(query.get(name, ["0"])[0]))
    except ValueError:
        return 0
