"""Opening and reading a feature store.

``Store`` takes one snapshot of the committed shards when it opens (the index parts listed then)
and serves every read from it, so a reader of a store that is still growing sees one consistent
set of shards. A sample read is, per field, one byte range computed from the zarr shard index,
checked against the CRC-32C in the index: locally a read-only view of the mapped shard object,
checked in place (no copy at all); elsewhere one ranged read (``cat_ranges`` on fsspec);
a sample is found by id (``read``) or by its position in the snapshot (``read_at``, ``store[i]``).
Full scans read whole blocks of shards instead (featstore.scan).
"""

from __future__ import annotations

import copy
import math
import operator
import os
import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import Any, Literal, TypeVar, overload

import numpy as np
import pyarrow as pa

from mmcache.featstore import format as fmt
from mmcache.featstore import manifest as manifests
from mmcache.featstore.errors import CorruptionError, MissingFieldError, NotAStoreError, ReadOnlyError, SchemaError
from mmcache.featstore.sample import Sample
from mmcache.featstore.scan import DEFAULT_READAHEAD_BYTES, scan_samples
from mmcache.featstore.index import ShardInfo, index_parts, parse_index_part, read_parquet, read_parts
from mmcache.featstore.rows import LoadedRows, ShardRows
from mmcache.featstore.snapshot import dense_samples, gather_parts, snapshot_of
from mmcache.featstore.backends import open_storage
from mmcache.featstore.storage import Storage
from mmcache.featstore.tensors import in_format
from mmcache.featstore.writer import StoreWriter
from mmcache.featstore.cache import CachingStorage

T = TypeVar("T")


