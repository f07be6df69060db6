"""Data compaction: committed shards much smaller than the store's target size are rewritten,
a group at a time, into shards of about that size (docs/FORMAT.md, "Data compaction").

Each group becomes one shard whose commit record names the shards it ``replaces``: committing it
is the atomic switch; the old objects stay for a grace period. No torch or dask here:
``compact_data`` takes the function that runs the rewrites (docs/design/store.md, "Data compaction").
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import format as fmt
from .errors import CorruptionError, ShardCommittedError
from .index import ShardInfo, parse_index_part_record, read_parquet, shard_info
from .order import shard_sequence
from .reader import open_store
from .store import Store
from .storage import Storage
from .writer import DEFAULT_SHARD_BYTES, Rewrite

# Old objects outlive the switch by this long: a reader that opened before it loads the old
# shards' rows and data when it first reads them, and a training run keeps one snapshot open for
# days (and resumes from it). A week, as Delta Lake keeps removed files by default; the replaced
# shards are small ones, and `mmcache compact --grace 0` frees them at once when nothing reads.
DEFAULT_GRACE_S = 7 * 24 * 3600.0
# A shard is "small", and so rewritten, below this fraction of the target size: one between it
# and the target is already few requests per byte, and rewriting it would cost more than it saves.
SMALL_FRACTION = 0.25


@dataclass(kw_only=True)
class DataCompaction:
    """Settings of a data compaction (``mmcache compact``; the end of ``mmcache encode``)."""

    target_bytes: int = DEFAULT_SHARD_BYTES  # a rewritten shard holds about this many bytes
    grace_s: float = DEFAULT_GRACE_S         # replaced objects are deleted this long after the switch

    def __post_init__(self) -> None:
        if self.target_bytes < 1 or self.grace_s < 0:
            raise ValueError(f"a data compaction needs target_bytes > 0 and grace_s >= 0, got {self.target_bytes} and {self.grace_s}")


@dataclass(kw_only=True)
class Group:
    """Small shards rewritten into one: ``shards`` in the shuffles' sequence; ``replaces`` adds what
    those shards replaced themselves, so that a replaced name stays known once its rewrite goes."""

    shards: list[str]
    replaces: list[str]
    committed_at: float
    name: str


@dataclass(kw_only=True)
class DataSummary:
    shards_before: int = 0
    groups: int = 0
    written: list[str] = field(default_factory=list)  # rewrites committed by this run
    lost_races: int = 0                               # groups another compactor committed first
    deleted: list[str] = field(default_factory=list)  # replaced shards whose objects went after the grace

    def line(self) -> str:
        raced = f" ({self.lost_races} committed by another compactor first)" if self.lost_races else ""
        return (f"data: rewrote {len(self.written)} shard(s) from {self.groups} group(s) of small shards{raced} "
                f"({self.shards_before} shard(s) before); deleted {len(self.deleted)} replaced shard(s) past the grace")


def shard_nbytes(info: ShardInfo) -> int:
    return sum(int(o["nbytes"]) for o in info.objects.values())


def plan_groups(store: Store, target_bytes: int) -> list[Group]:
    """Groups of small shards, in the sequence epoch orders visit them (``shard_sequence``: not
    in commit order, so two encodes of the same inputs compact alike), of about ``target_bytes``
    each (two shards or more per group), the shards of a group holding the same fields. A shard
    holding a sample field that another shard holds too (racing writers) is left alone: `mmcache
    repair` settles it first."""
    raced = set() if store.dense else {shard for _, _, shard in store.duplicates} | _winners(store)
    open_groups: dict[tuple[str, ...], tuple[list[ShardInfo], int]] = {}
    groups: list[list[ShardInfo]] = []
    for info in (store.shards[name] for name in shard_sequence(store)):
        size = shard_nbytes(info)
        if size >= target_bytes * SMALL_FRACTION or info.name in raced:
            continue
        key = tuple(sorted(info.layouts))
        members, total = open_groups.get(key, ([], 0))
        members, total = [*members, info], total + size
        if total >= target_bytes:
            groups.append(members)
            members, total = [], 0
        open_groups[key] = (members, total)
    groups += [members for members, _ in open_groups.values() if len(members) > 1]
    return [_group(store, members) for members in groups if len(members) > 1]


def _winners(store: Store) -> set[str]:
    """Shards whose rows win over a duplicate elsewhere: moving them would change the winner."""
    samples = store.sample_index
    return {samples.shard_of[samples.holder[f][samples.row_of[i]]] for i, f, _ in samples.duplicates}


def _group(store: Store, members: list[ShardInfo]) -> Group:
    names = [info.name for info in members]
    closure = {old for info in members for old in info.replaces}
    digest = hashlib.sha256(json.dumps(names).encode()).hexdigest()
    earliest = min(members, key=lambda info: (info.committed_at, info.name))  # its place in snapshot order
    return Group(shards=names, replaces=names + sorted(closure - set(names)), committed_at=earliest.committed_at,
                 name=fmt.rewrite_name(earliest.name, digest))


def rewrite_group(url: str, storage_options: dict[str, Any] | None, group: Group) -> str | None:
    """Write ``group`` as one shard and commit it as their replacement (on a worker, or in
    process). Returns its name, or None when another compactor committed the same group first
    (theirs is kept, this copy deleted)."""
    source = open_store(url, storage_options, shards=group.shards)
    target = open_store(url, storage_options, mode="a", load_index=False, manifest=source.manifest)
    fields = sorted(source.shards[group.shards[0]].layouts)
    try:
        writer = target.writer(shard_bytes=1 << 62, fields=fields or None, compact_every=0, allow_nonfinite=True)
        meta_columns = source.meta_columns
        for name in group.shards:
            _copy_shard(source, writer, name, meta_columns)
        try:
            return writer.commit(group.name, rewrite=Rewrite(replaces=tuple(group.replaces), committed_at=group.committed_at))
        except ShardCommittedError:
            return None
    finally:
        source.close()
        target.close()


def _copy_shard(source: Store, writer: Any, name: str, meta_columns: list[str]) -> None:
    info = source.shards[name]
    if info.num_rejected:
        for reject in read_parquet(source.storage.read(info.rejects_key)).to_pylist():
            writer.reject(reject.pop("source"), reject.pop("reason"), **reject)
    rows = source.shard_rows(name)
    metas = {c: source.index.column(c).slice(rows.start, len(rows)).to_pylist() for c in meta_columns}
    for k, (sample_id, arrays) in enumerate(source.iter_shard(name)):
        # Copies: the scan's arrays may be views of a block it reuses.
        writer.add(sample_id, {f: a.copy() for f, a in arrays.items()}, {c: v[k] for c, v in metas.items() if v[k] is not None})


def compact_data(store: Store, config: DataCompaction, storage_options: dict[str, Any] | None = None,
                 run: Callable[[Callable[..., str | None], Sequence[Group]], Iterable[str | None]] | None = None) -> DataSummary:
    """Rewrite the small shards of ``store``'s snapshot into shards of about ``config.target_bytes``
    and delete replaced objects past ``config.grace_s``. ``run(fn, groups)`` runs
    ``fn(group)`` for each group (default: here, one after the other)."""
    summary = DataSummary(shards_before=len(store.shards))
    groups = plan_groups(store, config.target_bytes)
    summary.groups = len(groups)
    fn = _Rewriter(store.url, storage_options)
    for name in (run or _in_process)(fn, groups):
        if name is None:
            summary.lost_races += 1
        else:
            summary.written.append(name)
    # Nothing replaced before this pass, nothing past a grace: its own replaced shards are not
    # (a listing and a read saved, each a request on an object store), unless the grace is 0.
    if store.replaced or config.grace_s <= 0:
        summary.deleted = delete_replaced(store.storage, config.grace_s)
    return summary


def _in_process(fn: Callable[[Group], str | None], groups: Sequence[Group]) -> list[str | None]:
    return [fn(group) for group in groups]


@dataclass
class _Rewriter:
    """``rewrite_group`` bound to a store: what a Dask worker is sent (no closure)."""

    url: str
    storage_options: dict[str, Any] | None

    def __call__(self, group: Group) -> str | None:
        return rewrite_group(self.url, self.storage_options, group)


def rewritten_at(storage: Storage, entry: str, shard: str) -> tuple[float, tuple[str, ...]] | None:
    """(when rewrite ``shard`` was committed, what it replaces), from its index part ``entry``;
    None when it is gone."""
    key = f"{fmt.INDEX_DIR}/{entry}"
    try:
        _, record = parse_index_part_record(storage.read(key), shard, key, storage.url, None)
    except FileNotFoundError:
        return None
    return float(record.get("rewritten_at") or 0.0), fmt.replaced_shards(shard, record.get("replaces"), key)


def replaced_ages(storage: Storage, now: float) -> tuple[dict[str, str], dict[str, float]]:
    """(every listed shard -> its index part's file name, replaced shard -> seconds since its
    youngest listed rewrite was committed): a shard is past the grace only when every rewrite
    naming it is."""
    listed = {p[0]: e for e in storage.list_dir(fmt.INDEX_DIR) if (p := fmt.parse_index_part_name(e)) is not None}
    age: dict[str, float] = {}
    for shard, entry in listed.items():
        found = rewritten_at(storage, entry, shard) if fmt.is_rewrite_name(shard) else None
        for old in found[1] if found else ():
            age[old] = min(age.get(old, float("inf")), now - found[0])  # type: ignore[index]
    return listed, age


def delete_replaced(storage: Storage, grace_s: float, now: float | None = None) -> list[str]:
    """Delete the objects of replaced shards once every listed rewrite naming them is older than
    ``grace_s``: data and rejects first, the index part last, so that a pass stopped midway
    finds the shard again (still replaced, so still out of every snapshot) and finishes it."""
    listed, age = replaced_ages(storage, time.time() if now is None else now)
    deleted = []
    for shard in sorted(s for s in listed if age.get(s, -1.0) >= grace_s):
        key = f"{fmt.INDEX_DIR}/{listed[shard]}"
        try:
            raw = storage.read(key)
        except FileNotFoundError:
            continue  # another compaction deleted it since our listing
        table, record = parse_index_part_record(raw, shard, key, storage.url, fmt.parse_index_part_name(listed[shard])[1])  # type: ignore[index]
        # Checked like any record before use: it names only objects of its own shard.
        for obj in sorted(shard_info(record, shard, key, len(raw)).objects):
            storage.delete(obj)
        storage.delete(key)
        deleted.append(shard)
    return deleted


def check_replaced(store: Store, report: Any, grace_s: float = DEFAULT_GRACE_S) -> set[str]:
    """``mmcache verify``: every replaced shard still listed must have each of its (sample id,
    field) in the snapshot with the same CRC-32C (a rewrite lost or changed nothing); each is
    noted as replaced (``report.replaced``), past the grace too. Returns their data directories,
    which are not leftovers."""
    listed, age = replaced_ages(store.storage, time.time())
    dirs = set()
    for shard in sorted(s for s in listed if s in store.replaced):
        key = f"{fmt.INDEX_DIR}/{listed[shard]}"
        try:
            raw = store.storage.read(key)
            table, record = parse_index_part_record(raw, shard, key, store.url, fmt.parse_index_part_name(listed[shard])[1])  # type: ignore[index]
            info = shard_info(record, shard, key, len(raw))
        except (CorruptionError, FileNotFoundError) as exc:
            report.warnings.append(f"shard {shard!r}, replaced by a data compaction (readers ignore it): {exc}")
            continue
        dirs.add(info.data_root.rsplit("/", 1)[-1])
        if why := _not_in_snapshot(store, table, list(info.layouts)):
            report.problems.append(f"shard {shard!r}, replaced by data compaction {store.replaced[shard]!r}: {why}")
        past = f"; past the grace of {grace_s:.0f}s, `mmcache compact` deletes it" if age.get(shard, 0.0) >= grace_s else ""
        report.replaced.append(f"shard {shard!r} was replaced by data compaction {store.replaced[shard]!r} "
                               f"{age.get(shard, 0.0):.0f}s ago; readers no longer read it{past}")
    return dirs


def _not_in_snapshot(store: Store, table: Any, fields: list[str]) -> str:
    """Why the rows of a replaced shard are not all in the snapshot as they were ('' if they are)."""
    ids = table.column("id").to_pylist()
    samples = store.sample_index
    for name in fields:
        crcs = table.column(f"{name}.crc32c").to_pylist()
        for sample_id, crc in zip(ids, crcs, strict=True):
            row = samples.row_of.get(sample_id)
            holder = -1 if row is None else int(samples.holder[name][row])
            if holder < 0:
                return f"sample {sample_id!r} field {name!r} is in no shard of the snapshot (lost)"
            if int(samples.crcs[name][holder]) != crc:
                return f"sample {sample_id!r} field {name!r} differs in the snapshot (another CRC-32C)"
    return ""
