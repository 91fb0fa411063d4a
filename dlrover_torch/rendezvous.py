"""torch elastic's RendezvousHandler backed by the master's rendezvous rounds.

`MasterRendezvousHandler(client, kv, run_id, node_rank_hint, local_world_size, min_nodes,
max_nodes, node_unit=1, last_call_seconds=1.0, join_timeout_seconds=600)`; keyword-only extras:
`lease_seconds` (a node silent this long is lost, default 10) and `local_addr` (this node's
address for MASTER_ADDR, default the FQDN). Interface changes since the first version: none.

- `next_rendezvous()` joins the round being formed and blocks on the master (no polling) until
  it closes with this node in it. It returns a `RendezvousInfo` whose store is a `MasterStore`
  prefixed by "<run_id>/<round>/" and whose bootstrap info (MASTER_ADDR/MASTER_PORT for the
  workers' own process group) is a port on the rank-0 node claimed fresh for this round: a
  restarted group never reuses the store or the port of the group it replaces.
- After a round, a watch thread keeps one blocking call open on the master (it also renews this
  node's lease), so `num_nodes_waiting()` answers from memory: > 0 when newcomers can make a
  bigger round, a member re-joined, or a member was lost (the rest must re-rendezvous, at a
  smaller size if need be). The agent restarts its workers then without using `max_restarts`.
- `shutdown()` leaves the rendezvous gracefully: this node's silence is then not a loss.
- A master restart does not end the round: the watch retries until the new master answers, and
  that master serves the same round from its state store, so the workers keep running.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

import grpc
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from dlrover_torch.store import MasterStore
from master.client import KVClient, MasterError, RendezvousClient, StaleNodeError
from master.pb import rendezvous_pb2

log = logging.getLogger(__name__)

BACKEND = "dlrover"
STORE_TIMEOUT = timedelta(seconds=300)
MAX_WAIT_CHUNK_S = 10.0  # one blocking call on the master lasts at most this long
PORT_CLAIM_ATTEMPTS = 32
WATCH_RETRY_S = 1.0  # after a failed watch call (master unreachable), try again after this
CHANNEL_CLOSED = "Channel closed"  # grpc's detail when this process closed its own channel
_RoundReply = rendezvous_pb2.RoundReply


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MasterRendezvousHandler(RendezvousHandler):
    """Rendezvous rounds on the master, fenced by round number (see the module docstring)."""

    def __init__(
        self,
        client: RendezvousClient,
        kv: KVClient,
        run_id: str,
        node_rank_hint: int,
        local_world_size: int,
        min_nodes: int,
        max_nodes: int,
        node_unit: int = 1,
        last_call_seconds: float = 1.0,
        join_timeout_seconds: float = 600,
        *,
        lease_seconds: float = 10.0,
        local_addr: str | None = None,
    ) -> None:
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
        if join_timeout_seconds <= 0:
            raise ValueError(f"join_timeout_seconds must be > 0, got {join_timeout_seconds}")
        self._client = client
        self._kv = kv
        self._run_id = run_id
        self._rank_hint = node_rank_hint
        self._local_world_size = local_world_size
        self._join_timeout = join_timeout_seconds
        self._lease = lease_seconds
        self._addr = local_addr or socket.getfqdn()
        self._config = rendezvous_pb2.RendezvousConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            node_unit=node_unit,
            last_call_ms=int(last_call_seconds * 1000),
            lease_ms=int(lease_seconds * 1000),
        )
        self._lock = threading.Lock()
        self._round = 0
        self._waiting = 0
        self._closed = False
        self._watch_stop: threading.Event | None = None
        self.last_round: _RoundReply | None = None  # the members of the last round, for logs

    # -- RendezvousHandler ----------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        """Workers build their own process group from MASTER_ADDR/PORT, not the agent's store."""
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it closes with this node in it."""
        self._stop_watch()
        deadline = time.monotonic() + self._join_timeout
        try:
            reply = self._join_and_wait(deadline)
        except StaleNodeError as e:
            raise RendezvousStateError(
                f"the master refuses this node in rendezvous {self._run_id!r}: {e}"
            ) from e
        except MasterError as e:
            raise RendezvousConnectionError(
                f"rendezvous {self._run_id!r} on the master failed: {e}"
            ) from e
        round_number, rank, world_size = reply.round, reply.rank, len(reply.members)
        store = MasterStore(self._kv, f"{self._run_id}/{round_number}/", STORE_TIMEOUT)
        bootstrap = self._bootstrap(store, rank, round_number)
        with self._lock:
            self._round = round_number
            self._waiting = 0
            self.last_round = reply
        self._start_watch(round_number)
        log.info(
            "rendezvous %r round %d: rank %d of %d; workers meet at %s:%d",
            self._run_id,
            round_number,
            rank,
            world_size,
            bootstrap.master_addr,
            bootstrap.master_port,
        )
        return RendezvousInfo(store, rank, world_size, bootstrap)

    def num_nodes_waiting(self) -> int:
        """Nodes whose admission needs this round's members to re-rendezvous (from memory)."""
        with self._lock:
            return self._waiting

    def is_closed(self) -> bool:
        with self._lock:
            return self._closed

    def set_closed(self) -> None:
        """Close the rendezvous for every node: no later round forms."""
        try:
            self._client.set_closed(self._run_id)
        except MasterError as e:
            raise RendezvousConnectionError(f"cannot close rendezvous {self._run_id!r}: {e}") from e
        with self._lock:
            self._closed = True

    def shutdown(self) -> bool:
        """Stop watching and leave gracefully; False if the master could not be told."""
        self._stop_watch()
        try:
            self._client.leave(self._run_id)
        except MasterError as e:
            log.warning("leaving rendezvous %r failed: %s", self._run_id, e)
            return False
        return True

    # -- joining --------------------------------------------------------------

    def _join(self) -> int:
        reply = self._client.join(
            self._run_id, self._config, self._rank_hint, self._local_world_size, self._addr
        )
        if reply.closed:
            with self._lock:
                self._closed = True
            raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
        return reply.round

    def _join_and_wait(self, deadline: float) -> _RoundReply:
        round_number = self._join()
        while True:
            wait_ms = int(max(0.0, min(MAX_WAIT_CHUNK_S, deadline - time.monotonic())) * 1000)
            try:
                reply = self._client.wait_round(self._run_id, round_number, wait_ms)
            except StaleNodeError as e:
                # Our place was lost (e.g. the lease ran out while this process was stopped).
                log.warning("rendezvous %r: %s; joining again", self._run_id, e)
                round_number = self._join()
                continue
            if reply.status == _RoundReply.DONE:
                return reply
            if reply.status == _RoundReply.CLOSED:
                with self._lock:
                    self._closed = True
                raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
            if reply.status == _RoundReply.NEXT:
                log.info(
                    "rendezvous %r: round %d closed without this node; waiting for round %d",
                    self._run_id,
                    round_number,
                    reply.round,
                )
                round_number = reply.round
            if time.monotonic() >= deadline:
                self._leave_quietly()
                raise RendezvousTimeoutError(
                    f"rendezvous {self._run_id!r}: round {round_number} did not admit this node "
                    f"within {self._join_timeout:g}s (min_nodes={self._config.min_nodes}, "
                    f"max_nodes={self._config.max_nodes}, node_unit={self._config.node_unit}); "
                    "start more nodes or raise the join timeout"
                )

    def _leave_quietly(self) -> None:
        try:
            self._client.leave(self._run_id)
        except MasterError as e:
            log.warning("leaving rendezvous %r failed: %s", self._run_id, e)

    def _bootstrap(self, store: MasterStore, rank: int, round_number: int) -> RendezvousStoreInfo:
        """Rank 0 claims a port never used by an earlier round of this run and publishes it."""
        addr_key, port_key = (
            RendezvousStoreInfo.MASTER_ADDR_KEY,
            RendezvousStoreInfo.MASTER_PORT_KEY,
        )
        if rank == 0:
            port = self._claim_port(round_number)
            store.set(addr_key, self._addr.encode())
            store.set(port_key, str(port).encode())
        try:
            addr = store.get(addr_key).decode()
            port = int(store.get(port_key).decode())
        except RuntimeError as e:
            raise RendezvousStateError(
                f"rendezvous {self._run_id!r} round {round_number}: rank 0 did not publish "
                f"MASTER_ADDR/MASTER_PORT ({e})"
            ) from e
        return RendezvousStoreInfo(addr, port)

    def _claim_port(self, round_number: int) -> int:
        mark = str(round_number).encode()
        for _ in range(PORT_CLAIM_ATTEMPTS):
            port = free_port()
            key = f"{self._run_id}/bootstrap-ports/{self._addr}:{port}".encode()
            # First claim wins: the key is created only when missing (expected value empty).
            if self._kv.compare_set(key, b"", mark) == mark:
                return port
        raise RendezvousStateError(
            f"no fresh port on {self._addr} after {PORT_CLAIM_ATTEMPTS} attempts: every free port "
            "the OS offered was used by an earlier round"
        )

    # -- watching -------------------------------------------------------------

    def _start_watch(self, round_number: int) -> None:
        stop = threading.Event()
        self._watch_stop = stop
        thread = threading.Thread(
            target=self._watch,
            args=(round_number, stop),
            name=f"dlrover-rdzv-watch-{round_number}",
            daemon=True,
        )
        thread.start()

    def _stop_watch(self) -> None:
        # The thread ends when its current call returns (at most one chunk; at once when this
        # node re-joins, since that changes what the call watches).
        if self._watch_stop is not None:
            self._watch_stop.set()
            self._watch_stop = None

    def _watch(self, round_number: int, stop: threading.Event) -> None:
        known = 0
        chunk_ms = int(min(MAX_WAIT_CHUNK_S, self._lease / 3) * 1000)
        while not stop.is_set():
            try:
                reply = self._client.watch(self._run_id, round_number, known, chunk_ms)
            except StaleNodeError as e:
                # The round is over without us (or we were declared lost): re-rendezvous.
                log.info("rendezvous %r round %d is over: %s", self._run_id, round_number, e)
                with self._lock:
                    if not stop.is_set():
                        self._waiting = max(self._waiting, 1)
                return
            except MasterError as e:
                if stop.is_set():
                    return  # shut down meanwhile: the failure does not matter any more
                if e.code == grpc.StatusCode.CANCELLED and CHANNEL_CLOSED in str(e):
                    log.info("rendezvous watch ends: the client channel was closed")
                    return
                # Also CANCELLED by a master that stops serving (it may come back restarted,
                # with this round): keep watching.
                log.warning("rendezvous watch failed: %s; retrying in %gs", e, WATCH_RETRY_S)
                stop.wait(WATCH_RETRY_S)
                continue
            except ValueError as e:  # grpc: "Cannot invoke RPC on closed channel!"
                log.info("rendezvous watch ends: %s", e)
                return
            known = reply.waiting
            with self._lock:
                if stop.is_set():
                    return
                self._waiting = reply.waiting
                self._closed = self._closed or reply.closed
            if reply.closed:
                return
