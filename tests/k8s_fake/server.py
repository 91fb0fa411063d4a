"""A fake Kubernetes API server on loopback, good enough for the official `kubernetes` client.

Speaks the REST conventions (`/api/v1/namespaces/NS/RESOURCE[/NAME]`, `/apis/GROUP/VERSION/...`,
Status objects for errors, list metadata with a resourceVersion) and the watch protocol
(`?watch=true`: a chunked stream of one JSON event per line, ERROR events with 410 for an
expired resourceVersion, optional BOOKMARKs, `timeoutSeconds`).

It misbehaves when told to, as a real one does: `faults` (a `FaultPlan`) fails chosen requests
(429 with Retry-After, 5xx, 403 from quota, Pod Security or RBAC, a cut connection), and
`sidecars` are injected into every pod created, before its own containers, as a mutating
webhook of a service mesh does. `served` is the timeline of answers: (monotonic time, method,
path, status; 0 for a cut connection).
"""

from __future__ import annotations

import copy
import json
import re
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tests.k8s_fake.faults import RESET, RESET_AFTER, FaultPlan
from tests.k8s_fake.kubelet import FakeJobController, FakeKubelet
from tests.k8s_fake.selectors import SelectorError
from tests.k8s_fake.store import CORE, ApiError, ObjectStore, status_object

DEFAULT_WATCH_SECONDS = 1800
WATCH_POLL_SECONDS = 0.2


