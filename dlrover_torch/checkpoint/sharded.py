"""Sharded (FSDP) flash checkpoints whose disk layout ``torch.distributed.checkpoint`` reads.

Each rank copies its local shards (DTensor local tensors) into its shm slot; the persister
writes them as ``__<rank>_0.distcp`` items in DCP's format, and the last rank to commit merges
every rank's chunk list into DCP's ``.metadata``. Loading from disk goes through ``dcp.load``,
so a checkpoint can also be resharded or read by tools that understand DCP.
"""

from __future__ import annotations

import base64
import io
import logging
import os
from typing import Any

import torch

from dlrover_torch.checkpoint import layout, storage
from dlrover_torch.checkpoint.checkpointer import Checkpointer
from dlrover_torch.checkpoint.errors import CheckpointError, CorruptCheckpointError
from dlrover_torch.checkpoint.shm import SHM_DIR

log = logging.getLogger(__name__)


def _is_dtensor(value: Any) -> bool:
    return layout._is_dtensor(value)


class ShardedCheckpointer(Checkpointer):
    """Flash checkpoints of a sharded state dict (e.g. ``get_state_dict`` of an FSDP model).

    ``load(state_dict)`` fills ``state_dict`` in place (like ``dcp.load``) and returns
    ``(step, state_dict)``, or None when there is no checkpoint.
    """

    format = "dcp"

    def __init__(
        self,
        checkpoint_dir: str,
        keep_latest: int | None = 2,
        memory_slots: int = 2,
        service_address: str | None = None,
        shm_dir: str = SHM_DIR,
    ) -> None:
        super().__init__(checkpoint_dir, keep_latest, "all", memory_slots, service_address, shm_dir)

    def load(self, state_dict: Any = None) -> tuple[int, Any] | None:  # type: ignore[override]
        """Fill ``state_dict`` in place from memory (same step everywhere) or from disk."""
        if state_dict is None:
            raise ValueError(
                "ShardedCheckpointer.load needs the state dict to fill (its shards say where "
                "each piece goes), e.g. get_state_dict(model, optimizer)"
            )
        copy = self._agreed_memory_copy()
        if copy is not None:
            _assign(state_dict, self.memory.read(copy), "")
            self.last_load_source = "memory"
            log.info("restored step %d from shared memory", copy.header.step)
            return copy.header.step, state_dict
        found = self._agreed_disk_step(self._verify_step)
        if found is None:
            self.last_load_source = None
            return None
        self.last_load_source = "disk"
        from torch.distributed.checkpoint import load as dcp_load

        step = found[0]
        dcp_load(state_dict, checkpoint_id=storage.step_dir(self.checkpoint_dir, step))
        log.info("restored step %d from %s (DCP)", step, self.checkpoint_dir)
        return step, state_dict

    def _verify_step(self, step: int) -> None:
        """Check the CRCs of this rank's share of the step's files (ranks split the work)."""
        directory = storage.step_dir(self.checkpoint_dir, step)
        manifests = storage.read_manifests(directory)
        if not os.path.exists(os.path.join(directory, ".metadata")):
            raise CorruptCheckpointError(f"{directory}: .metadata is missing")
        for writer, manifest in sorted(manifests.items()):
            if writer % self.world != self.rank:
                continue
            for name, raw in manifest["files"].items():
                storage.verify_file(
                    os.path.join(directory, name), storage.FileDigest.from_json(raw)
                )

    def _meta(self, lay: layout.Layout, step: int, state_dict: Any) -> bytes:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, mapping = flatten_state_dict(state_dict)
        index_of = {id(src): i for i, src in enumerate(lay.sources)}
        tensors: list[dict[str, Any]] = []
        blobs: list[dict[str, Any]] = []
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                i = index_of[id(value)]
                ext = lay.extents[i]
                global_shape = ext.global_shape if ext.global_shape is not None else ext.shape
                offsets = (
                    ext.chunk_offsets if ext.chunk_offsets is not None else [0] * len(ext.shape)
                )
                whole = ext.shape == global_shape
                if ext.nbytes == 0 and not whole:
                    continue  # an empty shard of an unevenly sharded tensor
                if whole and self.rank != 0:
                    continue  # replicated: rank 0 writes it once
                tensors.append(
                    {
                        "fqn": fqn,
                        "extent": i,
                        "dtype": ext.dtype,
                        "shape": ext.shape,
                        "global_shape": global_shape,
                        "chunk_offsets": offsets,
                    }
                )
            elif self.rank == 0:
                buf = io.BytesIO()
                torch.save(value, buf)  # DCP stores non-tensor values this way
                blobs.append({"fqn": fqn, "data": base64.b64encode(buf.getvalue()).decode()})
        persist = {
            "dir": self.checkpoint_dir,
            "writers": self.writers,
            "keep_latest": self.keep_latest,
            "format": self.format,
        }
        dcp = {
            "tensors": tensors,
            "bytes": blobs,
            "planner_data": {k: list(v) for k, v in mapping.items()},
        }
        return layout.encode_meta(lay, {"step": step, "persist": persist, "dcp": dcp})


def _assign(dst: Any, src: Any, path: str) -> None:
    """Copy a loaded state dict into ``dst`` in place (tensors by copy, other leaves by value)."""
    keys = list(dst) if isinstance(dst, dict) else range(len(dst))
    for key in keys:
        where = f"{path}[{key!r}]"
        try:
            loaded = src[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise CheckpointError(
                f"state_dict{where} is not in the checkpoint; load with the same model and "
                "optimizer structure that was saved"
            ) from exc
        target = dst[key]
        if isinstance(target, torch.Tensor):
            local = target.to_local() if _is_dtensor(target) else target
            if tuple(local.shape) != tuple(loaded.shape):
                raise CheckpointError(
                    f"state_dict{where}: shard shape {tuple(local.shape)} but the checkpoint "
                    f"holds {tuple(loaded.shape)}; the sharding changed, so load from disk"
                )
            with torch.no_grad():
                local.copy_(loaded)
        elif isinstance(target, dict | list):
            _assign(target, loaded, where)
        else:
            dst[key] = loaded
