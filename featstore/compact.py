"""Index checkpoints: the rows of many committed index parts in two Parquet objects, so that
opening a store costs one listing and a couple of reads at any shard count (Delta Lake and
Iceberg checkpoint their logs for the same reason). ``mmcache verify`` checks them against the
parts (featstore.verify).

A checkpoint is written in two steps, like a shard (docs/FORMAT.md, "Index checkpoints"):

1. ``checkpoints/<digest>.rows.parquet``: every row of the parts it covers, in snapshot order,
   with a ``shard`` column; ``checkpoints/<digest>.parts.parquet``: one row per covered part (its
   file name, its listing fingerprint, its commit record). ``<digest>`` is the SHA-256 of the two
   objects' bytes, parts then rows (first 32 hex digits): a reader checks what it read against
   the name, and two compactors of the same parts write the same objects.
2. ``index/_checkpoint.<parts>.<digest>.json``, created only if absent: the marker that makes the
   checkpoint visible. It sits in ``index/`` so that the one listing a reader takes anyway finds
   it; its name does not end in ``.parquet`` and does not start like a shard, so plain readers and
   older mmcache skip it.

A reader uses a covered part's rows from the checkpoint only when the part is still listed with
the fingerprint it had (size plus the backend's mtime, inode or ETag): a part deleted since
(``mmcache repair``) drops out, one committed since, or recreated under the same name, is read.
So a checkpoint never hides or changes a committed shard; it only saves reads. Nothing here
deletes an index part; old checkpoints are pruned marker first, and a reader that finds one gone
falls back to the next one, or to the parts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmcache.featstore import format as fmt
from mmcache.featstore.errors import CorruptionError, FeatstoreError, FormatVersionError
from mmcache.featstore.snapshot import ShardInfo, recorded_shard_info

if TYPE_CHECKING:
    from mmcache.featstore.reader import Store
    from mmcache.featstore.storage import Storage

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_METADATA_KEY = b"mmcache.checkpoint"
CHECKPOINT_VERSION = 1
# Writers start a compaction after about this many commits (StoreWriter(compact_every=...)).
DEFAULT_COMPACT_EVERY = 64
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


# ---- the listing ---------------------------------------------------------------------------
def list_index(storage: Storage) -> dict[str, str]:
    """Names directly under ``index/`` -> a fingerprint of the object (its size and what the
    backend says changes when it is rewritten), from one listing: what tells a reader that a part
    is the very one a checkpoint covers, without reading it."""
    from mmcache.featstore.storage import FsspecStorage, LocalStorage

    remote = getattr(storage, "remote", None)  # a CachingStorage lists through its remote
    if remote is not None:
        return list_index(remote)
    if isinstance(storage, LocalStorage):
        out = {}
        try:
            with os.scandir(storage.root / fmt.INDEX_DIR) as entries:
                for entry in entries:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue  # a temporary file that went away meanwhile
                    # A name recreated after a delete gets a new inode or mtime, whatever its size.
                    out[entry.name] = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        except (FileNotFoundError, NotADirectoryError):
            pass
        return out
    if isinstance(storage, FsspecStorage):
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: _fingerprint(e) for e in storage.list_entries(fmt.INDEX_DIR) if e.get("type") != "directory"}
    return {name: "" for name in storage.list_dir(fmt.INDEX_DIR)}  # no fingerprint: names only


def _fingerprint(entry: dict[str, Any]) -> str:
    # S3 and GCS give a content hash (the ETag of a single PUT is its MD5); others a time stamp.
    tag = next((entry[k] for k in ("ETag", "etag", "md5Hash", "crc32c", "mtime", "LastModified", "created") if entry.get(k) is not None), "")
    return f"{entry.get('size')}:{tag}"


# ---- reading -------------------------------------------------------------------------------
class _Records:
    """The ``record`` column of a checkpoint's parts object, decoded on first use: it is most of
    that object's bytes, and an open needs none of it."""

    def __init__(self, raw: bytes) -> None:
        self._raw, self._texts = raw, None
        self._lock = threading.Lock()

    def __call__(self, row: int) -> str:
        with self._lock:  # readers of one store may first touch its shards from several threads
            if self._texts is None:
                self._texts = pq.ParquetFile(io.BytesIO(self._raw)).read(columns=["record"], use_threads=False).column("record").to_pylist()
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
        listing = pq.ParquetFile(io.BytesIO(parts_raw))
        doc = json.loads((listing.metadata.metadata or {})[CHECKPOINT_METADATA_KEY])
        if doc.get("checkpoint_version", 0) > CHECKPOINT_VERSION:
            raise FormatVersionError(f"{where} was written by a newer mmcache (checkpoint version {doc['checkpoint_version']}); upgrade mmcache")
        described = listing.read(columns=list(_PART_COLUMNS[:-1]), use_threads=False)
        columns = [described.column(name).to_pylist() for name in _PART_COLUMNS[:-1]]
        if listing.schema_arrow.names != list(_PART_COLUMNS):
            raise ValueError(f"columns {listing.schema_arrow.names}")
        table = pq.read_table(io.BytesIO(rows_raw), use_threads=False)
    except (pa.ArrowException, KeyError, OSError, TypeError, ValueError) as exc:
        if isinstance(exc, FormatVersionError):
            raise
        raise CorruptionError(f"{where}: not a valid index checkpoint ({exc})") from None
    parts, start, index, records = {}, 0, fmt.INDEX_DIR, _Records(parts_raw)
    for row, (entry, name, listed, nbytes, num_samples, num_rejected, committed_at, data_root, rejects_key, fields) in enumerate(zip(*columns, strict=True)):
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


