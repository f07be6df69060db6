"""The snapshot a reader takes when it opens a store: the index parts committed at that moment,
checked and concatenated, and where each field of each sample is.

Index parts are listed once and each is checked against the CRC-32C in its name. Their rows are
concatenated in shard order (each shard's rows are one range). A sample's row is its first; in a
store whose fields were added after some samples were written (format version 2), a field of a
sample may live in a later shard, under the same id, and ``holder[field][row]`` points there.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from featstore import format as fmt
from featstore.errors import CorruptionError, FormatVersionError, SnapshotError
from featstore.storage import Storage

# Arrow's thread pools can abort the interpreter at exit (apache/arrow#34314); index parts are
# small, so every Parquet read here is single-threaded.


@dataclass(frozen=True)
class ShardInfo:
    name: str
    num_samples: int
    num_rejected: int
    layouts: dict[str, fmt.ChunkLayout]
    objects: dict[str, dict[str, int]]
    index_key: str
    index_nbytes: int


@dataclass
class Snapshot:
    shards: dict[str, ShardInfo]
    damaged: dict[str, str]          # shard -> why its index part was left out (strict=False)
    index: pa.Table                  # every index row, plus a "shard" column
    ids: list[str]                   # per row
    shard_of: list[str]              # per row
    shard_rows: dict[str, range]     # shard -> its rows
    offsets: dict[str, np.ndarray]   # field -> per row (0 where the row's shard lacks the field)
    shapes: dict[str, list[tuple[int, ...]]]
    crcs: dict[str, np.ndarray]
    row_of: dict[str, int]           # sample id -> its first row
    holder: dict[str, np.ndarray]    # field -> per first row, the row holding the field (-1: none)
    dense: bool                      # every shard holds every field, each id once (version 1)


def load_snapshot(storage: Storage, fields: list[str], *, strict: bool, list_parts: bool = True, only: Sequence[str] | None = None) -> Snapshot:
    """Read the committed index parts (``only`` those shards, if given; none with ``list_parts=False``).
    A damaged part fails the open when ``strict``, and is left out and reported otherwise."""
    url = storage.url
    tables, shards, damaged = [], {}, {}
    wanted = None if only is None else set(only)
    parts = []
    for entry in storage.list_dir(fmt.INDEX_DIR) if list_parts else ():
        parsed = fmt.parse_index_part_name(entry)
        if parsed is None:
            continue  # a temporary file of a commit in progress, or foreign
        if wanted is not None and parsed[0] not in wanted:
            continue  # committed after the snapshot was taken
        parts.append((entry, *parsed))
    for (entry, name, crc), raw in zip(parts, _read_parts(storage, [f"{fmt.INDEX_DIR}/{p[0]}" for p in parts]), strict=True):
        key = f"{fmt.INDEX_DIR}/{entry}"
        try:
            if name in shards:
                raise CorruptionError(f"{url}: shard {name!r} has two index parts")
            if fmt.crc32c(raw) != crc:
                raise CorruptionError(f"{url}/{key}: index part of shard {name!r} fails its checksum")
            table, info = _parse_index_part(raw, name, key, url)
        except CorruptionError as exc:
            if strict:
                raise CorruptionError(f"{exc}; run `mmcache verify {url}` for a full report") from None
            damaged[name] = str(exc)
            continue
        tables.append(table.append_column("shard", pa.array([name] * table.num_rows, pa.string())))
        shards[name] = info
    if wanted is not None and (gone := sorted(wanted - set(shards) - set(damaged))):
        raise SnapshotError(
            f"{url}: {len(gone)} shard(s) of the requested snapshot are not committed there, e.g. {gone[0]!r}; "
            "the store was changed or is a different one"
        )
    table = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({"id": pa.array([], pa.string()), "shard": pa.array([], pa.string())})
    ids = table.column("id").to_pylist()
    starts = np.cumsum([0] + [info.num_samples for info in shards.values()])
    shard_rows = {name: range(int(a), int(b)) for name, a, b in zip(shards, starts[:-1], starts[1:])}
    shapes = {
        f: [tuple(s) if s is not None else () for s in table.column(f"{f}.shape").to_pylist()] if f"{f}.shape" in table.column_names else [()] * table.num_rows
        for f in fields
    }
    row_of, holder, dense = _locate_fields(url, ids, shards, shard_rows, fields)
    return Snapshot(
        shards=shards, damaged=damaged, index=table, ids=ids, shard_of=table.column("shard").to_pylist(), shard_rows=shard_rows,
        offsets={f: _column_numpy(table, f"{f}.offset") for f in fields}, shapes=shapes, crcs={f: _column_numpy(table, f"{f}.crc32c") for f in fields},
        row_of=row_of, holder=holder, dense=dense,
    )


def _locate_fields(url: str, ids: list[str], shards: dict[str, ShardInfo], shard_rows: dict[str, range], fields: list[str]) -> tuple[dict[str, int], dict[str, np.ndarray], bool]:
    """(sample id -> first row, field -> holder rows, dense)."""
    row_of: dict[str, int] = {}
    for row, sample_id in enumerate(ids):
        row_of.setdefault(sample_id, row)
    rows = np.arange(len(ids), dtype=np.int64)
    with_samples = [name for name, info in shards.items() if info.num_samples]
    if len(row_of) == len(ids) and all(set(shards[n].layouts) == set(fields) for n in with_samples):
        return row_of, {field: rows for field in fields}, True
    first = np.fromiter((row_of[i] for i in ids), dtype=np.int64, count=len(ids))  # row -> its sample's first row
    duplicates: list[str] = []
    holder = {}
    for field in fields:
        held = [shard_rows[n] for n in with_samples if field in shards[n].layouts]
        holding = np.concatenate([np.arange(r.start, r.stop, dtype=np.int64) for r in held]) if held else rows[:0]
        samples, at = np.unique(first[holding], return_index=True)  # the first occurrence wins
        holder[field] = np.full(len(ids), -1, dtype=np.int64)
        holder[field][samples] = holding[at]
        if len(samples) < len(holding):
            extra = np.setdiff1d(np.arange(len(holding)), at)
            duplicates.extend(f"{ids[int(holding[i])]}.{field}" for i in extra[:5])
    if duplicates:
        # Only concurrent writers given overlapping inputs can cause this; keep the first
        # (shards are listed in name order, so the choice is deterministic) and say so.
        warnings.warn(f"{url}: sample field(s) appear in more than one shard, e.g. {duplicates[0]!r}; `mmcache verify` lists them", stacklevel=6)
    return row_of, holder, False


def _read_parts(storage: Storage, keys: list[str]) -> Iterator[bytes]:
    """Index parts in order; from an object store many at once (one request each)."""
    if not storage.is_remote or len(keys) < 2:
        return (storage.read(key) for key in keys)
    pool = ThreadPoolExecutor(16, thread_name_prefix="featstore-index")
    try:
        return iter(list(pool.map(storage.read, keys)))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _column_numpy(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.int64)
    column = table.column(name)
    # Rows of shards without this field (added to the store later) are null: never read.
    return (column.fill_null(0) if column.null_count else column).to_numpy()


def _parse_index_part(raw: bytes, name: str, key: str, url: str) -> tuple[pa.Table, ShardInfo]:
    where = f"{url}/{key}"
    try:
        table = pq.read_table(io.BytesIO(raw), use_threads=False)
        info = json.loads((table.schema.metadata or {})[fmt.COMMIT_METADATA_KEY])
    except (pa.ArrowException, KeyError, OSError, ValueError) as exc:
        raise CorruptionError(f"{where} is not a valid index part ({exc})") from None
    if info.get("format_version", 0) > fmt.FORMAT_VERSION:
        raise FormatVersionError(f"{where} was written by a newer format version ({info['format_version']})")
    if table.num_rows != info["num_samples"]:
        raise CorruptionError(f"{where}: {table.num_rows} rows but the commit record says {info['num_samples']}")
    layouts = {f: fmt.ChunkLayout(v["elements"], v["chunk_elements"], v["num_chunks"]) for f, v in info["fields"].items()}
    return table, ShardInfo(name, info["num_samples"], info["num_rejected"], layouts, info["objects"], key, len(raw))
