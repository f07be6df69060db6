"""Opening and reading a feature store.

``Store`` takes one snapshot of the committed shards when it opens (the index parts listed then)
and serves every read from it, so a reader of a store that is still growing sees one consistent
set of shards. A sample read is, per field, one ranged read computed from the zarr shard index
(``os.preadv`` locally, ``cat_ranges`` on fsspec), checked against the CRC-32C in the index.
"""

from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from featstore import format as fmt
from featstore import manifest as manifests

# Arrow's thread pools can abort the interpreter at exit (apache/arrow#34314); index parts are
# small, so every Parquet read and write here is single-threaded.
from featstore.errors import CorruptionError, MissingFieldError, NotAStoreError, ReadOnlyError, SchemaError
from featstore.snapshot import ShardInfo, load_snapshot
from featstore.storage import Storage, open_storage
from featstore.tensors import in_format


class Store:
    """A feature store opened for reading (``mode="r"``) or for adding shards (``mode="a"``)."""

    def __init__(self, storage: Storage, manifest: dict[str, Any], *, mode: str = "r", verify_reads: bool = True, strict: bool = True, load_index: bool = True, shards: Sequence[str] | None = None) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
        self.storage = storage
        self.url = storage.url
        self.mode = mode
        self.verify_reads = verify_reads
        # strict: a damaged index part makes open fail (fail closed); otherwise it is left out
        # and listed in ``damaged`` (what `mmcache verify` wants).
        self.strict = strict
        self.damaged: dict[str, str] = {}
        # Changes declared by writers but not yet folded into zarr.json are in effect already.
        self._manifest = manifests.merged(storage, manifest)
        self._lock = threading.Lock()
        self._chunk_index: dict[tuple[str, str], np.ndarray] = {}
        # load_index=False: a writer that only adds shards (an encode task) need not read every
        # index part of a large store first; its snapshot is then empty.
        # shards: open exactly this snapshot (say, the one a run started with) rather than
        # whatever is committed now; a listed shard that is gone is an error.
        self._load_index(list_parts=load_index, only=shards)

    # ---- schema -------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        return int(self._manifest["format_version"])

    @property
    def fields(self) -> dict[str, fmt.FieldSpec]:
        # Cached: every add() and read asks for it. fix_ndims replaces the manifest and the cache.
        cached = self.__dict__.get("_fields")
        if cached is None or cached[0] is not self._manifest:
            cached = (self._manifest, {name: fmt.FieldSpec.from_value(name, value) for name, value in self._manifest["fields"].items()})
            self._fields = cached
        return cached[1]

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self._manifest.get("attrs") or {})

    def field_ndim(self, name: str) -> int | None:
        return self._manifest["fields"][name].get("ndim")

    def fix_ndims(self, ndims: dict[str, int]) -> None:
        """Record the ndim of fields declared without one, from the first committed sample."""
        unset = {f: n for f, n in ndims.items() if self._manifest["fields"][f].get("ndim") is None}
        if not unset:
            return
        current = self.storage_manifest()
        for name, ndim in unset.items():
            known = current["fields"][name].get("ndim")
            if known is not None and known != ndim:
                raise SchemaError(f"field {name!r}: {ndim} dimensions, but the store already holds {known}")
            manifests.declare_ndim(self.storage, name, ndim)
        self._set_manifest(manifests.publish(self.storage))

    def storage_manifest(self) -> dict[str, Any]:
        """The manifest in effect now (``zarr.json`` with every declaration merged)."""
        return manifests.merged(self.storage, fmt.parse_root_group(self.storage.read(fmt.MANIFEST_KEY), self.url))

    def add_fields(self, fields: dict[str, Any]) -> None:
        """Declare new fields in an existing store (same form as ``create``'s ``fields``). The
        samples already committed keep what they have; shards written with
        ``writer(fields=[...])`` then add the new fields to them, under the same ids. Safe from
        many processes at once (featstore.manifest): no addition can lose another."""
        if self.mode != "a":
            raise ReadOnlyError(f"{self.url} is opened read-only; open it with mode='a' to add fields")
        specs = {name: fmt.FieldSpec.from_value(name, value) for name, value in fields.items()}
        current = self.storage_manifest()
        if clash := sorted(set(specs) & set(current["fields"])):
            raise SchemaError(f"{self.url} already has field(s) {clash}; give the new features other names")
        if not specs:
            return
        for name, spec in specs.items():
            manifests.declare_field(self.storage, name, spec.to_dict())
        self._set_manifest(manifests.publish(self.storage))

    def require_format_version(self, version: int) -> None:
        """Raise the manifest's format version to at least ``version`` (never lowers it)."""
        if self.format_version >= version:
            return
        manifests.declare(self.storage, "version", str(version), {})
        self._set_manifest(manifests.publish(self.storage))

    def _set_manifest(self, manifest: dict[str, Any]) -> None:
        self._manifest = manifest
        # The snapshot's per-field tables gain the new fields, which no committed sample has yet.
        rows = len(self._ids)
        for name in manifest["fields"]:
            if name not in self._holder:
                self._offsets[name] = np.zeros(rows, dtype=np.int64)
                self._shapes[name] = [()] * rows
                self._crcs[name] = np.zeros(rows, dtype=np.uint32)
                self._holder[name] = np.full(rows, -1, dtype=np.int64)
                self._dense = self._dense and rows == 0

    # ---- index --------------------------------------------------------------------------
    def _load_index(self, list_parts: bool = True, only: Sequence[str] | None = None) -> None:
        snap = load_snapshot(self.storage, list(self.fields), strict=self.strict, list_parts=list_parts, only=only)
        self.damaged.update(snap.damaged)
        # The index checkpoint the snapshot used (featstore.compact), and how many parts it covered.
        self.checkpoint, self.checkpoint_covered = snap.checkpoint, snap.covered
        self.shards: dict[str, ShardInfo] = snap.shards
        # Committed objects never change: a caching layer may key its entries on their checksums.
        # (Asked only of a storage that listens: a checkpoint's records are decoded when first used.)
        if type(self.storage).known_objects is not Storage.known_objects:
            self.storage.known_objects({key: obj for info in snap.shards.values() for key, obj in info.objects.items()})
        self.index: pa.Table = snap.index
        self._ids, self._shard_of, self._shard_rows = snap.ids, snap.shard_of, snap.shard_rows
        self._offsets, self._shapes, self._crcs = snap.offsets, snap.shapes, snap.crcs
        self._row_of, self._holder, self._dense = snap.row_of, snap.holder, snap.dense
        # (sample id, field, shard) rows ignored because an earlier commit holds them.
        self.duplicates: list[tuple[str, str, str]] = snap.duplicates
        self._written: dict[str, set[str]] = {}
        self._rechecked: set[str] = set()

    def assume_checked(self, shards: Sequence[str]) -> None:
        """Tell a writer's store (opened without its index) which shards its producer already
        planned around, so ``refresh_committed`` need not read them."""
        self._rechecked.update(shards)

    def refresh_committed(self) -> None:
        """Read the index parts committed since this snapshot (and not read by an earlier call)
        and note their samples, so that a writer's duplicate checks see them. Only a shard's ids
        and fields are kept: the read snapshot itself does not change."""
        from featstore.snapshot import parse_index_part

        for entry in self.storage.list_dir(fmt.INDEX_DIR):
            parsed = fmt.parse_index_part_name(entry)
            if parsed is None or parsed[0] in self.shards or parsed[0] in self._rechecked:
                continue
            key = f"{fmt.INDEX_DIR}/{entry}"
            table, info = parse_index_part(self.storage.read(key), parsed[0], key, self.url, parsed[1])
            self.note_committed(info.name, table.column("id").to_pylist(), list(info.layouts))
            self._rechecked.add(info.name)

    def note_committed(self, shard: str, sample_ids: list[str], fields: Sequence[str] | None = None) -> None:
        """Called by a writer of this store after a commit, so its duplicate checks see new ids.
        The read snapshot itself does not change: reopen the store to read new shards."""
        for field in fields or self.fields:
            self._written.setdefault(field, set()).update(sample_ids)

    def is_known(self, sample_id: str, fields: Sequence[str] | None = None) -> bool:
        """True when the sample already has any of ``fields`` (default: any field)."""
        return any(self.has_field(sample_id, f) or sample_id in self._written.get(f, ()) for f in fields or self.fields)

    def has_field(self, sample_id: str, field: str) -> bool:
        row = self._row_of.get(sample_id)
        return row is not None and field in self._holder and self._holder[field][row] >= 0

    def fields_of(self, sample_id: str) -> list[str]:
        """The fields this sample has in the snapshot (all of the store's, unless fields were
        added to the store after the sample was written)."""
        row = self.row(sample_id)
        return [f for f in self.fields if self._holder[f][row] >= 0]

    def samples_per_field(self) -> dict[str, int]:
        rows = np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))
        return {f: int((self._holder[f][rows] >= 0).sum()) for f in self.fields}

    def sample_ids(self, with_fields: Sequence[str] | None = None) -> list[str]:
        """Committed sample ids of this snapshot, in shard order; with ``with_fields``, only the
        samples that have all of those fields."""
        if not with_fields:
            return list(self._row_of)
        rows = np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))
        keep = np.ones(len(rows), dtype=bool)
        for field in with_fields:
            if field not in self.fields:
                raise SchemaError(f"{self.url} has no field {field!r} (fields: {sorted(self.fields)})")
            keep &= self._holder[field][rows] >= 0
        return [self._ids[r] for r in rows[keep]]

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._row_of

    def has_shard(self, name: str) -> bool:
        """True when shard ``name`` is committed (checked against storage, not the snapshot)."""
        if name in self.shards:
            return True
        return any((parsed := fmt.parse_index_part_name(entry)) and parsed[0] == name for entry in self.storage.list_names(fmt.INDEX_DIR, f"{name}."))

    @property
    def rejects(self) -> pa.Table:
        tables = [
            pq.read_table(io.BytesIO(self.storage.read(info.rejects_key)), use_threads=False)
            for info in self.shards.values()
            if info.num_rejected
        ]
        if not tables:
            return pa.table({"source": pa.array([], pa.string()), "reason": pa.array([], pa.string())})
        return pa.concat_tables(tables, promote_options="permissive")

    def num_rejected(self) -> int:
        return sum(info.num_rejected for info in self.shards.values())

    def nbytes(self) -> int:
        return sum(o["nbytes"] for info in self.shards.values() for o in info.objects.values()) + sum(i.index_nbytes for i in self.shards.values())

    # ---- reading ------------------------------------------------------------------------
    def row(self, sample_id: str) -> int:
        row = self._row_of.get(sample_id)
        if row is None:
            raise KeyError(f"sample {sample_id!r} is not in {self.url}")
        return row

    def shape(self, sample_id: str, field: str) -> tuple[int, ...]:
        return self._shapes[field][self._holder_row(self.row(sample_id), field)]

    def _holder_row(self, row: int, field: str) -> int:
        """The index row holding ``field`` of the sample whose row is ``row``."""
        if field not in self.fields:
            raise SchemaError(f"{self.url} has no field {field!r} (fields: {sorted(self.fields)})")
        held = int(self._holder[field][row])
        if held < 0:
            raise MissingFieldError(
                f"sample {self._ids[row]!r} of {self.url} has no {field!r} yet (it has {[f for f in self.fields if self._holder[f][row] >= 0]}); "
                "encode that field for it, or read only the samples that have it (sample_ids(with_fields=...))"
            )
        return held

    def _fields_to_read(self, row: int, fields: Sequence[str] | None) -> Sequence[str]:
        if fields:
            return fields
        return [f for f in self.fields if self._holder[f][row] >= 0]

    def read(self, sample_id: str, fields: Sequence[str] | None = None, *, format: str = "numpy") -> dict[str, Any]:
        """One sample, exactly as written (dtype and shape); ``format="torch"`` gives tensors
        sharing the read buffers (bfloat16 stays bfloat16)."""
        return in_format(self.read_row(self.row(sample_id), fields), format)

    def read_row(self, row: int, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The sample whose row is ``row``: ``fields``, or every field it has."""
        specs = self.fields
        out = {}
        first = row
        for name in self._fields_to_read(first, fields):
            row = self._holder_row(first, name)
            spec = specs[name]
            shard = self._shard_of[row]
            shape = self._shapes[name][row]
            array = np.empty(shape, dtype=spec.numpy_dtype)
            count = array.size
            if count:
                ranges = self._ranges(shard, spec, int(self._offsets[name][row]), count)
                self.storage.read_ranges(self.shards[shard].data_key(name), ranges, array.reshape(-1).view(np.uint8))
            if self.verify_reads and fmt.crc32c(array) != int(self._crcs[name][row]):
                raise CorruptionError(f"{self.url}: sample {self._ids[row]!r} field {name!r} in shard {shard!r} fails its checksum")
            out[name] = array
        return out

    def read_rows(self, rows: Sequence[int], fields: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
        """Many samples in one batched read: on an object store every byte range of every sample
        is requested concurrently, instead of one request after another. (On local disk it is
        ``read_row`` per sample: there a call costs microseconds and nothing is gained.)"""
        if not self.storage.is_remote:
            return [self.read_row(row, fields) for row in rows]
        specs = self.fields
        # (sample, field) -> the index row holding it
        held = [{name: self._holder_row(row, name) for name in self._fields_to_read(row, fields)} for row in rows]
        self._load_chunk_indexes({(self._shard_of[r], name) for sample in held for name, r in sample.items()})
        requests, samples = [], []
        for sample_rows in held:
            sample = {}
            for name, row in sample_rows.items():
                spec = specs[name]
                shard = self._shard_of[row]
                array = np.empty(self._shapes[name][row], dtype=spec.numpy_dtype)
                if array.size:
                    ranges = self._ranges(shard, spec, int(self._offsets[name][row]), array.size)
                    requests.append((self.shards[shard].data_key(name), ranges, array.reshape(-1).view(np.uint8)))
                sample[name] = array
            samples.append(sample)
        self.storage.read_into(requests)
        if self.verify_reads:
            for sample_rows, sample in zip(held, samples, strict=True):
                for name, array in sample.items():
                    row = sample_rows[name]
                    if fmt.crc32c(array) != int(self._crcs[name][row]):
                        raise CorruptionError(f"{self.url}: sample {self._ids[row]!r} field {name!r} in shard {self._shard_of[row]!r} fails its checksum")
        return samples

    def iter_shard(self, shard: str, fields: Sequence[str] | None = None) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """Every sample of one shard with the shard's fields (or ``fields``, which it must hold),
        from one large read per field (the fast full-scan path)."""
        held = self.shards[shard].layouts
        if fields and self.shards[shard].num_samples and (absent := [f for f in fields if f not in held]):
            raise SchemaError(f"{self.url}: shard {shard!r} holds {sorted(held)}, not {absent}")
        return self._samples_of(shard, self._read_shard(shard, fields), whole=False)

    def _read_shard(self, shard: str, fields: Sequence[str] | None) -> dict[str, np.ndarray]:
        """Each field's whole element run of ``shard``, flat, in one read per field (the fields
        the shard holds, of ``fields`` if given)."""
        specs = self.fields
        layouts = self.shards[shard].layouts
        buffers = {}
        for name in fields or specs:
            if name not in layouts:
                continue
            spec = specs[name]
            buf = np.empty(layouts[name].elements * np.dtype(spec.zarr_dtype).itemsize, dtype=np.uint8)
            if buf.size:
                self.storage.read_ranges(self.shards[shard].data_key(name), self._ranges(shard, spec, 0, layouts[name].elements), buf)
            buffers[name] = buf.view(spec.numpy_dtype)
        return buffers

    def _samples_of(self, shard: str, buffers: dict[str, np.ndarray], *, whole: bool, fields: Sequence[str] | None = None) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """The samples of ``shard`` from its field buffers. ``whole``: only samples whose first
        row is here, with ``fields`` (default: all they have); fields held by other shards (added
        to the store later) are read sample by sample."""
        rows = self._shard_rows[shard]
        # Per-field columns of this shard as plain lists: the loop below runs once per sample.
        columns = {
            name: (flat, self._shapes[name][rows.start : rows.stop], self._offsets[name][rows.start : rows.stop].tolist(), self._crcs[name][rows.start : rows.stop].tolist())
            for name, flat in buffers.items()
        }
        # A dense store's shard has every field of every sample it lists: nothing to join.
        whole = whole and not (self._dense and all(f in buffers for f in fields or self.fields))
        elsewhere: dict[int, dict[str, np.ndarray]] = {}
        if whole:
            # Fields of this shard's samples that other shards hold: one batched read per field set.
            wanted: dict[tuple[str, ...], list[int]] = {}
            for row in rows:
                if self._row_of[self._ids[row]] == row:
                    names = tuple(f for f in self._fields_to_read(row, fields) if f not in buffers)
                    if names:
                        wanted.setdefault(names, []).append(row)
            for names, group in wanted.items():
                elsewhere.update(zip(group, self.read_rows(group, list(names)), strict=True))
        for i, row in enumerate(rows):
            sample_id = self._ids[row]
            if whole and self._row_of[sample_id] != row:
                continue  # this row adds fields to a sample listed earlier: yielded there
            sample = {}
            for name, (flat, shapes, offsets, crcs) in columns.items():
                shape, start = shapes[i], offsets[i]
                array = flat[start : start + math.prod(shape)].reshape(shape)
                if self.verify_reads and fmt.crc32c(array) != crcs[i]:
                    raise CorruptionError(f"{self.url}: sample {sample_id!r} field {name!r} in shard {shard!r} fails its checksum")
                sample[name] = array
            sample.update(elsewhere.get(row, {}))
            yield sample_id, sample

    def scan(self, fields: Sequence[str] | None = None, readahead: int = 1) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """Every sample once, shard by shard, with ``fields`` (default: every field it has). The
        next ``readahead`` shards' bytes are read on a background thread (I/O releases the GIL)
        while this thread checks and hands out the current one; memory is bounded by
        ``readahead + 1`` shards. 0 reads in this thread."""
        names = list(self.shards)
        if readahead <= 0 or len(names) < 2:
            for shard in names:
                yield from self._samples_of(shard, self._read_shard(shard, fields), whole=True, fields=fields)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="featstore-readahead") as pool:
            ahead = [pool.submit(self._read_shard, s, fields) for s in names[:readahead]]
            try:
                for i, shard in enumerate(names):
                    buffers = ahead.pop(0).result()
                    if i + readahead < len(names):
                        ahead.append(pool.submit(self._read_shard, names[i + readahead], fields))
                    yield from self._samples_of(shard, buffers, whole=True, fields=fields)
            finally:
                for future in ahead:
                    future.cancel()

    def _ranges(self, shard: str, spec: fmt.FieldSpec, start: int, count: int) -> list[tuple[int, int]]:
        layout = self.shards[shard].layouts[spec.name]
        itemsize = np.dtype(spec.zarr_dtype).itemsize
        if start + count > layout.elements:
            raise CorruptionError(f"{self.url}: shard {shard!r} field {spec.name!r}: index points past the end of the data")
        return fmt.byte_ranges(self._shard_chunks(shard, spec.name), layout, start, count, itemsize)

    def _load_chunk_indexes(self, pairs: set[tuple[str, str]]) -> None:
        """Fetch the shard indexes of many (shard, field) pairs in one batched read."""
        missing = sorted(p for p in pairs if p not in self._chunk_index)
        if len(missing) < 2:
            for shard, field in missing:
                self._shard_chunks(shard, field)
            return
        requests = []
        for shard, field in missing:
            info = self.shards[shard]
            data_key = self.shards[shard].data_key(field)
            size = info.objects[data_key]["nbytes"]
            tail = np.empty(fmt.index_nbytes(info.layouts[field].num_chunks), dtype=np.uint8)
            requests.append((data_key, [(size - tail.size, size)], tail))
        self.storage.read_into(requests)
        for (shard, field), (data_key, _, tail) in zip(missing, requests, strict=True):
            chunks = fmt.parse_shard_index(tail.tobytes(), self.shards[shard].layouts[field].num_chunks, f"{self.url}/{data_key}")
            with self._lock:
                self._chunk_index[(shard, field)] = chunks

    def _shard_chunks(self, shard: str, field: str) -> np.ndarray:
        key = (shard, field)
        chunks = self._chunk_index.get(key)
        if chunks is None:
            info = self.shards[shard]
            layout = info.layouts[field]
            data_key = self.shards[shard].data_key(field)
            size = info.objects[data_key]["nbytes"]
            tail_len = fmt.index_nbytes(layout.num_chunks)
            tail = self.storage.read_range(data_key, size - tail_len, size)
            chunks = fmt.parse_shard_index(tail, layout.num_chunks, f"{self.url}/{data_key}")
            with self._lock:
                self._chunk_index[key] = chunks
        return chunks

    # ---- writing ------------------------------------------------------------------------
    def writer(self, **kwargs: Any):
        """A ``StoreWriter`` adding shards to this store (needs ``mode="a"``)."""
        if self.mode != "a":
            raise ReadOnlyError(f"{self.url} is opened read-only; open it with mode='a' (or featstore.append) to add samples")
        from featstore.writer import StoreWriter

        return StoreWriter(self, **kwargs)

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, samples={len(self)}, shards={len(self.shards)}, fields={list(self.fields)})"


def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, mode: str = "r", verify_reads: bool = True, strict: bool = True, load_index: bool = True,
               cache_dir: str | os.PathLike[str] | None = None, cache_bytes: int | None = None, shards: Sequence[str] | None = None) -> Store:
    storage = open_storage(url, storage_options)
    if cache_dir is not None and storage.is_remote:
        from featstore.cache import CachingStorage

        storage = CachingStorage(storage, cache_dir, cache_bytes)
    try:
        raw = storage.read(fmt.MANIFEST_KEY)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        storage.close()
        raise NotAStoreError(f"{storage.url} is not an mmcache feature store (no {fmt.MANIFEST_KEY}); create one with `mmcache encode` or featstore.create()") from None
    return Store(storage, fmt.parse_root_group(raw, storage.url), mode=mode, verify_reads=verify_reads, strict=strict, load_index=load_index, shards=shards)


def create_store(
    url: str | os.PathLike[str],
    fields: dict[str, Any],
    *,
    storage_options: dict[str, Any] | None = None,
    attrs: dict[str, Any] | None = None,
    exist_ok: bool = False,
) -> Store:
    """Create a store (or, with ``exist_ok``, open an existing one with the same fields)."""
    if not fields:
        raise SchemaError("a store needs at least one field")
    specs = {name: fmt.FieldSpec.from_value(name, value) for name, value in fields.items()}
    storage = open_storage(url, storage_options)
    if storage.exists(fmt.MANIFEST_KEY):
        store = Store(storage, fmt.parse_root_group(storage.read(fmt.MANIFEST_KEY), storage.url), mode="a")
        if not exist_ok:
            raise SchemaError(f"{storage.url} already holds a feature store; open it with featstore.append() to add to it")
        _check_same_fields(store, specs)
        return store
    if not storage.is_empty():
        raise NotAStoreError(f"{storage.url} exists and is not empty, and is not a feature store; choose a new location")
    manifest = fmt.make_manifest(specs, dict(attrs or {}))
    # The shards group first, the root group (which makes it a store) last.
    storage.write_atomic(f"{fmt.SHARDS_DIR}/zarr.json", fmt.group_json())
    storage.write_atomic(fmt.MANIFEST_KEY, fmt.root_group_json(manifest))
    return Store(storage, manifest, mode="a")


def _check_same_fields(store: Store, specs: dict[str, fmt.FieldSpec]) -> None:
    have = {n: s.dtype for n, s in store.fields.items()}
    want = {n: s.dtype for n, s in specs.items()}
    if have != want:
        raise SchemaError(f"{store.url} holds fields {have}, not {want}")