# ---- writing -------------------------------------------------------------------------------
@dataclass
class CompactSummary:
    key: str | None = None        # the checkpoint now in effect (None: the store has no parts)
    parts: int = 0                # index parts it covers
    new_parts: int = 0            # of which read from their index parts this time
    rows: int = 0
    nbytes: int = 0
    written: bool = False         # False: the existing checkpoint already covered every part
    pruned: list[str] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)   # parts left out (and so still read)

    def line(self) -> str:
        if self.key is None:
            return "nothing to compact: the store has no committed shards"
        what = f"wrote {self.key}" if self.written else f"{self.key} is up to date"
        extra = f"; pruned {len(self.pruned)} older checkpoint(s)" if self.pruned else ""
        bad = f"; {len(self.damaged)} damaged index part(s) left out (run `mmcache verify`)" if self.damaged else ""
        return f"{what}: {self.parts} index part(s) ({self.new_parts} new), {self.rows} row(s), {self.nbytes} bytes{extra}{bad}"


def compact_store(storage: Storage, *, keep: int = KEEP, rebuild: bool = False) -> CompactSummary:
    """Write a checkpoint covering every index part committed now (reading only those the newest
    checkpoint lacks), publish it, and prune older checkpoints. Safe beside readers, writers and
    other compactors: it creates objects only if absent and deletes only checkpoints.
    ``rebuild``: read every part, ignoring the existing checkpoints, and then delete all of them
    (for one that ``mmcache verify`` found disagreeing with the parts)."""
    from mmcache.featstore.snapshot import gather_parts

    gathered = gather_parts(storage, strict=False, use_checkpoint=not rebuild, checkpoint_problems=[])
    summary = CompactSummary(damaged=gathered.damaged)
    if not gathered.order:
        return summary
    old = gathered.checkpoint
    summary.new_parts = sum(1 for entry, _ in gathered.order if entry not in gathered.covered)
    summary.parts, summary.rows = len(gathered.order), gathered.table.num_rows
    if old is not None and not summary.new_parts and len(gathered.covered) == len(old.parts):
        summary.key, summary.nbytes = old.key, old.nbytes  # nothing committed or deleted since
    else:
        records = gathered.records
        described = pa.table({
            "entry": [entry for entry, _ in gathered.order],
            "shard": [info.name for _, info in gathered.order],
            "listed": [gathered.listing[entry] for entry, _ in gathered.order],  # its fingerprint when compacted
            "index_nbytes": pa.array([info.index_nbytes for _, info in gathered.order], pa.int64()),
            "num_samples": pa.array([info.num_samples for _, info in gathered.order], pa.int64()),
            "num_rejected": pa.array([info.num_rejected for _, info in gathered.order], pa.int64()),
            "committed_at": pa.array([info.committed_at for _, info in gathered.order], pa.float64()),
            "data": pa.array([info.data_root for _, info in gathered.order], pa.string()),
            "rejects": pa.array([info.rejects_key for _, info in gathered.order], pa.string()),
            "fields": pa.array([list(info.layouts) for _, info in gathered.order], pa.list_(pa.string())),
            "record": [json.dumps(records[entry]) if isinstance(records[entry], dict) else records[entry].record for entry, _ in gathered.order],
        })
        # Nothing time- or writer-dependent: compactors of the same parts write the same bytes.
        doc = {"checkpoint_version": CHECKPOINT_VERSION, "format_version": fmt.FORMAT_VERSION, "rows": gathered.table.num_rows}
        parts_raw = _parquet_bytes(described, {CHECKPOINT_METADATA_KEY: json.dumps(doc).encode()})
        rows_raw = _parquet_bytes(gathered.table.replace_schema_metadata(None), {})
        digest = digest_of(parts_raw, rows_raw)
        # Content-named: a concurrent compactor of the same parts writes the very same bytes.
        for key, raw in zip(checkpoint_keys(digest), (parts_raw, rows_raw), strict=True):
            if not storage.write_new(key, raw):
                # Other bytes under a name that is the hash of these: a damaged copy. Writing the
                # right ones over it is what anyone would write there.
                storage.write_atomic(key, raw)
        # Trusted only once read back whole and matching its name; only then is it published.
        read_checkpoint(storage, digest, "")
        storage.write_new(f"{fmt.INDEX_DIR}/{marker_name(len(gathered.order), digest)}", json.dumps({"parts": len(gathered.order), "rows": gathered.table.num_rows}).encode())
        summary.key, summary.nbytes, summary.written = f"{CHECKPOINT_DIR}/{digest}", len(parts_raw) + len(rows_raw), True
    summary.pruned = _prune(storage, summary.key, keep, everything=rebuild)
    return summary


