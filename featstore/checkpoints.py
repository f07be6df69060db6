"""Index checkpoints, read: the rows of many committed index parts in two Parquet objects, so
that opening a store costs one listing and a couple of reads at any shard count. Writing and
pruning them is ``featstore.compact``'s; ``mmcache verify`` checks them against the parts.

A covered part's rows come from the checkpoint only while the part is listed as it was, so a
checkpoint never hides or changes a committed shard (docs/design/store.md, "Index checkpoints, read").
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from . import format as fmt
from .checksums import crc32c
from .errors import CorruptionError, FormatVersionError
from .index import IN_RECORD, ShardInfo, is_first_id, parquet_file, read_parquet, recorded_shard_info
from .storage import Storage

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_METADATA_KEY = b"mmcache.checkpoint"
CHECKPOINT_VERSION = 2  # 2: the parts object is Arrow IPC (.parts.arrow); 1: Parquet (.parts.parquet), still read
PARTS_ARROW, PARTS_PARQUET = ".parts.arrow", ".parts.parquet"
_ARROW_MAGIC = b"ARROW1"
KEEP = 2             # checkpoints kept: the newest, and the one before for readers that listed it
MAX_TRIES = 3        # damaged or pruned checkpoints a reader tries before it reads every part
_MARKER = re.compile(r"^_checkpoint\.(\d{10})\.([0-9a-f]{32})\.json$")


class CheckpointWarning(UserWarning):
    """A checkpoint could not be used (damaged): it was ignored, and the parts it covers read."""


def marker_name(parts: int, digest: str) -> str:
    return f"_checkpoint.{parts:010d}.{digest}.json"


def parse_marker(name: str) -> tuple[int, str] | None:
    match = _MARKER.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def checkpoint_keys(digest: str, parts: str = PARTS_ARROW) -> tuple[str, str]:
    """The (parts, rows) objects of checkpoint ``digest``; ``parts``: the parts object's suffix
    (``PARTS_PARQUET`` for a checkpoint of version 1)."""
    return f"{CHECKPOINT_DIR}/{digest}{parts}", f"{CHECKPOINT_DIR}/{digest}.rows.parquet"


def object_keys(digest: str) -> list[str]:
    """Every object checkpoint ``digest`` may have, in either version: what pruning deletes."""
    return [f"{CHECKPOINT_DIR}/{digest}{PARTS_PARQUET}", *checkpoint_keys(digest), ids_key(digest)]


def parts_object(described: pa.Table, doc: dict[str, Any]) -> bytes:
    """A checkpoint's parts object: an Arrow IPC file of one uncompressed batch, ``doc`` in its
    schema metadata. Every open reads it: IPC is taken as it lies (~40 us for 50 parts, where the
    same table as Parquet took ~240 us to decode), and uncompressed needs no Arrow thread."""
    sink = pa.BufferOutputStream()
    table = described.replace_schema_metadata({CHECKPOINT_METADATA_KEY: json.dumps(doc).encode()}).combine_chunks()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(1, table.num_rows))
    return sink.getvalue().to_pybytes()


def read_parts_object(raw: bytes, columns: Sequence[str] | None = None) -> tuple[pa.Table, dict[bytes, bytes], list[str]]:
    """A parts object (Arrow IPC since checkpoint version 2; Parquet before), read without any
    thread: its table (``columns`` of it), its metadata, and the names of all its columns."""
    if raw[:6] != _ARROW_MAGIC:
        listing = parquet_file(raw)
        wanted = None if columns is None else list(columns)
        return listing.read(columns=wanted, use_threads=False), listing.metadata.metadata or {}, listing.schema_arrow.names
    reader = ipc.open_file(pa.py_buffer(raw), options=ipc.IpcReadOptions(use_threads=False))
    table = reader.read_all()
    return (table.select(list(columns)) if columns is not None else table), reader.schema.metadata or {}, table.column_names


def ids_key(digest: str) -> str:
    """The sorted id hashes of checkpoint ``digest`` (written since the two-level index)."""
    return f"{CHECKPOINT_DIR}/{digest}.ids.u64"


def digest_of(parts: bytes, rows: bytes) -> str:
    return hashlib.sha256(parts + rows).hexdigest()[:32]


class _Records:
    """The ``record`` column of a checkpoint's parts object, decoded on first use: it is most of
    that object's bytes, and an open needs none of it."""

    def __init__(self, raw: bytes) -> None:
        self._raw, self._texts = raw, None
        self._lock = threading.Lock()

    def __call__(self, row: int) -> str:
        with self._lock:  # readers of one store may first touch its shards from several threads
            if self._texts is None:
                self._texts = read_parts_object(self._raw, ["record"])[0].column("record").to_pylist()
        return self._texts[row]


