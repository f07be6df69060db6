"""Where each sample of a snapshot is: ``ShardTable`` (per shard, from the shard table an open
reads) and ``SampleIndex`` (per sample, built from every index row when first needed).

A ``Store`` owns both: a dense store's reads by position need only the first (design notes:
docs/design/store.md, "Two-level index").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import pyarrow as pa

from . import format as fmt
from .index import ShardInfo
from .rows import LoadedRows, ShardRows
from .snapshot import GatheredParts, dense_samples, snapshot_of


class ShardTable:
    """The snapshot's shards in order: each one's rows of the snapshot, and its per-sample rows
    (featstore.rows), loaded per shard when a read first needs them."""

    def __init__(self, gathered: GatheredParts, fields: Callable[[], Sequence[str]]) -> None:
        self.gathered = gathered
        self._fields = fields  # the store's fields now (added fields reach rows loaded after)
        self.shards: dict[str, ShardInfo] = {info.name: info for _, info in gathered.order}
        # (Python ints first: every open builds this, and NumPy's per-element costs dominate here.)
        starts = list(accumulate((info.num_samples for info in self.shards.values()), initial=0))
        self.starts = np.array(starts, dtype=np.int64)
        self.rows: dict[str, range] = {name: range(a, b) for name, a, b in zip(self.shards, starts, starts[1:])}
        self.loaded = LoadedRows(self._load)

    def _load(self, number: int) -> ShardRows:
        return ShardRows(self.gathered.rows_of(self.gathered.order[number][0]), list(self._fields()))

    def locate(self, row: int) -> tuple[int, int]:
        """(shard number, row within it) of a row of the snapshot."""
        number = int(np.searchsorted(self.starts, row, side="right")) - 1
        return number, row - int(self.starts[number])

    def shard_name(self, number: int) -> str:
        return self.gathered.order[number][1].name

    def rows_at(self, row: int) -> tuple[ShardRows, int]:
        """(the loaded rows of the shard holding ``row``, ``row``'s place in them)."""
        number, i = self.locate(row)
        return self.loaded.get(number), i

    def dense_count(self, fields: list[str]) -> int | None:
        """The number of samples where the snapshot is dense, told from the shard table (else None:
        featstore.snapshot.dense_samples)."""
        return dense_samples(self.gathered, fields)


class SampleIndex:
    """Every index row of a snapshot, plus a "shard" column (``table``), and per row its sample id,
    shard and, per field, element offset, shape and CRC-32C (0 / () where the row's shard lacks
    the field). A sample's row is its first (``row_of``); ``holder[field][row]`` is the row holding
    that field of the sample whose first row is ``row`` (-1: none), a later shard's where the field
    was added to the store after the sample was written. ``dense``: every sample is one row."""

    def __init__(self, gathered: GatheredParts, fields: list[str]) -> None:
        snap = snapshot_of(gathered, fields)
        self.table: pa.Table = snap.index
        self.ids: list[str] = snap.ids
        self.shard_of: list[str] = snap.shard_of
        self.offsets: dict[str, np.ndarray] = snap.offsets
        self.shapes: dict[str, list[tuple[int, ...]]] = snap.shapes
        self.crcs: dict[str, np.ndarray] = snap.crcs
        self.row_of: dict[str, int] = snap.row_of
        self.holder: dict[str, np.ndarray] = snap.holder
        self.dense: bool = snap.dense
        # (sample id, field, shard) rows ignored because an earlier commit holds them
        self.duplicates: list[tuple[str, str, str]] = snap.duplicates
        self._first_rows: np.ndarray | None = None
        self._meta_lists: dict[str, list[Any]] | None = None

    def __len__(self) -> int:
        return len(self.row_of)

    def is_first(self, row: int) -> bool:
        """True when ``row`` is its sample's first row (where reads and scans find the sample)."""
        return self.row_of[self.ids[row]] == row

    def fields_at(self, row: int, fields: Sequence[str]) -> list[str]:
        """Those of ``fields`` (the store's) that the sample whose first row is ``row`` has."""
        return list(fields) if self.dense else [f for f in fields if self.holder[f][row] >= 0]

    def first_rows(self) -> np.ndarray:
        """Every sample's first row, in position order."""
        rows = self._first_rows
        if rows is None:
            rows = self._first_rows = np.fromiter(self.row_of.values(), dtype=np.int64, count=len(self.row_of))
        return rows

    def rows_holding(self, row: int, fields: Sequence[str]) -> list[int]:
        """``row`` and the later rows that hold some of ``fields`` of its sample, in order."""
        if self.dense:
            return [row]
        return [row, *sorted({int(self.holder[f][row]) for f in fields if self.holder[f][row] > row})]

    @property
    def meta_columns(self) -> list[str]:
        """The columns of per-sample metadata: every one but ``id``, ``shard`` and the fields'."""
        return [c for c in self.table.column_names if "." not in c and c not in fmt.RESERVED_COLUMNS]

    def meta(self, row: int, fields: Sequence[str]) -> dict[str, Any]:
        """The metadata of the sample whose first row is ``row`` (its first row's value wins)."""
        columns = self._meta_lists
        if columns is None:
            # Once per store, as Python lists: a per-row pyarrow scalar lookup costs microseconds
            # per key, and a training loop may ask for every sample's metadata.
            columns = self._meta_lists = {c: self.table.column(c).to_pylist() for c in self.meta_columns}
        rows = self.rows_holding(row, fields)
        meta: dict[str, Any] = {}
        for name, values in columns.items():
            for r in rows:
                if values[r] is not None:
                    meta[name] = values[r]
                    break
        return meta

    def add_fields(self, names: Sequence[str]) -> None:
        """Fields new to the store, which no committed sample has yet."""
        rows = len(self.ids)
        for name in names:
            if name not in self.holder:
                self.offsets[name] = np.zeros(rows, dtype=np.int64)
                self.shapes[name] = [()] * rows
                self.crcs[name] = np.zeros(rows, dtype=np.uint32)
                self.holder[name] = np.full(rows, -1, dtype=np.int64)
                self.dense = self.dense and rows == 0
