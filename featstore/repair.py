"""``mmcache repair``: drop the rows readers ignore, and the index rewrite it shares with copy.

Racing writers can both commit a (sample id, field) when each checked the store before the
other committed (featstore.writer re-reads the store just before committing, which closes all
but that window). Readers already resolve it, reading the earliest commit's row; repair removes
the later rows for good. A shard whose rows all lose is uncommitted (its index part deleted); one
with some losing rows is committed again under a new name, from an index part without them,
pointing at the same data objects, and only then is the old index part deleted. No data object
moves or changes, so a reader that opened the store before keeps reading it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from . import format as fmt
from .errors import CorruptionError
from .store import Store
from .index import ShardInfo, read_parquet
from .writer import index_part_bytes


@dataclass(kw_only=True)
class RepairSummary:
    rows_removed: int
    shards_rewritten: int
    shards_uncommitted: int

    def line(self) -> str:
        return f"removed {self.rows_removed} duplicate row(s): {self.shards_rewritten} shard(s) recommitted, {self.shards_uncommitted} uncommitted"


def rewritten_part(raw: bytes, info: ShardInfo, drop_ids: set[str], name: str) -> bytes:
    """Index part ``raw`` of ``info`` without the rows of ``drop_ids``, as version-3 shard ``name``
    over the same objects (its data directory and rejects named in the record)."""
    table = read_parquet(raw)
    record = fmt.store_json(table.schema.metadata[fmt.COMMIT_METADATA_KEY])
    kept = table.filter(pc.invert(pc.is_in(table.column("id"), pa.array(sorted(drop_ids), pa.string()))))
    record.update(
        format_version=fmt.EXCLUSIVE_COMMIT_VERSION, shard=name, num_samples=kept.num_rows,
        data=info.data_root, rejects=info.rejects_key, committed_at=info.committed_at,
        first_id=kept.column("id")[0].as_py() if kept.num_rows else None,
    )
    return index_part_bytes(kept, record)


def losing_rows(store: Store) -> dict[str, set[str]]:
    """Shard -> ids of its rows that readers ignore for every field the shard holds."""
    lost: dict[tuple[str, str], set[str]] = {}
    for sample_id, field, shard in store.duplicates:
        lost.setdefault((shard, sample_id), set()).add(field)
    out: dict[str, set[str]] = {}
    for (shard, sample_id), fields in lost.items():
        if fields == set(store.shards[shard].layouts):
            out.setdefault(shard, set()).add(sample_id)
    return out


def repair_store(store: Store) -> RepairSummary:
    """Remove the duplicate rows of ``store`` (opened with mode="a")."""
    summary = RepairSummary(rows_removed=0, shards_rewritten=0, shards_uncommitted=0)
    for shard, drop in losing_rows(store).items():
        info = store.shards[shard]
        raw = store.storage.read(info.index_key)
        if len(drop) == info.num_samples and not info.num_rejected:
            store.storage.delete(info.index_key)
            summary.shards_uncommitted += 1
        else:
            name = _free_name(store, shard)
            if not store.storage.write_new(fmt.index_part_key(name), rewritten_part(raw, info, drop, name)):
                raise CorruptionError(f"{store.url}: shard {name!r} appeared while repairing {shard!r}; run repair again")
            store.storage.delete(info.index_key)
            summary.shards_rewritten += 1
        summary.rows_removed += len(drop)
    return summary


def _free_name(store: Store, shard: str) -> str:
    n = 1
    while store.has_shard(name := _recommitted_name(shard, n)):
        n += 1
    return name


def _recommitted_name(shard: str, n: int) -> str:
    """``<shard>-r<n>``, which sorts right after ``shard`` (so its samples keep their places). A
    data compaction's shard gets ``<shard>-c<12 hex digits>`` instead: a name of its kind, without
    which readers would not honour the ``replaces`` its record keeps (docs/FORMAT.md, "Data
    compaction")."""
    if fmt.is_rewrite_name(shard):
        return fmt.check_shard_name(f"{shard}-c{hashlib.sha256(f'{shard}-r{n}'.encode()).hexdigest()[:12]}")
    return f"{shard}-r{n}"