class CoveredPart:
    """One index part a checkpoint covers. (A plain class: thousands are made per open, and a
    frozen dataclass's __init__ costs several times more.)"""

    __slots__ = ("entry", "listed", "info", "start", "records", "row")

    def __init__(self, entry: str, listed: str, info: ShardInfo, start: int, records: _Records, row: int) -> None:
        self.entry = entry      # its file name under index/
        self.listed = listed    # its fingerprint when it was compacted
        self.info = info
        self.start = start      # its first row in the checkpoint's table
        self.records, self.row = records, row  # its row in the parts object

    @property
    def record(self) -> str:
        """Its commit record, JSON, exactly as its index part holds it."""
        return self.records(self.row)


class Checkpoint:
    """A checkpoint read and checked. Its rows (``table``) are read when first used where the
    marker vouches for the parts object alone (``open_checkpoint``): an open needs only the shard
    table, and a 2M-sample store's rows object is tens of MB."""

    def __init__(self, key: str, marker: str, parts: dict[str, CoveredPart], nbytes: int, samples: int | None,
                 rows: Callable[[], pa.Table], ids: Callable[[], np.ndarray] | None = None) -> None:
        self.key = key                  # checkpoints/<digest>: what messages and Store.checkpoint name
        self.marker = marker
        self.parts = parts              # entry -> part, in table order
        self.nbytes = nbytes
        self.samples = samples          # distinct sample ids among its rows (None: an older compactor's)
        self.current = True    # written as this version writes it (an older compactor's: no first ids copied out, or Parquet parts)
        self._rows, self._table = rows, None
        self._ids = ids
        self._lock = threading.Lock()

    def id_hashes(self) -> np.ndarray | None:
        """The sorted, unique hashes of its ids (featstore.idhash), read now (8 bytes per id:
        not kept, a reader asks once), or None where its compactor wrote none; CorruptionError
        or FileNotFoundError where the object is damaged or gone."""
        return None if self._ids is None else self._ids()

    @property
    def table(self) -> pa.Table:
        """The covered rows, with a "shard" column (read and checked against the name on first use)."""
        with self._lock:
            if self._table is None:
                self._table = self._rows()
        return self._table


_PART_COLUMNS = ("entry", "shard", "listed", "index_nbytes", "num_samples", "num_rejected", "committed_at", "data", "rejects", "fields", "record")


def markers(listing: Iterable[str]) -> list[tuple[int, str, str]]:
    """(parts, digest, marker name) of the checkpoints in a listing, the most complete first."""
    # (The prefix first: an open asks this of every name under index/, and few are markers.)
    found = [(*parsed, name) for name in listing if name.startswith("_checkpoint.") and (parsed := parse_marker(name))]
    return sorted(found, key=lambda m: (-m[0], m[1]))


def parse_checkpoint(parts_raw: bytes, rows_raw: bytes, digest: str, marker: str, url: str) -> Checkpoint:
    where = f"{url}/{CHECKPOINT_DIR}/{digest}"
    if digest_of(parts_raw, rows_raw) != digest:
        raise CorruptionError(f"{where}: index checkpoint does not match the SHA-256 in its name (damaged or cut short)")
    checkpoint = _parse_parts(parts_raw, digest, marker, url, lambda: _parse_rows(rows_raw, where), len(parts_raw) + len(rows_raw))
    checkpoint.table  # noqa: B018 - read now: the caller has the bytes and wants them checked
    return checkpoint


