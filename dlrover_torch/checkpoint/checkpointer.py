"""The training-side API: ``Checkpointer.save`` copies to shared memory and returns at once.

Persistence to disk runs elsewhere: in the node agent under ``dlrover-run`` (found through
``DLROVER_CKPT_SERVICE``), otherwise in a small background process this class starts.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dlrover_torch.checkpoint import env, layout, lease, shm, shm_clean, storage
from dlrover_torch.checkpoint.client import ServiceClient
from dlrover_torch.checkpoint.errors import CheckpointError, CorruptCheckpointError
from dlrover_torch.checkpoint.memory import HostBuffer, MemoryCopy, MemoryStore
from dlrover_torch.checkpoint.preflight import check_disk, check_shm

log = logging.getLogger(__name__)

Storage = Literal["memory", "disk"]


def standalone_namespace(checkpoint_dir: str) -> str:
    """The shm namespace of a checkpoint directory when no agent provides one: the user, the
    directory's name (so ``ls /dev/shm`` tells whose it is) and a hash of its path."""
    path = os.path.abspath(checkpoint_dir)
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "_." else "_" for c in os.path.basename(path))[:24]
    return f"dlrover-fc-{os.getuid()}-{name or 'root'}-{digest}"


def _dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return env.rank_from_env()


def agree(value: int) -> tuple[int, int]:
    """(min, max) of ``value`` over all ranks; the value itself without a process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value, value
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t[0]), -int(t[1])


@dataclass
class _Pending:
    step: int
    slot: int
    future: Future[dict[str, Any]]


class Checkpointer:
    """Flash checkpoints of a plain or DDP model: memory copies, persisted in the background.

    ``writers="rank0"`` persists rank 0's state only (DDP: replicas are identical);
    ``writers="all"`` persists every rank's own state. Every rank always keeps its memory copy.
    """

    format = "flash"

    def __init__(
        self,
        checkpoint_dir: str,
        keep_latest: int | None = 2,
        writers: Literal["rank0", "all"] = "rank0",
        memory_slots: int = 2,
        service_address: str | None = None,
        shm_dir: str = shm.SHM_DIR,
    ) -> None:
        if writers not in ("rank0", "all"):
            raise ValueError(f"writers={writers!r}: use 'rank0' or 'all'")
        if keep_latest is not None and keep_latest < 1:
            raise ValueError(f"keep_latest={keep_latest}: use at least 1, or None to keep all")
        self.checkpoint_dir = os.path.abspath(checkpoint_dir)
        self.keep_latest = keep_latest
        self.rank, self.world = _dist_info()
        self.writers = [0] if writers == "rank0" else list(range(self.world))
        self._client: ServiceClient | None = None
        self._client_error: BaseException | None = None
        self._pending: list[_Pending] = []
        self._failures: list[str] = []
        self._disk_checked = False
        # The service's report of each finished persist (step, seconds, bytes, cpu_seconds, ...).
        self.persist_reports: list[dict[str, Any]] = []
        # Where the last load() found its checkpoint: "memory", "disk" or None (nothing).
        self.last_load_source: str | None = None
        address = service_address or env.service_address_from_env()
        self._agent_mode = address is not None
        if address is not None:  # the agent owns the segments (and keeps them for a restart)
            self._client = ServiceClient.connect(address)
            namespace = self._client.namespace
            self._client_ready = threading.Event()
            self._client_ready.set()
        self._lease: lease.Lease | None = None
        self._closed = False
        if address is None:
            namespace = standalone_namespace(self.checkpoint_dir)
            # This process owns its rank's segments: at exit they go, after a death they go
            # once the grace has passed without a restart (the service reaps them).
            self._orphan_grace = env.orphan_grace_from_env()
            self._take_lease(namespace, shm_dir)
            self._owner_pid = os.getpid()
            atexit.register(self._at_exit)
            # Start the persister now, off the training thread, so no save waits for it.
            self._client_ready = threading.Event()
            threading.Thread(
                target=self._spawn_service,
                args=(namespace, shm_dir),
                name="ckpt-spawn",
                daemon=True,
            ).start()
        self.memory = MemoryStore(namespace, self.rank, self.world, memory_slots, shm_dir)

    # ---- public API --------------------------------------------------------------------
    def prepare(self, state_dict: Any) -> None:
        """Run the preflight and reserve + pre-touch shared memory for states like this one.

        Call it once before the training loop so that even the first save runs at copy speed.
        """
        lay, _ = layout.plan(state_dict)
        meta = self._meta(lay, step=0, state_dict=state_dict)
        self._ensure_memory(lay, meta)
        if self.rank in self.writers:
            self._check_disk(lay.data_bytes + len(meta))

    def save(self, step: int, state_dict: Any, storage: Storage = "memory") -> None:
        """Copy ``state_dict`` into shared memory; with ``storage="disk"`` also persist it.

        Returns as soon as the copy is complete: the training may modify its tensors.
        Raises CheckpointError if an earlier persist failed (never skipped silently).
        """
        if storage not in ("memory", "disk"):
            raise ValueError(f"storage={storage!r}: use 'memory' or 'disk'")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: use a non-negative int")
        self._raise_failures()
        lay, tensors = layout.plan(state_dict)
        meta = self._meta(lay, step, state_dict)
        persist = storage == "disk" and self.rank in self.writers
        if persist and not self._disk_checked:
            self._check_disk(lay.data_bytes + len(meta))
        busy = {p.slot for p in self._pending if not p.future.done()}
        rewritten = self.memory.rewrite_first(lay, tensors, meta, step, busy)
        if rewritten is not None:  # no wait for the other slot's fresh memory
            if persist:
                self._pending.append(
                    _Pending(step, rewritten[0], self._submit_persist(*self._slot_seq(rewritten)))
                )
            return
        first = self.memory.first_save_possible(tensors)
        if first:  # nothing to reserve up front: the write reserves what it writes
            check_shm(self.memory.bytes_needed(lay.data_bytes, len(meta)), 0, self.memory.directory)
        else:
            self._ensure_memory(lay, meta, in_save=True)

        def committed(index: int, seq: int) -> None:
            if persist:
                fut = self._submit_persist(self.memory.paths[index], seq)
                self._pending.append(_Pending(step, index, fut))

        if first:
            committed(*self.memory.write_first(lay, tensors, meta, step))
            return
        self.memory.flush()
        index = self._acquire_slot(step)
        self.memory.write(
            index, lay, tensors, meta, step, on_commit=lambda seq: committed(index, seq)
        )

    def load(self) -> tuple[int, Any] | None:
        """The latest ``(step, state_dict)``: from memory if every rank holds the same step.

        Otherwise the newest committed checkpoint on disk whose checksums verify (a corrupt one
        is reported and skipped for the previous one). None when there is no checkpoint.
        """
        found = self._load_memory()
        if found is not None:
            self.last_load_source = "memory"
            return found
        found = self._load_disk()
        self.last_load_source = "disk" if found is not None else None
        return found

    def wait(self, timeout: float | None = None) -> None:
        """Block until every requested persist is durable; raise if any failed."""
        self.memory.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        for pending in list(self._pending):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                pending.future.result(timeout=left)
            except TimeoutError as exc:
                raise CheckpointError(
                    f"checkpoint step {pending.step} not persisted within {timeout} s"
                ) from exc
            except CheckpointError:
                pass  # collected below
        self._raise_failures()

    def close(self, remove_memory: bool | None = None) -> None:
        """Wait for persists, stop the standalone service, release shared memory.

        ``remove_memory`` defaults to True standalone (training is over) and False under an
        agent (the agent owns the segments).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        try:
            self.wait()
        finally:
            if remove_memory is None:
                remove_memory = not self._agent_mode
            self.memory.close(unlink=remove_memory)
            if self._lease is not None:
                self._lease.release(remove=remove_memory)
            self._client_ready.wait(timeout=60)
            if self._client is not None:
                self._client.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------
    def _service_process(self) -> Any:
        """The standalone service's Popen (tests and diagnostics); None under an agent."""
        self._client_ready.wait()
        return self._client.proc if self._client is not None else None

    def _slot_seq(self, found: tuple[int, int]) -> tuple[str, int]:
        return self.memory.paths[found[0]], found[1]

    def _take_lease(self, namespace: str, shm_dir: str) -> None:
        path = lease.lease_path(namespace, self.rank, shm_dir)
        info = lease.owner_info("standalone", dir=self.checkpoint_dir, rank=self.rank)
        self._lease = lease.Lease.take(path, info)
        if self._lease is None:
            log.warning(
                "another live process (%s) owns the shared memory of %s rank %d; it removes it",
                lease.read_info(path).get("pid", "?"),
                self.checkpoint_dir,
                self.rank,
            )

    def _at_exit(self) -> None:
        """The script ended without close(): finish persists and free the memory copy, unless
        an uncaught exception ended it (then, as after a kill, a restart may reload it)."""
        if os.getpid() != self._owner_pid:  # a forked child exiting: the memory is not its own
            return
        if getattr(sys, "last_value", None) is not None:
            log.warning(
                "the script died of %s: the memory checkpoint of %s stays for a restart (freed "
                "after %.0f s without one, its step written to disk first if it is not there)",
                type(sys.last_value).__name__,
                self.checkpoint_dir,
                self._orphan_grace,
            )
            # As after a kill: the lease goes with this process and the service reaps.
            self.wait()
            return
        try:
            self.close(remove_memory=self._lease is not None)
        except BaseException:
            log.exception("closing the checkpointer of %s at exit failed", self.checkpoint_dir)

    def _spawn_service(self, namespace: str, shm_dir: str) -> None:
        try:
            try:  # segments of this user's dead runs, past their grace
                shm_clean.sweep(shm_dir, self._orphan_grace)
            except OSError as exc:
                log.warning("sweeping ownerless checkpoint memory in %s failed: %s", shm_dir, exc)
            self._client = ServiceClient.spawn(namespace, shm_dir, self._orphan_grace)
        except BaseException as exc:  # surfaced by the first disk save
            self._client_error = exc
        finally:
            self._client_ready.set()

    def _submit_persist(self, slot_path: str, seq: int) -> Future[dict[str, Any]]:
        """Send a persist request; if the service is still starting, send it when it is up."""
        if self._client_ready.is_set():
            if self._client is None:
                raise CheckpointError(f"no checkpoint service: {self._client_error}")
            return self._client.persist(slot_path, seq)
        fut: Future[dict[str, Any]] = Future()

        def relay() -> None:
            self._client_ready.wait()
            if self._client is None:
                fut.set_exception(CheckpointError(f"no checkpoint service: {self._client_error}"))
                return
            inner = self._client.persist(slot_path, seq)
            inner.add_done_callback(
                lambda f: (
                    fut.set_exception(f.exception())
                    if f.exception()
                    else fut.set_result(f.result())
                )
            )

        threading.Thread(target=relay, name="ckpt-relay", daemon=True).start()
        return fut

    def _meta(self, lay: layout.Layout, step: int, state_dict: Any) -> bytes:
        persist = {
            "dir": self.checkpoint_dir,
            "writers": self.writers,
            "keep_latest": self.keep_latest,
            "format": self.format,
        }
        return layout.encode_meta(lay, {"step": step, "persist": persist})

    def _ensure_memory(self, lay: layout.Layout, meta: bytes, in_save: bool = False) -> None:
        needed = self.memory.bytes_needed(lay.data_bytes, len(meta))
        if self.memory.ensure_needed(lay.data_bytes, len(meta)):
            check_shm(needed, self.memory.reserved_bytes(), self.memory.directory)
            started = time.monotonic()
            if self.memory.ensure(lay.data_bytes, len(meta)) and in_save:
                log.warning(
                    "this save reserved %s of shared memory first (%.2f s of the save); call "
                    "prepare(state_dict) before the training loop to keep that out of it",
                    shm.fmt_bytes(needed),
                    time.monotonic() - started,
                )

    def _check_disk(self, nbytes: int) -> None:
        check_disk(self.checkpoint_dir, nbytes, self.keep_latest)
        self._disk_checked = True

    def _acquire_slot(self, step: int) -> int:
        started = None
        while True:
            busy = {p.slot for p in self._pending if not p.future.done()}
            index = self.memory.acquire(busy)
            if index is not None:
                if started is not None:
                    log.warning(
                        "save(step=%d) waited %.3f s for a persist to finish with its slot; "
                        "save to disk less often or use more memory_slots",
                        step,
                        time.monotonic() - started,
                    )
                return index
            started = started or time.monotonic()
            waiting = [p for p in self._pending if not p.future.done()]
            if waiting:
                try:
                    waiting[0].future.result()
                except CheckpointError:
                    pass
            else:  # the agent is reading a slot for persist_latest: brief by construction
                time.sleep(0.01)
            self._collect()

    def _collect(self) -> None:
        """Move finished persists out of the pending list, recording failures."""
        still = []
        for p in self._pending:
            if not p.future.done():
                still.append(p)
                continue
            try:
                reply = p.future.result()
            except CheckpointError as exc:
                self._failures.append(f"step {p.step}: {exc}")
                continue
            self.persist_reports.append({"step": p.step, **reply})
            if not reply.get("ok"):
                self._failures.append(f"step {p.step}: {reply.get('error')}")
            elif reply.get("skipped"):
                log.warning("persist of step %d: %s", p.step, reply["skipped"])
            else:
                log.info(
                    "checkpoint step %d persisted (%s in %.3f s)",
                    p.step,
                    shm.fmt_bytes(int(reply.get("bytes_written", 0))),
                    float(reply.get("seconds", 0.0)),
                )
        self._pending = still

    def _raise_failures(self) -> None:
        self._collect()
        if self._failures:
            failures, self._failures = self._failures, []
            raise CheckpointError("persisting checkpoints failed: " + "; ".join(failures))

    def _load_memory(self) -> tuple[int, Any] | None:
        copy = self._agreed_memory_copy()
        if copy is None:
            return None
        state = self.memory.read(copy)
        log.info("restored step %d from shared memory", copy.header.step)
        return copy.header.step, state

    def _agreed_memory_copy(self) -> MemoryCopy | None:
        """This rank's newest memory copy if all ranks hold its step and disk is not newer."""
        copy = self.memory.latest()
        step = copy.header.step if copy is not None else -1
        lo, hi = agree(step)
        if lo != hi or lo < 0:
            if step >= 0:
                log.info("memory step %d here, ranks hold %d..%d: using disk", step, lo, hi)
            return None
        tracker = storage.read_tracker(self.checkpoint_dir)
        if tracker is not None and tracker > step:
            log.info("disk holds step %d, newer than memory step %d: using disk", tracker, step)
            return None
        return copy

    def _source_rank(self, manifests_writers: list[int]) -> int:
        return self.rank if self.rank in manifests_writers else manifests_writers[0]

    def _load_disk(self) -> tuple[int, Any] | None:
        found = self._agreed_disk_step(self._read_step)
        if found is not None:
            log.info("restored step %d from %s", found[0], self.checkpoint_dir)
        return found

    def _agreed_disk_step(self, attempt: Any) -> tuple[int, Any] | None:
        """The newest committed step every rank can read: ``(step, attempt(step))``.

        ``attempt`` raises CorruptCheckpointError for a step this rank cannot use; ranks then
        agree on the newest step that works for all of them.
        """
        candidates = storage.committed_steps(self.checkpoint_dir)
        bound: int | None = None
        while True:
            mine: tuple[int, Any] | None = None
            for step in candidates:
                if bound is not None and step > bound:
                    continue
                try:
                    mine = (step, attempt(step))
                    break
                except CorruptCheckpointError as exc:
                    log.error("checkpoint step %d is corrupt, trying the one before: %s", step, exc)
            lo, hi = agree(mine[0] if mine is not None else -1)
            if lo == hi:
                return mine
            if lo < 0:
                return None
            bound = lo

    def _read_step(self, step: int) -> Any:
        directory = storage.step_dir(self.checkpoint_dir, step)
        manifests = storage.read_manifests(directory)
        writers = next(iter(manifests.values()))["writers"]
        manifest = manifests[self._source_rank(writers)]
        name = storage.flash_file_name(int(manifest["rank"]))
        digest = storage.FileDigest.from_json(manifest["files"][name])
        buf = HostBuffer(digest.size)
        path = os.path.join(directory, name)
        storage.read_verified(path, digest, memoryview(buf.tensor.numpy()))
        header = shm.SlotHeader.unpack(buf.tensor[: shm.HEADER_BYTES].numpy().tobytes())
        if header is None:
            raise CorruptCheckpointError(f"{path}: no flash header")
        meta = buf.tensor[header.meta_off : header.meta_off + header.meta_len].numpy().tobytes()
        lay, _doc = layout.decode_meta(meta)
        tree = layout.rebuild(lay, buf.leaf(shm.HEADER_BYTES))
        del buf.tensor
        return tree
