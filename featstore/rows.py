"""The second level of a store's index: one shard's per-sample rows, loaded when a read first
needs them, as a few compact columns (numpy, and Arrow for the ids).

Loaded shards are kept up to ``ROWS_KEPT`` rows in all, least recently used dropped first
(docs/design/store.md, "Two-level index").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol, overload

import numpy as np
import pyarrow as pa

from .snapshot import column_numpy

# About 10 MB of loaded rows for a store of one small field (~40 bytes a row).
ROWS_KEPT = 1 << 18


class ShardRows:
    """One shard's index rows: per field its element offsets, CRC-32Cs and shapes (flat values
    plus bounds, as the Parquet list column holds them), and the sample ids."""

    __slots__ = ("ids", "offsets", "crcs", "shape_values", "shape_bounds", "num_rows")

    def __init__(self, table: pa.Table, fields: Sequence[str]) -> None:
        self.num_rows = table.num_rows
        self.ids = table.column("id").combine_chunks()
        self.offsets = {f: column_numpy(table, f"{f}.offset") for f in fields}
        self.crcs = {f: column_numpy(table, f"{f}.crc32c") for f in fields}
        self.shape_values: dict[str, np.ndarray] = {}
        self.shape_bounds: dict[str, np.ndarray] = {}
        for f in fields:
            column = table.column(f"{f}.shape").combine_chunks()
            # A null shape (never written so in a dense store) has no values: it reads as ().
            self.shape_values[f] = column.values.to_numpy(zero_copy_only=False)
            self.shape_bounds[f] = column.offsets.to_numpy()

    def sample_id(self, i: int) -> str:
        return str(self.ids[i].as_py())

    def shape(self, field: str, i: int) -> tuple[int, ...]:
        bounds = self.shape_bounds[field]
        return tuple(self.shape_values[field][bounds[i]:bounds[i + 1]].tolist())


class LoadedRows:
    """The shards whose rows were loaded, by shard number, least recently used dropped first
    beyond ``kept`` rows in all. ``load(number)`` reads a shard's rows; safe from many threads
    (a shard two threads miss at once is loaded twice, and one copy kept)."""

    def __init__(self, load: Callable[[int], ShardRows], kept: int = ROWS_KEPT) -> None:
        self._load, self._kept = load, kept
        self._shards: OrderedDict[int, ShardRows] = OrderedDict()
        self._rows = 0
        self._lock = threading.Lock()

    def get(self, number: int) -> ShardRows:
        with self._lock:
            rows = self._shards.get(number)
            if rows is not None:
                self._shards.move_to_end(number)
                return rows
        rows = self._load(number)  # outside the lock: other threads' hits need not wait on a read
        with self._lock:
            if number not in self._shards:
                self._shards[number] = rows
                self._rows += rows.num_rows
            while self._rows > self._kept and len(self._shards) > 1:
                _, dropped = self._shards.popitem(last=False)
                self._rows -= dropped.num_rows
        return rows

    def clear(self) -> None:
        with self._lock:
            self._shards.clear()
            self._rows = 0


class _ByPosition(Protocol):  # a Store (not imported: the reader imports this module)
    def id_at(self, position: int) -> str: ...

    def __len__(self) -> int: ...


class PositionIds(Sequence[str]):
    """The ids of a dense store's samples by position, looked up when asked (``Store.id_at``):
    what a reader holds instead of a list of every id (featstore.dataset, the trainer's stream)."""

    def __init__(self, store: _ByPosition) -> None:
        self._store = store

    def __len__(self) -> int:
        return len(self._store)

    @overload
    def __getitem__(self, position: int) -> str: ...
    @overload
    def __getitem__(self, position: slice) -> Sequence[str]: ...

    def __getitem__(self, position: int | slice) -> str | Sequence[str]:
        if isinstance(position, slice):
            return [self._store.id_at(p) for p in range(*position.indices(len(self)))]
        return self._store.id_at(int(position))
