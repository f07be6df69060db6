"""Local-disk storage: straight to the OS, because per-call overhead, not bandwidth, decides small
reads: ``mmap`` for reads and scans, ``os.preadv`` into caller-owned buffers, write-to-temp +
``os.replace`` for atomic commits, create-if-absent by ``link``.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import sys
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CorruptionError
from .storage import Storage, check_key


def under_root(path: str, root: str | None) -> bool:
    """Whether the resolved ``path`` is ``root`` or lies under it: the one containment check for
    every path that comes from data (an encode's media, an import's feature files)."""
    return root is not None and (path == root or path.startswith(root.rstrip("/") + "/"))


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
        # Names, then a stat of each through the folder's descriptor (every open lists index/:
        # 12 % less than scandir's stats here). A link is fingerprinted as itself, not followed.
        try:
            folder = os.open(self._path(prefix), os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out, stat = {}, os.stat
        try:
            for name in os.listdir(folder):
                try:
                    st = stat(name, dir_fd=folder, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # a temporary file that went away meanwhile
                # A name recreated after a delete gets a new inode or mtime, whatever its size.
                out[name] = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        finally:
            os.close(folder)
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
