"""``Store``: one snapshot of a feature store, read.

An open takes the committed shards of that moment and serves every read from them: a sample by
id (``read``) or by position (``read_at``, ``store[i]``) is per field one byte range checked
against its CRC-32C; full scans read whole blocks (featstore.scan). Adding to a store is
featstore.appendable's ``AppendableStore`` (``open_store(..., mode="a")``); how a read works:
docs/design/store.md, "Reads".
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from functools import cached_property
from typing import Any, Literal, TypeVar, overload

import numpy as np
import pyarrow as pa

from . import checksums
from . import format as fmt
from . import manifest as manifests
from .chunk_index import ChunkIndex
from .errors import CorruptionError, MissingFieldError, ReadOnlyError, SchemaError
from .index import ShardInfo, read_rejects
from .sample import Sample
from .sample_index import SampleIndex, ShardTable
from .scan import DEFAULT_READAHEAD_BYTES, scan_samples
from .snapshot import gather_parts
from .storage import Storage
from .tensors import in_format

T = TypeVar("T")


class Store(manifests.ManifestView):
    """A feature store opened for reading; ``mode="a"`` opens an ``AppendableStore``, which adds to it."""

    mode = "r"

    def __init__(self, storage: Storage, manifest: dict[str, Any], *, verify_reads: bool = True, strict: bool = True, load_index: bool = True,
                 shards: Sequence[str] | None = None, merge_declarations: bool = True) -> None:
        self.storage = storage
        self.url = storage.url
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
        self._rejects: tuple[list[str], pa.Table] | None = None  # (the rejects objects read, their table)
        self._samples: SampleIndex | None = None  # built on first use (sample_index)
        # load_index=False: a writer that only adds shards (an encode task) need not read every
        # index part of a large store first; its snapshot is then empty.
        # shards: open exactly this snapshot (say, the one a run started with) rather than
        # whatever is committed now; a listed shard that is gone is an error.
        self._load_index(list_parts=load_index, only=shards)

    # ---- writing: only an AppendableStore writes ------------------------------------------
    # These stay here, as one-line errors, because a store opened read-only is the most common
    # wrong turn on the way to writing (and code typed ``Store`` calls them on stores opened with
    # mode="a"): the error says what to do instead of an AttributeError.
    def writer(self, **kwargs: Any) -> Any:
        """A ``StoreWriter`` adding shards to this store: needs ``mode="a"`` (an AppendableStore)."""
        raise ReadOnlyError(f"{self.url} is opened read-only; open it with mode='a' (or featstore.append) to add samples")

    def add_fields(self, fields: dict[str, Any]) -> None:
        """Declare new fields: needs ``mode="a"`` (AppendableStore.add_fields)."""
        raise ReadOnlyError(f"{self.url} is opened read-only; open it with mode='a' to add fields")

    def require_format_version(self, version: int) -> None:
        """Check the manifest's format version is at least ``version``; raising it needs ``mode="a"``."""
        if self.format_version >= version:
            return
        raise ReadOnlyError(f"{self.url} is opened read-only; open it with mode='a' to raise its format version")

    # ---- the snapshot -------------------------------------------------------------------
    def _load_index(self, list_parts: bool = True, only: Sequence[str] | None = None) -> None:
        # The shard table only (featstore.snapshot): per-sample rows load per shard on first use
        # (featstore.rows), or all at once for what needs them all (sample_index).
        gathered = gather_parts(self.storage, strict=self.strict, list_parts=list_parts, only=only, lazy=True)
        self.damaged.update(gathered.damaged)
        # The index checkpoint the snapshot used (featstore.checkpoints), and how many parts it covered.
        self.checkpoint = None if gathered.checkpoint is None else gathered.checkpoint.key
        self.checkpoint_covered = len(gathered.covered)
        self._table = ShardTable(gathered, lambda: list(self.fields))
        self.shards: dict[str, ShardInfo] = self._table.shards
        self.replaced = gathered.replaced  # shard -> the data compaction that rewrote it: committed, not read
        # Committed objects never change: a caching layer may key its entries on their checksums
        # (asked only of a storage that listens: a checkpoint's records are decoded when first used).
        if type(self.storage).known_objects is not Storage.known_objects:
            self.storage.known_objects({key: obj for info in self.shards.values() for key, obj in info.objects.items()})
        self.chunk_index = ChunkIndex(self.storage, self.shards, self.url)

    @cached_property
    def sample_index(self) -> SampleIndex:
        """The per-sample index (featstore.sample_index), built on first use: a lookup by id,
        metadata, scans, copy and verify need it; reads by position of a dense store, ``len`` and
        the shard table do not. It costs ~0.4-0.9 KiB per sample."""
        with self._lock:  # built once, whichever thread asks first
            if self._samples is None:
                self._samples = SampleIndex(self._table.gathered, list(self.fields))
            return self._samples

    @cached_property
    def _counts(self) -> tuple[int, bool]:
        """(samples, dense): from the shard table where it can tell (featstore.snapshot.dense_samples),
        else from the per-sample index."""
        n = None if self._samples is not None else self._table.dense_count(list(self.fields))
        if n is None:
            samples = self.sample_index
            return len(samples), samples.dense
        return n, True

    @property
    def index(self) -> pa.Table:
        """Every index row of the snapshot (one per sample per shard it has fields in), plus a "shard" column."""
        return self.sample_index.table

    @property
    def duplicates(self) -> list[tuple[str, str, str]]:
        """(sample id, field, shard) rows ignored because an earlier commit holds them."""
        return self.sample_index.duplicates

    @property
    def dense(self) -> bool:
        """True when every sample is one index row and a sample's position is its row: what lets
        reads by position load only the shards they touch (a store whose every shard holds every
        field and no sample twice; known from the shard table)."""
        return bool(self._counts[1])

    def shard_rows(self, shard: str) -> range:
        """The rows of ``shard`` in the snapshot (of ``index``, and of the per-sample index)."""
        return self._table.rows[shard]

    def has_field(self, sample_id: str, field: str) -> bool:
        samples = self.sample_index
        row = samples.row_of.get(sample_id)
        return row is not None and field in samples.holder and samples.holder[field][row] >= 0

    def fields_of(self, sample_id: str) -> list[str]:
        """The fields this sample has in the snapshot (all of the store's, unless fields were
        added to the store after the sample was written)."""
        return self.sample_index.fields_at(self.row(sample_id), self.fields)

    def samples_per_field(self) -> dict[str, int]:
        if self._counts[1]:
            return {f: self._counts[0] for f in self.fields}
        samples = self.sample_index
        rows = samples.first_rows()
        return {f: int((samples.holder[f][rows] >= 0).sum()) for f in self.fields}

    def sample_ids(self, with_fields: Sequence[str] | None = None) -> list[str]:
        """Committed sample ids of this snapshot, in shard order; with ``with_fields``, only the
        samples that have all of those fields."""
        samples = self.sample_index
        if not with_fields:
            return list(samples.row_of)
        rows = np.fromiter(samples.row_of.values(), dtype=np.int64, count=len(samples.row_of))
        keep = np.ones(len(rows), dtype=bool)
        for field in with_fields:
            self._check_field(field)
            keep &= samples.holder[field][rows] >= 0
        return [samples.ids[r] for r in rows[keep]]

    def __len__(self) -> int:
        return int(self._counts[0])

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self.sample_index.row_of

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
        if kept is None or kept[0] != keys:
            kept = self._rejects = (keys, read_rejects(self.storage, keys))
        return kept[1]

    def num_rejected(self) -> int:
        return sum(info.num_rejected for info in self.shards.values())

    def nbytes(self) -> int:
        return sum(o["nbytes"] for info in self.shards.values() for o in info.objects.values()) + sum(i.index_nbytes for i in self.shards.values())

    # ---- rows -----------------------------------------------------------------------------
    def row(self, sample_id: str) -> int:
        row = self.sample_index.row_of.get(sample_id)
        if row is None:
            raise KeyError(f"sample {sample_id!r} is not in {self.url}")
        return row

    def shape(self, sample_id: str, field: str) -> tuple[int, ...]:
        return self.sample_index.shapes[field][self._holder_row(self.row(sample_id), field)]

    def _check_field(self, field: str) -> None:
        if field not in self.fields:
            raise SchemaError(f"{self.url} has no field {field!r} (fields: {sorted(self.fields)})")

    def _holder_row(self, row: int, field: str) -> int:
        """The index row holding ``field`` of the sample whose row is ``row``."""
        self._check_field(field)
        if self._counts[1]:
            return row  # every row holds every field
        samples = self.sample_index
        held = int(samples.holder[field][row])
        if held < 0:
            raise MissingFieldError(
                f"sample {samples.ids[row]!r} of {self.url} has no {field!r} yet (it has {samples.fields_at(row, self.fields)}); "
                "encode that field for it, or read only the samples that have it (sample_ids(with_fields=...))"
            )
        return held

    def fields_to_read(self, row: int, fields: Sequence[str] | None = None) -> Sequence[str]:
        """``fields``, or every field that the sample whose first row is ``row`` has."""
        if fields:
            return fields
        if self._counts[1]:
            return list(self.fields)
        return self.sample_index.fields_at(row, self.fields)

    def _id_of(self, row: int) -> str:
        if self._samples is not None:
            return self._samples.ids[row]
        rows, i = self._table.rows_at(row)
        return rows.sample_id(i)

    def _field_row(self, first: int, name: str) -> tuple[str, tuple[int, ...], int, int, int]:
        """(shard, shape, element offset, CRC-32C, index row) of field ``name`` of the sample
        whose first row is ``first``: from the per-sample index where built, else from its
        shard's rows (a dense store's reads by position)."""
        row = self._holder_row(first, name)
        samples = self._samples
        if samples is not None:
            return samples.shard_of[row], samples.shapes[name][row], int(samples.offsets[name][row]), int(samples.crcs[name][row]), row
        number, i = self._table.locate(row)
        rows = self._table.loaded.get(number)
        return self._table.shard_name(number), rows.shape(name, i), int(rows.offsets[name][i]), int(rows.crcs[name][i]), row

    def byte_ranges(self, shard: str, field: str, start: int, count: int) -> list[tuple[int, int]]:
        """The byte ranges of elements ``[start, start + count)`` of ``field`` in ``shard``'s object."""
        return self.chunk_index.ranges(shard, self.fields[field], start, count)

    # ---- reading --------------------------------------------------------------------------
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
        self._check_field(field)
        rows = self._table.rows_at(self._table.rows[shard].start)[0]
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
        if self._counts[1]:
            return index  # every sample is one row, in order
        return int(self.sample_index.first_rows()[index])

    # ---- metadata -------------------------------------------------------------------------
    @property
    def meta_columns(self) -> list[str]:
        """The index columns that hold per-sample metadata (caption, provenance, ...): every
        column except ``id``, ``shard`` and the fields' ``<field>.offset/.shape/.crc32c``."""
        return self.sample_index.meta_columns

    def meta(self, sample_id: str) -> dict[str, Any]:
        """What the writer recorded for this sample with ``add(..., meta=...)``; keys it did not
        set are absent. A sample whose fields were added by later shards has their rows' keys
        too (its first row's value wins where both have one)."""
        return self._meta_of(self.row(sample_id))

    def _meta_of(self, row: int) -> dict[str, Any]:
        return self.sample_index.meta(row, list(self.fields))

    def read_row(self, row: int, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The sample whose index row is ``row`` (``store.row(id)``, a row of ``store.index``):
        ``fields``, or every field it has. Not a position: where fields were added to a store
        later, a sample has several index rows; ``read_at`` takes positions."""
        specs = self.fields
        out = {}
        first = row
        for name in self.fields_to_read(first, fields):
            spec = specs[name]
            shard, shape, offset, crc, row = self._field_row(first, name)
            array = self.chunk_index.read_field(shard, spec, shape, offset)
            if self.verify_reads and checksums.crc32c(array) != crc:
                raise CorruptionError(f"{self.url}: sample {self._id_of(row)!r} field {name!r} in shard {shard!r} fails its checksum")
            out[name] = array
        return out

    def read_rows(self, rows: Sequence[int], fields: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
        """Many samples in one batched read: on an object store every byte range of every sample
        is requested concurrently, instead of one request after another. (On local disk it is
        ``read_row`` per sample: there a call costs microseconds and nothing is gained.)"""
        if not self.storage.is_remote:
            return [self.read_row(row, fields) for row in rows]
        specs = self.fields
        # (sample, field) -> (shard, shape, offset, crc, index row) of what holds it
        held = [{name: self._field_row(row, name) for name in self.fields_to_read(row, fields)} for row in rows]
        samples = self.chunk_index.read_many([{name: (at[0], specs[name], at[1], at[2]) for name, at in sample.items()} for sample in held])
        if self.verify_reads:
            for sample_rows, sample in zip(held, samples, strict=True):
                for name, array in sample.items():
                    shard, _, _, crc, row = sample_rows[name]
                    if checksums.crc32c(array) != crc:
                        raise CorruptionError(f"{self.url}: sample {self._id_of(row)!r} field {name!r} in shard {shard!r} fails its checksum")
        return samples

    # ---- scans ----------------------------------------------------------------------------
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
            self._check_field(field)
        in_format({}, format)  # an unknown format fails before any read
        return self._track(self._scan(fields, readahead_bytes, format, with_meta))

    def _scan(self, fields: Sequence[str] | None, readahead_bytes: int, format: str, with_meta: bool) -> Iterator[tuple[str, Any]]:
        for sample_id, arrays in scan_samples(self, list(self.shards), fields, whole=True, readahead_bytes=readahead_bytes):
            arrays = in_format(arrays, format)
            yield sample_id, (Sample(sample_id, arrays, self._meta_of(self.sample_index.row_of[sample_id])) if with_meta else arrays)

    def _track(self, scan: Generator[T, None, None]) -> Generator[T, None, None]:
        """A scan's loading threads stop and are joined when it ends, when it is closed or dropped
        (its generator's ``close``), and at the latest when the store is closed: no thread of a
        scan outlives its store, nor runs native code while the interpreter exits."""
        self._scans.add(scan)
        return scan

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
