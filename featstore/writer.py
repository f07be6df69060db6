"""Writing a feature store: samples are buffered into a shard, and each shard is committed
atomically — data objects first, the Parquet index part last. A reader lists index parts only,
so a writer killed at any moment leaves every committed shard intact and its own shard invisible.
Any number of writers may add shards to one store at the same time, even with overlapping
samples or the same shard names: see "Commit protocol" in docs/FORMAT.md for why nothing is lost
or duplicated.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from . import checksums
from . import compact
from . import format as fmt
from .compact import DEFAULT_COMPACT_EVERY
from .errors import DuplicateSampleError, NonFiniteError, SchemaError, ShardCommittedError
from .index import parquet_bytes
from .storage import Storage
from .tensors import as_array

# ``store`` below is an ``AppendableStore`` (featstore.appendable: its fields, storage and the ids
# committed so far). It is not imported: that module imports this one (``AppendableStore.writer``),
# and dependencies here run one way.
Store = Any

DEFAULT_SHARD_BYTES = 256 << 20


@dataclass(frozen=True, kw_only=True)
class Rewrite:
    """A commit that rewrites committed shards (a data compaction, featstore.rewrite). Its rows
    are copies of theirs by design, so none is left out as committed elsewhere; its record names
    them (``replaces``) and takes the earliest one's commit time, hence its place in snapshot order."""

    replaces: tuple[str, ...]
    committed_at: float


@dataclass
class _Pending:
    sample_id: str
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


