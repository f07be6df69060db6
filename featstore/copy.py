"""``mmcache copy SRC DST``: copy a store between any two URLs (local, s3://, memory://, ...).

The copy follows the store's own commit protocol, so a reader of the destination never sees a
half-copied shard, and an interrupted copy resumes by doing only what is missing:

1. The manifest (``zarr.json``) and the shards group go first: the destination is then a valid,
   empty-looking store, before any index part exists there.
2. Per shard, every object of its commit record (data, zarr metadata, rejects) is copied in
   parallel, each checked against the size and CRC-32C its commit record gives, so a damaged
   source is never propagated. An object an interrupted copy left behind is kept when its size
   and CRC-32C match, and copied again otherwise.
3. The shard's index part goes last, byte for byte (its name carries its CRC-32C): that PUT (or
   rename, on disk) commits the shard at the destination.

Shards already committed at the destination are skipped; one committed there with different
content is an error (the destination is another store). The source is read as the snapshot
taken when the copy starts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from featstore import format as fmt
from featstore.errors import CorruptionError, NotAStoreError, SchemaError
from featstore.storage import Storage, open_storage


@dataclass(kw_only=True)
class CopySummary:
    src: str
    dst: str
    shards: int
    shards_copied: int
    shards_skipped: int
    objects_copied: int
    objects_kept: int
    bytes_copied: int
    seconds: float

    def line(self) -> str:
        rate = self.bytes_copied / self.seconds / 1e6 if self.seconds > 0 else 0.0
        return (
            f"copied {self.shards_copied} shard(s) ({self.bytes_copied / 1e6:.1f} MB, {rate:.1f} MB/s, "
            f"{self.objects_kept} object(s) kept from an earlier try), {self.shards_skipped} already there "
            f"-> {self.dst}"
        )


class _ByteBudget:
    """Bounds the bytes held in memory by copies in flight (objects are read whole)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.held and self.held + n > self.limit:
                self._cond.wait()
            self.held += n

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()


def copy_store(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    *,
    workers: int = 8,
    max_inflight_bytes: int = 1 << 30,
    progress: Callable[[int, int, int], None] | None = None,
) -> CopySummary:
    """Copy the store at ``src`` to ``dst``; re-running it copies only what is missing.
    ``progress(shards_done, shards_total, bytes_copied)`` is called after each shard."""
    from featstore.reader import open_store

    t0 = time.perf_counter()
    source = open_store(src, src_options)  # strict: a damaged index part fails the copy at once
    dest = open_storage(dst, dst_options)
    try:
        _put_manifest(source.storage, dest)
        at_dest = {}
        for entry in dest.list_dir(fmt.INDEX_DIR):
            parsed = fmt.parse_index_part_name(entry)
            if parsed:
                at_dest[parsed[0]] = entry
        todo, skipped = [], 0
        for name, info in source.shards.items():
            mine = info.index_key.rsplit("/", 1)[-1]
            if name in at_dest:
                if at_dest[name] != mine:
                    raise SchemaError(
                        f"{dest.url}: shard {name!r} is committed there with other content ({at_dest[name]}, not {mine}); "
                        "the destination holds another store: copy into a new location"
                    )
                skipped += 1
            else:
                todo.append(info)
        counts = {"objects_copied": 0, "objects_kept": 0, "bytes_copied": 0}
        lock = threading.Lock()
        budget = _ByteBudget(max_inflight_bytes)

        def copy_one(key: str, expected: dict[str, int]) -> None:
            copied = _copy_object(source.storage, dest, key, expected, budget)
            with lock:
                counts["objects_copied" if copied else "objects_kept"] += 1
                counts["bytes_copied"] += copied

        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="featstore-copy") as pool:
            plan: list[tuple[Any, list[Future]]] = [
                (info, [pool.submit(copy_one, key, expected) for key, expected in info.objects.items()]) for info in todo
            ]
            try:
                for done, (info, futures) in enumerate(plan, 1):
                    for future in futures:
                        future.result()
                    _commit_shard(source.storage, dest, info)
                    if progress:
                        progress(done + skipped, len(source.shards), counts["bytes_copied"])
            except BaseException:
                for _, futures in plan:
                    for future in futures:
                        future.cancel()
                raise
        return CopySummary(
            src=source.url, dst=dest.url, shards=len(source.shards), shards_copied=len(todo), shards_skipped=skipped,
            seconds=time.perf_counter() - t0, **counts,
        )
    finally:
        source.close()
        dest.close()


def _put_manifest(src: Storage, dest: Storage) -> None:
    raw = src.read(fmt.MANIFEST_KEY)
    manifest = fmt.parse_root_group(raw, src.url)
    try:
        existing = dest.read(fmt.MANIFEST_KEY)
    except FileNotFoundError:
        existing = None
    if existing is None:
        if not dest.is_empty():
            raise NotAStoreError(f"{dest.url} exists, is not empty and is not a feature store; copy into a new location")
    elif existing != raw:
        theirs = fmt.parse_root_group(existing, dest.url)
        # The same store, if its fields are the source's (or some of them: fields added since).
        same_fields = all(manifest["fields"].get(n, {}).get("dtype") == f["dtype"] for n, f in theirs["fields"].items())
        if not same_fields or theirs.get("attrs") != manifest.get("attrs"):
            raise SchemaError(f"{dest.url} holds a different feature store (fields {sorted(theirs['fields'])}); copy into a new location")
        # Its manifest since completed (ndims fixed by a first commit, fields added): take the source's.
    if existing != raw:
        if not dest.exists(f"{fmt.SHARDS_DIR}/zarr.json"):
            dest.write_atomic(f"{fmt.SHARDS_DIR}/zarr.json", fmt.group_json())
        dest.write_atomic(fmt.MANIFEST_KEY, raw)


def _copy_object(src: Storage, dest: Storage, key: str, expected: dict[str, int], budget: _ByteBudget) -> int:
    """Copy one committed object, checked against its commit record; returns bytes copied (0
    when a matching copy is already there)."""
    nbytes, crc = int(expected["nbytes"]), int(expected["crc32c"])
    budget.acquire(nbytes)
    try:
        try:
            have = dest.size(key)
        except FileNotFoundError:
            have = None
        if have == nbytes and fmt.crc32c(dest.read(key)) == crc:
            return 0  # left whole by an interrupted copy
        data = src.read(key)
        if len(data) != nbytes:
            raise CorruptionError(f"{src.url}/{key} has {len(data)} bytes, its commit record says {nbytes}: the source is damaged, run `mmcache verify {src.url}`")
        if fmt.crc32c(data) != crc:
            raise CorruptionError(f"{src.url}/{key} fails its checksum: the source is damaged, run `mmcache verify {src.url}`")
        dest.write_parts(key, [data])
        return nbytes
    finally:
        budget.release(nbytes)


def _commit_shard(src: Storage, dest: Storage, info: Any) -> None:
    raw = src.read(info.index_key)
    _, crc = fmt.parse_index_part_name(info.index_key.rsplit("/", 1)[-1])
    if fmt.crc32c(raw) != crc:
        raise CorruptionError(f"{src.url}/{info.index_key}: index part of shard {info.name!r} fails its checksum")
    dest.write_atomic(info.index_key, raw)  # the commit point at the destination