def _parse_parts(parts_raw: bytes, digest: str, marker: str, url: str, rows: Callable[[], pa.Table], nbytes: int,
                 ids: Callable[[], np.ndarray] | None = None) -> Checkpoint:
    """The parts object of a checkpoint (its shard table); ``rows`` reads the rows object."""
    key = f"{CHECKPOINT_DIR}/{digest}"
    where = f"{url}/{key}"
    try:
        described, metadata, names = read_parts_object(parts_raw, _PART_COLUMNS[:-1])
        doc = fmt.store_json(metadata[CHECKPOINT_METADATA_KEY])
        if doc.get("checkpoint_version", 0) > CHECKPOINT_VERSION:
            raise FormatVersionError(f"{where} was written by a newer mmcache (checkpoint version {doc['checkpoint_version']}); upgrade mmcache")
        if names != list(_PART_COLUMNS):
            raise ValueError(f"columns {names}")
        columns = [described.column(name).to_pylist() for name in _PART_COLUMNS[:-1]]
    except (pa.ArrowException, KeyError, OSError, TypeError, ValueError) as exc:
        if isinstance(exc, FormatVersionError):
            raise
        raise CorruptionError(f"{where}: not a valid index checkpoint ({exc})") from None
    parts, start, index, records = {}, 0, fmt.INDEX_DIR, _Records(parts_raw)
    first_ids = _first_ids(doc, len(columns[0]), where)
    checked = _names_valid(dict(zip(_PART_COLUMNS, columns)))  # else each row is checked, and the first bad one named
    for row, (entry, name, listed, nbytes, num_samples, num_rejected, committed_at, data_root, rejects_key, fields) in enumerate(zip(*columns, strict=True)):
        if not (checked or (isinstance(entry, str) and (parsed := fmt.parse_index_part_name(entry)) and parsed[0] == name)):
            raise CorruptionError(f"{where}: covers {entry!r}, not the index part of shard {name!r}")  # a name from the store, checked
        info = recorded_shard_info(name, f"{index}/{entry}", nbytes, num_samples, num_rejected, committed_at, data_root, rejects_key, fields, records, row,
                                   first_ids[row], checked=checked)
        parts[entry] = CoveredPart(entry, listed, info, start, records, row)
        start += num_samples
    if doc.get("rows") != start:
        raise CorruptionError(f"{where}: its parts hold {start} rows but it says {doc.get('rows')}")
    samples = doc.get("samples")

    def table() -> pa.Table:
        got = rows()
        if got.num_rows != start:
            raise CorruptionError(f"{where}: {got.num_rows} rows but its parts hold {start}")
        return got

    checkpoint = Checkpoint(key, marker, parts, nbytes, samples if type(samples) is int else None, table, ids)
    checkpoint.current = "first_ids" in doc and parts_raw[:6] == _ARROW_MAGIC
    return checkpoint


def _names_valid(columns: dict[str, list[Any]]) -> bool:
    """Whether every covered part's names are this format's (what ``parse_index_part_name`` and
    ``recorded_names_problem`` check per row), each column checked by one match of its lines
    joined: an open checks every part a checkpoint covers, and row by row that was ~2 us of
    each. False (a name is wrong, or a store of versions 1-2, whose part names carry a CRC)
    leaves the checks to each row, which name the first bad one."""
    shards = columns["shard"]
    if columns["entry"] != [f"{name}.parquet" if type(name) is str else None for name in shards]:
        return False
    fields = [f for names in columns["fields"] for f in (names if type(names) is list else [None])]
    texts = {}
    for name, values in (("shard", shards), ("data", columns["data"]), ("rejects", columns["rejects"]), ("field", fields)):
        if (text := _lines(values)) is None:
            return False
        texts[name] = text
    return _CRC_LINE.search(texts["shard"]) is None and all(_LINES[name].fullmatch(text) is not None for name, text in texts.items())


def _lines(values: list[Any]) -> str | None:
    """``values`` one a line (each ended by a line break), or None where one is not a string,
    holds a line break or ``..``."""
    try:
        text = "\n".join(values) + "\n" if values else ""
    except TypeError:
        return None
    return text if text.count("\n") == len(values) and ".." not in text else None


