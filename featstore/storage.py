"""A small key/value storage layer under the feature store: local disk or any fsspec URL.

Two implementations of one interface, chosen from the URL. Local paths go straight to the OS
(``mmap`` for reads and scans, ``os.preadv`` into caller-owned buffers, write-to-temp +
``os.replace`` for atomic commits),
because per-call overhead, not bandwidth, decides small reads. Everything else (``memory://``,
``s3://``, ...) goes through fsspec, whose single-object PUTs are atomic and whose
``cat_ranges`` batches many ranged reads into few concurrent requests.

Remote operations are retried (``mmcache.featstore.retry``): a transient fault (HTTP 5xx, throttling,
connection reset or refused, timeout, a body cut short) is tried again with backoff, and one that
persists fails with a ``StorageError`` naming the object. Messages never carry credentials.

Writes to an object store are batched (``write_many``): a shard's data objects go up at once, as
concurrent requests on fsspec's event loop, large ones in parts (S3 multipart upload) that are
each retried on their own, so a commit costs a few round trips whatever its number of objects.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import logging
import mmap
import os
import stat
import sys
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from mmcache.featstore import secrets
from mmcache.featstore.errors import ConfigError, CorruptionError
from mmcache.featstore.retry import RetryPolicy, describe, is_transient, remote_filesystem, with_retries, with_retries_async

__all__ = ["FsspecStorage", "LocalStorage", "RetryPolicy", "Storage", "UploadPolicy", "open_storage", "with_retries"]
T = TypeVar("T")
log = logging.getLogger("mmcache.featstore.storage")

# (key, byte ranges, flat uint8 buffer the ranges fill, back to back)
ReadRequest = tuple[str, Sequence[tuple[int, int]], np.ndarray]


class Storage(abc.ABC):
    """Where a store's objects live. Keys are '/'-separated paths relative to the store root.

    A backend implements the abstract methods; the others have plain defaults that a backend
    overrides where it can do better (batched or concurrent requests, memory maps). What a
    backend can do is asked through its capability properties and methods (``is_remote``,
    ``map_object``, ``page_cache_visible``, ``local_cache``), never through its type. Every
    backend passes one conformance suite (tests/featstore/storage_conformance.py).
    """

    url: str

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        raise NotImplementedError

    @abc.abstractmethod
    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        """Fill ``out`` (a flat uint8 buffer) with the concatenation of the byte ranges."""
        raise NotImplementedError

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        """Many ``read_ranges`` at once; remote backends issue them concurrently."""
        for key, ranges, out in requests:
            self.read_ranges(key, ranges, out)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        out = np.empty(end - start, dtype=np.uint8)
        self.read_ranges(key, [(start, end)], out)
        return out.tobytes()

    def page_cache_visible(self, key: str) -> bool:
        """Whether ``mincore`` on a mapping of ``key`` tells which of its pages are in the page
        cache: Linux (since 5.0) answers it only for a file the process owns or may write, and
        claims every page otherwise. False where objects are not files."""
        return False

    def map_object(self, key: str, nbytes: int) -> np.ndarray | None:
        """The whole object (of ``nbytes``, from its commit record) as a flat uint8 array backed by
        the OS page cache, or None where objects cannot be mapped (then callers read ranges)."""
        return None

    def view_range(self, key: str, nbytes: int, start: int, end: int) -> np.ndarray | None:
        """Bytes ``[start, end)`` of the object (of ``nbytes``, from its commit record) as a
        read-only flat uint8 view of the OS page cache, without a copy, or None where objects
        cannot be mapped (then callers read ranges). The object stays mapped while a view of it
        is held; the storage keeps a few mapped for the next reads."""
        return None

    @abc.abstractmethod
    def write_atomic(self, key: str, data: bytes) -> None:
        """Publish ``data`` under ``key`` so that readers see all of it or nothing."""
        raise NotImplementedError

    @abc.abstractmethod
    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        """Write a large object from buffers without joining them first (need not be atomic)."""
        raise NotImplementedError

    def write_many(self, objects: Sequence[tuple[str, Sequence[Any]]]) -> None:
        """Write several objects, each from its buffers as ``write_parts`` does, and return once
        all are written; remote backends upload them concurrently. On failure some may be written
        and others not (callers only ever batch objects that nothing names yet)."""
        for key, parts in objects:
            self.write_parts(key, parts)

    @abc.abstractmethod
    def write_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` only if it does not exist yet, atomically: of writers
        racing on one key exactly one wins, and nobody's bytes are replaced. Returns False when
        another writer's object is there (True when it holds these very bytes: a retried
        request whose first answer was lost)."""
        raise NotImplementedError

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object (missing is fine): only ever objects this writer made and lost."""
        raise NotImplementedError

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        raise NotImplementedError

    @abc.abstractmethod
    def size(self, key: str) -> int:
        raise NotImplementedError

    @abc.abstractmethod
    def list_dir(self, prefix: str) -> list[str]:
        """Names (not paths) directly under ``prefix``; empty if it does not exist."""
        raise NotImplementedError

    def list_names(self, prefix: str, start: str) -> list[str]:
        """Names directly under ``prefix`` that begin with ``start``."""
        return [name for name in self.list_dir(prefix) if name.startswith(start)]

    def list_fingerprints(self, prefix: str) -> dict[str, str]:
        """Names directly under ``prefix`` -> a fingerprint of each object that changes when it is
        rewritten (size plus mtime, inode or ETag), from one listing. '' where the backend gives
        no such thing (then a reader cannot tell a rewritten object from the one it knew)."""
        return {name: "" for name in self.list_dir(prefix)}

    def get_file(self, key: str, local_path: str) -> None:
        """Copy a whole object to a local file (backends stream it, not held in memory)."""
        Path(local_path).write_bytes(self.read(key))

    def is_empty(self) -> bool:
        return not self.list_dir("")

    def known_objects(self, objects: dict[str, dict[str, int]]) -> None:
        """Told by a reader which immutable objects it may read, with their ``nbytes`` and
        ``crc32c`` from the commit records (a caching layer keys its entries on them)."""

    @property
    def is_remote(self) -> bool:
        """Objects are behind a network (requests cost milliseconds: batch and overlap them)."""
        return False

    @property
    def local_cache(self) -> Any:
        """The read-through cache (``featstore.cache.CachingStorage``) this storage reads through,
        or None: the trainer reports its hit rates and sizes its read-ahead by it."""
        return None

    def close(self) -> None:
        pass


def check_key(key: str, url: str) -> str:
    """``key`` if it names an object inside the store: relative, '/'-separated, no empty, '.' or
    '..' component, no NUL. Keys come from the store itself (commit records, checkpoints), and a
    shared store is untrusted: a key that could resolve outside it is corruption, never a path."""
    if not isinstance(key, str) or key.startswith("/") or "\0" in key or "\\" in key or any(part in ("", ".", "..") for part in key.split("/")):
        raise CorruptionError(f"{url}: the store names an object {key!r} outside itself: it is damaged or hostile (run `mmcache verify {url}`)")
    return key


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    text = os.fspath(url)
    if "://" not in text or text.startswith("file://"):
        return LocalStorage(text.removeprefix("file://"))
    return FsspecStorage(text, storage_options or {})


class LocalStorage(Storage):
    # Readers keep shard objects open across reads; cap the number so a store with many shards
    # does not exhaust file descriptors.
    MAX_OPEN_FILES = 256
    # Objects kept mapped for random reads (view_range): address space only, plus a descriptor
    # each (Python's mmap holds its own).
    MAX_MAPS = 64

    def __init__(self, path: str) -> None:
        self.root = Path(path).expanduser().resolve()
        self.url = str(self.root)
        self._fds: OrderedDict[str, list] = OrderedDict()
        self._views: OrderedDict[str, tuple[mmap.mmap, np.ndarray]] = OrderedDict()  # view_range's maps, by key
        self._inside: set[str] = set()  # folders (keys) checked to resolve inside the root
        self._lock = threading.Lock()
        # Raw descriptors are not closed by the interpreter: without this, a store opened and
        # dropped without close() kept up to MAX_OPEN_FILES of them for the life of the process.
        weakref.finalize(self, _close_descriptors, self._fds, self._lock, self._views)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key, self.url) if key else self.root

    def _open_object(self, key: str) -> tuple[int, int]:
        """(a read-only descriptor of ``key``, its size); ``key`` must be a regular file inside the
        store: a shared store is untrusted input, and a FIFO or device in it would block or never
        end a read, a symbolic link would reach outside it. O_NONBLOCK keeps the open itself of a
        FIFO from blocking; it changes nothing for a regular file. (Strings, not Paths: an open
        reads every index part through here, and Path operations cost more than the syscalls.)"""
        path = f"{self.url}/{check_key(key, self.url)}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise CorruptionError(f"{path} is a symbolic link: a store holds only regular files (run `mmcache verify {self.url}`)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptionError(f"{path} is not a regular file: a store holds only regular files (run `mmcache verify {self.url}`)")
            folder = key.rpartition("/")[0]
            if folder and folder not in self._inside:
                if not os.path.realpath(f"{self.url}/{folder}").startswith(self.url + os.sep):
                    raise CorruptionError(f"{path} lies outside the store through a symbolic link (run `mmcache verify {self.url}`)")
                self._inside.add(folder)  # directories of committed objects are not replaced
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def _acquire(self, key: str) -> list:
        """An open descriptor entry ``[fd, users, evicted]`` for ``key``. Eviction never closes a
        descriptor another thread is reading from: it is closed when its last user releases it."""
        with self._lock:
            entry = self._fds.get(key)
            if entry is None:
                entry = self._fds[key] = [self._open_object(key)[0], 0, False]
                while len(self._fds) > self.MAX_OPEN_FILES:
                    self._retire(self._fds.popitem(last=False)[1])
            else:
                self._fds.move_to_end(key)
            entry[1] += 1
            return entry

    def _release(self, entry: list) -> None:
        with self._lock:
            entry[1] -= 1
            if entry[1] == 0 and entry[2]:
                os.close(entry[0])

    @staticmethod
    def _retire(entry: list) -> None:  # caller holds the lock
        entry[2] = True
        if entry[1] == 0:
            os.close(entry[0])

    def read(self, key: str) -> bytes:
        fd, size = self._open_object(key)
        try:
            data = os.read(fd, size)
            while len(data) < size and (more := os.read(fd, size - len(data))):  # reads stop at ~2 GiB
                data += more
            return data
        finally:
            os.close(fd)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        entry = self._acquire(key)
        try:
            view = memoryview(out).cast("B")
            pos = 0
            for start, end in ranges:
                want = end - start
                got = os.preadv(entry[0], [view[pos : pos + want]], start)
                if got != want:
                    raise CorruptionError(f"{self._path(key)}: expected {want} bytes at offset {start}, got {got} (truncated)")
                pos += want
        finally:
            self._release(entry)

    def page_cache_visible(self, key: str) -> bool:
        path = self._path(key)
        try:
            return path.stat().st_uid == os.geteuid() or os.access(path, os.W_OK)
        except OSError:
            return False

    def _map(self, key: str, nbytes: int, access: int) -> mmap.mmap:
        # The map lives as long as an array views it. Committed objects are never truncated
        # (writers publish by rename), so checking the size once here keeps a short file from
        # faulting (SIGBUS) later: it is refused as truncated.
        entry = self._acquire(key)
        try:
            size = os.fstat(entry[0]).st_size
            if size < nbytes:
                raise CorruptionError(f"{self._path(key)}: expected {nbytes} bytes, found {size} (truncated)")
            return mmap.mmap(entry[0], nbytes, access=access)
        finally:
            self._release(entry)

    def map_object(self, key: str, nbytes: int) -> np.ndarray | None:
        # Copy-on-write (MAP_PRIVATE): arrays viewing the map are writable like any read's, and a
        # write never reaches the file. A scan maps each block afresh, so no write is seen twice.
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        mapped = self._map(key, nbytes, mmap.ACCESS_COPY)
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)  # a larger kernel read-ahead for a cold scan
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # Linux: a fault reads the file into the page cache in 2 MiB pages, and a 2 MiB page
                # already there is mapped by one page-table entry, not 512 (featstore.scan: the cost
                # of mapping 4 KiB pages was most of a warm scan's time). Copy-on-write stays per page.
                try:
                    mapped.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass  # a kernel without transparent huge pages (EINVAL): 4 KiB pages, only slower
        return np.frombuffer(mapped, dtype=np.uint8)

    def view_range(self, key: str, nbytes: int, start: int, end: int) -> np.ndarray | None:
        # Read-only and shared (MAP_SHARED, PROT_READ): one map serves every read of the object,
        # so a view handed out must not be writable (a write would change what the next read
        # checks). A write through it is numpy's ValueError, never a fault.
        if not 0 <= start <= end <= nbytes:
            raise CorruptionError(f"{self._path(key)}: bytes {start}..{end} asked of an object of {nbytes} (run `mmcache verify {self.url}`)")
        if end == start:
            return np.empty(0, dtype=np.uint8)
        with self._lock:
            held = self._views.get(key)
            if held is not None:
                self._views.move_to_end(key)
        if held is None:
            mapped = self._map(key, nbytes, mmap.ACCESS_READ)
            held = (mapped, np.frombuffer(mapped, dtype=np.uint8))
            with self._lock:
                self._views[key] = held
                while len(self._views) > self.MAX_MAPS:
                    self._views.popitem(last=False)  # unmapped once no view of it is held
        first = start - start % mmap.PAGESIZE
        _prefault(held[0], first, end - first, f"{self.url}/{key}")
        return held[1][start:end]

    @staticmethod
    def _durable_temp(path: Path, parts: Iterable[Any]) -> Path:
        """``parts`` written to a temporary file beside ``path`` and fsynced: data must be durable
        before the index part that commits it is, and is published only by a rename or link."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp

    def write_atomic(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.replace(self._durable_temp(path, [data]), path)

    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        path = self._path(key)
        self._forget(key)
        # Written beside and renamed over: bytes a reader may already hold open (a retried task
        # rewriting its shard) are never truncated under it.
        os.replace(self._durable_temp(path, parts), path)

    def write_new(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._durable_temp(path, [data])
        try:
            # link() publishes the whole file under its name, and fails if the name is taken
            # (rename would silently replace the other writer's file).
            os.link(tmp, path)
            return True
        except FileExistsError:
            return path.read_bytes() == bytes(data)
        finally:
            tmp.unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        self._forget(key)
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Directories exist only through their objects on object stores; here the emptied ones go too.
        for parent in path.parents:
            if parent == self.root or self.root not in parent.parents:
                break
            try:
                parent.rmdir()
            except OSError:  # not empty (or already gone): it still holds something
                break

    def _forget(self, key: str) -> None:
        with self._lock:
            entry = self._fds.pop(key, None)
            if entry is not None:
                self._retire(entry)
            self._views.pop(key, None)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_fingerprints(self, prefix: str) -> dict[str, str]:
        out = {}
        try:
            with os.scandir(self._path(prefix)) as entries:
                for entry in entries:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue  # a temporary file that went away meanwhile
                    # A name recreated after a delete gets a new inode or mtime, whatever its size.
                    out[entry.name] = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        except (FileNotFoundError, NotADirectoryError):
            pass
        return out

    def close(self) -> None:
        _close_descriptors(self._fds, self._lock, self._views)


def _close_descriptors(fds: OrderedDict[str, list], lock: threading.Lock, views: OrderedDict[str, Any]) -> None:
    """Close a LocalStorage's cached descriptors (one still in use closes when it is released)
    and drop its maps (one a caller still views is unmapped, and its descriptor closed, when the
    last view goes): ``close()``, and the finalizer of a storage dropped without it."""
    with lock:
        for entry in fds.values():
            LocalStorage._retire(entry)
        fds.clear()
        views.clear()


# madvise(MADV_POPULATE_READ), Linux 5.14+ (Python names it from 3.13 on): a range's page-table
# entries in one call, what is not in the page cache read from disk, instead of a page fault per
# 64 KiB when the CRC first touches the range (warm random reads of 1 MiB ~1.4x faster here).
_POPULATE_READ: int | None = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)
_populate_unknown: list[bool] = []  # holds False once the kernel said it has no such advice


def _prefault(mapped: mmap.mmap, start: int, length: int, where: str) -> None:
    if _POPULATE_READ is not None and not _populate_unknown:
        try:
            mapped.madvise(_POPULATE_READ, start, length)
            return
        except OSError as exc:
            if exc.errno == errno.EFAULT:  # a page past the end: the file shrank after it was mapped
                raise CorruptionError(f"{where}: truncated while mapped (committed objects never change)") from None
            if exc.errno != errno.EINVAL:
                raise
            _populate_unknown.append(False)  # a kernel before 5.14: faults populate it instead
    if hasattr(mapped, "madvise"):
        # One read-ahead request for the whole range where it is not in the page cache (a fault
        # alone reads only its window, 128 KiB by default).
        mapped.madvise(mmap.MADV_WILLNEED, start, length)


@dataclass(frozen=True)
class UploadPolicy:
    """How ``FsspecStorage.write_many`` uploads. The requests in flight at once come from the
    filesystem's own ``max_concurrency`` (an s3fs storage option, default 10) when it has one."""

    concurrency: int = 10             # requests in flight at once, per batch
    part_bytes: int = 16 << 20        # multipart part size (S3 needs at least 5 MiB)
    multipart_above: int = 32 << 20   # objects larger than this go up in parts


class FsspecStorage(Storage):
    retry = RetryPolicy()
    uploads = UploadPolicy()

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        secrets.register(storage_options)
        try:
            # featstore's retries are the only ones: s3fs's and botocore's are set to one attempt.
            self.fs, root = remote_filesystem(url, storage_options, self.retry)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open {secrets.redact_url(url)}: {describe(exc)}") from None
        self.root = root.rstrip("/")
        # s3fs: its async internals (listing without a probe of the parent, multipart calls)
        # save round trips; any other filesystem goes through fsspec's public API only.
        self._s3 = hasattr(self.fs, "_call_s3") and hasattr(self.fs, "_lsdir")
        protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, tuple) else self.fs.protocol
        self.url = secrets.redact_url(f"{protocol}://{self.root.removeprefix('/')}" if protocol != "memory" else f"memory://{self.root}")

    @property
    def is_remote(self) -> bool:
        return True

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key, self.url)}" if key else self.root

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        return with_retries(fn, self._where(key), op, self.retry)

    def read(self, key: str) -> bytes:
        # One GET: s3fs would first ask for the size (a HEAD per read) to fetch large objects
        # in concurrent ranges, which the objects read whole here (manifest, index parts) are not.
        kwargs = {"max_concurrency": 1} if self._s3 else {}
        return self._call("read", key, lambda: self.fs.cat_file(self._path(key), **kwargs))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        self.read_into([(key, ranges, out)])

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        # One flat list of ranges, fetched concurrently by cat_ranges; under faults only the
        # ranges that failed are fetched again.
        pieces = []  # (key, start, end, out view)
        for key, ranges, out in requests:
            view = memoryview(out).cast("B")
            pos = 0
            for start, end in ranges:
                pieces.append((key, start, end, view[pos : pos + end - start]))
                pos += end - start
        pending = [p for p in pieces if p[2] > p[1]]
        if not pending:
            return

        def attempt() -> None:
            nonlocal pending
            blobs = self.fs.cat_ranges([self._path(p[0]) for p in pending], [p[1] for p in pending], [p[2] for p in pending], on_error="return")
            failed, first = [], None
            for piece, blob in zip(pending, blobs, strict=True):
                key, start, end, view = piece
                if isinstance(blob, BaseException):
                    failed.append(piece)
                    if first is None or (is_transient(first[1]) and not is_transient(blob)):
                        first = (key, blob)  # a permanent failure decides: no retry
                    continue
                if len(blob) != end - start:
                    raise CorruptionError(f"{self._where(key)}: expected {end - start} bytes at offset {start}, got {len(blob)} (truncated)")
                view[:] = blob
            pending = failed
            if first is not None:
                where[0] = first[0]
                raise first[1]

        where = [pending[0][0]]
        with_retries(attempt, lambda: self._where(where[0]), "read", self.retry)

    def get_file(self, key: str, local_path: str) -> None:
        """Download a whole object to a local file (streamed, not held in memory)."""
        self._call("read", key, lambda: self.fs.get_file(self._path(key), local_path))

    def write_atomic(self, key: str, data: bytes) -> None:
        # One PUT: object stores (and the in-memory fs) publish it whole or not at all. A retry
        # after a lost response PUTs the same bytes again, which changes nothing.
        payload = bytes(data)
        self._call("write", key, lambda: self.fs.pipe_file(self._path(key), payload))

    # Backends whose PUT can be made conditional (If-None-Match: * on S3; an exclusive open in
    # memory). Elsewhere write_new checks, then writes: not atomic, but every object name a writer
    # creates besides the commit record is unique to it (see featstore.writer).
    _CONDITIONAL_PUT = ("s3", "s3a", "memory")

    def write_new(self, key: str, data: bytes) -> bool:
        payload, path = bytes(data), self._path(key)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)

        def create() -> bool:
            try:
                if any(p in self._CONDITIONAL_PUT for p in protocols):
                    self.fs.pipe_file(path, payload, mode="create")
                elif self.fs.exists(path):
                    raise FileExistsError(path)
                else:
                    self.fs.pipe_file(path, payload)
                return True
            except FileExistsError:
                self.fs.invalidate_cache(path)
                return self.fs.cat_file(path) == payload

        return self._call("write", key, create)

    def delete(self, key: str) -> None:
        path = self._path(key)

        def remove() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", key, remove)

    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        parts = list(parts)  # a retry writes them again from the start

        def write() -> None:
            with self.fs.open(self._path(key), "wb") as fh:
                for part in parts:
                    fh.write(part)

        self._call("write", key, write)

    def write_many(self, objects: Sequence[tuple[str, Sequence[Any]]]) -> None:
        if not getattr(self.fs, "async_impl", False) or not hasattr(self.fs, "_pipe_file"):
            return super().write_many(objects)  # a synchronous filesystem (memory://): in turn
        from fsspec.asyn import sync

        sync(self.fs.loop, self._upload_all, list(objects))

    async def _upload_all(self, objects: list[tuple[str, Sequence[Any]]]) -> None:
        limit = asyncio.Semaphore(max(1, int(getattr(self.fs, "max_concurrency", 0) or self.uploads.concurrency)))
        # Every upload runs to its end (none is left running behind a raised error); the first
        # failure is then raised.
        results = await asyncio.gather(*(self._upload(limit, key, parts) for key, parts in objects), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _upload(self, limit: asyncio.Semaphore, key: str, parts: Sequence[Any]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        if self._s3 and size > self.uploads.multipart_above:
            return await self._upload_in_parts(limit, key, views, size)
        data = b"".join(views)
        async with limit:
            # A retry after a lost answer PUTs the same bytes again, which changes nothing.
            await with_retries_async(lambda: self.fs._pipe_file(self._path(key), data), self._where(key), "write", self.retry)

    async def _upload_in_parts(self, limit: asyncio.Semaphore, key: str, views: list[memoryview], size: int) -> None:
        """An S3 multipart upload, each part retried on its own: a fault costs one part, not
        the object. The object appears whole at completion, or not at all."""
        bucket, path, _ = self.fs.split_path(self._path(key))
        where, step = self._where(key), max(5 << 20, self.uploads.part_bytes)

        def s3(method: str, **kwargs: Any) -> Callable[[], Any]:
            return lambda: self.fs._call_s3(method, Bucket=bucket, Key=path, **kwargs)

        async with limit:
            upload = (await with_retries_async(s3("create_multipart_upload"), where, "write", self.retry))["UploadId"]

        async def put_part(number: int, start: int) -> dict[str, Any]:
            async with limit:  # a part's bytes are joined only once it may be sent
                body = _joined_range(views, start, min(size, start + step))
                out = await with_retries_async(s3("upload_part", UploadId=upload, PartNumber=number, Body=body), f"{where} (part {number})", "write", self.retry)
            return {"PartNumber": number, "ETag": out["ETag"]}

        try:
            results = await asyncio.gather(*(put_part(i + 1, start) for i, start in enumerate(range(0, size, step))), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            tried = [0]

            async def complete() -> None:
                tried[0] += 1
                try:
                    await s3("complete_multipart_upload", UploadId=upload, MultipartUpload={"Parts": results})()
                except Exception as exc:
                    # A retry whose first answer was lost: the upload is complete and gone. The
                    # key is this writer's own, so the object there is the one just completed.
                    if tried[0] > 1 and isinstance(exc, FileNotFoundError) and (await self.fs._info(self._path(key), refresh=True))["size"] == size:
                        return
                    raise

            async with limit:
                await with_retries_async(complete, where, "write", self.retry)
        except BaseException:
            try:  # the parts uploaded so far would otherwise be kept (and billed) by the service
                await s3("abort_multipart_upload", UploadId=upload)()
            except Exception as exc:  # noqa: BLE001 - the upload's own failure is what is raised
                log.warning("%s: could not abort the multipart upload (%s); a lifecycle rule removes it", where, describe(exc))
            raise
        finally:
            self.fs.invalidate_cache(self._path(key))

    def exists(self, key: str) -> bool:
        path = self._path(key)

        def probe() -> bool:
            self.fs.invalidate_cache(path)  # s3fs may answer from a stale listing
            try:
                if self._s3:
                    # One HEAD: s3fs's info() follows a miss with a listing (is it a directory?),
                    # and a key here is always an object's.
                    bucket, name, _ = self.fs.split_path(path)
                    self.fs.call_s3("head_object", Bucket=bucket, Key=name)
                else:
                    self.fs.info(path)
            except FileNotFoundError:
                return False
            return True

        return self._call("stat", key, probe)

    def size(self, key: str) -> int:
        path = self._path(key)

        def stat() -> int:
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

        return self._call("stat", key, stat)

    def list_entries(self, prefix: str) -> list[dict[str, Any]]:
        """fsspec's detailed entries directly under ``prefix`` (its own entry left out; empty if it
        does not exist), listed afresh and retried. On S3 one request per 1,000 names: s3fs's
        ls() lists the parent too when a folder is empty (to tell an empty one from a file), a
        second request for every new store's empty folders."""
        path = self._path(prefix)

        def listing() -> list[dict[str, Any]]:
            # Listings are cached by some filesystems (s3fs); a reader must see fresh commits.
            self.fs.invalidate_cache(path)
            try:
                if self._s3:
                    from fsspec.asyn import sync

                    entries = sync(self.fs.loop, self.fs._lsdir, path, refresh=True)
                else:
                    entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
            return [e for e in entries if e["name"].rstrip("/") != path.rstrip("/")]

        return self._call("list", prefix, listing)

    def list_fingerprints(self, prefix: str) -> dict[str, str]:
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: _fingerprint(e) for e in self.list_entries(prefix) if e.get("type") != "directory"}

    def list_dir(self, prefix: str) -> list[str]:
        return sorted({e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.list_entries(prefix)})

    def list_names(self, prefix: str, start: str) -> list[str]:
        # Object stores filter by key prefix on the server (s3fs: find(prefix=...)): asking
        # whether one shard is committed must not page through every index part of the store.
        import inspect

        if "prefix" not in inspect.signature(self.fs.find).parameters:
            return super().list_names(prefix, start)
        path = self._path(prefix)

        def listing() -> list[str]:
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.find(path, maxdepth=1, prefix=start)
            except FileNotFoundError:
                return []
            return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

        return self._call("list", prefix, listing)


def _joined_range(views: list[memoryview], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the concatenation of ``views``."""
    out, pos = [], 0
    for view in views:
        lo, hi = max(start, pos), min(end, pos + view.nbytes)
        if lo < hi:
            out.append(view[lo - pos : hi - pos])
        pos += view.nbytes
        if pos >= end:
            break
    return b"".join(out)


def _fingerprint(entry: dict[str, Any]) -> str:
    # S3 and GCS give a content hash (the ETag of a single PUT is its MD5); others a time stamp.
    tag = next((entry[k] for k in ("ETag", "etag", "md5Hash", "crc32c", "mtime", "LastModified", "created") if entry.get(k) is not None), "")
    return f"{entry.get('size')}:{tag}"
