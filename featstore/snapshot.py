"""The snapshot a reader takes when it opens a store: the index parts committed at that moment,
checked and concatenated, and where each field of each sample is.

Index parts are listed once and each is checked against the CRC-32C sealed in it (versions 1-2:
in its name); the rows of the parts an index checkpoint covers come from it instead, in one read
(featstore.compact). Their rows are concatenated in commit order (each shard's rows are one range). A sample's row is its first; in
a store whose fields were added after some samples were written, a field of a sample may live in
a later shard, under the same id, and ``holder[field][row]`` points there. A (sample id, field)
that racing writers both committed is read from the earliest commit; the others are listed in
``duplicates``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmcache.featstore import format as fmt
from mmcache.featstore.errors import CorruptionError, FormatVersionError, SnapshotError
from mmcache.featstore.storage import Storage

# Arrow's thread pools can abort the interpreter at exit (apache/arrow#34314); index parts are
# small, so every Parquet read here is single-threaded.


# Read-only by convention, not frozen: an open from an index checkpoint builds thousands, and a
# frozen dataclass's __init__ (an object.__setattr__ per field) cost four times as much.
@dataclass(slots=True)
class ShardInfo:
    name: str
    num_samples: int
    num_rejected: int
    layouts: Mapping[str, fmt.ChunkLayout]
    objects: Mapping[str, Mapping[str, int]]
    index_key: str
    index_nbytes: int
    data_root: str = ""        # where its objects live (version 3: per writer; before: shards/<name>)
    rejects_key: str = ""
    committed_at: float = 0.0  # by the writer's clock; 0 for versions 1-2

    def data_key(self, field: str) -> str:
        return f"{self.data_root}/{field}/c/0"


class RecordMapping(Mapping[str, Any]):
    """A shard's layouts (``part="fields"``) or objects from its commit record, decoded on first
    use. A checkpoint holds the records of thousands of shards, and an open needs only their
    names, sizes and fields: decoding every record there was most of its cost. ``keys`` (the
    field names) answers ``in`` and iteration without decoding."""

    __slots__ = ("_record", "_row", "_part", "_keys", "_data")

    def __init__(self, record: Callable[[int], str], row: int, part: str, keys: Sequence[str] | None = None) -> None:
        self._record, self._row, self._part, self._keys = record, row, part, keys
        self._data: dict[str, Any] | None = None

    def _decoded(self) -> dict[str, Any]:
        if self._data is None:
            # (Each of a shard's two mappings decodes the record once, when first used.)
            doc = json.loads(self._record(self._row))[self._part]
            self._data = {f: fmt.ChunkLayout(v["elements"], v["chunk_elements"], v["num_chunks"]) for f, v in doc.items()} if self._part == "fields" else doc
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._decoded()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys if self._keys is not None else self._decoded())

    def __len__(self) -> int:
        return len(self._keys if self._keys is not None else self._decoded())

    def __contains__(self, key: object) -> bool:
        return key in (self._keys if self._keys is not None else self._decoded())

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def recorded_shard_info(name: str, key: str, nbytes: int, num_samples: int, num_rejected: int, committed_at: float,
                        data_root: str, rejects_key: str, fields: Sequence[str], record: Callable[[int], str], row: int) -> ShardInfo:
    """A ``ShardInfo`` from a checkpoint: the scalars as given, layouts and objects decoded from
    the commit record's JSON (``record(row)``) when first read."""
    return ShardInfo(name, num_samples, num_rejected, RecordMapping(record, row, "fields", fields), RecordMapping(record, row, "objects"),
                     key, nbytes, data_root, rejects_key, committed_at)


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
    checkpoint: str | None = None    # the index checkpoint whose rows were used (featstore.compact)
    covered: int = 0                 # index parts taken from it rather than read


@dataclass
class GatheredParts:
    """The index parts of one listing, checked, in snapshot order, with their rows."""

    listing: dict[str, str]                 # every name under index/ -> its listing fingerprint
    order: list[tuple[str, ShardInfo]]      # (file name under index/, shard), commit order then name
    table: pa.Table                         # their rows in that order, plus a "shard" column
    records: dict[str, Any]                 # file name -> commit record (a dict; from a checkpoint, its CoveredPart)
    damaged: dict[str, str]
    checkpoint: Any = None                  # the featstore.compact.Checkpoint used, if any
    covered: set[str] = field(default_factory=set)  # parts whose rows came from it