def inject_sidecars(pod: dict[str, Any], sidecars: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod with `sidecars` listed before its own containers (a mesh's mutating webhook)."""
    pod = copy.deepcopy(pod)
    spec = pod.setdefault("spec", {})
    own = spec.get("containers") or []
    spec["containers"] = [copy.deepcopy(c) for c in sidecars] + own
    return pod


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    _cut_answer = False  # an injected RESET_AFTER: serve the request, never answer it

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- plumbing ------------------------------------------------------------------

    def _send_json(
        self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        if self._cut_answer:  # served, but the client never hears of it
            self.server.note_served(self.command, urlsplit(self.path).path, RESET)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        data = json.dumps(body).encode()
        # Noted before it is sent: whatever answer a client saw is in `served` already.
        self.server.note_served(self.command, urlsplit(self.path).path, code)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _inject_fault(self, path: str, params: dict[str, str], body: Any) -> bool:
        """Answer with an injected fault instead of serving, if one matches; True if so."""
        fault = self.server.faults.take(self.command, path, _truthy(params.get("watch")))
        if fault is None:
            return False
        if fault.status == RESET_AFTER:
            self._cut_answer = True
            return False
        if fault.status == RESET:
            self.server.note_served(self.command, path, RESET)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return True
        name = ((body or {}).get("metadata") or {}).get("name") if isinstance(body, dict) else ""
        status = status_object(fault.status, fault.reason, fault.text(name or path.split("/")[-1]))
        headers = {}
        if fault.retry_after_seconds is not None:
            headers["Retry-After"] = str(fault.retry_after_seconds)
            status["details"] = {"retryAfterSeconds": fault.retry_after_seconds}
        self._send_json(fault.status, status, headers)
        return True

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return None
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ApiError(400, "BadRequest", f"invalid JSON body: {e}") from None

    def _route(self, parts: list[str]) -> tuple[str, str | None, str, str | None, str | None]:
        """(groupVersion, namespace, resource, name, subresource) of a request path."""
        if parts[:2] == ["api", "v1"]:
            gv, rest = CORE, parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not 1 <= len(rest) <= 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        resource = rest[0]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        return gv, namespace, resource, name, sub

    def _dispatch(self, method: str) -> None:
        store = self.server.store
        url = urlsplit(self.path)
        params = dict(parse_qsl(url.query))
        store.log_request(method, url.path, params)
        try:
            body = self._read_body()
            if self._inject_fault(url.path, params, body):
                return
            gv, ns, resource, name, sub = self._route([p for p in url.path.split("/") if p])
            if sub not in (None, "status"):
                raise ApiError(404, "NotFound", f"subresource {sub!r} is not served here")
            if method == "GET" and name is None:
                if _truthy(params.get("watch")):
                    self._watch(gv, ns, resource, params)
                    return
                items, rv = store.list(
                    gv, resource, ns, params.get("labelSelector"), params.get("fieldSelector")
                )
                kind = store.kind_of(gv, resource)
                self._send_json(
                    200,
                    {
                        "kind": kind + "List",
                        "apiVersion": gv,
                        "metadata": {"resourceVersion": str(rv)},
                        "items": items,
                    },
                )
                return
            if ns is None:
                raise ApiError(404, "NotFound", "namespaced resources need a namespace")
            if method == "POST" and name is None:
                if resource == "pods" and self.server.sidecars:
                    body = inject_sidecars(body or {}, self.server.sidecars)
                self._send_json(201, store.create(gv, resource, ns, body or {}))
            elif method == "GET":
                self._send_json(200, store.get(gv, resource, ns, name))
            elif method == "PUT":
                self._send_json(200, store.replace(gv, resource, ns, name, body or {}))
            elif method == "PATCH":
                content_type = self.headers.get("Content-Type", "")
                self._send_json(200, store.patch(gv, resource, ns, name, body, content_type))
            elif method == "DELETE":
                opts = body or {}
                grace = params.get("gracePeriodSeconds", opts.get("gracePeriodSeconds"))
                policy = params.get("propagationPolicy", opts.get("propagationPolicy"))
                obj = store.delete(
                    gv, resource, ns, name, None if grace is None else int(grace), policy
                )
                if resource in ("pods", "services"):
                    self._send_json(200, obj)
                else:
                    status = status_object(200, "", "")
                    status["details"] = {"name": name, "kind": resource}
                    self._send_json(200, status)
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
        except ApiError as e:
            self._send_json(e.code, e.status())
        except SelectorError as e:
            self._send_json(400, status_object(400, "BadRequest", str(e)))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # -- watch ---------------------------------------------------------------------

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        self._write_chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def _watch(self, gv: str, ns: str | None, resource: str, params: dict[str, str]) -> None:
        store = self.server.store
        if store.refuse_watches:
            raise ApiError(503, "ServiceUnavailable", "the fake server refuses watches now")
        w = store.open_watch(
            gv,
            resource,
            ns,
            params.get("labelSelector"),
            params.get("fieldSelector"),
            params.get("resourceVersion"),
        )
        self.server.note_served("GET", urlsplit(self.path).path, 200)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if w.expired:
                rv = params.get("resourceVersion")
                message = f"too old resource version: {rv} ({store.horizon})"
                self._event("ERROR", status_object(410, "Expired", message))
            else:
                self._stream(w, params)
            self._write_chunk(b"")  # the terminating zero-length chunk: a clean end
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            store.close_watch(w)

    def _client_gone(self) -> bool:
        """The client closed its end (like a cancelled request context in the real server)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _stream(self, w, params: dict[str, str]) -> None:
        store = self.server.store
        kind = store.kind_of(w.gv, w.resource)
        for obj in w.initial:
            self._event("ADDED", obj)
        timeout = int(params.get("timeoutSeconds") or DEFAULT_WATCH_SECONDS)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if _truthy(params.get("allowWatchBookmarks")):
                    rv = str(max(w.cursor, store.horizon))
                    meta = {"resourceVersion": rv}
                    self._event("BOOKMARK", {"kind": kind, "apiVersion": w.gv, "metadata": meta})
                return
            for change_type, obj in store.next_changes(w, min(remaining, WATCH_POLL_SECONDS)):
                self._event(change_type, obj)
            if self._client_gone():
                return
            if w.dropped:
                if w.abrupt:
                    # Cut the connection in the middle of the chunked stream.
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    raise ConnectionResetError("watch dropped by the test")
                return


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, store: ObjectStore) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.store = store
        self.faults = FaultPlan()
        self.sidecars: list[dict[str, Any]] = []
        self._served_lock = threading.Lock()
        self.served: list[tuple[float, str, str, int]] = []

    def note_served(self, method: str, path: str, code: int) -> None:
        with self._served_lock:
            self.served.append((time.monotonic(), method, path, code))


class FakeKubeApiServer:
    """Start with `with FakeKubeApiServer() as api:`; `api.url` is the server for the client."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.store = ObjectStore()
        self.kubelet = FakeKubelet(self.store, namespace)
        self.jobs = FakeJobController(self.store, namespace)
        self._httpd = _HTTPServer(self.store)
        self.faults = self._httpd.faults
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="fake-kube-api", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def sidecars(self) -> list[dict[str, Any]]:
        """Containers injected into every pod created from now on, before its own."""
        return self._httpd.sidecars

    def served(self, method: str | None = None, path: str = "") -> list[tuple[float, int]]:
        """(monotonic time, status) of each answer to `method` on a path matching `path`."""
        with self._httpd._served_lock:
            rows = list(self._httpd.served)
        return [
            (t, code)
            for t, m, p, code in rows
            if (method is None or m == method) and re.search(path, p)
        ]

    def api_client(self):
        """A real `kubernetes.client.ApiClient` pointed at this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def close(self) -> None:
        self.store.close()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeKubeApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- conveniences for tests ------------------------------------------------------

    def objects(
        self, resource: str, label_selector: str | None = None, gv: str = CORE
    ) -> list[dict[str, Any]]:
        items, _ = self.store.list(gv, resource, self.namespace, label_selector)
        return items

    def pods(self, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.objects("pods", label_selector)

    def pod(self, name: str) -> dict[str, Any]:
        return self.store.get(CORE, "pods", self.namespace, name)

    def create(self, resource: str, body: dict[str, Any], gv: str = CORE) -> dict[str, Any]:
        return self.store.create(gv, resource, self.namespace, body)

    def delete(
        self,
        resource: str,
        name: str,
        grace_seconds: int | None = None,
        gv: str = CORE,
        propagation: str | None = None,
    ) -> dict:
        return self.store.delete(gv, resource, self.namespace, name, grace_seconds, propagation)

    def requests(self, method: str | None = None, watch: bool | None = None) -> list:
        """The requests served so far: (method, path, query params)."""
        return [
            r
            for r in list(self.store.requests)
            if (method is None or r[0] == method)
            and (watch is None or _truthy(r[2].get("watch")) == watch)
        ]

    def wait_for(self, predicate, timeout: float = 10.0, what: str = "condition") -> Any:
        """Poll `predicate()` until it returns something truthy; fail the test after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.02)
