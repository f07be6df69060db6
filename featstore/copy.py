"""``mmcache copy SRC DST``: copy a store between any two URLs (local, s3://, memory://, ...).

The copy follows the store's commit protocol (manifest first, each shard's objects checked
against its commit record, its index part last), so a reader of the destination never sees a
half-copied shard and an interrupted copy resumes; ``merge`` copies into another store with the
same fields. Prompt embeddings are copied too (docs/design/store.md, "Copying a store").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import checksums, compact
from . import format as fmt
from . import manifest as manifests
from .errors import CorruptionError, NotAStoreError, SchemaError
from .index import index_parts, parse_index_part, row_problem
from .prompts import list_parts, part_bytes, read_part
from .reader import open_store
from .store import Store
from .repair import rewritten_part
from .backends import open_storage
from .storage import Storage


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
    samples_dropped: int = 0  # --merge: rows left out because the destination holds those samples
    prompts_copied: int = 0  # prompt-embedding objects written at the destination
    prompts_dropped: int = 0  # --merge: embeddings left out because the destination holds others

    def line(self) -> str:
        rate = self.bytes_copied / self.seconds / 1e6 if self.seconds > 0 else 0.0
        return (
            f"copied {self.shards_copied} shard(s) ({self.bytes_copied / 1e6:.1f} MB, {rate:.1f} MB/s, "
            f"{self.objects_kept} object(s) kept from an earlier try), {self.shards_skipped} already there"
            + (f", {self.samples_dropped} sample(s) the destination already held left out" if self.samples_dropped else "")
            + (f", {self.prompts_copied} prompt-embedding object(s)" if self.prompts_copied else "")
            + (f" ({self.prompts_dropped} prompt(s) the destination holds otherwise left out)" if self.prompts_dropped else "")
            + f" -> {self.dst}"
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
    merge: bool = False,
) -> CopySummary:
    """Copy the store at ``src`` to ``dst``; re-running it copies only what is missing. A
    destination that holds shards the source lacks is refused, unless ``merge``: then the
    source's shards are added, without the samples the destination already holds.
    ``progress(shards_done, shards_total, bytes_copied)`` is called after each shard."""
    t0 = time.perf_counter()
    if nested := _nested(src, dst):
        raise SchemaError(nested)
    source = open_store(src, src_options)  # strict: a damaged index part fails the copy at once
    dest = open_storage(dst, dst_options)
    try:
        _put_manifest(source, dest)
        at_dest = {part.shard: part.entry for part in index_parts(dest.list_dir(fmt.INDEX_DIR))}
        if (foreign := sorted(set(at_dest) - set(source.shards))) and not merge:
            raise SchemaError(
                f"{dest.url} already holds {len(foreign)} shard(s) that {source.url} lacks (e.g. {foreign[0]!r}): it is not an "
                "earlier copy of it, and copying would mix two stores; copy into a new location, or pass --merge to add the "
                "source's samples that the destination lacks"
            )
        todo, skipped, dropped = _plan_shards(source, dest, at_dest, _held_at(dst, dst_options) if foreign else set())
        prompts, prompts_dropped = _plan_prompts(source, dest, merge)
        for key, raw in prompts:  # small objects, each created only if absent
            if not dest.write_new(key, raw):
                raise SchemaError(f"{dest.url}/{key} was written with other content meanwhile; run the copy again")
        report = None if progress is None else lambda done, copied: progress(done + skipped, len(source.shards), copied)
        ndims = {name: spec.ndim for name, spec in source.fields.items()}
        counts = _copy_shards(source.storage, dest, todo, workers, _ByteBudget(max_inflight_bytes), report, ndims)
        if todo:  # a checkpoint of its own: the source's records fingerprints of the source's listing, not of this one
            compact.compact_at_close(dest, "at the end of the copy")
        return CopySummary(
            src=source.url, dst=dest.url, shards=len(source.shards), shards_copied=len(todo), shards_skipped=skipped,
            seconds=time.perf_counter() - t0, samples_dropped=dropped, prompts_copied=len(prompts), prompts_dropped=prompts_dropped, **counts,
        )
    finally:
        source.close()
        dest.close()


def _nested(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """Why a copy from ``src`` to ``dst`` would read or write itself, if one lies inside the other
    ('' if neither): on one file system, by path (local ones resolved: a link or '..' cannot hide it)."""
    import fsspec

    (src_protocol, src_path), (dst_protocol, dst_path) = (fsspec.core.split_protocol(os.fspath(url)) for url in (src, dst))
    local = {None, "file", "local"}
    if src_protocol in local and dst_protocol in local:
        src_path, dst_path = os.path.realpath(src_path), os.path.realpath(dst_path)
    elif src_protocol != dst_protocol:
        return ""
    a, b = src_path.rstrip("/") + "/", dst_path.rstrip("/") + "/"
    if a == b:
        return f"the source {os.fspath(src)} and the destination {os.fspath(dst)} are the same location: there is nothing to copy"
    if b.startswith(a):
        return f"the destination {os.fspath(dst)} is inside the source {os.fspath(src)}: the copy would be written into the store it copies; copy to a location outside it"
    if a.startswith(b):
        return f"the source {os.fspath(src)} is inside the destination {os.fspath(dst)}: copy to a location that does not hold it"
    return ""


def _plan_shards(source: Store, dest: Storage, at_dest: dict[str, str], held: set[tuple[str, str]]) -> tuple[list[tuple[Any, set[str]]], int, int]:
    """(shards to copy with the sample ids each leaves out, shards already there, samples left
    out). ``held``: the (sample id, field) pairs the destination holds (--merge)."""
    todo, skipped, dropped = [], 0, 0
    for name, info in source.shards.items():
        mine = info.index_key.rsplit("/", 1)[-1]
        if name in at_dest:
            if at_dest[name] != mine or dest.read(f"{fmt.INDEX_DIR}/{at_dest[name]}") != source.storage.read(info.index_key):
                raise SchemaError(
                    f"{dest.url}: shard {name!r} is committed there with other content; "
                    "the destination holds another store: copy into a new location"
                )
            skipped += 1
            continue
        # --merge: each (sample id, field) stays in one shard; the destination's copy wins.
        rows, ids = source.shard_rows(name), source.sample_index.ids
        drop = {ids[r] for r in rows if any((ids[r], f) in held for f in info.layouts)}
        held.update((ids[r], f) for r in rows for f in info.layouts if ids[r] not in drop)
        dropped += len(drop)
        todo.append((info, drop))
    return todo, skipped, dropped


def _copy_shards(src: Storage, dest: Storage, todo: list[tuple[Any, set[str]]], workers: int, budget: _ByteBudget,
                 progress: Callable[[int, int], None] | None, ndims: dict[str, int | None]) -> dict[str, int]:
    """Copy each shard's objects (``workers`` at a time, within ``budget`` bytes in flight), then
    commit it at the destination, in order; ``progress(shards_done, bytes_copied)`` after each."""
    counts = {"objects_copied": 0, "objects_kept": 0, "bytes_copied": 0}
    lock = threading.Lock()

    def copy_one(key: str, expected: dict[str, int]) -> None:
        copied = _copy_object(src, dest, key, expected, budget)
        with lock:
            counts["objects_copied" if copied else "objects_kept"] += 1
            counts["bytes_copied"] += copied

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="featstore-copy") as pool:
        plan: list[tuple[Any, set[str], list[Future]]] = [
            (info, drop, [pool.submit(copy_one, key, expected) for key, expected in info.objects.items()]) for info, drop in todo
        ]
        try:
            for done, (info, drop, futures) in enumerate(plan, 1):
                for future in futures:
                    future.result()
                _commit_shard(src, dest, info, drop, ndims)
                if progress:
                    progress(done, counts["bytes_copied"])
        except BaseException:
            for _, _, futures in plan:
                for future in futures:
                    future.cancel()
            raise
    return counts


def _put_manifest(source: Any, dest: Storage) -> None:
    manifest = source.storage_manifest()  # with the declarations folded in
    raw = fmt.root_group_json(manifest)
    try:
        existing = dest.read(fmt.MANIFEST_KEY)
    except FileNotFoundError:
        existing = None
    if existing is None:
        if not dest.is_empty():
            raise NotAStoreError(f"{dest.url} exists, is not empty and is not a feature store; copy into a new location")
    elif existing != raw:
        theirs = manifests.merged(dest, fmt.parse_root_group(existing, dest.url))
        # The same store, if its fields are the source's (or some of them: fields added since).
        same_fields = all(manifest["fields"].get(n, {}).get("dtype") == f["dtype"] for n, f in theirs["fields"].items())
        if not same_fields or theirs.get("attrs") != manifest.get("attrs"):
            raise SchemaError(f"{dest.url} holds a different feature store (fields {sorted(theirs['fields'])}); copy into a new location")
        # Its manifest since completed (ndims fixed by a first commit, fields added): take the source's.
    if existing != raw:
        if not dest.exists(f"{fmt.SHARDS_DIR}/zarr.json"):
            dest.write_atomic(f"{fmt.SHARDS_DIR}/zarr.json", fmt.group_json())
        dest.write_atomic(fmt.MANIFEST_KEY, raw)


def _plan_prompts(source: Any, dest: Storage, merge: bool) -> tuple[list[tuple[str, bytes]], int]:
    """The prompt-embedding objects to create at ``dest`` (key, bytes), and how many embeddings
    ``merge`` left out. Every object on both sides is read and checked; a damaged one is an error."""
    # What the destination held before this copy: (field, digest, prompt) -> embedding. (The
    # source is compared with it only: a source whose own objects differ on a prompt, e.g. encoded
    # on two devices, is copied as it is.)
    held: dict[tuple[str, str, str], tuple[str, tuple[int, ...], bytes]] = {}
    there = set()
    for key in list_parts(dest):
        try:
            part = read_part(dest.read(key), key, dest.url)
        except CorruptionError as exc:
            raise CorruptionError(f"{exc}: the destination is damaged; delete that object (the copy writes it again) and retry") from None
        there.add(key)
        for prompt, value in part.embeddings.items():
            held.setdefault((part.field, part.digest, prompt), value)  # readers take the first in name order
    todo, dropped = [], 0
    for key in list_parts(source.storage):
        try:
            raw = source.storage.read(key)
            part = read_part(raw, key, source.url)
        except CorruptionError as exc:
            raise CorruptionError(f"{exc}: the source is damaged, run `mmcache verify {source.url}`") from None
        other = {p for p, v in part.embeddings.items() if held.get((part.field, part.digest, p), v) != v}
        if other and not merge:
            shown = ", ".join("the empty prompt" if p == "" else repr(p[:40]) for p in sorted(other)[:3])
            raise SchemaError(
                f"{dest.url} holds other embeddings of {shown} (field {part.field!r}, encoder {part.digest}) than {source.url}/{key}: "
                "it is not a copy of this store; copy into a new location, or pass --merge to keep the destination's"
            )
        dropped += len(other)
        if key in there:
            continue  # the destination holds this set of prompts already (an earlier copy's, or its own)
        kept = {p: v for p, v in part.embeddings.items() if p not in other}
        if other and kept:
            key, raw = part_bytes(part.field, part.fingerprint, kept)  # the source's object without them
        if kept and key not in there:
            todo.append((key, raw))
            there.add(key)
    return todo, dropped


def _held_at(url: str | os.PathLike[str], options: dict[str, Any] | None) -> set[tuple[str, str]]:
    """Every (sample id, field) the destination's readers see."""

    with open_store(url, options) as store:
        return {(sample_id, field) for sample_id in store.sample_ids() for field in store.fields_of(sample_id)}


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
        if have == nbytes and checksums.crc32c(dest.read(key)) == crc:
            return 0  # left whole by an interrupted copy
        data = src.read(key)
        if len(data) != nbytes:
            raise CorruptionError(f"{src.url}/{key} has {len(data)} bytes, its commit record says {nbytes}: the source is damaged, run `mmcache verify {src.url}`")
        if checksums.crc32c(data) != crc:
            raise CorruptionError(f"{src.url}/{key} fails its checksum: the source is damaged, run `mmcache verify {src.url}`")
        dest.write_parts(key, [data])
        return nbytes
    finally:
        budget.release(nbytes)


def _commit_shard(src: Storage, dest: Storage, info: Any, drop: set[str], ndims: dict[str, int | None]) -> None:
    raw = src.read(info.index_key)
    table, _ = parse_index_part(raw, info.name, info.index_key, src.url, fmt.parse_index_part_name(info.index_key.rsplit("/", 1)[-1])[1])
    if wrong := row_problem(table, info, ndims):
        raise CorruptionError(f"{src.url}/{info.index_key}: {wrong}: the source is damaged, run `mmcache verify {src.url}`")
    key = info.index_key
    if drop:  # --merge: the same objects, an index part without the rows the destination holds
        raw, key = rewritten_part(raw, info, drop, info.name), fmt.index_part_key(info.name)
    if not dest.write_new(key, raw):  # the commit point at the destination
        raise SchemaError(f"{dest.url}: shard {info.name!r} was committed there with other content meanwhile; the destination holds another store")
