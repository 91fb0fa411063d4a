"""A TCP forwarder on loopback that a test can cut and restore: a node behind it loses the
master while it keeps running (gRPC over plain TCP, h2c, passes through unchanged)."""

from __future__ import annotations

import contextlib
import socket
import threading

CHUNK_BYTES = 65536


class LoopbackProxy:
    """Forwards 127.0.0.1:`port` to `target`. `cut()` drops every connection and refuses new
    ones (each is closed at once, so calls fail UNAVAILABLE and are retried); `restore()`
    forwards again."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self.refused = 0  # connections refused while cut
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """The node's traffic stops: open connections end, new ones are closed at once."""
        with self._lock:
            self._cut = True
            sockets, self._open = self._open, set()
        for s in sockets:
            _close(s)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                cut = self._cut
                if cut:
                    self.refused += 1
            if cut:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK_BYTES):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {src, dst}
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
