"""The persist service: workers send "persist slot S" over a unix socket, one thread writes.

The node agent runs it in-process (``AgentCheckpointKeeper``); without an agent the checkpointer
starts it as its own small process (``python -m dlrover_torch.checkpoint.service``, no torch
import unless the sharded format is used). Messages are JSON lines:

    worker -> service  {"op": "hello"}                       -> {"op": "hello", "namespace": ...}
    worker -> service  {"op": "persist", "id": n, "slot": path, "seq": q}
    service -> worker  {"op": "persisted", "id": n, "ok": ..., "error": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import socket
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from dlrover_torch.checkpoint import shm, shm_clean
from dlrover_torch.checkpoint.persister import PersistResult, persist_slot, read_slot_config
from dlrover_torch.checkpoint.socket_dir import hold_owner_lock, make_socket_dir

log = logging.getLogger(__name__)

STANDALONE_IDLE_EXIT_S = 60.0  # a standalone service nobody connected to gives up after this
PARENT_POLL_S = 0.2  # how often such a service checks that the process that started it lives


class PersistService:
    """Accepts persist requests on ``socket_path`` and runs them one at a time, in order."""

    def __init__(self, socket_path: str, namespace: str, shm_dir: str = shm.SHM_DIR) -> None:
        self.socket_path = socket_path
        self.namespace = namespace
        self.shm_dir = shm_dir
        self._jobs: queue.Queue[tuple[str, int | None, Future[PersistResult]] | None] = (
            queue.Queue()
        )
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc")
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._cond = threading.Condition()
        self._connections = 0
        self._ever_connected = False
        self._busy = 0
        self._closed = False

    def start(self) -> None:
        """Bind the socket and start the accept and persist threads."""
        shm.unlink_quietly(self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        sock.listen(64)
        self._sock = sock
        for target, name in ((self._accept_loop, "ckpt-accept"), (self._run_jobs, "ckpt-persist")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "checkpoint persist service on %s (namespace %s)", self.socket_path, self.namespace
        )

    def submit(self, slot_path: str, seq: int | None = None) -> Future[PersistResult]:
        """Queue a persist of ``slot_path``; the future completes when it is durable (or failed)."""
        fut: Future[PersistResult] = Future()
        with self._cond:
            if self._closed:
                fut.set_result(PersistResult(False, error="the persist service is closed"))
                return fut
            self._busy += 1
        self._jobs.put((slot_path, seq, fut))
        return fut

    def persist_latest(self, timeout: float) -> list[PersistResult]:
        """Persist every rank's newest committed memory checkpoint; wait up to ``timeout`` s."""
        newest: dict[int, tuple[int, str]] = {}
        for path in shm.slot_paths(self.namespace, self.shm_dir):
            slot = shm.SlotFile.open(path)
            if slot is None:
                continue
            try:
                found = read_slot_config(slot)
            except Exception as exc:  # a slot being rewritten; the other slot still counts
                log.warning("skipping %s: %s", path, exc)
                found = None
            finally:
                slot.close()
            if found is not None:
                header = found[0]
                if header.seq > newest.get(header.rank, (-1, ""))[0]:
                    newest[header.rank] = (header.seq, path)
        futures = [self.submit(path, seq) for seq, path in newest.values()]
        results = []
        for fut in futures:
            try:
                results.append(fut.result(timeout=timeout))
            except FutureTimeout:
                results.append(PersistResult(False, error=f"not persisted within {timeout} s"))
        for r in results:
            log.log(logging.INFO if r.ok else logging.ERROR, "persist latest: %s", r.to_json())
        return results

    def wait_abandoned(self, parent: int | None = None) -> None:
        """Block until every client has gone and no work is left (standalone mode's exit);
        without a first client, until the process that started this one (`parent`, default:
        the parent now) died, or a timeout."""
        parent = os.getppid() if parent is None else parent
        deadline = time.monotonic() + STANDALONE_IDLE_EXIT_S
        with self._cond:
            while not self._ever_connected:
                if os.getppid() != parent:  # reparented: the training process is gone
                    log.warning("the process that started this service died; exiting")
                    return
                if time.monotonic() >= deadline:
                    log.warning(
                        "no checkpointer connected within %s s; exiting", STANDALONE_IDLE_EXIT_S
                    )
                    return
                self._cond.wait(PARENT_POLL_S)
            self._cond.wait_for(lambda: self._busy == 0 and self._connections == 0)

    def close(self, unlink_segments: bool = False) -> None:
        """Stop accepting, finish queued work, optionally remove this namespace's segments."""
        with self._cond:
            self._closed = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=60)
        self._crc_pool.shutdown(wait=True)
        shm.unlink_quietly(self.socket_path)
        if unlink_segments:
            for path in shm.slot_paths(self.namespace, self.shm_dir):
                shm.unlink_quietly(path)

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot_path, seq, fut = job
            try:
                result = persist_slot(slot_path, seq, self._crc_pool)
            except Exception as exc:  # persist_slot reports errors itself; this is a bug guard
                log.exception("persist of %s crashed", slot_path)
                result = PersistResult(False, error=f"{type(exc).__name__}: {exc}")
            fut.set_result(result)
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._cond:
                self._connections += 1
                self._ever_connected = True
            threading.Thread(
                target=self._serve, args=(conn,), name="ckpt-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()

        def send(doc: dict[str, Any]) -> None:
            data = (json.dumps(doc) + "\n").encode()
            with send_lock:
                try:
                    conn.sendall(data)
                except OSError:
                    log.info("worker went away before reply %s", doc.get("id"))

        try:
            with conn, conn.makefile("rb") as reader:
                for line in reader:
                    msg = json.loads(line)
                    if msg.get("op") == "hello":
                        send({"op": "hello", "namespace": self.namespace, "pid": os.getpid()})
                    elif msg.get("op") == "persist":
                        fut = self.submit(msg["slot"], msg.get("seq"))
                        rid = msg.get("id")
                        fut.add_done_callback(
                            lambda f, rid=rid: send(
                                {"op": "persisted", "id": rid, **f.result().to_json()}
                            )
                        )
                    else:
                        send({"op": "error", "error": f"unknown op {msg.get('op')!r}"})
        except (OSError, ValueError) as exc:
            log.warning("checkpoint client connection ended: %s", exc)
        finally:
            with self._cond:
                self._connections -= 1
                self._cond.notify_all()


def main(argv: list[str] | None = None) -> int:
    """Standalone service: serve until the training process has gone and the work is done."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", required=True)
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="the process that started this service: once it is gone, nobody will connect",
    )
    parser.add_argument("--shm-dir", default=shm.SHM_DIR)
    parser.add_argument(
        "--orphan-grace",
        type=float,
        default=None,
        help="once the training process is gone, free its shared memory after this many seconds",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("DLROVER_CKPT_LOG_LEVEL", "INFO"),
        format="%(asctime)s ckpt-service %(levelname)s %(message)s",
    )
    # The socket's folder is made here, not by the starter: a starter killed before it started
    # this process would have left an empty folder that no sweep recognises. The folder is this
    # process's from now on: a sweep removes it if this process is killed. Its path follows
    # "ready" on stdout.
    socket_path = make_socket_dir()
    owner_lock = hold_owner_lock(socket_path)
    service = PersistService(socket_path, args.namespace, args.shm_dir)
    service.start()
    try:
        sys.stdout.write(f"ready {socket_path}\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the training process died before it read this: nobody will come
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        log.warning("the process that started this service is gone; exiting")
    else:
        # Named by the starter: it may have died before this process could ask for its parent.
        service.wait_abandoned(args.parent_pid)
    service.close(unlink_segments=False)  # a restarted worker reloads from these
    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)
    owner_lock.close()
    # The training process died (a close() waits for this process, so it cannot be that): free
    # its memory once the grace has passed, unless a restart took it over meanwhile.
    if args.orphan_grace is not None and os.getppid() != args.parent_pid:
        shm_clean.reap(args.shm_dir, args.namespace, args.orphan_grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
