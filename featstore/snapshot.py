"""The snapshot a reader takes when it opens a store: the index parts committed at that moment,
checked and concatenated, and where each field of each sample is.

Index parts are listed once and each is checked against the CRC-32C in its name. Their rows are
concatenated in commit order (each shard's rows are one range). A sample's row is its first; in
a store whose fields were added after some samples were written, a field of a sample may live in
a later shard, under the same id, and ``holder[field][row]`` points there. A (sample id, field)
that racing writers both committed is read from the earliest commit; the others are listed in
``duplicates``.
"""

from __future__ import annotations

import io
import json
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
    data_root: str = ""        # where its objects live (version 3: per writer; before: shards/<name>)
    rejects_key: str = ""
    committed_at: float = 0.0  # by the writer's clock; 0 for versions 1-2

    def data_key(self, field: str) -> str:
        return f"{self.data_root}/{field}/c/0"


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
    duplicates: list[tuple[str, str, str]]  # (sample id, field, shard) rows a reader ignores: an earlier commit holds them


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
    parsed_parts = []
    for (entry, name, crc), raw in zip(parts, _read_parts(storage, [f"{fmt.INDEX_DIR}/{p[0]}" for p in parts]), strict=True):
        key = f"{fmt.INDEX_DIR}/{entry}"
        try:
            if name in shards:
                # Only a version-1/2 writer (whose part names carried their CRC) could do this.
                raise CorruptionError(f"{url}: shard {name!r} has two index parts")
            table, info = parse_index_part(raw, name, key, url, crc)
        except CorruptionError as exc:
            if strict:
                raise CorruptionError(f"{exc}; run `mmcache verify {url}` for a full report") from None
            damaged[name] = str(exc)
            continue
        shards[name] = info
        parsed_parts.append((info, table))
    # Commit order (then name): a sample field committed twice by racing writers is read from
    # the earliest commit, which is the one any reader that opened in between already saw.
    parsed_parts.sort(key=lambda p: (p[0].committed_at, p[0].name))
    shards = {info.name: info for info, _ in parsed_parts}
    tables = [table.append_column("shard", pa.array([info.name] * table.num_rows, pa.string())) for info, table in parsed_parts]
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
    row_of, holder, dense, duplicates = _locate_fields(ids, shards, shard_rows, fields)
    return Snapshot(
        shards=shards, damaged=damaged, index=table, ids=ids, shard_of=table.column("shard").to_pylist(), shard_rows=shard_rows,
        offsets={f: _column_numpy(table, f"{f}.offset") for f in fields}, shapes=shapes, crcs={f: _column_numpy(table, f"{f}.crc32c") for f in fields},
        row_of=row_of, holder=holder, dense=dense, duplicates=duplicates,
    )


def _locate_fields(ids: list[str], shards: dict[str, ShardInfo], shard_rows: dict[str, range], fields: list[str]) -> tuple[dict[str, int], dict[str, np.ndarray], bool, list[tuple[str, str, str]]]:
    """(sample id -> first row, field -> holder rows, dense, duplicate rows ignored)."""
    row_of: dict[str, int] = {}
    for row, sample_id in enumerate(ids):
        row_of.setdefault(sample_id, row)
    rows = np.arange(len(ids), dtype=np.int64)
    with_samples = [name for name, info in shards.items() if info.num_samples]
    if len(row_of) == len(ids) and all(set(shards[n].layouts) == set(fields) for n in with_samples):
        return row_of, {field: rows for field in fields}, True, []
    first = np.fromiter((row_of[i] for i in ids), dtype=np.int64, count=len(ids))  # row -> its sample's first row
    duplicates: list[tuple[str, str, str]] = []
    shard_of_row = np.repeat(np.arange(len(shard_rows)), [len(r) for r in shard_rows.values()])
    names = list(shard_rows)
    holder = {}
    for field in fields:
        held = [shard_rows[n] for n in with_samples if field in shards[n].layouts]
        holding = np.concatenate([np.arange(r.start, r.stop, dtype=np.int64) for r in held]) if held else rows[:0]
        samples, at = np.unique(first[holding], return_index=True)  # the first (earliest) commit wins
        holder[field] = np.full(len(ids), -1, dtype=np.int64)
        holder[field][samples] = holding[at]
        if len(samples) < len(holding):
            extra = np.setdiff1d(np.arange(len(holding)), at)
            duplicates.extend((ids[int(holding[i])], field, names[int(shard_of_row[holding[i]])]) for i in extra)
    # Racing writers (or a version-1/2 store's) can leave a sample field in two shards: readers
    # take the earliest commit's, `mmcache verify` reports the rest, `mmcache repair` drops them.
    return row_of, holder, False, duplicates


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


def parse_index_part(raw: bytes, name: str, key: str, url: str, crc: int | None) -> tuple[pa.Table, ShardInfo]:
    """An index part's rows and commit record, checked against its CRC-32C: the one in its name
    (``crc``, versions 1-2) or (version 3) the one sealed into its metadata."""
    where = f"{url}/{key}"
    if crc is not None and fmt.crc32c(raw) != crc:
        raise CorruptionError(f"{where}: index part of shard {name!r} fails its checksum")
    try:
        parquet = pq.ParquetFile(io.BytesIO(raw))
        table = parquet.read(use_threads=False)
        metadata = table.schema.metadata or {}
        # The sealed CRC is in the Parquet footer's key/value metadata; the Arrow schema stored
        # beside it still holds the placeholder.
        sealed = (parquet.metadata.metadata or {})[fmt.COMMIT_CRC_METADATA_KEY] if crc is None else None
        info = json.loads(metadata[fmt.COMMIT_METADATA_KEY])
    except (pa.ArrowException, KeyError, OSError, ValueError) as exc:
        raise CorruptionError(f"{where}: index part of shard {name!r} is not a valid index part ({exc})") from None
    if sealed is not None and not fmt.index_part_seal_ok(raw, sealed):
        raise CorruptionError(f"{where}: index part of shard {name!r} fails its checksum")
    if info.get("format_version", 0) > fmt.FORMAT_VERSION:
        raise FormatVersionError(f"{where} was written by a newer format version ({info['format_version']})")
    if table.num_rows != info["num_samples"]:
        raise CorruptionError(f"{where}: {table.num_rows} rows but the commit record says {info['num_samples']}")
    layouts = {f: fmt.ChunkLayout(v["elements"], v["chunk_elements"], v["num_chunks"]) for f, v in info["fields"].items()}
    root = info.get("data") or f"{fmt.SHARDS_DIR}/{name}"
    rejects = info.get("rejects") or f"{fmt.REJECTS_DIR}/{name}.parquet"
    return table, ShardInfo(name, info["num_samples"], info["num_rejected"], layouts, info["objects"], key, len(raw), root, rejects, float(info.get("committed_at") or 0.0))
