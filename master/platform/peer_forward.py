"""Stable peer addresses where ranks move (a lost Ray node): a TCP forwarder per peer.

A TF server keeps the cluster spec it started with: a peer relaunched at a new address is
unreachable until the process restarts. Where a platform cannot keep addresses (Ray has no
service names), each node gets `TF_CONFIG` with its peers at forwarders of its own, on its
host; when a peer moves, its forwarders are pointed at the new address and the connections
through them are cut, so gRPC reconnects there and TF recovers as from a PS restart in place.
Pure sockets: TF sees plain TCP, any protocol passes.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Each direction of a connection copies at most this much per system call.
CHUNK_BYTES = 1 << 20
CONNECT_TIMEOUT_SECONDS = 5.0
# Set to "0" in a job's env to give nodes their peers' own addresses (a moved peer then
# restarts the nodes that dial it).
ENV_PEER_FORWARD = "DLROVER_PEER_FORWARD"

Rank = tuple[str, int]


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Forwarder:
    """Listens on `host` (a free port) and joins each connection to the current target."""

    def __init__(self, host: str, target: str) -> None:
        self._target = target
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.create_server((host, 0), backlog=64)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"forward-{self.address}", daemon=True).start()

    @property
    def target(self) -> str:
        return self._target

    def retarget(self, target: str) -> None:
        """New connections go to `target`; those open now are cut (their peer went away)."""
        with self._lock:
            self._target = target
            live, self._live = self._live, set()
        for s in live:
            _close(s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        _close(self._listener)
        self.retarget(self._target)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._join, args=(client,), daemon=True).start()

    def _join(self, client: socket.socket) -> None:
        target = self._target
        try:
            upstream = socket.create_connection(
                split_address(target), timeout=CONNECT_TIMEOUT_SECONDS
            )
        except OSError:
            _close(client)  # the peer is not there (yet): the client retries
            return
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closed or target != self._target:
                _close(client)
                _close(upstream)
                return
            self._live.update((client, upstream))
        ended = [0]  # directions done: both sockets close after the second
        threading.Thread(target=self._pump, args=(upstream, client, ended), daemon=True).start()
        self._pump(client, upstream, ended)

    def _pump(self, src: socket.socket, dst: socket.socket, ended: list[int]) -> None:
        """Copy `src` to `dst` until `src` ends (passed on as a half-close) or either fails;
        the connection closes once both directions are done, or at once on a failure."""
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        clean = True
        try:
            while n := src.recv_into(buf):
                dst.sendall(view[:n])
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            clean = False
        with self._lock:
            ended[0] += 1
            last = ended[0] >= 2 or not clean
            if last:
                self._live -= {src, dst}
        if last:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def dials(own_type: str, peer_type: str) -> bool:
    """Whether a task of `own_type` connects to tasks of `peer_type` in TF PS training: the
    chief and workers (and an evaluator) reach every PS, a PS reaches the chief and workers
    (it pulls their tensors), a TF2 coordinator (the chief) reaches every task."""
    if own_type == "ps":
        return peer_type != "ps"
    return own_type == "chief" or peer_type == "ps"


def peer_addresses(tf_config: str) -> tuple[str, dict[Rank, str]]:
    """The host of this node's own task and the address of every task it dials, from
    `TF_CONFIG` (the own host is "" for a config without a task of its own in the cluster)."""
    doc = json.loads(tf_config)
    task = doc.get("task") or {}
    own = (str(task.get("type", "")), int(task.get("index", -1)))
    peers: dict[Rank, str] = {}
    own_host = ""
    for node_type, addresses in (doc.get("cluster") or {}).items():
        for rank, address in enumerate(addresses):
            if (node_type, rank) == own:
                own_host = split_address(address)[0]
            elif dials(own[0], node_type):
                peers[(node_type, rank)] = address
    return own_host, peers


def with_peers(tf_config: str, addresses: Mapping[Rank, str]) -> str:
    """`TF_CONFIG` with the given tasks at other addresses."""
    doc = json.loads(tf_config)
    for (node_type, rank), address in addresses.items():
        doc["cluster"][node_type][rank] = address
    return json.dumps(doc)


class PeerForwarders:
    """One node's forwarders, one per peer task in its `TF_CONFIG`."""

    def __init__(self) -> None:
        self._by_rank: dict[Rank, Forwarder] = {}
        self._own_type = ""

    def forward(self, tf_config: str) -> str:
        """Start a forwarder per peer on this node's host; the `TF_CONFIG` that uses them
        (unchanged for a config whose own task is not in its cluster)."""
        host, peers = peer_addresses(tf_config)
        if not host:
            return tf_config
        self._own_type = str(json.loads(tf_config)["task"]["type"])
        try:
            for rank, address in peers.items():
                self._by_rank[rank] = Forwarder(host, address)
        except OSError as e:
            log.warning("cannot forward to peers on %s (%s): they are given as they are", host, e)
            self.close()
            return tf_config
        return with_peers(tf_config, {r: f.address for r, f in self._by_rank.items()})

    def readdress(self, addresses: Mapping[Rank, str]) -> bool:
        """Point the forwarders of these ranks at their new addresses; whether this node
        forwards to every one of them it dials (else it still dials an old address)."""
        for rank, address in addresses.items():
            forwarder = self._by_rank.get(rank)
            if forwarder is not None and forwarder.target != address:
                forwarder.retarget(address)
        if not self._own_type:
            return False  # forwards nothing: dials every peer directly
        dialed = [r for r in addresses if dials(self._own_type, r[0])]
        return all(rank in self._by_rank for rank in dialed)

    def close(self) -> None:
        for forwarder in self._by_rank.values():
            forwarder.close()
        self._by_rank.clear()
