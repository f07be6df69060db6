"""The index of a store: listing ``index/`` and parsing its parts (each a shard's rows and its
commit record, docs/FORMAT.md). The one home of both: the snapshot, the writer's duplicate
checks, checkpoints, copy and verify all list and parse parts through here.

Every Parquet object the store holds is read through ``parquet_file`` / ``read_parquet``: no
thread of Arrow's is ever started (see ``parquet_file``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from . import checksums
from . import format as fmt
from .errors import CorruptionError, FormatVersionError
from .storage import Storage


class IndexPart(NamedTuple):
    """A committed index part, from its file name under ``index/``."""

    entry: str        # file name under index/
    shard: str
    crc: int | None   # the CRC-32C in its name (versions 1-2), else None

    @property
    def key(self) -> str:
        return f"{fmt.INDEX_DIR}/{self.entry}"


def index_parts(names: Iterable[str]) -> list[IndexPart]:
    """The committed index parts among the names of a listing of ``index/``, in listing order;
    temporary files of commits in progress, checkpoint markers and foreign names are skipped."""
    return [IndexPart(name, *parsed) for name in names if (parsed := fmt.parse_index_part_name(name)) is not None]


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
    replaces: tuple[str, ...] = ()  # a data compaction's shard: the shards it rewrote (featstore.rewrite)
    # The id of its first index row, as its commit record says (None: no rows, or a shard committed
    # before records held it; IN_RECORD: not copied out of the record, read there when asked):
    # what epoch orders visit shards by (featstore.order), the same on every encode of the same
    # inputs, wherever they lay.
    first_id: str | None = None

    def data_key(self, field: str) -> str:
        return f"{self.data_root}/{field}/c/0"


IN_RECORD = "\0in the record"  # a ShardInfo.first_id an older checkpoint did not copy out (no id has a NUL)


def first_id_of(info: ShardInfo) -> str | None:
    """``info.first_id``, read from its commit record (once) where a checkpoint did not copy it out."""
    if info.first_id == IN_RECORD:
        assert isinstance(info.layouts, RecordMapping), info.name
        info.first_id = recorded_first_id(info.layouts.record(), info.index_key)  # the same on every read: kept
    return info.first_id


def recorded_first_id(record: dict[str, Any], key: str) -> str | None:
    first = record.get("first_id")
    if not is_first_id(first):
        raise CorruptionError(f"{key}: a commit record whose first_id is {first!r}, not an id")
    return first


def is_first_id(value: Any) -> bool:
    """A recorded first id: an id (no NUL: ``IN_RECORD`` is none), or None."""
    return value is None or (isinstance(value, str) and "\0" not in value)


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
            doc = fmt.store_json(self._record(self._row))[self._part]
            self._data = {f: fmt.ChunkLayout(v["elements"], v["chunk_elements"], v["num_chunks"]) for f, v in doc.items()} if self._part == "fields" else doc
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._decoded()[key]

    def record(self) -> dict[str, Any]:
        """The whole commit record, decoded (not kept)."""
        return fmt.store_json(self._record(self._row))

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys if self._keys is not None else self._decoded())

    def __len__(self) -> int:
        return len(self._keys if self._keys is not None else self._decoded())

    def __contains__(self, key: object) -> bool:
        return key in (self._keys if self._keys is not None else self._decoded())

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def recorded_shard_info(name: str, key: str, nbytes: int, num_samples: int, num_rejected: int, committed_at: float,
                        data_root: str, rejects_key: str, fields: Sequence[str], record: Callable[[int], str], row: int,
                        first_id: str | None = IN_RECORD, *, checked: bool = False) -> ShardInfo:
    """A ``ShardInfo`` from a checkpoint: the scalars as given, layouts and objects decoded from
    the commit record's JSON (``record(row)``) when first read, and the first id from the record
    too unless the checkpoint copied it out. ``checked``: the names were checked already (for
    every part at once)."""
    if not checked and (why := fmt.recorded_names_problem(name, data_root, rejects_key, fields)):
        raise CorruptionError(f"{key}: {why}")
    # Only a rewrite's record is decoded at the open: other names carry no "replaces".
    replaces = fmt.replaced_shards(name, _json(record(row), key).get("replaces"), key) if fmt.is_rewrite_name(name) else ()
    return ShardInfo(name, num_samples, num_rejected, RecordMapping(record, row, "fields", fields), RecordMapping(record, row, "objects"),
                     key, nbytes, data_root, rejects_key, committed_at, replaces, first_id)



def _json(text: str, key: str) -> dict[str, Any]:
    try:
        doc = fmt.store_json(text)
    except ValueError as exc:
        raise CorruptionError(f"{key}: a commit record that is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptionError(f"{key}: a commit record that is not a JSON object")
    return doc


# ---- the listing ----------------------------------------------------------------------------
def list_index(storage: Storage) -> dict[str, str]:
    """Names directly under ``index/`` -> a fingerprint of the object (its size and what the
    backend says changes when it is rewritten), from one listing: what tells a reader that a part
    is the very one a checkpoint covers, without reading it."""
    return storage.list_fingerprints(fmt.INDEX_DIR)


def read_parts(storage: Storage, keys: list[str]) -> Iterator[bytes]:
    """Objects (index parts, rejects) in order; from an object store many at once (one request each)."""
    if not storage.is_remote or len(keys) < 2:
        return (storage.read(key) for key in keys)
    with ThreadPoolExecutor(min(16, len(keys)), thread_name_prefix="featstore-index") as pool:  # joined on return
        return iter(list(pool.map(storage.read, keys)))


def parse_index_part(raw: bytes, name: str, key: str, url: str, crc: int | None) -> tuple[pa.Table, ShardInfo]:
    """An index part's rows and commit record, checked against its CRC-32C: the one in its name
    (``crc``, versions 1-2) or (version 3) the one sealed into its metadata."""
    table, record = parse_index_part_record(raw, name, key, url, crc)
    return table, shard_info(record, name, key, len(raw))


def parse_index_part_record(raw: bytes, name: str, key: str, url: str, crc: int | None) -> tuple[pa.Table, dict[str, Any]]:
    """``parse_index_part``, with the commit record as stored (a dict) instead of a ``ShardInfo``."""
    where = f"{url}/{key}"
    if crc is not None and checksums.crc32c(raw) != crc:
        raise CorruptionError(f"{where}: index part of shard {name!r} fails its checksum")
    try:
        parquet = parquet_file(raw)
        table = parquet.read(use_threads=False)
        metadata = table.schema.metadata or {}
        # The sealed CRC is in the Parquet footer's key/value metadata; the Arrow schema stored
        # beside it still holds the placeholder.
        sealed = (parquet.metadata.metadata or {})[fmt.COMMIT_CRC_METADATA_KEY] if crc is None else None
        info = fmt.store_json(metadata[fmt.COMMIT_METADATA_KEY])
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
    """A shard's ``ShardInfo`` from its commit record (as its index part, or a checkpoint, holds
    it); CorruptionError naming ``key`` when the record is not this format's."""
    root = info.get("data") or f"{fmt.SHARDS_DIR}/{name}"
    rejects = info.get("rejects") or f"{fmt.REJECTS_DIR}/{name}.parquet"
    try:
        layouts = {f: fmt.ChunkLayout(*_counts(v["elements"], v["chunk_elements"], v["num_chunks"])) for f, v in info["fields"].items()}
        counts = _counts(info["num_samples"], info["num_rejected"])
        objects = info["objects"]
        for obj in objects.values():
            _counts(obj["nbytes"], obj["crc32c"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptionError(f"{key}: the commit record of shard {name!r} is not this format's ({exc!r})") from None
    if why := fmt.recorded_names_problem(name, root, rejects, list(layouts)):
        raise CorruptionError(f"{key}: {why}")
    if stray := [k for k in objects if not (k == rejects or (k.startswith(root + "/") and ".." not in k.split("/")))]:
        raise CorruptionError(f"{key}: shard {name!r} lists an object {stray[0]!r} outside its data directory {root}")
    replaces = fmt.replaced_shards(name, info.get("replaces"), key)
    return ShardInfo(name, counts[0], counts[1], layouts, objects, key, nbytes, root, rejects, float(info.get("committed_at") or 0.0), replaces,
                     recorded_first_id(info, key))


def row_problem(table: pa.Table, info: ShardInfo, ndims: Mapping[str, int | None] | None = None) -> str | None:
    """What is wrong with the first sample of an index part whose extent (``<field>.offset`` + the
    product of ``<field>.shape``) lies outside the data its commit record gives that field, or
    whose shape has not the field's dimensions (``ndims``: the manifest's), or None. Readers
    bound each read where they compute it; a copy, which reads no sample, checks here so that it
    never publishes rows that verify would refuse."""
    ids = table.column("id").to_pylist()
    for name, layout in info.layouts.items():
        if f"{name}.offset" not in table.column_names:
            continue
        ndim = (ndims or {}).get(name)
        extents = zip(table.column(f"{name}.offset").to_pylist(), table.column(f"{name}.shape").to_pylist(), strict=True)
        for sample_id, (offset, shape) in zip(ids, extents, strict=True):
            if offset is None:
                continue
            if not (0 <= offset and all(d >= 0 for d in shape) and offset + math.prod(shape) <= layout.elements):
                return f"sample {sample_id!r} field {name!r} points outside the data of shard {info.name!r}"
            if ndim is not None and len(shape) != ndim:
                return f"sample {sample_id!r} field {name!r} has a shape of {len(shape)} dimension(s), the field {ndim}"
    return None


def _counts(*values: Any) -> tuple[int, ...]:
    """Non-negative integers below 2^63, or ValueError: sizes from a store bound what is allocated."""
    if not all(type(v) is int and 0 <= v < 1 << 63 for v in values):
        raise ValueError(f"not sizes: {values}")
    return values


def read_rejects(storage: Storage, keys: list[str]) -> pa.Table:
    """The rejects objects ``keys``, one table (their objects many at once from an object store)."""
    tables = [read_parquet(raw) for raw in read_parts(storage, keys)]
    return (pa.concat_tables(tables, promote_options="permissive") if tables
            else pa.table({"source": pa.array([], pa.string()), "reason": pa.array([], pa.string())}))


def parquet_file(raw: bytes) -> pq.ParquetFile:
    """A Parquet object held in memory, opened so that reading it starts no thread.

    Arrow's thread pools are native threads nobody joins: one still alive when the interpreter
    exits can abort it with ``terminate called without an active exception`` (exit 134,
    apache/arrow#34314; ``mmcache verify`` did, about once in 200 runs). ``pq.read_table`` starts
    them even with ``use_threads=False`` (its dataset path), and so does any read through a
    Python file object such as ``io.BytesIO`` (Arrow's I/O pool); a ``ParquetFile`` over an Arrow
    buffer read with ``use_threads=False`` starts none. Store objects are small: one core is plenty."""
    return pq.ParquetFile(pa.BufferReader(raw))


def read_parquet(raw: bytes, columns: Sequence[str] | None = None) -> pa.Table:
    """The table of an in-memory Parquet object, read without any thread (``parquet_file``)."""
    return parquet_file(raw).read(columns=columns, use_threads=False)


def parquet_bytes(table: pa.Table, footer_metadata: dict[bytes, bytes] | None = None) -> bytes:
    """``table`` as one Parquet object (index parts, checkpoints, rejects). ``footer_metadata``
    goes into the footer's key/value metadata only: as schema metadata pyarrow would store it twice."""
    sink = io.BytesIO()
    with pq.ParquetWriter(sink, table.schema) as writer:
        writer.write_table(table)
        if footer_metadata:
            writer.add_key_value_metadata(footer_metadata)
    return sink.getvalue()
