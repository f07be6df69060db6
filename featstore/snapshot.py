"""The snapshot a reader takes when it opens a store: the index parts committed at that moment,
checked and concatenated, and where each field of each sample is.

``gather_parts`` gives the shard table; ``dense_samples`` tells from it whether each sample is one
row; ``GatheredParts.rows_of`` gives one shard's rows; ``snapshot_of`` the per-sample structures
(docs/FORMAT.md, "Two-level index"; docs/design/store.md, "The snapshot").
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import format as fmt
from .checkpoints import CheckpointWarning, find_checkpoint
from .errors import CorruptionError, FeatstoreError, SnapshotError
from .idhash import any_known, id_hashes
from .index import IndexPart, ShardInfo, index_parts, list_index, parse_index_part_record, read_parts, shard_info
from .storage import Storage


def snapshot_digest(shards: Sequence[str]) -> str:
    """A short name for a snapshot (its sorted shard names), to compare ranks, runs and resumes:
    a data compaction keeps the sample count but changes the shards, and with them the order."""
    return hashlib.sha256(json.dumps(sorted(shards)).encode()).hexdigest()[:16]


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
    """The index parts of one listing, checked, in snapshot order. Their rows (``table``) are
    concatenated on first use: an open from a checkpoint needs only the shard table."""

    storage: Storage
    listing: dict[str, str]                 # every name under index/ -> its listing fingerprint
    order: list[tuple[str, ShardInfo]]      # (file name under index/, shard), commit order then name
    records: dict[str, Any]                 # file name -> commit record (a dict; from a checkpoint, its CoveredPart)
    damaged: dict[str, str]
    tables: dict[str, pa.Table]             # file name -> rows, of the parts read whole
    checkpoint: Any = None                  # the featstore.checkpoints.Checkpoint used, if any
    covered: dict[str, Any] = field(default_factory=dict)  # file name -> CoveredPart, the parts whose rows come from it
    replaced: dict[str, str] = field(default_factory=dict)  # shard -> the data compaction's shard that replaces it (featstore.rewrite)
    _table: pa.Table | None = None

    @property
    def table(self) -> pa.Table:
        """Every part's rows in snapshot order, plus a "shard" column."""
        if self._table is None:
            rows = self._checkpoint_rows()  # first: where it falls back to the parts, no part is covered any more
            self._table = _concat(self.order, self.covered, rows, self.tables)
        return self._table

    def _checkpoint_rows(self) -> pa.Table | None:
        """The checkpoint's rows. Where they prove damaged or gone once read (a lazily opened
        checkpoint's), the parts it covers are read instead, as an open would have done."""
        if not self.covered:
            return None
        try:
            return self.checkpoint.table
        except (CorruptionError, FileNotFoundError) as exc:
            warnings.warn(f"{exc}; it is ignored and the index parts it covers are read instead (`mmcache compact {self.storage.url}` replaces it)",
                          CheckpointWarning, stacklevel=4)
        self.tables.update(_read_whole(self.storage, list(self.covered)))
        self.covered = {}
        return None

    def rows_of(self, entry: str) -> pa.Table:
        """The rows of one part (a file name under index/): from what was read already, else from
        the part itself (a covered part is listed with the fingerprint the checkpoint recorded:
        it is the very object whose rows the checkpoint holds). A covered part found damaged or
        gone since gives the checkpoint's copy of its rows, which readers used before."""
        table = self.tables.get(entry)
        if table is not None:
            return table
        part = self.covered.get(entry)
        if self._table is not None and part is not None:
            return self.checkpoint.table.slice(part.start, part.info.num_samples)
        try:
            parsed = index_parts([entry])[0]
            return parse_index_part_record(self.storage.read(parsed.key), parsed.shard, parsed.key, self.storage.url, parsed.crc)[0]
        except (CorruptionError, FileNotFoundError):
            if part is None:
                raise
        return self.checkpoint.table.slice(part.start, part.info.num_samples)


def _read_whole(storage: Storage, entries: list[str]) -> dict[str, pa.Table]:
    """The rows of these parts, read from the parts themselves (a damaged one is an error)."""
    found = _Found({}, {}, {})
    found.read(storage, index_parts(entries), strict=True)
    return found.tables


