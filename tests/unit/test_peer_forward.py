"""A node's forwarders to its peers: real sockets on loopback, a peer that moves."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from master.platform.peer_forward import (
    Forwarder,
    PeerForwarders,
    dials,
    peer_addresses,
    with_peers,
)


class EchoServer:
    """A peer: answers each line with its name and the line."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                conn.sendall(self.name.encode() + b":" + line)

    def close(self) -> None:
        self._server.close()


def ask(sock_file, sock: socket.socket, line: bytes) -> bytes:
    sock.sendall(line + b"\n")
    return sock_file.readline().rstrip(b"\n")


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_a_forwarder_joins_connections_to_its_target_and_follows_a_move():
    old, new = EchoServer("old"), EchoServer("new")
    forwarder = Forwarder("127.0.0.1", old.address)
    try:
        a = connect(forwarder.address)
        af = a.makefile("rb")
        assert ask(af, a, b"x") == b"old:x"
        big = b"y" * (3 << 20)  # more than one copy's chunk, both ways
        assert ask(af, a, big) == b"old:" + big
        forwarder.retarget(new.address)
        # The connection through it is cut: the client sees its end and dials again.
        assert af.readline() == b""
        b = connect(forwarder.address)
        assert ask(b.makefile("rb"), b, b"z") == b"new:z"
        assert forwarder.target == new.address
    finally:
        forwarder.close()
        old.close()
        new.close()


def test_a_half_closed_connection_still_gets_its_reply():
    """The client ends its side; the peer's answer to everything it sent still comes back."""

    def count_then_reply(conn: socket.socket) -> None:
        total = 0
        while data := conn.recv(65536):
            total += len(data)
        conn.sendall(str(total).encode())
        conn.close()

    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: count_then_reply(server.accept()[0]), daemon=True).start()
    forwarder = Forwarder("127.0.0.1", f"127.0.0.1:{server.getsockname()[1]}")
    try:
        c = connect(forwarder.address)
        c.sendall(b"z" * 100_000)
        c.shutdown(socket.SHUT_WR)
        assert c.recv(64) == b"100000"
        assert c.recv(64) == b""  # then the connection ends
    finally:
        forwarder.close()
        server.close()


def test_a_connection_to_a_peer_not_there_yet_is_closed_so_the_client_retries():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        forwarder = Forwarder("127.0.0.1", nobody)
        try:
            c = connect(forwarder.address)
            c.settimeout(5)
            assert c.recv(1) == b""
        finally:
            forwarder.close()


def test_a_closed_forwarder_refuses_new_connections():
    peer = EchoServer("p")
    forwarder = Forwarder("127.0.0.1", peer.address)
    forwarder.close()
    with pytest.raises(OSError):
        connect(forwarder.address).recv(1)
    peer.close()


TF_CONFIG = json.dumps(
    {
        "cluster": {
            "chief": ["10.0.0.1:2222"],
            "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
            "ps": ["10.0.0.4:2222", "10.0.0.5:2222"],
        },
        "task": {"type": "worker", "index": 1},
    }
)


def test_a_node_forwards_only_to_the_peers_it_dials():
    assert peer_addresses(TF_CONFIG) == (
        "10.0.0.3",
        {("ps", 0): "10.0.0.4:2222", ("ps", 1): "10.0.0.5:2222"},
    )
    ps = json.dumps({**json.loads(TF_CONFIG), "task": {"type": "ps", "index": 0}})
    host, peers = peer_addresses(ps)
    assert host == "10.0.0.4" and set(peers) == {("chief", 0), ("worker", 0), ("worker", 1)}
    assert dials("chief", "worker") and dials("evaluator", "ps") and not dials("ps", "ps")
    assert not dials("worker", "worker")
    # A config whose task is not in its cluster (a standby's is given at its promotion).
    assert peer_addresses(json.dumps({"cluster": {"ps": ["a:1"]}, "task": {}}))[0] == ""


def test_a_config_gets_its_peers_at_the_forwarders_and_its_own_address_unchanged():
    doc = json.loads(with_peers(TF_CONFIG, {("ps", 1): "127.0.0.1:9"}))
    assert doc["cluster"]["ps"] == ["10.0.0.4:2222", "127.0.0.1:9"]
    assert doc["task"] == {"type": "worker", "index": 1}


def test_peer_forwarders_rewrite_the_config_and_are_readdressed():
    ps0, moved = EchoServer("ps0"), EchoServer("ps0-moved")
    config = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:1"], "ps": [ps0.address]},
            "task": {"type": "worker", "index": 0},
        }
    )
    peers = PeerForwarders()
    try:
        doc = json.loads(peers.forward(config))
        assert doc["cluster"]["worker"] == ["127.0.0.1:1"]  # its own: where its server binds
        via = doc["cluster"]["ps"][0]
        assert via != ps0.address and via.startswith("127.0.0.1:")
        c = connect(via)
        assert ask(c.makefile("rb"), c, b"a") == b"ps0:a"
        assert peers.readdress({("ps", 0): moved.address})
        deadline = time.monotonic() + 5
        while True:  # the cut connection's end reaches the client
            c2 = connect(via)
            reply = ask(c2.makefile("rb"), c2, b"b")
            if reply == b"ps0-moved:b" or time.monotonic() > deadline:
                break
        assert reply == b"ps0-moved:b"
        # A rank it does not dial (another worker) is no reason to restart it...
        assert peers.readdress({("worker", 1): "127.0.0.1:2", ("ps", 0): moved.address})
        # ...but one it dials directly is (a node whose config forwards nothing).
        assert not PeerForwarders().readdress({("ps", 0): moved.address})
    finally:
        peers.close()
        ps0.close()
        moved.close()