class StoreWriter:
    """Adds samples to a store. Use as a context manager, or call ``close()`` to commit.

    Shards are committed automatically once they hold ``shard_bytes`` of data, named
    ``<prefix>-<n>``; a producer that needs deterministic shard names (so a re-run can skip
    what is done) calls ``commit(name)`` itself.
    """

    def __init__(self, store: Store, *, shard_bytes: int = DEFAULT_SHARD_BYTES, shard_prefix: str | None = None, fields: list[str] | None = None,
                 compact_every: int = DEFAULT_COMPACT_EVERY, allow_nonfinite: bool | Collection[str] = False, checkpoint_at_close: bool = True) -> None:
        self._store = store
        self._storage: Storage = store.storage
        # fields: the store's fields this writer's shards hold (default all). A subset adds fields
        # to samples written earlier (see Store.add_fields), under the same ids.
        if fields is not None and (unknown := sorted(set(fields) - set(store.fields))):
            raise SchemaError(f"{store.url} has no field(s) {unknown} (fields: {sorted(store.fields)}); declare them with Store.add_fields")
        if fields is not None and not fields:
            raise SchemaError("a writer needs at least one field")
        self.fields = [f for f in store.fields if fields is None or f in fields]
        self.shard_bytes = shard_bytes
        # Index checkpoints (featstore.compact) once this many commits are not covered; 0: never.
        self.compact_every = compact_every
        # And one at close, where cheap (featstore.compact.compact_at_close), so that what this
        # writer leaves opens from it; off for writers of one shard among many (an encode's
        # tasks: the job checkpoints at its end).
        self.checkpoint_at_close = checkpoint_at_close and compact_every > 0
        # Float fields that may hold NaN or infinity (True: all); others refuse such a sample.
        self.allow_nonfinite = set(self.fields) if allow_nonfinite is True else set(allow_nonfinite or ())
        self.shard_prefix = fmt.check_name("shard prefix", shard_prefix or uuid.uuid4().hex[:12])
        self._seq = 0
        self._pending: list[_Pending] = []
        self._pending_ids: set[str] = set()
        self._pending_bytes = 0
        self._rejects: list[dict[str, Any]] = []
        self._closed = False
        self.committed: list[str] = []
        self.dropped: list[str] = []  # ids left out because another writer committed them first

    @property
    def store(self) -> Store:
        return self._store

    @property
    def pending_bytes(self) -> int:
        """Bytes of the samples added and not committed yet."""
        return self._pending_bytes

    # ---- adding -------------------------------------------------------------------------
    def add(self, sample_id: str, arrays: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        self._check_open()
        fmt.check_name("sample id", sample_id)
        if sample_id in self._pending_ids or self._store.is_known(sample_id, self.fields):
            what = "" if len(self.fields) == len(self._store.fields) else f" with field(s) {self.fields}"
            raise DuplicateSampleError(f"sample id {sample_id!r} is already in the store{what} or in this shard")
        fields = self._store.fields
        missing = sorted(set(self.fields) - set(arrays))
        extra = sorted(set(arrays) - set(self.fields))
        if missing or extra:
            raise SchemaError(
                f"sample {sample_id!r}: "
                + "; ".join(filter(None, [missing and f"missing field(s) {missing}", extra and f"unknown field(s) {extra}"]))
                + f" (this writer's fields: {sorted(self.fields)})"
            )
        checked = {name: self._check_array(sample_id, fields[name], value) for name, value in arrays.items()}
        meta = dict(meta or {})
        for key in meta:
            if key in fmt.RESERVED_COLUMNS or not isinstance(key, str) or "." in key:
                raise SchemaError(f"sample {sample_id!r}: meta key {key!r} is reserved or contains '.'")
        self._pending.append(_Pending(sample_id, checked, meta))
        self._pending_ids.add(sample_id)
        self._pending_bytes += sum(a.nbytes for a in checked.values())
        if self._pending_bytes >= self.shard_bytes:
            self.commit()

    def reject(self, source: str, reason: str, **meta: Any) -> None:
        """Record an input that could not be turned into a sample; committed with the next shard."""
        self._check_open()
        self._rejects.append({"source": str(source), "reason": str(reason), **meta})

    def _check_array(self, sample_id: str, spec: fmt.FieldSpec, value: Any) -> np.ndarray:
        array = as_array(value)
        if array.dtype != spec.numpy_dtype:
            raise SchemaError(
                f"sample {sample_id!r} field {spec.name!r}: dtype {array.dtype} but the store holds "
                f"{spec.dtype}; convert it first (the store never casts silently)"
            )
        ndim = self._store.field_ndim(spec.name)
        if ndim is None and self._pending:  # not fixed yet: this shard's first sample decides
            ndim = self._pending[0].arrays[spec.name].ndim
        if ndim is not None and array.ndim != ndim:
            raise SchemaError(
                f"sample {sample_id!r} field {spec.name!r}: {array.ndim} dimensions {array.shape}, expected {ndim}"
            )
        array = np.ascontiguousarray(array)
        if spec.name not in self.allow_nonfinite and not fmt.all_finite(array, spec.dtype):
            raise NonFiniteError(f"sample {sample_id!r} field {spec.name!r} holds NaN or infinity; not written "
                                 "(StoreWriter(allow_nonfinite=[...]) for a field whose values mean it)")
        return array

    # ---- committing ---------------------------------------------------------------------
    def commit(self, name: str | None = None, *, rewrite: Rewrite | None = None) -> str | None:
        """Write the pending samples (and rejects) as one shard. Returns its name, or None when
        there was nothing to commit and no name was asked for.

        Samples that another writer committed (with any of this writer's fields) since this
        store's snapshot are left out (listed in ``dropped``). If another writer commits a
        shard of the same ``name`` first, this one's objects are deleted and
        ``ShardCommittedError`` says so; nothing of the other writer's is touched. On an object
        store a commit is three round trips: the data objects at once, one listing, the index part."""
        self._check_open()
        if not self._pending and not self._rejects and name is None:
            return None
        chosen = name is not None
        if name is None:
            name = f"{self.shard_prefix}-{self._seq:06d}"  # unique to this writer: no check needed
            self._seq += 1
        else:
            fmt.check_shard_name(name)
            if name in self._store.shards:
                raise ShardCommittedError(f"shard {name!r} is already committed in {self._store.url}")
        # Samples this writer already knows to be committed elsewhere (its snapshot, its own
        # earlier commits) are left out before anything is written; no request is needed for it.
        if rewrite is None:
            self._drop_committed_elsewhere()
        self._store.fix_ndims({f: a.ndim for f, a in self._pending[0].arrays.items()} if self._pending else {})
        self._store.require_format_version(fmt.EXCLUSIVE_COMMIT_VERSION)
        # Every object but the index part goes under a name unique to this writer and try, so
        # two writers of one shard name (a retried task and its zombie, two runs of one plan)
        # never write the same object; the commit record names the directory.
        root = fmt.data_root(name, uuid.uuid4().hex[:8])
        objects: dict[str, dict[str, int]] = {}
        # A failure (or a kill) from here on leaves objects that no index part names: readers
        # never see them, and `mmcache verify` lists them as leftovers.
        table, commit_info = self._write_objects(name, root, objects)
        # The check, once the (slow) data writes are done, so that only a commit in the moment
        # between this listing and the commit point can still overlap this shard: one listing of
        # index/ tells whether the name is taken and what was committed since the snapshot.
        # (Checking before the data writes too would cost every commit a round trip, to save
        # only a losing writer's uploads.)
        if rewrite is None and (chosen or table.num_rows):
            committed = self._store.refresh_committed()
            if chosen and name in committed:
                self._clear_pending()
                self._discard(objects)
                discarded = "; this writer's copy was discarded" if objects else ""
                raise ShardCommittedError(f"shard {name!r} is already committed in {self._store.url}{discarded}")
        if rewrite is None:
            table, commit_info = self._without_committed_elsewhere(table, commit_info)
        # Readers resolve a (sample id, field) that racing writers both committed by the
        # earliest commit, then the shard name: deterministic for every reader of the same shards.
        stamp = {"committed_at": time.time()} if rewrite is None else {"committed_at": rewrite.committed_at, "replaces": list(rewrite.replaces), "rewritten_at": time.time()}
        if table.num_rows:  # what epoch orders visit shards by (ShardInfo.first_id)
            stamp["first_id"] = table.column("id")[0].as_py()
        part = index_part_bytes(table, {**commit_info, **stamp})
        # The commit point: until this object exists the shard is invisible to every reader; it
        # is created only if absent, so of two writers of one shard name exactly one commits.
        won = self._storage.write_new(fmt.index_part_key(name), part)
        ids = table.column("id").to_pylist()
        self._clear_pending()
        if not won:
            self._discard(objects)
            raise ShardCommittedError(
                f"shard {name!r} of {self._store.url} was committed by another writer while this one wrote it; "
                "this writer's copy was discarded and the other's kept"
            )
        self._store.note_committed(name, ids, self.fields)
        self.committed.append(name)
        compact.after_commit(self._store.storage, name, self.compact_every, len(self.committed))
        return name

    def _drop_committed_elsewhere(self) -> None:
        """Drop pending samples that already have one of this writer's fields in a shard this
        writer knows of (its snapshot, shards re-read by earlier checks, its own commits)."""
        if not self._pending:
            return
        keep = [p for p in self._pending if not self._store.is_known(p.sample_id, self.fields)]
        if len(keep) < len(self._pending):
            self.dropped.extend(p.sample_id for p in self._pending if p not in keep)
            self._pending, self._pending_ids = keep, {p.sample_id for p in keep}
            self._pending_bytes = sum(a.nbytes for p in keep for a in p.arrays.values())

    def _without_committed_elsewhere(self, table: pa.Table, commit_info: dict[str, Any]) -> tuple[pa.Table, dict[str, Any]]:
        """The index rows minus samples another writer committed since the snapshot, as the
        check just before the commit point found them (their bytes stay in this shard's data
        objects, unreferenced)."""
        if not table.num_rows:
            return table, commit_info
        ids = table.column("id").to_pylist()
        gone = {i for i in ids if self._store.is_known(i, self.fields)}
        if not gone:
            return table, commit_info
        self.dropped.extend(i for i in ids if i in gone)
        keep = pa.array([i not in gone for i in ids])
        return table.filter(keep), {**commit_info, "num_samples": len(ids) - len(gone)}

    def _write_objects(self, name: str, root: str, objects: dict[str, dict[str, int]]) -> tuple[pa.Table, dict[str, Any]]:
        """Write the shard's data objects under ``root``; return its index rows and commit record."""
        partial = bool(self._pending) and len(self.fields) < len(self._store.fields)
        field_layouts: dict[str, dict[str, int]] = {}
        columns: dict[str, Any] = {"id": [p.sample_id for p in self._pending]}
        # Every object of the shard, written in one batch (concurrent requests on an object store).
        batch: list[tuple[str, list[Any]]] = []
        if self._pending:
            _add_small(batch, objects, f"{root}/zarr.json", fmt.group_json())
        for fname in self.fields if self._pending else ():
            spec = self._store.fields[fname]
            arrays = [p.arrays[fname] for p in self._pending]
            layout, crc = _add_field(batch, objects, root, spec, arrays)
            field_layouts[fname] = {"elements": layout.elements, "chunk_elements": layout.chunk_elements, "num_chunks": layout.num_chunks}
            counts = np.array([a.size for a in arrays], dtype=np.int64)
            columns[f"{fname}.offset"] = pa.array(np.concatenate([[0], np.cumsum(counts)[:-1]]), pa.int64())
            columns[f"{fname}.shape"] = pa.array([list(a.shape) for a in arrays], pa.list_(pa.int64()))
            columns[f"{fname}.crc32c"] = pa.array(crc, pa.uint32())
        rejects_key = None
        if self._rejects:
            rejects_key = f"{fmt.REJECTS_DIR}/{root.rsplit('/', 1)[-1]}.parquet"
            _add_small(batch, objects, rejects_key, parquet_bytes(pa.Table.from_pylist(self._rejects)))
        for key in sorted({k for p in self._pending for k in p.meta}):
            columns[key] = _meta_column(key, [p.meta.get(key) for p in self._pending])
        table = _table(columns, self.fields if self._pending else [])
        self._storage.write_many(batch)
        commit_info = {
            "format_version": fmt.EXCLUSIVE_COMMIT_VERSION,
            "shard": name,
            "num_samples": len(self._pending),
            "num_rejected": len(self._rejects),
            "fields": field_layouts,
            "partial": partial,
            "data": root,
            "rejects": rejects_key,
            "committed_at": 0.0,  # set just before the commit point
            "objects": objects,
        }
        return table, commit_info

    def _discard(self, objects: dict[str, dict[str, int]]) -> None:
        for key in objects:
            self._storage.delete(key)

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            if self._pending or self._rejects:
                self.commit()
            self._closed = True
            if self.committed and self.checkpoint_at_close:
                compact.compact_at_close(self._storage, "at a writer's close")

    def abort(self) -> None:
        """Drop what is pending; committed shards stay."""
        self._clear_pending()
        self._closed = True

    def _clear_pending(self) -> None:
        self._pending, self._pending_ids, self._pending_bytes, self._rejects = [], set(), 0, []

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # On an exception, commit nothing half-made: what was committed before stays.
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise SchemaError("this writer is closed")


def _add_small(batch: list, objects: dict, key: str, data: bytes) -> None:
    batch.append((key, [data]))
    objects[key] = {"nbytes": len(data), "crc32c": checksums.crc32c(data)}


def _add_field(batch: list, objects: dict, base: str, spec: fmt.FieldSpec, arrays: list[np.ndarray]) -> tuple[fmt.ChunkLayout, list[int]]:
    """A field's two objects (its zarr.json and its one zarr shard object, from the samples'
    buffers without joining them); returns the layout and the per-sample CRC-32Cs."""
    storage_dtype = np.dtype(spec.zarr_dtype)
    views = [a.reshape(-1).view(storage_dtype) for a in arrays]
    layout = fmt.ChunkLayout.for_elements(sum(v.size for v in views), storage_dtype.itemsize)
    _add_small(batch, objects, f"{base}/{spec.name}/zarr.json", fmt.array_json(spec, layout))
    padding, tail = fmt.shard_object_tail(layout, storage_dtype.itemsize)
    crcs = [checksums.crc32c(v) for v in views]
    parts = [v for v in views if v.size] + [bytes(padding), tail]
    key = f"{base}/{spec.name}/c/0"
    batch.append((key, parts))
    objects[key] = {"nbytes": sum(memoryview(p).nbytes for p in parts), "crc32c": _object_crc(views, crcs, [bytes(padding), tail])}
    return layout, crcs


def _object_crc(views: list[np.ndarray], crcs: list[int], tail: list[bytes]) -> int:
    """The whole object's CRC-32C from the per-sample CRCs (no second pass over the data)."""
    return checksums.crc32c_concat([*crcs, *(checksums.crc32c(part) for part in tail)], [v.nbytes for v in views] + [len(p) for p in tail])


def _meta_column(key: str, values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemaError(f"meta key {key!r}: values of mixed types cannot form a column ({exc})") from None


def _table(columns: dict[str, Any], fields: list[str]) -> pa.Table:
    if "id" in columns and not isinstance(columns["id"], pa.Array):
        columns["id"] = pa.array(columns["id"], pa.string())
    if not fields and not columns["id"]:
        return pa.table({"id": pa.array([], pa.string())})
    return pa.table(columns)


def index_part_bytes(table: pa.Table, commit_info: dict[str, Any]) -> bytes:
    """A version-3 index part: the rows, the commit record, and its own CRC-32C (sealed in)."""
    metadata = {fmt.COMMIT_METADATA_KEY: json.dumps(commit_info).encode(), fmt.COMMIT_CRC_METADATA_KEY: fmt.CRC_PLACEHOLDER}
    return fmt.seal_index_part(parquet_bytes(table.replace_schema_metadata(metadata)))