def gather_parts(storage: Storage, *, strict: bool, list_parts: bool = True, only: Sequence[str] | None = None,
                 use_checkpoint: bool = True, checkpoint_problems: list[str] | None = None, lazy: bool = False,
                 listing: dict[str, str] | None = None) -> GatheredParts:
    """List ``index/`` once and gather the committed parts (``only`` those shards, if given): the
    rows of those a checkpoint covers from it (one read), the others from their own parts. A part
    is taken from the checkpoint only while it is listed with the fingerprint the checkpoint
    recorded, so the result is exactly what reading every listed part gives. ``lazy``: the
    checkpoint's rows are read when ``table`` is first used. ``listing``: one the caller took of
    ``index/`` just now (``list_index``), to not take it twice."""
    if listing is None:
        listing = list_index(storage) if list_parts else {}
    wanted = None if only is None else set(only)
    checkpoint = find_checkpoint(storage, listing, checkpoint_problems, lazy=lazy) if use_checkpoint and listing else None
    covered = {} if checkpoint is None else {
        entry: part for entry, part in checkpoint.parts.items()
        if listing.get(entry) == part.listed and (wanted is None or part.info.name in wanted)
    }
    found = _Found({part.info.name: part.info for part in covered.values()}, dict(covered), {part.info.name: entry for entry, part in covered.items()})
    # Parts committed after the snapshot was taken (not ``wanted``) are left out.
    parts = [p for p in index_parts(e for e in listing if e not in covered) if wanted is None or p.shard in wanted]
    # Data compactions' parts first: the parts they replace need not be read at all.
    found.read(storage, [p for p in parts if fmt.is_rewrite_name(p.shard)], strict)
    gone_by = {old for info in found.shards.values() for old in info.replaces}
    found.read(storage, [p for p in parts if not fmt.is_rewrite_name(p.shard) and p.shard not in gone_by], strict)
    replaced = found.leave_out_replaced(covered)
    # Commit order (then name): a sample field committed twice by racing writers is read from
    # the earliest commit, which is the one any reader that opened in between already saw.
    order = sorted(((found.entries[info.name], info) for info in found.shards.values()), key=lambda p: (p[1].committed_at, p[1].name))
    if wanted is not None and (gone := sorted(wanted - set(found.shards) - set(found.damaged) - set(replaced))):
        raise SnapshotError(f"{storage.url}: {len(gone)} shard(s) of the requested snapshot are not committed there, e.g. {gone[0]!r}"
                            + _why_gone(storage, listing, set(gone)))
    return GatheredParts(storage, listing, order, found.records, found.damaged, found.tables, checkpoint, covered, replaced)


def _why_gone(storage: Storage, listing: dict[str, str], gone: set[str]) -> str:
    """Why shards of a requested snapshot are gone: a data compaction that rewrote them and then
    deleted them past its grace (its part's ``replaces`` names them), or else a change of store.
    Read only on that error: the listed rewrites' parts, many at once (``read_parts``)."""
    rewrites = [(entry, parsed) for entry in sorted(listing) if (parsed := fmt.parse_index_part_name(entry)) and fmt.is_rewrite_name(parsed[0])]
    keys = [f"{fmt.INDEX_DIR}/{entry}" for entry, _ in rewrites]
    try:
        for key, (_, (shard, crc)), raw in zip(keys, rewrites, read_parts(storage, keys), strict=True):
            if gone & set(parse_index_part_record(raw, shard, key, storage.url, crc)[1].get("replaces") or ()):
                return (f": a data compaction rewrote them into {shard!r} and deleted them past its grace period. A snapshot (a "
                        "training run's, to resume) outlives its shards only within the grace (`mmcache compact --grace`, "
                        "run.compact_grace): start a new run on the store as it is now, or raise the grace for runs that last longer")
    except (OSError, FeatstoreError) as exc:  # a part deleted, damaged or unreadable since the listing: said, not hidden
        return f"; the store was changed or is a different one (its data compactions could not be read to tell: {exc})"
    return "; the store was changed or is a different one"


@dataclass
class _Found:
    """What ``gather_parts`` has found so far: shards, commit records and file names (of the parts
    a checkpoint covers, to begin with), then the rows of the parts it reads itself."""

    shards: dict[str, ShardInfo]
    records: dict[str, Any]      # file name -> commit record (a covered part's: decoded when needed)
    entries: dict[str, str]      # shard -> file name under index/
    tables: dict[str, pa.Table] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)

    def read(self, storage: Storage, parts: list[IndexPart], strict: bool) -> None:
        url = storage.url
        for part, raw in zip(parts, read_parts(storage, [p.key for p in parts]), strict=True):
            try:
                if part.shard in self.shards:
                    # Only a version-1/2 writer (whose part names carried their CRC) could do this.
                    raise CorruptionError(f"{url}: shard {part.shard!r} has two index parts")
                table, record = parse_index_part_record(raw, part.shard, part.key, url, part.crc)
                info = shard_info(record, part.shard, part.key, len(raw))
            except CorruptionError as exc:
                if strict:
                    raise CorruptionError(f"{exc}; run `mmcache verify {url}` for a full report") from None
                self.damaged[part.shard] = str(exc)
                continue
            self.shards[part.shard] = info
            self.records[part.entry], self.entries[part.shard] = record, part.entry
            self.tables[part.entry] = table.append_column("shard", pa.array([part.shard] * table.num_rows, pa.string()))

    def leave_out_replaced(self, covered: dict[str, Any]) -> dict[str, str]:
        """Leave out every shard that a valid part's ``replaces`` names (a data compaction
        rewrote it, featstore.rewrite): the commit of the rewrite is the switch, so a snapshot
        holds either the old shards or the new one. Returns replaced shard -> its rewrite."""
        replaced = {old: info.name for info in self.shards.values() for old in info.replaces}
        for name in [n for n in self.shards if n in replaced]:
            del self.shards[name]
            entry = self.entries.pop(name)
            for held in (self.records, self.tables, covered):
                held.pop(entry, None)
        for name in replaced:
            self.damaged.pop(name, None)  # nobody reads it any more
        return replaced