def _line_patterns() -> dict[str, re.Pattern[str]]:
    """format.recorded_name_patterns for lines joined: one name a line, every line matching."""
    bare = {name: pattern.removeprefix("^").removesuffix("$") for name, pattern in fmt.recorded_name_patterns().items()}
    return {name: re.compile(f"(?:{pattern}\n)*") for name, pattern in bare.items() if name != "crc_suffix"}


_LINES = _line_patterns()
# A shard name ending like a version-2 part name's CRC, on one of the joined lines.
_CRC_LINE = re.compile(fmt.recorded_name_patterns()["crc_suffix"].removesuffix("$") + "\n")


def _first_ids(doc: dict[str, Any], parts: int, where: str) -> list[str | None]:
    """Each covered part's first id as the checkpoint copied it out of its commit record, or (a
    checkpoint written before it did) ``IN_RECORD`` for each: read from the record when asked."""
    first_ids = doc.get("first_ids")
    if first_ids is None:
        return [IN_RECORD] * parts
    if not (isinstance(first_ids, list) and len(first_ids) == parts and all(is_first_id(f) for f in first_ids)):
        raise CorruptionError(f"{where}: its first_ids are not one id (or null) per part")
    return first_ids


def _parse_rows(rows_raw: bytes, where: str) -> pa.Table:
    try:
        return read_parquet(rows_raw).replace_schema_metadata(None)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptionError(f"{where}: not a valid index checkpoint ({exc})") from None


def read_checkpoint(storage: Storage, digest: str, marker: str) -> Checkpoint:
    """Checkpoint ``digest``, read (both objects at once from an object store) and checked;
    FileNotFoundError when it was pruned."""
    try:
        parts_raw, rows_raw = _read_both(storage, checkpoint_keys(digest))
    except FileNotFoundError:  # version 1's parts object (or pruned: then this fails the same way)
        parts_raw, rows_raw = _read_both(storage, checkpoint_keys(digest, PARTS_PARQUET))
    return parse_checkpoint(parts_raw, rows_raw, digest, marker, storage.url)


def _read_both(storage: Storage, keys: tuple[str, str]) -> tuple[bytes, bytes]:
    if not storage.is_remote:
        return storage.read(keys[0]), storage.read(keys[1])
    with ThreadPoolExecutor(2, thread_name_prefix="featstore-checkpoint") as pool:
        parts_raw, rows_raw = pool.map(storage.read, keys)
    return parts_raw, rows_raw


def open_checkpoint(storage: Storage, digest: str, marker: str) -> Checkpoint:
    """Checkpoint ``digest`` for an open: where its marker records the parts object's checksum and
    the rows object's size (as compactors since mmcache's two-level index write it), only the
    parts object is read and the rows object's size is checked (a cut-short copy fails here); its
    rows are read, and checked against the name, when first used. Otherwise ``read_checkpoint``."""
    seal = _marker_seal(storage.read(f"{fmt.INDEX_DIR}/{marker}")) if marker else None
    if seal is None:
        return read_checkpoint(storage, digest, marker)
    parts_key, rows_key = checkpoint_keys(digest, seal[3])
    where = f"{storage.url}/{CHECKPOINT_DIR}/{digest}"
    parts_raw = storage.read(parts_key)
    if not _parts_match(parts_raw, seal[0]) or storage.size(rows_key) != seal[1]:
        raise CorruptionError(f"{where}: index checkpoint does not match the SHA-256 in its name (damaged or cut short)")

    def rows() -> pa.Table:
        rows_raw = storage.read(rows_key)
        if digest_of(parts_raw, rows_raw) != digest:
            raise CorruptionError(f"{where}: index checkpoint does not match the SHA-256 in its name (damaged or cut short)")
        return _parse_rows(rows_raw, where)

    def ids() -> np.ndarray:
        raw = storage.read(ids_key(digest))
        if hashlib.sha256(raw).hexdigest() != seal[2] or len(raw) % 8:
            raise CorruptionError(f"{storage.url}/{ids_key(digest)}: the id hashes of an index checkpoint do not match the SHA-256 its marker records")
        return np.frombuffer(raw, dtype="<u8")

    return _parse_parts(parts_raw, digest, marker, storage.url, rows, len(parts_raw) + seal[1], ids if seal[2] is not None else None)