def _parquet_bytes(table: pa.Table, metadata: dict[bytes, bytes]) -> bytes:
    # In the footer's key/value metadata only: as schema metadata pyarrow would store it twice.
    sink = io.BytesIO()
    with pq.ParquetWriter(sink, table.schema) as writer:
        writer.write_table(table)
        if metadata:
            writer.add_key_value_metadata(metadata)
    return sink.getvalue()


def _prune(storage: Storage, current: str, keep: int, everything: bool = False) -> list[str]:
    """Delete checkpoints less complete than ``current`` beyond the ``keep`` newest, and any whose
    objects are damaged or gone. Marker first: a reader that listed it and then finds the objects
    gone takes the next checkpoint, or reads the parts."""
    found = markers(list_index(storage))
    mine = next((m for m in found if f"{CHECKPOINT_DIR}/{m[1]}" == current), None)
    pruned, kept = [], 0
    for parts, digest, marker in found:
        key = f"{CHECKPOINT_DIR}/{digest}"
        if key == current:
            kept += 1
            continue
        healthy = not everything and _healthy(storage, digest, marker)
        if healthy and (kept < keep or (mine is not None and parts >= mine[0])):
            kept += 1
            continue  # a recent one readers may have listed, or a concurrent compactor's
        storage.delete(f"{fmt.INDEX_DIR}/{marker}")
        for obj in checkpoint_keys(digest):
            storage.delete(obj)
        pruned.append(key)
    return pruned


def _healthy(storage: Storage, digest: str, marker: str) -> bool:
    try:
        read_checkpoint(storage, digest, marker)
    except FormatVersionError:
        return True  # a newer mmcache's: not ours to judge
    except (FileNotFoundError, CorruptionError):
        return False
    return True


def uncovered_parts(listing: dict[str, str]) -> int:
    """Index parts in a listing beyond what its most complete checkpoint covers (by the count
    in the marker's name: nothing is read)."""
    parts = sum(1 for name in listing if fmt.parse_index_part_name(name) is not None)
    found = markers(listing)
    return parts - (found[0][0] if found else 0)


def after_commit(store: Store, shard: str, every: int, commits: int) -> None:
    """Called by a writer after its ``commits``-th commit. Every ``every``-th commit of a writer,
    and any commit whose shard name hashes to 0 modulo ``every`` (so that writers of one shard
    each, like encode tasks, take part without coordination), lists the index and compacts it
    when at least ``every`` parts are not covered by a checkpoint. The commit has happened
    whatever this does: a failure here is a warning."""
    if every <= 0 or (commits % every and fmt.crc32c(shard.encode()) % every):
        return
    try:
        if uncovered_parts(list_index(store.storage)) >= every:
            compact_store(store.storage)
    except (FeatstoreError, OSError) as exc:
        warnings.warn(f"{store.url}: automatic index compaction after shard {shard!r} failed ({exc}); the shard is committed, "
                      f"and `mmcache compact {store.url}` can be run at any time", CheckpointWarning, stacklevel=3)
