"""`dlrover brain serve`: the Brain as an HTTP service many masters share."""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from master.brain.history import HistoryStore, JobRecord
from master.brain.optimizer import propose

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20


class BrainService:
    """Serves POST /v1/runs (record a run), POST /v1/propose and GET /v1/runs?job=NAME."""

    def __init__(self, store: HistoryStore, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = store
        try:
            self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        except OSError as e:
            message = f"cannot serve the Brain on {host}:{port}: {e}; choose another --port"
            raise OSError(message) from e
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Serve until stop() (or Ctrl-C) in this thread."""
        self._httpd.serve_forever(poll_interval=0.2)

    def start(self) -> int:
        """Serve in a background thread; returns the port."""
        self._thread = threading.Thread(target=self.serve_forever, name="brain", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handle(self, method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        if method == "POST" and path == "/v1/runs":
            self.store.add(JobRecord.from_dict(_require(body, "job", "run_dir", "status")))
            return HTTPStatus.CREATED, {"ok": True}
        if method == "POST" and path == "/v1/propose":
            body = _require(body, "job")
            runs = self.store.runs(body["job"])
            proposal = propose(
                body["job"],
                int(body.get("ps_memory_mb", 0)),
                int(body.get("ps_replicas", 0)),
                int(body.get("worker_replicas", 0)),
                runs,
            )
            return HTTPStatus.OK, proposal.to_dict()
        if method == "GET" and path == "/v1/runs":
            job = query.get("job", [""])[0]
            if not job:
                raise ValueError("GET /v1/runs needs ?job=NAME")
            return HTTPStatus.OK, {"runs": [r.to_dict() for r in self.store.runs(job)]}
        if method == "GET" and path == "/healthz":
            return HTTPStatus.OK, {"ok": True}
        return HTTPStatus.NOT_FOUND, {"error": f"no {method} {path}"}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                url = urlsplit(self.path)
                try:
                    body = None
                    if method == "POST":
                        length = int(self.headers.get("Content-Length") or 0)
                        if length > MAX_BODY_BYTES:
                            raise ValueError(f"body of {length} bytes is over {MAX_BODY_BYTES}")
                        body = json.loads(self.rfile.read(length) or b"{}")
                    status, reply = service._handle(method, url.path, parse_qs(url.query), body)
                except (ValueError, TypeError, KeyError) as e:
                    status, reply = HTTPStatus.BAD_REQUEST, {"error": str(e)}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("brain http: " + format, *args)

        return Handler


def _require(body: Any, *keys: str) -> dict:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    missing = [k for k in keys if k not in body]
    if missing:
        raise ValueError(f"the request body lacks {', '.join(missing)}")
    return body