class Store:
    """A feature store opened for reading (``mode="r"``) or for adding shards (``mode="a"``)."""

    def __init__(self, storage: Storage, manifest: dict[str, Any], *, mode: str = "r", verify_reads: bool = True, strict: bool = True, load_index: bool = True, shards: Sequence[str] | None = None,
                 merge_declarations: bool = True) -> None:
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
        # Changes declared by writers but not yet folded into zarr.json are in effect already
        # (merge_declarations=False: ``manifest`` is one a Store already merged).
        self._manifest = manifests.merged(storage, manifest) if merge_declarations else manifest
        self._lock = threading.Lock()
        self._scans: weakref.WeakSet[Generator[Any, None, None]] = weakref.WeakSet()  # open scans (see _track)
        self._chunk_index: dict[tuple[str, str], np.ndarray] = {}
        self._rejects: tuple[list[str], pa.Table] | None = None  # (the rejects objects read, their table)
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
    def manifest(self) -> dict[str, Any]:
        """The manifest in effect for this store (``zarr.json`` with the declarations merged), as
        plain JSON: what ``open_store(..., manifest=...)`` takes."""
        return copy.deepcopy(self._manifest)

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
        if "_ids" not in self.__dict__:
            # Nothing per sample built yet: it will be, with the new fields. Whether the store is
            # dense is asked again (a new field that committed samples lack makes it not).
            self.__dict__.pop("_dense", None)
            self.__dict__.pop("_n", None)
            self._loaded.clear()
            return
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
        # The shard table only (featstore.snapshot): per-sample rows load per shard on first use
        # (featstore.rows), or all at once for what needs them all (_per_sample).
        gathered = gather_parts(self.storage, strict=self.strict, list_parts=list_parts, only=only, lazy=True)
        self._gathered = gathered
        self.damaged.update(gathered.damaged)
        # The index checkpoint the snapshot used (featstore.checkpoints), and how many parts it covered.
        self.checkpoint = None if gathered.checkpoint is None else gathered.checkpoint.key
        self.checkpoint_covered = len(gathered.covered)
        self.shards: dict[str, ShardInfo] = {info.name: info for _, info in gathered.order}
        self.replaced = gathered.replaced  # shard -> the data compaction that rewrote it: committed, not read
        # Committed objects never change: a caching layer may key its entries on their checksums
        # (asked only of a storage that listens: a checkpoint's records are decoded when first used).
        if type(self.storage).known_objects is not Storage.known_objects:
            self.storage.known_objects({key: obj for info in self.shards.values() for key, obj in info.objects.items()})
        self._starts = np.cumsum([0] + [info.num_samples for info in self.shards.values()], dtype=np.int64)
        self._shard_rows = {name: range(int(a), int(b)) for name, a, b in zip(self.shards, self._starts[:-1], self._starts[1:])}
        self._loaded = LoadedRows(self._load_shard_rows)
        self._written: dict[str, set[str]] = {}
        self._rechecked: set[str] = set()

    # Per-sample structures, built together on first use (featstore.snapshot.Snapshot): a lookup
    # by id, metadata, scans, copy and verify need them; reads by position of a dense store, len
    # and the shard table do not. They cost ~0.4-0.9 KiB per sample.
    index: pa.Table
    _ids: list[str]
    _shard_of: list[str]
    _offsets: dict[str, np.ndarray]
    _shapes: dict[str, list[tuple[int, ...]]]
    _crcs: dict[str, np.ndarray]
    _row_of: dict[str, int]
    _holder: dict[str, np.ndarray]
    duplicates: list[tuple[str, str, str]]  # (sample id, field, shard) rows ignored because an earlier commit holds them
    _PER_SAMPLE = frozenset(("index", "_ids", "_shard_of", "_offsets", "_shapes", "_crcs", "_row_of", "_holder", "duplicates"))

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes not set yet: the per-sample ones, and _dense / _n.
        if name in Store._PER_SAMPLE:
            self._per_sample()
        elif name in ("_dense", "_n"):
            self._find_dense()
        else:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.__dict__[name]

    def _per_sample(self) -> None:
        with self._lock:
            if "_ids" in self.__dict__:
                return
            snap = snapshot_of(self._gathered, list(self.fields))
            self.index = snap.index
            self._offsets, self._shapes, self._crcs = snap.offsets, snap.shapes, snap.crcs
            self._row_of, self._holder, self.duplicates = snap.row_of, snap.holder, snap.duplicates
            self._dense, self._n = snap.dense, len(snap.row_of)
            self._shard_of = snap.shard_of
            self._ids = snap.ids  # last: its presence says the rest is there

    def _find_dense(self) -> None:
        """Whether every sample is one row in position order, and how many there are, from the
        shard table where it can tell (featstore.snapshot.dense_samples), else per sample."""
        n = dense_samples(self._gathered, list(self.fields))
        if n is None:
            self._per_sample()
        else:
            self._n, self._dense = n, True

    @property
    def dense(self) -> bool:
        """True when every sample is one index row and a sample's position is its row: what lets
        reads by position load only the shards they touch (a store whose every shard holds every
        field and no sample twice; known from the shard table)."""
        return bool(self._dense)

    def _load_shard_rows(self, number: int) -> ShardRows:
        return ShardRows(self._gathered.rows_of(self._gathered.order[number][0]), list(self.fields))

    def _locate(self, row: int) -> tuple[int, int]:
        """(shard number, row within it) of a row of the snapshot."""
        number = int(np.searchsorted(self._starts, row, side="right")) - 1
        return number, row - int(self._starts[number])

    def assume_checked(self, shards: Sequence[str]) -> None:
        """Tell a writer's store (opened without its index) which shards its producer already
        planned around, or knows to hold none of this writer's samples, so ``refresh_committed``
        need not read them."""
        self._rechecked.update(shards)

    def refresh_committed(self) -> set[str]:
        """Read the index parts committed since this snapshot (and not read by an earlier call)
        and note their samples, so that a writer's duplicate checks see them. Only a shard's ids
        and fields are kept: the read snapshot itself does not change. Returns the name of every
        shard committed now, replaced ones included (one listing answers both questions)."""
        parts = index_parts(self.storage.list_dir(fmt.INDEX_DIR))
        new = [p for p in parts if p.shard not in self.shards and p.shard not in self._rechecked]
        for part, raw in zip(new, read_parts(self.storage, [p.key for p in new]), strict=True):
            table, info = parse_index_part(raw, part.shard, part.key, self.url, part.crc)
            self.note_committed(info.name, table.column("id").to_pylist(), list(info.layouts))
            self.replaced.update(dict.fromkeys(info.replaces, info.name))
        return {p.shard for p in parts} | set(self.replaced)

    def note_committed(self, shard: str, sample_ids: list[str], fields: Sequence[str] | None = None) -> None:
        """Called by a writer of this store after a commit, so its duplicate checks see new ids.
        The read snapshot itself does not change: reopen the store to read new shards."""
        # Its own index part need not be read back by this writer's next check.
        self._rechecked.add(shard)
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
        if self._dense:
            return {f: self._n for f in self.fields}
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
        return int(self._n)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._row_of

    def has_shard(self, name: str) -> bool:
        """True when shard ``name`` is committed (checked against storage, not the snapshot); a
        shard a data compaction replaced was committed, even once its objects are deleted."""
        if name in self.shards or name in self.replaced:
            return True
        return any((parsed := fmt.parse_index_part_name(entry)) and parsed[0] == name for entry in self.storage.list_names(fmt.INDEX_DIR, f"{name}."))

    @property
    def rejects(self) -> pa.Table:
        """Every shard's rejects, one table: read once per set of shards that have any (a re-run's
        planning asks several times), their objects many at once from an object store."""
        keys = [info.rejects_key for info in self.shards.values() if info.num_rejected]
        kept = self._rejects
        if kept is not None and kept[0] == keys:
            return kept[1]
        tables = [read_parquet(raw) for raw in read_parts(self.storage, keys)]
        table = (pa.concat_tables(tables, promote_options="permissive") if tables
                 else pa.table({"source": pa.array([], pa.string()), "reason": pa.array([], pa.string())}))
        self._rejects = (keys, table)
        return table

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
        if self._dense:
            return row  # every row holds every field
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
        if self._dense:
            return list(self.fields)
        return [f for f in self.fields if self._holder[f][row] >= 0]

    def _id_of(self, row: int) -> str:
        if "_ids" in self.__dict__:
            return self._ids[row]
        number, i = self._locate(row)
        return self._loaded.get(number).sample_id(i)

    def _field_row(self, first: int, name: str) -> tuple[str, tuple[int, ...], int, int, int]:
        """(shard, shape, element offset, CRC-32C, index row) of field ``name`` of the sample
        whose first row is ``first``: from the per-sample structures where built, else from its
        shard's rows (a dense store's reads by position)."""
        row = self._holder_row(first, name)
        if "_ids" in self.__dict__:
            return self._shard_of[row], self._shapes[name][row], int(self._offsets[name][row]), int(self._crcs[name][row]), row
        number, i = self._locate(row)
        rows = self._loaded.get(number)
        return self._shard_name(number), rows.shape(name, i), int(rows.offsets[name][i]), int(rows.crcs[name][i]), row

    def _shard_name(self, number: int) -> str:
        return self._gathered.order[number][1].name

    @overload
    def read(self, sample_id: str, fields: Sequence[str] | None = None, *, format: str = "numpy", with_meta: Literal[False] = False) -> dict[str, Any]: ...
    @overload
    def read(self, sample_id: str, fields: Sequence[str] | None = None, *, format: str = "numpy", with_meta: Literal[True]) -> Sample: ...

    def read(self, sample_id: str, fields: Sequence[str] | None = None, *, format: str = "numpy", with_meta: bool = False) -> dict[str, Any] | Sample:
        """One sample by id, exactly as written (dtype and shape): ``fields``, or every field it
        has. The arrays of a local store are read-only views of its mapped objects (``np.array(x)``
        for one to write to); ``format="torch"`` gives tensors (bfloat16 stays bfloat16) sharing a
        freshly read buffer, or copies of those read-only views; ``with_meta=True`` a ``Sample``
        that also carries its id and metadata."""
        row = self.row(sample_id)
        arrays = in_format(self.read_row(row, fields), format)
        return Sample(self._id_of(row), arrays, self._meta_of(row)) if with_meta else arrays

    # ---- by position ----------------------------------------------------------------------
    # A sample's position is its place in the snapshot's order: that of sample_ids(), scan()
    # and the index's first rows (shard commit order, then the order within the shard).
    def id_at(self, position: int) -> str:
        """The id of the sample at ``position`` (negative counts from the end)."""
        return self._id_of(self._row_at(position))

    @overload
    def read_at(self, position: int, fields: Sequence[str] | None = None, *, format: str = "numpy", with_meta: Literal[False] = False) -> dict[str, Any]: ...
    @overload
    def read_at(self, position: int, fields: Sequence[str] | None = None, *, format: str = "numpy", with_meta: Literal[True]) -> Sample: ...

    def read_at(self, position: int, fields: Sequence[str] | None = None, *, format: str = "numpy", with_meta: bool = False) -> dict[str, Any] | Sample:
        """The sample at ``position`` (``0 <= position < len(store)``, or negative from the end),
        as ``read(store.id_at(position), ...)`` gives it; IndexError out of range."""
        row = self._row_at(position)
        arrays = in_format(self.read_row(row, fields), format)
        return Sample(self._id_of(row), arrays, self._meta_of(row)) if with_meta else arrays

    def shape_at(self, position: int, field: str) -> tuple[int, ...]:
        """The shape of ``field`` of the sample at ``position``, from the index: in a dense store
        from its shard's rows alone (loaded on first use, as a read by position loads them)."""
        return self._field_row(self._row_at(position), field)[1]

    def shard_shapes(self, shard: str, field: str) -> tuple[np.ndarray, np.ndarray]:
        """The shapes of ``field`` of every sample of ``shard`` of a dense store at once, as the
        index's list column holds them: (flat values, bounds), sample ``i``'s shape being
        ``values[bounds[i]:bounds[i + 1]]``. From the shard's rows alone (a planner's bulk
        ``shape_at``)."""
        if not self.dense:
            raise SchemaError(f"{self.url}: shard_shapes needs a dense store (every shard with every field, each sample once)")
        if field not in self.fields:
            raise SchemaError(f"{self.url} has no field {field!r} (fields: {sorted(self.fields)})")
        number = self._locate(self._shard_rows[shard].start)[0]
        rows = self._loaded.get(number)
        return rows.shape_values[field], rows.shape_bounds[field]

    def __getitem__(self, key: int | str) -> dict[str, Any]:
        """``store[i]`` is ``read_at(i)``, ``store["id"]`` is ``read("id")``: every field, numpy.
        With ``len()`` this makes a store a map-style dataset."""
        if isinstance(key, str):
            return self.read(key)
        return self.read_at(key)

    def __iter__(self) -> Iterator[Any]:
        # Without this, __getitem__ + __len__ would make `for x in store` a loop of single reads.
        raise TypeError("a Store is not iterated directly: use store.scan() for (id, sample) pairs, or store.sample_ids()")

    def _row_at(self, position: int) -> int:
        if isinstance(position, (bool, np.bool_)) or not hasattr(position, "__index__"):
            raise TypeError(f"a store is indexed by position (an int) or by sample id (a str), not {type(position).__name__}")
        index = operator.index(position)
        n = len(self)
        if not -n <= index < n:
            held = f"holds {n} samples (positions 0..{n - 1}, or -{n}..-1 from the end)" if n else "holds no samples"
            raise IndexError(f"position {index} is out of range: {self.url} {held}")
        index %= n
        if self._dense:
            return index  # every sample is one row, in order
        rows = self.__dict__.get("_first_rows")
        if rows is None:
            rows = self._first_rows = np.fromiter(self._row_of.values(), dtype=np.int64, count=n)
        return int(rows[index])

    # ---- metadata -------------------------------------------------------------------------
    @property
    def meta_columns(self) -> list[str]:
        """The index columns that hold per-sample metadata (caption, provenance, ...): every
        column except ``id``, ``shard`` and the fields' ``<field>.offset/.shape/.crc32c``."""
        return [c for c in self.index.column_names if "." not in c and c not in fmt.RESERVED_COLUMNS]

    def meta(self, sample_id: str) -> dict[str, Any]:
        """What the writer recorded for this sample with ``add(..., meta=...)``; keys it did not
        set are absent. A sample whose fields were added by later shards has their rows' keys
        too (its first row's value wins where both have one)."""
        return self._meta_of(self.row(sample_id))

    def _meta_of(self, row: int) -> dict[str, Any]:
        columns = self.__dict__.get("_meta_lists")
        if columns is None:
            # Once per store, as Python lists: a per-row pyarrow scalar lookup costs microseconds
            # per key, and a training loop may ask for every sample's metadata.
            columns = self._meta_lists = {c: self.index.column(c).to_pylist() for c in self.meta_columns}
        rows = [row]
        if not self._dense:
            rows += sorted({int(self._holder[f][row]) for f in self.fields if self._holder[f][row] > row})
        meta: dict[str, Any] = {}
        for name, values in columns.items():
            for r in rows:
                if values[r] is not None:
                    meta[name] = values[r]
                    break
        return meta

    def read_row(self, row: int, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The sample whose index row is ``row`` (``store.row(id)``, a row of ``store.index``):
        ``fields``, or every field it has. Not a position: where fields were added to a store
        later, a sample has several index rows; ``read_at`` takes positions."""
        specs = self.fields
        out = {}
        first = row
        for name in self._fields_to_read(first, fields):
            spec = specs[name]
            shard, shape, offset, crc, row = self._field_row(first, name)
            count = math.prod(shape)
            # The ranges first: they bound the index row's shape by the shard's data before anything is allocated.
            ranges = self._ranges(shard, spec, offset, count) if count else []
            array = self._field_bytes(shard, name, ranges, count * spec.numpy_dtype.itemsize).view(spec.numpy_dtype).reshape(shape)
            if self.verify_reads and fmt.crc32c(array) != crc:
                raise CorruptionError(f"{self.url}: sample {self._id_of(row)!r} field {name!r} in shard {shard!r} fails its checksum")
            out[name] = array
        return out

    def _field_bytes(self, shard: str, name: str, ranges: list[tuple[int, int]], nbytes: int) -> np.ndarray:
        """A field's bytes, flat: where the storage maps objects (local disk) and they are one range
        (the writer puts a sample's chunks back to back), a read-only view of the mapped object,
        checked in place by the caller: no copy at all; else read into a new buffer."""
        key = self.shards[shard].data_key(name)
        if len(ranges) == 1:
            view = self.storage.view_range(key, self.shards[shard].objects[key]["nbytes"], *ranges[0])
            if view is not None:
                return view
        out = np.empty(nbytes, dtype=np.uint8)
        if ranges:
            self.storage.read_ranges(key, ranges, out)
        return out

    def read_rows(self, rows: Sequence[int], fields: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
        """Many samples in one batched read: on an object store every byte range of every sample
        is requested concurrently, instead of one request after another. (On local disk it is
        ``read_row`` per sample: there a call costs microseconds and nothing is gained.)"""
        if not self.storage.is_remote:
            return [self.read_row(row, fields) for row in rows]
        specs = self.fields
        # (sample, field) -> (shard, shape, offset, crc, index row) of what holds it
        held = [{name: self._field_row(row, name) for name in self._fields_to_read(row, fields)} for row in rows]
        self._load_chunk_indexes({(at[0], name) for sample in held for name, at in sample.items()})
        requests, samples = [], []
        for sample_rows in held:
            sample = {}
            for name, (shard, shape, offset, _, _) in sample_rows.items():
                spec = specs[name]
                count = math.prod(shape)
                ranges = self._ranges(shard, spec, offset, count) if count else []
                array = np.empty(shape, dtype=spec.numpy_dtype)
                if count:
                    requests.append((self.shards[shard].data_key(name), ranges, array.reshape(-1).view(np.uint8)))
                sample[name] = array
            samples.append(sample)
        self.storage.read_into(requests)
        if self.verify_reads:
            for sample_rows, sample in zip(held, samples, strict=True):
                for name, array in sample.items():
                    shard, _, _, crc, row = sample_rows[name]
                    if fmt.crc32c(array) != crc:
                        raise CorruptionError(f"{self.url}: sample {self._id_of(row)!r} field {name!r} in shard {shard!r} fails its checksum")
        return samples

    def iter_shard(self, shard: str, fields: Sequence[str] | None = None, *, readahead_bytes: int = DEFAULT_READAHEAD_BYTES) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        """Every row of one shard with the shard's fields (or ``fields``, which it must hold), read
        in large blocks as ``scan`` does (see ``scan`` for who owns the arrays)."""
        held = self.shards[shard].layouts
        if fields and self.shards[shard].num_samples and (absent := [f for f in fields if f not in held]):
            raise SchemaError(f"{self.url}: shard {shard!r} holds {sorted(held)}, not {absent}")
        return self._track(scan_samples(self, [shard], fields, whole=False, readahead_bytes=readahead_bytes))

    @overload
    def scan(self, fields: Sequence[str] | None = None, *, readahead_bytes: int = ..., format: str = ..., with_meta: Literal[False] = False) -> Iterator[tuple[str, dict[str, Any]]]: ...
    @overload
    def scan(self, fields: Sequence[str] | None = None, *, readahead_bytes: int = ..., format: str = ..., with_meta: Literal[True]) -> Iterator[tuple[str, Sample]]: ...

    def scan(self, fields: Sequence[str] | None = None, *, readahead_bytes: int = DEFAULT_READAHEAD_BYTES, format: str = "numpy", with_meta: bool = False) -> Iterator[tuple[str, Any]]:
        """Every sample once, in position order, as ``(id, sample)`` with ``fields`` (default:
        every field it has), CRC-checked, the same arrays per-sample reads give.

        Shards are read in sequential blocks of ~16 MiB (memory-mapped locally, one batched
        ranged read per block elsewhere) loaded and checked on background threads up to
        ``readahead_bytes`` ahead (0: all in this thread). The arrays view their block without a
        copy; the store never reuses or overwrites a block, so a sample stays valid and unchanged
        for as long as it is held (and holds its block: copy it to keep only it)."""
        for field in fields or ():
            if field not in self.fields:
                raise SchemaError(f"{self.url} has no field {field!r} (fields: {sorted(self.fields)})")
        in_format({}, format)  # an unknown format fails before any read
        return self._track(self._scan(fields, readahead_bytes, format, with_meta))

    def _scan(self, fields: Sequence[str] | None, readahead_bytes: int, format: str, with_meta: bool) -> Iterator[tuple[str, Any]]:
        for sample_id, arrays in scan_samples(self, list(self.shards), fields, whole=True, readahead_bytes=readahead_bytes):
            arrays = in_format(arrays, format)
            yield sample_id, (Sample(sample_id, arrays, self._meta_of(self._row_of[sample_id])) if with_meta else arrays)

    def _track(self, scan: Generator[T, None, None]) -> Generator[T, None, None]:
        """A scan's loading threads stop and are joined when it ends, when it is closed or dropped
        (its generator's ``close``), and at the latest when the store is closed: no thread of a
        scan outlives its store, nor runs native code while the interpreter exits."""
        self._scans.add(scan)
        return scan

    def _ranges(self, shard: str, spec: fmt.FieldSpec, start: int, count: int) -> list[tuple[int, int]]:
        layout = self.shards[shard].layouts[spec.name]
        itemsize = np.dtype(spec.zarr_dtype).itemsize
        if start < 0 or count < 0 or start + count > layout.elements:
            raise CorruptionError(f"{self.url}: shard {shard!r} field {spec.name!r}: the index points past the end of the data "
                                  f"(run `mmcache verify {self.url}`)")
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
        return StoreWriter(self, **kwargs)

    def close(self) -> None:
        """Stop and join every scan still open on this store, then release its storage."""
        for scan in list(self._scans):
            scan.close()
        self.storage.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, samples={len(self)}, shards={len(self.shards)}, fields={list(self.fields)})"


def open_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, mode: str = "r", verify_reads: bool = True, strict: bool = True, load_index: bool = True,
               cache_dir: str | os.PathLike[str] | None = None, cache_bytes: int | None = None, shards: Sequence[str] | None = None,
               manifest: dict[str, Any] | None = None) -> Store:
    """``manifest``: the store's ``Store.manifest`` as a producer's planner read it; the store
    then opens without reading ``zarr.json`` and the declarations (two requests on an object
    store, for each of a job's tasks). Changes made since reach such a store's writers where they
    matter: a first commit re-reads the manifest to fix a field's ndim."""
    storage = open_storage(url, storage_options)
    if cache_dir is not None and storage.is_remote:
        storage = CachingStorage(storage, cache_dir, cache_bytes)
    if manifest is not None:
        return Store(storage, copy.deepcopy(manifest), mode=mode, verify_reads=verify_reads, strict=strict, load_index=load_index, shards=shards, merge_declarations=False)
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
    # One listing tells both whether a store is there and whether the place is empty.
    present = storage.list_dir("")
    if fmt.MANIFEST_KEY in present:
        store = Store(storage, fmt.parse_root_group(storage.read(fmt.MANIFEST_KEY), storage.url), mode="a")
        if not exist_ok:
            raise SchemaError(f"{storage.url} already holds a feature store; open it with featstore.append() to add to it")
        _check_same_fields(store, specs)
        return store
    if present:
        raise NotAStoreError(f"{storage.url} exists and is not empty, and is not a feature store; choose a new location")
    manifest = fmt.make_manifest(specs, dict(attrs or {}))
    # The shards group first, the root group (which makes it a store) last.
    storage.write_atomic(f"{fmt.SHARDS_DIR}/zarr.json", fmt.group_json())
    storage.write_atomic(fmt.MANIFEST_KEY, fmt.root_group_json(manifest))
    # Nothing to read back: the place was empty a moment ago, so there are no declarations and no
    # index parts (a writer racing on the new store is caught by its writers' commit checks).
    return Store(storage, manifest, mode="a", load_index=False, merge_declarations=False)


def _check_same_fields(store: Store, specs: dict[str, fmt.FieldSpec]) -> None:
    have = {n: s.dtype for n, s in store.fields.items()}
    want = {n: s.dtype for n, s in specs.items()}
    if have != want:
        raise SchemaError(f"{store.url} holds fields {have}, not {want}")