def gather_parts(storage: Storage, *, strict: bool, list_parts: bool = True, only: Sequence[str] | None = None,
                 use_checkpoint: bool = True, checkpoint_problems: list[str] | None = None) -> GatheredParts:
    """List ``index/`` once and gather the committed parts (``only`` those shards, if given): the
    rows of those a checkpoint covers from it (one read), the others from their own parts. A part
    is taken from the checkpoint only while it is listed with the fingerprint the checkpoint
    recorded, so the result is exactly what reading every listed part gives."""
    from mmcache.featstore import compact

    url = storage.url
    listing = compact.list_index(storage) if list_parts else {}
    wanted = None if only is None else set(only)
    checkpoint = compact.find_checkpoint(storage, listing, checkpoint_problems) if use_checkpoint and listing else None
    covered = {} if checkpoint is None else {
        entry: part for entry, part in checkpoint.parts.items()
        if listing.get(entry) == part.listed and (wanted is None or part.info.name in wanted)
    }
    shards: dict[str, ShardInfo] = {part.info.name: part.info for part in covered.values()}
    records: dict[str, Any] = {entry: part for entry, part in covered.items()}  # a covered part's: decoded when needed
    entries = {part.info.name: entry for entry, part in covered.items()}
    parts = []
    for entry in listing:
        parsed = None if entry in covered else fmt.parse_index_part_name(entry)
        if parsed is None:
            continue  # a temporary file of a commit in progress, a checkpoint marker, or foreign
        if wanted is not None and parsed[0] not in wanted:
            continue  # committed after the snapshot was taken
        parts.append((entry, *parsed))
    tables, damaged = {}, {}
    for (entry, name, crc), raw in zip(parts, _read_parts(storage, [f"{fmt.INDEX_DIR}/{p[0]}" for p in parts]), strict=True):
        key = f"{fmt.INDEX_DIR}/{entry}"
        try:
            if name in shards:
                # Only a version-1/2 writer (whose part names carried their CRC) could do this.
                raise CorruptionError(f"{url}: shard {name!r} has two index parts")
            table, record = parse_index_part_record(raw, name, key, url, crc)
        except CorruptionError as exc:
            if strict:
                raise CorruptionError(f"{exc}; run `mmcache verify {url}` for a full report") from None
            damaged[name] = str(exc)
            continue
        shards[name], records[entry], entries[name] = shard_info(record, name, key, len(raw)), record, entry
        tables[entry] = table.append_column("shard", pa.array([name] * table.num_rows, pa.string()))
    # Commit order (then name): a sample field committed twice by racing writers is read from
    # the earliest commit, which is the one any reader that opened in between already saw.
    order = sorted(((entries[info.name], info) for info in shards.values()), key=lambda p: (p[1].committed_at, p[1].name))
    if wanted is not None and (gone := sorted(wanted - set(shards) - set(damaged))):
        raise SnapshotError(
            f"{url}: {len(gone)} shard(s) of the requested snapshot are not committed there, e.g. {gone[0]!r}; "
            "the store was changed or is a different one"
        )
    # The checkpoint's rows are in snapshot order too: consecutive covered parts are one slice.
    pieces: list[pa.Table] = []
    run: list[int] = []
    rows = checkpoint.table if checkpoint is not None else pa.table({})
    for entry, info in order:
        part = covered.get(entry)
        if part is not None and run and run[1] == part.start:
            run[1] += info.num_samples
            continue
        if run:
            pieces.append(rows.slice(run[0], run[1] - run[0]))
        run = [part.start, part.start + info.num_samples] if part is not None else []
        if part is None:
            pieces.append(tables[entry])
    if run:
        pieces.append(rows.slice(run[0], run[1] - run[0]))
    table = pa.concat_tables(pieces, promote_options="permissive") if pieces else pa.table({"id": pa.array([], pa.string()), "shard": pa.array([], pa.string())})
    # Each part's metadata is its own commit record: none of them describes the whole table.
    table = table.replace_schema_metadata(None)
    return GatheredParts(listing, order, table, records, damaged, checkpoint, set(covered))