def _concat(order: list[tuple[str, ShardInfo]], covered: dict[str, Any], rows: pa.Table | None, tables: dict[str, pa.Table]) -> pa.Table:
    """Every part's rows in snapshot order. The checkpoint's rows (``rows``) are in snapshot
    order too: consecutive covered parts are one slice of it."""
    pieces: list[pa.Table] = []
    run: list[int] = []
    rows = rows if rows is not None else pa.table({})
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
    return table.replace_schema_metadata(None)


def dense_samples(gathered: GatheredParts, fields: list[str]) -> int | None:
    """The number of samples when the snapshot is dense (every shard with samples holds exactly
    ``fields`` and no id repeats, so a sample's position is its row), else None; found without a
    Python object per sample. From a checkpoint that covers every part, its count of distinct
    ids answers (nothing per sample is read); otherwise the ids are counted in Arrow."""
    infos = [info for _, info in gathered.order if info.num_samples]
    wanted = set(fields)
    if any(set(info.layouts) != wanted for info in infos):
        return None
    rows = sum(info.num_samples for info in infos)
    checkpoint, covered = gathered.checkpoint, gathered.covered
    counted = sum(part.info.num_samples for part in covered.values())
    if covered and checkpoint.samples is not None and len(covered) == len(checkpoint.parts):
        if checkpoint.samples != counted:
            return None
        if counted == rows or _new_ids_are_new(gathered):
            return rows
    if not rows:
        return 0
    distinct = pc.count_distinct(gathered.table.column("id")).as_py()
    return rows if distinct == rows else None


def _new_ids_are_new(gathered: GatheredParts) -> bool:
    """True when the ids of the parts read whole (committed after the checkpoint) are distinct
    and none hashes like one the checkpoint covers (featstore.idhash); False when that cannot be
    told so (the caller then counts every id)."""
    tables = [t.column("id") for t in gathered.tables.values() if t.num_rows]
    ids = pa.chunked_array([c for t in tables for c in t.chunks], pa.string())
    if pc.count_distinct(ids).as_py() != len(ids):
        return False
    try:
        known = gathered.checkpoint.id_hashes()
    except (CorruptionError, FileNotFoundError) as exc:
        warnings.warn(f"{exc}; the checkpoint's ids are counted instead", CheckpointWarning, stacklevel=4)
        return False
    return known is not None and not any_known(id_hashes(ids), known)


def snapshot_of(gathered: GatheredParts, fields: list[str]) -> Snapshot:
    """The per-sample snapshot of gathered parts (a Python object per sample: what a whole-store
    operation, a lookup by id or a store that is not dense needs)."""
    shards = {info.name: info for _, info in gathered.order}
    table = gathered.table
    ids = table.column("id").to_pylist()
    starts = np.cumsum([0] + [info.num_samples for info in shards.values()])
    shard_rows = {name: range(int(a), int(b)) for name, a, b in zip(shards, starts[:-1], starts[1:])}
    shapes = {f: _shapes(table, f"{f}.shape") for f in fields}
    row_of, holder, dense, duplicates = _locate_fields(ids, shards, shard_rows, fields)
    return Snapshot(
        shards=shards, damaged=gathered.damaged, index=table, ids=ids, shard_of=table.column("shard").to_pylist(), shard_rows=shard_rows,
        offsets={f: column_numpy(table, f"{f}.offset") for f in fields}, shapes=shapes, crcs={f: column_numpy(table, f"{f}.crc32c") for f in fields},
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


def column_numpy(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.int64)
    column = table.column(name)
    # Rows of shards without this field (added to the store later) are null: never read.
    return (column.fill_null(0) if column.null_count else column).to_numpy()


