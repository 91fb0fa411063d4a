"""A master without a job: the torch rendezvous and KV services for `dlrover-run --standalone`.

It serves the Rendezvous and KVStore services (not the Master service: there is no job, so no
nodes, shards or checkpoints). Nodes are not checked against a node table: any NodeRef with a
type is accepted, so every agent must use a distinct (type, rank) such as ("worker", node_rank).
"""

from __future__ import annotations

import logging
import secrets
from concurrent import futures

import grpc

from master.client import MAX_MESSAGE_BYTES
from master.kv.store import KVStore
from master.rendezvous.service import RendezvousService
from master.rpc.kv_servicer import add_kv_service
from master.rpc.rendezvous_servicer import add_rendezvous_service
from master.rpc.server import TokenInterceptor, pending_call_options
from master.state.sqlite import MEMORY_PATH, SQLiteStateStore

log = logging.getLogger(__name__)

# Blocking calls hold a server thread each (a waiting node: one wait plus one watch), and the
# pool only grows on demand, so the bound is generous.
DEFAULT_MAX_WORKERS = 1024


def start_standalone_master(
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    *,
    max_workers: int = DEFAULT_MAX_WORKERS,
    state_path: str = MEMORY_PATH,
) -> tuple[grpc.Server, int, str]:
    """Start the rendezvous and KV services on host:port (0 picks a free port).

    Returns (server, port, token): the started grpc.Server (stop it with
    `server.stop(grace).wait()`), the port it listens on, and the job token every client must
    send (the given one, or a fresh random one when token is None). State lives in memory
    unless state_path names a SQLite file.
    """
    if token is None:
        token = secrets.token_hex(16)
    if not token:
        raise ValueError("token must not be empty; pass None to get a random one")
    state = SQLiteStateStore(state_path)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        interceptors=[TokenInterceptor(token)],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            *pending_call_options(max_workers),
        ],
    )
    add_rendezvous_service(server, RendezvousService(state))
    add_kv_service(server, KVStore(state))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        state.close()
        raise OSError(f"cannot listen on {host}:{port}; choose another port")
    server.start()
    log.info("standalone master (rendezvous, KV) listening on %s:%d", host, bound)
    return server, bound, token
