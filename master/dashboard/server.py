"""A small HTTP server on the master: /metrics, the dashboard page and its JSON endpoints."""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from master.status_view import status_document

if TYPE_CHECKING:
    from master.job import JobMaster
    from master.metrics import JobMetrics
    from master.telemetry import JobTelemetry

log = logging.getLogger(__name__)

ROUTES = {
    "/": "the dashboard",
    "/metrics": "Prometheus metrics",
    "/api/status": "job, nodes, data progress, throughput, recent events (JSON)",
    "/api/events": "events from position ?since=N (JSON)",
    "/api/series": "time series samples after ?since=UNIX_TIME (JSON)",
    "/healthz": "liveness",
}


def dashboard_html() -> bytes:
    """The dashboard page (one file: markup, style and script, nothing fetched from outside)."""
    return resources.files("master.dashboard").joinpath("index.html").read_bytes()


class ObservabilityServer:
    """Serves one job's metrics and dashboard over HTTP on host:port (0 picks a port)."""

    def __init__(
        self,
        job: JobMaster,
        metrics: JobMetrics,
        telemetry: JobTelemetry,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.job = job
        self.metrics = metrics
        self.telemetry = telemetry
        self._page = dashboard_html()
        try:
            self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        except OSError as e:
            raise OSError(
                f"cannot serve metrics and the dashboard on {host}:{port}: {e.strerror}; "
                "choose another --metrics-port (0 picks a free one)"
            ) from e
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="http", kwargs={"poll_interval": 0.2}
        )
        self._thread.daemon = True

    def start(self) -> int:
        """Start serving in a background thread; returns the port."""
        self._thread.start()
        log.info("metrics and dashboard on port %d", self.port)
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
                    log.exception("HTTP %s failed", self.path)
                    self._send(HTTPStatus.INTERNAL_SERVER_ERROR, f"error: {e}\n".encode())

            def _send(self, status: HTTPStatus, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: " + format, *args)

        return Handler

    def _route(self, req: BaseHTTPRequestHandler) -> None:
        url = urlsplit(req.path)
        query = parse_qs(url.query)
        send = req._send  # type: ignore[attr-defined]
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


_JSON = "application/json"


def _json(data: Any) -> bytes:
    return json.dumps(data, default=str).encode()


def _int_arg(query: dict[str, list[str]], name: str) -> int:
    try:
        return max(0, int(query.get(name, ["0"])[0]))
    except ValueError:
        return 0
