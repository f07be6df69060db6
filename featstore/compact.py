"""Index checkpoints, written (``mmcache compact``; writers every so often): the rows of many
committed index parts in two Parquet objects, then a marker in ``index/`` that makes them
visible; old checkpoints are pruned marker first. Reading them is featstore.checkpoints'
(docs/FORMAT.md, "Index checkpoints"; docs/design/store.md, "Index checkpoints, written").
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import checksums
from . import format as fmt
from .checkpoints import (
    CHECKPOINT_DIR,
    CHECKPOINT_VERSION,
    KEEP,
    Checkpoint,
    CheckpointWarning,
    checkpoint_keys,
    digest_of,
    ids_key,
    marker_name,
    marker_doc,
    markers,
    object_keys,
    parts_object,
    read_checkpoint,
)
from .errors import CorruptionError, FeatstoreError, FormatVersionError
from .idhash import id_hashes
from .index import first_id_of, index_parts, list_index, parquet_bytes
from .snapshot import gather_parts
from .storage import Storage

# Writers start a compaction after about this many commits (StoreWriter(compact_every=...)).
DEFAULT_COMPACT_EVERY = 64


# ---- writing -------------------------------------------------------------------------------
@dataclass
class CompactSummary:
    key: str | None = None        # the checkpoint now in effect (None: the store has no parts)
    marker: str = ""              # its marker's name under index/
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


def compact_store(storage: Storage, *, keep: int = KEEP, rebuild: bool = False, listing: dict[str, str] | None = None) -> CompactSummary:
    """Write a checkpoint covering every index part committed now (reading only those the newest
    checkpoint lacks), publish it, and prune older checkpoints. Safe beside readers, writers and
    other compactors: it creates objects only if absent and deletes only checkpoints.
    ``rebuild``: read every part, ignoring the existing checkpoints, and then delete all of them
    (for one that ``mmcache verify`` found disagreeing with the parts)."""
    gathered = gather_parts(storage, strict=False, use_checkpoint=not rebuild, checkpoint_problems=[], listing=listing)
    summary = CompactSummary(damaged=gathered.damaged)
    if not gathered.order:
        return summary
    old = gathered.checkpoint
    summary.new_parts = sum(1 for entry, _ in gathered.order if entry not in gathered.covered)
    summary.parts, summary.rows = len(gathered.order), gathered.table.num_rows
    # (An older compactor's checkpoint is written again, with the first ids an order reads.)
    if old is not None and not summary.new_parts and len(gathered.covered) == len(old.parts) and old.current:
        summary.key, summary.nbytes, summary.marker = old.key, old.nbytes, old.marker  # nothing committed or deleted since
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
        # "samples": distinct ids, what lets a reader answer len() from the shard table alone.
        samples = pc.count_distinct(gathered.table.column("id")).as_py() if gathered.table.num_rows else 0
        doc = {"checkpoint_version": CHECKPOINT_VERSION, "format_version": fmt.FORMAT_VERSION, "rows": gathered.table.num_rows, "samples": samples,
               # Copied out of the records (an order asks for every shard's: no record is decoded then).
               "first_ids": [first_id_of(info) for _, info in gathered.order]}
        parts_raw = parts_object(described, doc)
        rows_raw = parquet_bytes(gathered.table.replace_schema_metadata(None), {})
        digest = digest_of(parts_raw, rows_raw)
        # No ids, no ids object: an empty object is one some S3 servers never answer the PUT of.
        ids_raw = np.unique(id_hashes(gathered.table.column("id"))).astype("<u8").tobytes() if gathered.table.num_rows else None
        objects = [(key, raw) for key, raw in zip((*checkpoint_keys(digest), ids_key(digest)), (parts_raw, rows_raw, ids_raw), strict=True) if raw is not None]
        # Content-named: a concurrent compactor of the same parts writes the very same bytes.
        for key, raw in objects:
            if not storage.write_new(key, raw):
                # Other bytes under a name that is the hash of these: a damaged copy. Writing the
                # right ones over it is what anyone would write there.
                storage.write_atomic(key, raw)
        # Trusted only once read back whole and matching its name; only then is it published.
        read_checkpoint(storage, digest, "")
        summary.marker = marker_name(len(gathered.order), digest)
        storage.write_new(f"{fmt.INDEX_DIR}/{summary.marker}", marker_doc(len(gathered.order), gathered.table.num_rows, parts_raw, rows_raw, ids_raw))
        summary.key, summary.nbytes, summary.written = f"{CHECKPOINT_DIR}/{digest}", len(parts_raw) + len(rows_raw), True
    # The listing it gathered from, and its own marker: a marker written since is a concurrent
    # compactor's, and its own prune's.
    listed = {**gathered.listing, **({summary.marker: ""} if summary.marker else {})}
    summary.pruned = _prune(storage, summary.key, keep, listed, everything=rebuild, replaced=set(gathered.replaced))
    return summary


def _prune(storage: Storage, current: str, keep: int, listing: dict[str, str], everything: bool = False, replaced: Collection[str] = ()) -> list[str]:
    """Delete checkpoints less complete than ``current`` beyond the ``keep`` newest, any whose
    objects are damaged or gone, and any that would rank above ``current`` but cover parts no
    longer listed as they were (deleted after a data compaction replaced them, or by repair) or
    shards a data compaction replaced (``replaced``: still listed within its grace): readers
    would pick it and use little of it. Marker first: a reader that listed it and then finds the
    objects gone takes the next checkpoint, or reads the parts."""
    found = markers(listing)
    mine = next((m for m in found if f"{CHECKPOINT_DIR}/{m[1]}" == current), None)
    pruned, kept = [], 0
    for parts, digest, marker in found:
        key = f"{CHECKPOINT_DIR}/{digest}"
        if key == current:
            kept += 1
            continue
        checkpoint = None if everything else _healthy(storage, digest, marker)
        above = mine is not None and parts >= mine[0]
        # An older version's checkpoint of as many parts as ours (ours rewrote it) is of no use.
        stale = above and checkpoint is not None and (_covers_gone(checkpoint, listing) or _older_of_as_many(checkpoint, parts, mine)
                                                      or _covers_replaced(checkpoint, replaced))
        if checkpoint is not None and not stale and (kept < keep or above):
            kept += 1
            continue  # a recent one readers may have listed, or a concurrent compactor's
        storage.delete(f"{fmt.INDEX_DIR}/{marker}")
        for obj in object_keys(digest):
            storage.delete(obj)
        pruned.append(key)
    return pruned


def _healthy(storage: Storage, digest: str, marker: str) -> Checkpoint | bool | None:
    """The checkpoint read back whole; True for a newer mmcache's (not ours to judge); None if
    it is damaged or gone."""
    try:
        return read_checkpoint(storage, digest, marker)
    except FormatVersionError:
        return True
    except (FileNotFoundError, CorruptionError):
        return None


def _older_of_as_many(checkpoint: Checkpoint | bool, parts: int, mine: tuple[int, str, str] | None) -> bool:
    return isinstance(checkpoint, Checkpoint) and not checkpoint.current and mine is not None and parts == mine[0]


def _covers_replaced(checkpoint: Checkpoint | bool, replaced: Collection[str]) -> bool:
    return bool(replaced) and not isinstance(checkpoint, bool) and any(part.info.name in replaced for part in checkpoint.parts.values())


def _covers_gone(checkpoint: Checkpoint | bool, listing: dict[str, str]) -> bool:
    return not isinstance(checkpoint, bool) and any(listing.get(entry) != part.listed for entry, part in checkpoint.parts.items())


def uncovered_parts(listing: dict[str, str]) -> int:
    """Index parts in a listing beyond what its most complete checkpoint covers (by the count
    in the marker's name: nothing is read). A checkpoint counting more parts than are listed
    covers some deleted since (replaced by a data compaction, or by repair): readers would read
    it in vain, so its own count adds to the listed parts, all of which it may have missed."""
    parts = len(index_parts(listing))
    found = markers(listing)
    best = found[0][0] if found else 0
    return parts - best if best <= parts else parts + best


def after_commit(storage: Storage, shard: str, every: int, commits: int) -> None:
    """Called by a writer after its ``commits``-th commit. Every ``every``-th commit of a writer,
    and any commit whose shard name hashes to 0 modulo ``every`` (so that writers of one shard
    each, like encode tasks, take part without coordination), lists the index and compacts it
    when at least ``every`` parts are not covered by a checkpoint. The commit has happened
    whatever this does: a failure here is a warning."""
    if every <= 0 or (commits % every and checksums.crc32c(shard.encode()) % every):
        return
    compact_when(storage, every, f"after shard {shard!r}")


# A writer's close and an encode job's end checkpoint the index when that is cheap next to what
# they wrote, so that whatever a writer closes opens from the shard table: a checkpoint is
# rewritten whole, so one of many parts waits until the uncovered parts are this share of it
# (meanwhile an open reads those parts itself, and writers compact every DEFAULT_COMPACT_EVERY).
CLOSE_SHARE = 8


def compact_when(storage: Storage, uncovered: int, when: str) -> None:
    """Compact the index if at least ``uncovered`` parts are not covered by a checkpoint."""
    _compact_if(storage, lambda listing: uncovered_parts(listing) >= uncovered, when)


def compact_at_close(storage: Storage, when: str) -> None:
    """Checkpoint the index at a writer's close if any part is not covered and that is cheap
    (``CLOSE_SHARE``)."""
    def cheap(listing: dict[str, str]) -> bool:
        found, uncovered = markers(listing), uncovered_parts(listing)
        return uncovered > 0 and uncovered * CLOSE_SHARE >= (found[0][0] if found else 0)

    _compact_if(storage, cheap, when)


def _compact_if(storage: Storage, wanted: Callable[[dict[str, str]], bool], when: str) -> None:
    """Compact the index if ``wanted(listing)``. The commits are done whatever this does: a
    failure is a warning, not an error."""
    try:
        if wanted(listing := list_index(storage)):
            compact_store(storage, listing=listing)
    except (FeatstoreError, OSError) as exc:
        warnings.warn(f"{storage.url}: automatic index compaction {when} failed ({exc}); every shard is committed, "
                      f"and `mmcache compact {storage.url}` can be run at any time", CheckpointWarning, stacklevel=4)
