"""The errors a user's data files can cause: each message names the file and what to do."""

from __future__ import annotations


class DataFileError(ValueError):
    """A data file cannot be used as asked (missing, corrupt, compressed, changed, unlike its
    siblings); the message names the file and the fix."""


class FileChangedError(DataFileError):
    """A file's size or modification time differs from its index: nothing is read from it."""

    @classmethod
    def of(cls, path: str, size: int, mtime_ns: int) -> FileChangedError:
        return cls(
            f"{path} changed after it was indexed (it had {size} bytes, modified at "
            f"{mtime_ns} ns): nothing is read from it. Files must not change while a job reads "
            "them: put the indexed content back, or start a new job (or use a new dataset "
            "name) to train on the new content"
        )