def marker_doc(parts: int, rows: int, parts_raw: bytes, rows_raw: bytes, ids_raw: bytes | None) -> bytes:
    """A marker's content: counts, which parts object, and what lets a reader trust the parts and
    ids objects alone. The parts object's CRC-32C, not its SHA-256: every open checks it, and a
    SHA-256 of 50 parts' object took 26 us of an open's ~500 (the name's SHA-256 still covers it,
    checked with the rows when they are read; a store's other objects are CRC-32C-checked too)."""
    return json.dumps({"parts": parts, "rows": rows, "parts_object": PARTS_ARROW, "parts_crc32c": crc32c(parts_raw),
                       "rows_nbytes": len(rows_raw), "ids_sha256": None if ids_raw is None else hashlib.sha256(ids_raw).hexdigest()}).encode()


def marker_problem(storage: Storage, checkpoint: Checkpoint, digest: str, marker: str) -> str:
    """Why a marker's content is not what a compactor writes for its checkpoint ('' when it is):
    a checkpoint of this version's must have exactly ``marker_doc``'s; an older compactor's
    marker (which records less) must agree in what it records."""
    raw = storage.read(f"{fmt.INDEX_DIR}/{marker}")
    seal = _marker_seal(raw)
    if seal is None and not checkpoint.current:
        return ""
    try:
        parts_raw, rows_raw = _read_both(storage, checkpoint_keys(digest, seal[3] if seal else PARTS_ARROW))
        ids_raw = storage.read(ids_key(digest)) if seal is not None and seal[2] is not None else None
    except FileNotFoundError as exc:
        return f"it names objects that are not there ({exc})"
    if checkpoint.current:
        expected = marker_doc(len(checkpoint.parts), checkpoint.table.num_rows, parts_raw, rows_raw, ids_raw)
        return "" if raw == expected else "its content is not what its compactor wrote (altered or damaged)"
    assert seal is not None
    ids_ok = ids_raw is None or hashlib.sha256(ids_raw).hexdigest() == seal[2]
    return "" if _parts_match(parts_raw, seal[0]) and len(rows_raw) == seal[1] and ids_ok else "it does not describe its checkpoint's objects"


def _marker_seal(raw: bytes) -> tuple[int | str, int, str | None, str] | None:
    """(the parts object's CRC-32C, or its SHA-256 where an older compactor recorded that; the rows
    size; the ids SHA-256 or None; the parts object's suffix) from a marker's content; None for
    an older compactor's marker (or one that is not this format's: the checkpoint is then read
    and checked whole)."""
    try:
        doc = fmt.store_json(raw)
        check = doc["parts_crc32c"] if "parts_crc32c" in doc else doc["parts_sha256"]
        size, ids, parts = doc["rows_nbytes"], doc.get("ids_sha256"), doc.get("parts_object")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not (type(check) in (int, str) and type(size) is int):
        return None
    return check, size, ids if isinstance(ids, str) else None, PARTS_ARROW if parts == PARTS_ARROW else PARTS_PARQUET


def _parts_match(raw: bytes, check: int | str) -> bool:
    return crc32c(raw) == check if type(check) is int else hashlib.sha256(raw).hexdigest() == check


def find_checkpoint(storage: Storage, listing: dict[str, str], problems: list[str] | None = None, *, lazy: bool = False) -> Checkpoint | None:
    """The most complete readable checkpoint the listing shows, or None. A damaged one is
    reported (``problems``, and a warning) and skipped; a pruned one is skipped silently.
    ``lazy``: its rows are read when first used (``open_checkpoint``)."""
    for _, digest, marker in markers(listing)[:MAX_TRIES]:
        try:
            return open_checkpoint(storage, digest, marker) if lazy else read_checkpoint(storage, digest, marker)
        except FileNotFoundError:
            continue  # pruned by a compactor after our listing
        except FormatVersionError:
            continue  # a newer mmcache's: the parts it covers are still there to read
        except CorruptionError as exc:
            if problems is not None:
                problems.append(str(exc))
            warnings.warn(f"{exc}; it is ignored and the index parts it covers are read instead (`mmcache compact {storage.url}` replaces it)", CheckpointWarning, stacklevel=3)
    return None
