"""What a finished ``mmcache encode`` job does to the store it wrote: rewrite its small shards
into large ones (a data compaction, featstore.rewrite) when it holds clearly more of them than it
should, then checkpoint the index (featstore.compact). Every shard is committed by then: a
failure here is a warning in the log, and ``mmcache compact`` can be run at any time."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ... import featstore
from ...featstore import compact
from ...featstore.rewrite import SMALL_FRACTION, DataCompaction, Group, compact_data, delete_replaced, shard_nbytes
from ..config import EncodeConfig


def shards_wanted(store: featstore.Store, target_bytes: int, workers: int) -> int:
    """How many shards the store should hold: max(workers, bytes / target)."""
    total = sum(shard_nbytes(info) for info in store.shards.values())
    return max(1, workers, math.ceil(total / target_bytes))


# Fewer small shards than this are left as they are: opening or reading a store of a few more
# shards costs next to nothing, and a small job (or one re-run of a few rows) should not pay a
# rewrite of everything it wrote (its index checkpoint costs little: compact.compact_at_close).
MIN_SMALL_SHARDS = 8


def too_many_small(store: featstore.Store, target_bytes: int, workers: int) -> int:
    """The number of small shards when they are at least ``MIN_SMALL_SHARDS`` and more than twice
    what the store should hold, else 0."""
    small = sum(1 for info in store.shards.values() if shard_nbytes(info) < target_bytes * SMALL_FRACTION)
    return small if small >= MIN_SMALL_SHARDS and small > 2 * shards_wanted(store, target_bytes, workers) else 0


def on_executor(executor: Any) -> Callable[[Callable[[Group], str | None], Sequence[Group]], list[str | None]]:
    """Run each group's rewrite as a task of the job's executor (a Dask cluster's workers, or the
    thread executor's): the bytes go through the workers, not through this process, and a Dask
    job's tasks are tracked by its worker watch (no live worker left: they end, not hang)."""

    def run(fn: Callable[[Group], str | None], groups: Sequence[Group]) -> list[str | None]:
        return [future.result() for future in executor.map(fn, groups, pure=False)]

    return run


def compact_after_job(config: EncodeConfig, store: featstore.Store, storage_options: dict[str, Any] | None, *,
                      executor: Any, workers: int, tasks_done: int, samples_written: int, log: Callable[[str], Any]) -> None:
    """Compact the data, where it has too many small shards, and then the index (as a writer's
    close does: where cheap, compact.compact_at_close). ``store`` is the snapshot the job planned
    from."""
    changed = False
    # At most this many small shards now (a small one holds at most samples_per_task rows; a tar's
    # task commits one per part): below MIN_SMALL_SHARDS, with nothing replaced, no request is made.
    bound = len(store.shards) + tasks_done + samples_written // config.run.samples_per_task
    try:
        if config.run.compact_data and (bound >= MIN_SMALL_SHARDS or store.replaced):
            changed = _compact_data(config, store.url, storage_options, executor=executor, workers=workers, log=log)
    except Exception as exc:  # noqa: BLE001 - whatever it was (a worker lost, a full disk), every shard is committed: said, not raised
        log(f"warning: data compaction at the end of the job failed ({type(exc).__name__}: {exc}); every shard is committed, "
            f"and `mmcache compact {store.url}` can be run at any time")
    if tasks_done or changed:
        # Its readers (every rank of every run) then open from a checkpoint, not part by part;
        # a job that committed nothing costs no listing for it.
        compact.compact_at_close(store.storage, "at the end of the job")


def _compact_data(config: EncodeConfig, url: str, storage_options: dict[str, Any] | None, *, executor: Any, workers: int,
                  log: Callable[[str], Any]) -> bool:
    """Rewrite the small shards of what the job left, if too many; else delete the objects of
    shards replaced over the grace ago. Returns whether the index changed (a shard rewritten, or
    replaced parts deleted: a checkpoint of them is stale)."""
    settings = DataCompaction(target_bytes=int(config.run.shard_bytes), grace_s=config.run.compact_grace)
    current = featstore.open(url, storage_options)  # what the job left, not what it planned from
    if small := too_many_small(current, settings.target_bytes, workers):
        summary = compact_data(current, settings, storage_options, run=on_executor(executor))
        log(f"data compaction: {small} small shard(s) of {len(current.shards)}; {summary.line()}")
        return bool(summary.written)
    if current.replaced and (deleted := delete_replaced(current.storage, settings.grace_s)):
        log(f"data compaction: deleted the objects of {len(deleted)} shard(s) replaced over run.compact_grace ago")
        return True
    return False
