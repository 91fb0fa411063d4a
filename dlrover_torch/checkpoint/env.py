"""The one place where worker processes read flash-checkpoint settings from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping

# Set by the node agent (dlrover-run) for its workers: the unix socket of its checkpoint keeper.
SERVICE_ENV = "DLROVER_CKPT_SERVICE"
# Seconds a standalone rank's shared memory outlives its owner's death (a restart re-attaches).
ORPHAN_GRACE_ENV = "DLROVER_CKPT_ORPHAN_GRACE_S"
DEFAULT_ORPHAN_GRACE_S = 300.0


def service_address_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the agent's checkpoint-service socket path, or None when running standalone."""
    value = (os.environ if environ is None else environ).get(SERVICE_ENV, "").strip()
    return value or None


def rank_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Return (rank, world_size) from torchrun-style variables, (0, 1) when unset."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))


def orphan_grace_from_env(environ: Mapping[str, str] | None = None) -> float:
    """Seconds ownerless shared memory is kept for a restart (``DLROVER_CKPT_ORPHAN_GRACE_S``)."""
    raw = (os.environ if environ is None else environ).get(ORPHAN_GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_ORPHAN_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ORPHAN_GRACE_ENV}={raw!r}: use a number of seconds") from None
    if value < 0:
        raise ValueError(f"{ORPHAN_GRACE_ENV}={raw!r}: use 0 or more seconds")
    return value
