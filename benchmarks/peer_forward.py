"""What a peer forwarder (master/platform/peer_forward.py) costs a connection on Ray: the same
work over a direct loopback connection and through a `Forwarder`, in the same run.

- bulk: one connection sends `--mib` MiB to a sink that acknowledges the end (a PS pulling a
  large tensor, a checkpoint's variables);
- round trips: `--round-trips` request/reply pairs of 256 bytes on one connection (gRPC's small
  calls: a step's parameter reads and gradient pushes on a small model).

Prints each figure and its ratio to the direct one, then one JSON line. Leaves out: gRPC itself
(plain sockets), other traffic on the machine, and Ray nodes on separate hosts (the hop is on
the caller's own host, so a real network adds the same latency to both sides).

    .venv/bin/python benchmarks/peer_forward.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from master.platform.peer_forward import Forwarder  # noqa: E402

CHUNK = 1 << 20
MESSAGE = 256


def _server(handler) -> tuple[socket.socket, str]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def _sink(conn: socket.socket) -> None:
    """Reads until the sender shuts its side, then answers with the byte count."""
    total, buf = 0, bytearray(CHUNK)
    while (n := conn.recv_into(buf)) > 0:
        total += n
    conn.sendall(str(total).encode())
    conn.close()


def _echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(MESSAGE)
    view = memoryview(buf)
    while True:
        got = 0
        while got < MESSAGE:
            n = conn.recv_into(view[got:])
            if not n:
                conn.close()
                return
            got += n
        conn.sendall(buf)


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def bulk_seconds(address: str, mib: int) -> float:
    payload = b"x" * CHUNK
    started = time.perf_counter()
    with _connect(address) as s:
        for _ in range(mib):
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        assert int(s.recv(64)) == mib * CHUNK
    return time.perf_counter() - started


def round_trip_seconds(address: str, count: int) -> float:
    message = b"y" * MESSAGE
    buf = bytearray(MESSAGE)
    view = memoryview(buf)
    with _connect(address) as s:
        started = time.perf_counter()
        for _ in range(count):
            s.sendall(message)
            got = 0
            while got < MESSAGE:
                got += s.recv_into(view[got:])
        return (time.perf_counter() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--round-trips", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sink, sink_address = _server(_sink)
    echo, echo_address = _server(_echo)
    via_sink = Forwarder("127.0.0.1", sink_address)
    via_echo = Forwarder("127.0.0.1", echo_address)
    # Alternate the two sides so drift on the machine hits both; keep each side's best.
    bulk = {"direct": [], "forwarded": []}
    trips = {"direct": [], "forwarded": []}
    for _ in range(args.repeats):
        bulk["direct"].append(bulk_seconds(sink_address, args.mib))
        bulk["forwarded"].append(bulk_seconds(via_sink.address, args.mib))
        trips["direct"].append(round_trip_seconds(echo_address, args.round_trips))
        trips["forwarded"].append(round_trip_seconds(via_echo.address, args.round_trips))
    gib = args.mib / 1024
    rate = {k: gib / min(v) for k, v in bulk.items()}
    rtt = {k: min(v) * 1e6 for k, v in trips.items()}
    print(f"bulk, {args.mib} MiB on one connection (best of {args.repeats}):")
    print(f"  direct     {rate['direct']:.2f} GiB/s")
    print(f"  forwarded  {rate['forwarded']:.2f} GiB/s ({rate['forwarded'] / rate['direct']:.2f}x)")
    print(f"round trips of {MESSAGE} bytes (mean of {args.round_trips}, best of {args.repeats}):")
    print(f"  direct     {rtt['direct']:.1f} us")
    print(f"  forwarded  {rtt['forwarded']:.1f} us (+{rtt['forwarded'] - rtt['direct']:.1f} us)")
    print(
        json.dumps(
            {
                "bulk_gib_per_s": {k: round(v, 3) for k, v in rate.items()},
                "bulk_ratio": round(rate["forwarded"] / rate["direct"], 3),
                "round_trip_us": {k: round(v, 1) for k, v in rtt.items()},
                "round_trip_added_us": round(rtt["forwarded"] - rtt["direct"], 1),
                "mib": args.mib,
                "round_trips": args.round_trips,
            }
        )
    )
    via_sink.close()
    via_echo.close()
    sink.close()
    echo.close()


if __name__ == "__main__":
    main()
