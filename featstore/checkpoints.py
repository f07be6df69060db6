"""Index checkpoints, read: the rows of many committed index parts in two Parquet objects, so
that opening a store costs one listing and a couple of reads at any shard count (Delta Lake and
Iceberg checkpoint their logs for the same reason). How a checkpoint is written and pruned is
``featstore.compact``'s; ``mmcache verify`` checks checkpoints against the parts.

A checkpoint (docs/FORMAT.md, "Index checkpoints"): ``checkpoints/<digest>.rows.parquet`` holds
every row of the parts it covers, in snapshot order, with a ``shard`` column;
``checkpoints/<digest>.parts.parquet`` one row per covered part (its file name, its listing
fingerprint, its commit record). ``<digest>`` is the SHA-256 of the two objects' bytes, parts then
rows (first 32 hex digits): a reader checks what it read against the name. The marker
``index/_checkpoint.<parts>.<digest>.json`` makes it visible; it sits in ``index/`` so that the
one listing a reader takes anyway finds it.

A reader uses a covered part's rows from the checkpoint only when the part is still listed with
the fingerprint it had (size plus the backend's mtime, inode or ETag): a part deleted since
(``mmcache repair``) drops out, one committed since, or recreated under the same name, is read.
So a checkpoint never hides or changes a committed shard; it only saves reads.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa

from mmcache.featstore import format as fmt
from mmcache.featstore.errors import CorruptionError, FormatVersionError
from mmcache.featstore.index import ShardInfo, parquet_file, read_parquet, recorded_shard_info
from mmcache.featstore.storage import Storage

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_METADATA_KEY = b"mmcache.checkpoint"
CHECKPOINT_VERSION = 1
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


def checkpoint_keys(digest: str) -> tuple[str, str]:
    """The (parts, rows) objects of checkpoint ``digest``."""
    return f"{CHECKPOINT_DIR}/{digest}.parts.parquet", f"{CHECKPOINT_DIR}/{digest}.rows.parquet"


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
                self._texts = read_parquet(self._raw, ["record"]).column("record").to_pylist()
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


@dataclass
class Checkpoint:
    key: str                          # checkpoints/<digest>: what messages and Store.checkpoint name
    marker: str
    table: pa.Table                   # the covered rows, with a "shard" column
    parts: dict[str, CoveredPart]     # entry -> part, in table order
    nbytes: int


_PART_COLUMNS = ("entry", "shard", "listed", "index_nbytes", "num_samples", "num_rejected", "committed_at", "data", "rejects", "fields", "record")


def markers(listing: Iterable[str]) -> list[tuple[int, str, str]]:
    """(parts, digest, marker name) of the checkpoints in a listing, the most complete first."""
    found = [(*parsed, name) for name in listing if (parsed := parse_marker(name))]
    return sorted(found, key=lambda m: (-m[0], m[1]))


def parse_checkpoint(parts_raw: bytes, rows_raw: bytes, digest: str, marker: str, url: str) -> Checkpoint:
    key = f"{CHECKPOINT_DIR}/{digest}"
    where = f"{url}/{key}"
    if digest_of(parts_raw, rows_raw) != digest:
        raise CorruptionError(f"{where}: index checkpoint does not match the SHA-256 in its name (damaged or cut short)")
    try:
        listing = parquet_file(parts_raw)
        doc = json.loads((listing.metadata.metadata or {})[CHECKPOINT_METADATA_KEY])
        if doc.get("checkpoint_version", 0) > CHECKPOINT_VERSION:
            raise FormatVersionError(f"{where} was written by a newer mmcache (checkpoint version {doc['checkpoint_version']}); upgrade mmcache")
        described = listing.read(columns=list(_PART_COLUMNS[:-1]), use_threads=False)
        columns = [described.column(name).to_pylist() for name in _PART_COLUMNS[:-1]]
        if listing.schema_arrow.names != list(_PART_COLUMNS):
            raise ValueError(f"columns {listing.schema_arrow.names}")
        table = read_parquet(rows_raw)
    except (pa.ArrowException, KeyError, OSError, TypeError, ValueError) as exc:
        if isinstance(exc, FormatVersionError):
            raise
        raise CorruptionError(f"{where}: not a valid index checkpoint ({exc})") from None
    parts, start, index, records = {}, 0, fmt.INDEX_DIR, _Records(parts_raw)
    for row, (entry, name, listed, nbytes, num_samples, num_rejected, committed_at, data_root, rejects_key, fields) in enumerate(zip(*columns, strict=True)):
        if not (isinstance(entry, str) and (parsed := fmt.parse_index_part_name(entry)) and parsed[0] == name):
            raise CorruptionError(f"{where}: covers {entry!r}, not the index part of shard {name!r}")  # a name from the store, checked
        info = recorded_shard_info(name, f"{index}/{entry}", nbytes, num_samples, num_rejected, committed_at, data_root, rejects_key, fields, records, row)
        parts[entry] = CoveredPart(entry, listed, info, start, records, row)
        start += num_samples
    if start != table.num_rows or doc.get("rows") != start:
        raise CorruptionError(f"{where}: {table.num_rows} rows but its parts hold {start}")
    return Checkpoint(key, marker, table.replace_schema_metadata(None), parts, len(parts_raw) + len(rows_raw))


def read_checkpoint(storage: Storage, digest: str, marker: str) -> Checkpoint:
    """Checkpoint ``digest``, read (both objects at once from an object store) and checked;
    FileNotFoundError when it was pruned."""
    keys = checkpoint_keys(digest)
    if storage.is_remote:
        with ThreadPoolExecutor(2, thread_name_prefix="featstore-checkpoint") as pool:
            parts_raw, rows_raw = pool.map(storage.read, keys)
    else:
        parts_raw, rows_raw = (storage.read(k) for k in keys)
    return parse_checkpoint(parts_raw, rows_raw, digest, marker, storage.url)


def find_checkpoint(storage: Storage, listing: dict[str, str], problems: list[str] | None = None) -> Checkpoint | None:
    """The most complete readable checkpoint the listing shows, or None. A damaged one is
    reported (``problems``, and a warning) and skipped; a pruned one is skipped silently."""
    for _, digest, marker in markers(listing)[:MAX_TRIES]:
        try:
            return read_checkpoint(storage, digest, marker)
        except FileNotFoundError:
            continue  # pruned by a compactor after our listing
        except FormatVersionError:
            continue  # a newer mmcache's: the parts it covers are still there to read
        except CorruptionError as exc:
            if problems is not None:
                problems.append(str(exc))
            warnings.warn(f"{exc}; it is ignored and the index parts it covers are read instead (`mmcache compact {storage.url}` replaces it)", CheckpointWarning, stacklevel=3)
    return None
