"""Typed errors of flash checkpoint; each message names the bad input and the fix."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be taken, persisted or loaded."""


class CapacityError(CheckpointError):
    """Shared memory or disk is too small for the checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A stored checkpoint failed its checksum or structure check."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A state dict holds a value flash checkpoint cannot store safely."""