def load_snapshot(storage: Storage, fields: list[str], *, strict: bool, list_parts: bool = True, only: Sequence[str] | None = None) -> Snapshot:
    """Read the committed index parts (``only`` those shards, if given; none with ``list_parts=False``).
    A damaged part fails the open when ``strict``, and is left out and reported otherwise."""
    gathered = gather_parts(storage, strict=strict, list_parts=list_parts, only=only)
    shards = {info.name: info for _, info in gathered.order}
    table = gathered.table
    ids = table.column("id").to_pylist()
    starts = np.cumsum([0] + [info.num_samples for info in shards.values()])
    shard_rows = {name: range(int(a), int(b)) for name, a, b in zip(shards, starts[:-1], starts[1:])}
    shapes = {f: _shapes(table, f"{f}.shape") for f in fields}
    row_of, holder, dense, duplicates = _locate_fields(ids, shards, shard_rows, fields)
    return Snapshot(
        shards=shards, damaged=gathered.damaged, index=table, ids=ids, shard_of=table.column("shard").to_pylist(), shard_rows=shard_rows,
        offsets={f: _column_numpy(table, f"{f}.offset") for f in fields}, shapes=shapes, crcs={f: _column_numpy(table, f"{f}.crc32c") for f in fields},
        row_of=row_of, holder=holder, dense=dense, duplicates=duplicates,
        checkpoint=None if gathered.checkpoint is None else gathered.checkpoint.key, covered=len(gathered.covered),
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


def _shapes(table: pa.Table, name: str) -> list[tuple[int, ...]]:
    """Each row's shape as a tuple (() where the row's shard lacks the field). From the list
    column's flat values and offsets: building them row by row through Python lists was the
    largest single cost of an open from a checkpoint."""
    if name not in table.column_names:
        return [()] * table.num_rows
    column = table.column(name).combine_chunks()
    offsets = column.offsets.to_numpy()
    if column.null_count and np.diff(offsets)[~column.is_valid().to_numpy(zero_copy_only=False)].any():
        return [tuple(s) if s is not None else () for s in column.to_pylist()]  # nulls over values: never written so
    values, bounds = column.values.to_numpy().tolist(), offsets.tolist()
    return [tuple(values[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _column_numpy(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.int64)
    column = table.column(name)
    # Rows of shards without this field (added to the store later) are null: never read.
    return (column.fill_null(0) if column.null_count else column).to_numpy()


def parse_index_part(raw: bytes, name: str, key: str, url: str, crc: int | None) -> tuple[pa.Table, ShardInfo]:
    """An index part's rows and commit record, checked against its CRC-32C: the one in its name
    (``crc``, versions 1-2) or (version 3) the one sealed into its metadata."""
    table, record = parse_index_part_record(raw, name, key, url, crc)
    return table, shard_info(record, name, key, len(raw))


def parse_index_part_record(raw: bytes, name: str, key: str, url: str, crc: int | None) -> tuple[pa.Table, dict[str, Any]]:
    """``parse_index_part``, with the commit record as stored (a dict) instead of a ``ShardInfo``."""
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
    return table, info


def shard_info(info: dict[str, Any], name: str, key: str, nbytes: int) -> ShardInfo:
    """A shard's ``ShardInfo`` from its commit record (as its index part, or a checkpoint, holds it)."""
    layouts = {f: fmt.ChunkLayout(v["elements"], v["chunk_elements"], v["num_chunks"]) for f, v in info["fields"].items()}
    root = info.get("data") or f"{fmt.SHARDS_DIR}/{name}"
    rejects = info.get("rejects") or f"{fmt.REJECTS_DIR}/{name}.parquet"
    return ShardInfo(name, info["num_samples"], info["num_rejected"], layouts, info["objects"], key, nbytes, root, rejects, float(info.get("committed_at") or 0.0))
