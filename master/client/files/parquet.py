"""Parquet files: the index of rows per row group (from the footer, no data read), the schema
every file must share, and rows read a row group at a time through pyarrow."""

from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Any

import numpy as np

from master.client.files.cache import FileIndex, FileStat
from master.client.files.errors import DataFileError, FileChangedError

FORMAT = "parquet"
# Decoded row groups kept per file: a shuffled window of a big row group is cut from it again.
ROW_GROUPS_KEPT = 2


def build_index(path: str) -> FileIndex:
    """Rows per row group and the Arrow schema, read from the file's footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stat = FileStat.of(path)
    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataFileError(
            f"{path} is not a readable Parquet file ({e}); write it again or leave it out"
        ) from e
    rows = np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], np.int64)
    schema = meta.schema.to_arrow_schema().remove_metadata()
    extra = {"schema": base64.b64encode(schema.serialize().to_pybytes()).decode()}
    return FileIndex(path, FORMAT, stat, int(rows.sum()), rows, extra)


def schema_of(index: FileIndex) -> Any:
    """The pyarrow.Schema a Parquet index recorded."""
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(index.extra["schema"])))


def check_same_schema(indexes: list[FileIndex]) -> Any:
    """The schema all files share; a DataFileError naming the first file that differs."""
    first = schema_of(indexes[0])
    for other in indexes[1:]:
        schema = schema_of(other)
        if not schema.equals(first):
            raise DataFileError(
                f"{other.path} has another schema than {indexes[0].path}; all Parquet files of "
                f"a dataset must have the same columns and types. {indexes[0].path}: "
                f"{_describe(first)}; {other.path}: {_describe(schema)}. Rewrite it with the "
                "same schema, or make it a dataset of its own"
            )
    return first


def _describe(schema: Any) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


class ParquetReader:
    """Rows of one Parquet file, read a row group at a time (the last few kept decoded)."""

    def __init__(self, index: FileIndex, columns: list[str] | None) -> None:
        import pyarrow.parquet as pq

        self.index = index
        self._columns = columns
        self._starts = np.concatenate(([0], np.cumsum(index.array)))
        self._file = open(index.path, "rb")  # noqa: SIM115 (closed by close())
        self._check()
        self._pq = pq.ParquetFile(self._file)
        self._groups: OrderedDict[int, Any] = OrderedDict()

    def _check(self) -> None:
        if FileStat.of(self._file.fileno()) != self.index.stat:
            stat = self.index.stat
            raise FileChangedError.of(self.index.path, stat.size, stat.mtime_ns)

    def rows(self, lo: int, hi: int) -> Any:
        """Rows [lo, hi) of this file as a pyarrow.Table."""
        import pyarrow as pa

        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        parts = []
        group = first
        while lo < hi:
            table = self._group(group)
            g0 = int(self._starts[group])
            take = min(hi, int(self._starts[group + 1])) - lo
            parts.append(table.slice(lo - g0, take))
            lo += take
            group += 1
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    def _group(self, group: int) -> Any:
        table = self._groups.pop(group, None)
        if table is None:
            self._check()
            table = self._pq.read_row_group(group, columns=self._columns)
            while len(self._groups) >= ROW_GROUPS_KEPT:
                self._groups.popitem(last=False)
        self._groups[group] = table
        return table

    def close(self) -> None:
        self._groups.clear()
        self._file.close()
