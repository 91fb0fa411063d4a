"""Capacity checks before the first save: /dev/shm for the memory copy, disk for persistence."""

from __future__ import annotations

import logging
import os
import shutil

from dlrover_torch.checkpoint.errors import CapacityError
from dlrover_torch.checkpoint.shm import SHM_DIR, fmt_bytes, shm_free_bytes

log = logging.getLogger(__name__)


def check_shm(needed: int, already_reserved: int = 0, directory: str = SHM_DIR) -> int:
    """Raise CapacityError unless ``directory`` can hold ``needed`` more bytes; return free."""
    free = shm_free_bytes(directory)
    missing = needed - already_reserved
    if missing > free:
        raise CapacityError(
            f"flash checkpoint needs {fmt_bytes(needed)} of shared memory in {directory} "
            f"({fmt_bytes(missing)} more than this rank holds) but only {fmt_bytes(free)} is "
            "free; enlarge it (docker run --shm-size, a Kubernetes emptyDir with medium: Memory "
            "and a sizeLimit, or mount -o remount,size=... /dev/shm), or pass memory_slots=1, "
            "or checkpoint less state per rank"
        )
    return free


def check_disk(checkpoint_dir: str, bytes_per_checkpoint: int, keep_latest: int | None) -> int:
    """Raise CapacityError unless one more checkpoint fits in ``checkpoint_dir``; return free."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    free = shutil.disk_usage(checkpoint_dir).free
    if bytes_per_checkpoint > free:
        raise CapacityError(
            f"a checkpoint of {fmt_bytes(bytes_per_checkpoint)} does not fit in "
            f"{checkpoint_dir} ({fmt_bytes(free)} free); free space there, pass another "
            "checkpoint_dir, or lower keep_latest"
        )
    if keep_latest and bytes_per_checkpoint * (keep_latest + 1) > free:
        log.warning(
            "%s has %s free: not enough for keep_latest=%d checkpoints of %s plus the one being "
            "written; older checkpoints will be deleted only after a new one commits",
            checkpoint_dir,
            fmt_bytes(free),
            keep_latest,
            fmt_bytes(bytes_per_checkpoint),
        )
    return free
