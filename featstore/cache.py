"""A local read-through cache of a remote store's objects (``mmcache.featstore.open(..., cache_dir=)``).

A second epoch (or run) of a trainer streaming ``s3://...`` reads at local-disk speed. Correct by
construction: only committed objects (which never change) are cached, keyed by their size and
CRC-32C, downloaded whole and checked before use; bounded, shared by processes, and never making
a read fail (docs/design/store.md, "The local read-through cache").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from . import cache_files as files
from .errors import ConfigError, CorruptionError
from .storage import ReadRequest, Storage

log = logging.getLogger("mmcache.featstore.cache")

LAYOUT = "mmcache-objects-v1"
STALE_PART_SECONDS = 3600   # temporary files older than this belong to a dead process
TOUCH_SECONDS = 30          # refresh an entry's mtime (its LRU age) at most this often
LOW_WATER = 0.9             # an eviction frees down to this share of the bound
STATS = ("requests", "hits", "misses", "uncached_reads", "downloads", "bytes_downloaded", "bytes_read", "other_bytes")


class CachingStorage(Storage):
    MAX_OPEN_FILES = 256
    FETCH_THREADS = 8

    def __init__(self, remote: Storage, cache_dir: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.remote = remote
        self.url = remote.url
        self.root = Path(cache_dir).expanduser().resolve() / LAYOUT
        try:
            for sub in ("objects", "tmp", "locks"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cache directory {cache_dir}: {exc}") from None
        self.scans = 0  # full scans of the directory (O(entries) each): once here, then rarely
        with files.locked(self.root / "lock"):
            held = self._usage()[0]
            self._write_ledger(held)
        if max_bytes is None:  # default: most of the free space (what is cached already counts as free)
            max_bytes = int(0.8 * (shutil.disk_usage(self.root).free + held))
        if max_bytes <= 0:
            raise ConfigError(f"cache size must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._known: dict[str, tuple[int, int]] = {}
        # key -> open descriptor of its entry; a descriptor is closed only when no read holds it
        self._handles: OrderedDict[str, files.Handle] = OrderedDict()
        self._touched: dict[str, float] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._stats = dict.fromkeys(STATS, 0)

    def _count(self, **increments: int) -> None:
        with self._lock:  # the fetch threads of one reader update these together
            for name, value in increments.items():
                self._stats[name] += value

    def stats(self) -> dict[str, float]:
        """Counters since this cache was opened (this process only), and the hit rate:

        ``requests`` reads of committed objects (one per object per sample field read);
        ``hits`` of them served from a copy already here, ``misses`` after downloading the
        object whole, ``uncached_reads`` by byte ranges from the store; ``downloads`` whole
        objects fetched; ``bytes_downloaded`` bytes received for committed objects (whole or
        ranged); ``bytes_read`` bytes handed to readers; ``other_bytes`` manifest and index
        parts read through; ``hit_rate`` hits / requests."""
        with self._lock:
            out: dict[str, float] = dict(self._stats)
        out["hit_rate"] = out["hits"] / out["requests"] if out["requests"] else 0.0
        return out

    def admits(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` is downloaded whole (else it is read by ranges)."""
        return 2 * nbytes <= LOW_WATER * self.max_bytes

    # ---- what may be cached -------------------------------------------------------------
    def known_objects(self, objects: dict[str, dict[str, int]]) -> None:
        self._known.update({key: (int(o["nbytes"]), int(o["crc32c"])) for key, o in objects.items()})

    def _entry_name(self, key: str) -> str:
        nbytes, crc = self._known[key]
        return hashlib.sha256(json.dumps([self.url, key, nbytes, crc]).encode()).hexdigest()

    def _entry_path(self, name: str) -> Path:
        return self.root / "objects" / name[:2] / name

    # ---- reads --------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        if key not in self._known:
            data = self.remote.read(key)
            self._count(other_bytes=len(data))
            return data
        out = np.empty(self._known[key][0], dtype=np.uint8)
        self.read_into([(key, [(0, out.size)], out)])
        return out.tobytes()

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        self.read_into([(key, ranges, out)])

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        keys = list(dict.fromkeys(key for key, _, _ in requests if key in self._known))
        missing = [k for k in keys if k not in self._handles]
        # How the first request of each key fetched in advance was served (later ones are hits).
        fetched: dict[str, str] = {}
        if len(missing) > 1:  # fetch what a batch needs concurrently
            with ThreadPoolExecutor(min(self.FETCH_THREADS, len(missing)), thread_name_prefix="cache-fetch") as pool:
                for key, (handle, outcome) in zip(missing, pool.map(self._acquire, missing), strict=True):
                    self._release(handle)
                    if outcome == "miss":
                        fetched[key] = outcome
        remote, counts = [], dict.fromkeys(("requests", "hits", "misses", "uncached_reads", "bytes_read", "bytes_downloaded", "other_bytes"), 0)
        for key, ranges, out in requests:
            nbytes = sum(end - start for start, end in ranges)
            if key not in self._known:  # not a committed object: nothing to cache it by
                remote.append((key, ranges, out))
                counts["other_bytes"] += nbytes
                continue
            handle, outcome = self._acquire(key)
            outcome = fetched.pop(key, outcome)
            counts["requests"] += 1
            counts["bytes_read"] += nbytes
            if handle is None:
                remote.append((key, ranges, out))
                counts["uncached_reads"] += 1
                counts["bytes_downloaded"] += nbytes
                continue
            counts["hits" if outcome == "hit" else "misses"] += 1
            try:
                files.pread_ranges(handle.fd, ranges, out, f"{self.url}/{key}")
            finally:
                self._release(handle)
        if remote:
            # cat_ranges: every range comes back whole (a short one raises), so the bytes
            # received are the bytes asked for.
            self.remote.read_into(remote)
        self._count(**counts)

    def _acquire(self, key: str) -> tuple[files.Handle | None, str]:
        """The open, verified local copy of ``key`` (fetched if needed), held until released, and
        how it was found: "hit" (here already) or "miss" (downloaded now); (None, "uncached")
        when it is not cached (it will not fit, no room now, or a local disk error)."""
        with self._lock:
            handle = self._handles.get(key)
            if handle is not None and files.unlinked(handle.fd):
                # Evicted (by any process) since it was opened: reads already holding it finish
                # on it, new ones fetch it again. Reading on from the descriptor would keep the
                # evicted bytes on disk, outside the bound, for as long as it stays open.
                del self._handles[key]
                handle.retired = True
                if handle.refs == 0:
                    os.close(handle.fd)
                handle = None
            if handle is not None:
                self._handles.move_to_end(key)
                handle.refs += 1
                self._touch(key)
                return handle, "hit"
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        nbytes, crc = self._known[key]
        if not self.admits(nbytes):
            return None, "uncached"
        with key_lock:  # one fetch per object per process...
            with self._lock:
                if key in self._handles:
                    handle = self._handles[key]
                    handle.refs += 1
                    return handle, "hit"
            name = self._entry_name(key)
            path = self._entry_path(name)
            outcome = "hit"
            try:
                fd = self._open_verified(path, nbytes, crc)
                if fd is None:
                    with files.locked(self.root / "locks" / name):  # ...and per cache directory
                        fd = self._open_verified(path, nbytes, crc)
                        if fd is None:
                            fd, outcome = self._fetch(key, name, path, nbytes, crc), "miss"
                if fd is None:
                    return None, "uncached"
            except FileNotFoundError:
                raise
            except OSError as exc:  # the local disk (full, read-only, ...): read remotely instead
                log.warning("cache %s: %s; reading %s/%s from the store instead", self.root, exc, self.url, key)
                return None, "uncached"
            handle = files.Handle(fd)
            with self._lock:
                self._handles[key] = handle
                self._touched[key] = time.monotonic()
                while len(self._handles) > self.MAX_OPEN_FILES:
                    _, old = self._handles.popitem(last=False)
                    old.retired = True
                    if old.refs == 0:
                        os.close(old.fd)
            return handle, outcome

    def _release(self, handle: files.Handle | None) -> None:
        if handle is None:
            return
        with self._lock:
            handle.refs -= 1
            if handle.retired and handle.refs == 0:
                os.close(handle.fd)

    def _touch(self, key: str) -> None:
        now = time.monotonic()
        if now - self._touched.get(key, 0.0) > TOUCH_SECONDS:
            self._touched[key] = now
            try:
                os.utime(self._entry_path(self._entry_name(key)))
            except OSError:
                pass  # evicted meanwhile: this process keeps reading its open copy

    def _open_verified(self, path: Path, nbytes: int, crc: int) -> int | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        if os.fstat(fd).st_size == nbytes and files.file_crc(fd, nbytes) == crc:
            try:
                os.utime(path)
            except FileNotFoundError:
                pass  # evicted meanwhile by another download: this descriptor still reads it
            return fd
        size = os.fstat(fd).st_size
        os.close(fd)
        log.warning("cache entry %s does not match its object (size or checksum); fetching it again", path)
        with files.locked(self.root / "lock"):
            if files.unlink(path):
                self._add_to_ledger(-size)
        return None

    def _fetch(self, key: str, name: str, path: Path, nbytes: int, crc: int) -> int | None:
        """Download ``key`` into its entry; the open descriptor of the verified bytes (valid even
        if a concurrent download evicts the entry before this process reads it), or None when
        there is no room now."""
        where = f"{self.url}/{key}"
        for attempt in (1, 2):  # a second try in case the bytes were damaged in transit
            part = self._reserve(name, nbytes)
            if part is None:
                return None
            try:
                self.remote.get_file(key, str(part))
                fd = os.open(part, os.O_RDONLY)
                size = os.fstat(fd).st_size
                self._count(bytes_downloaded=size)  # what arrived, checked or not
                if size == nbytes and files.file_crc(fd, nbytes) == crc:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    # Under the directory's lock: a scan lists objects/ then tmp/, and must not
                    # miss a reservation that turns into an entry between the two.
                    with files.locked(self.root / "lock"):
                        os.replace(part, path)  # the entry appears whole and verified, or not at all
                    self._count(downloads=1)
                    return fd  # the reservation is now the entry: the ledger already counts it
                os.close(fd)
            finally:
                if os.path.exists(part):  # not committed: give the reservation back
                    with files.locked(self.root / "lock"):  # file and ledger change together
                        if files.unlink(part):
                            self._add_to_ledger(-nbytes)
            if size != nbytes:
                raise CorruptionError(f"{where}: the store holds {size} bytes, its commit record says {nbytes} (truncated or overwritten); run `mmcache verify {self.url}`")
            if attempt == 2:
                raise CorruptionError(f"{where} fails its checksum (corrupted in the store); run `mmcache verify {self.url}`")
        raise AssertionError("unreachable: the second attempt returns or raises")

    # ---- size bound ---------------------------------------------------------------------
    def _reserve(self, name: str, nbytes: int) -> Path | None:
        """Make room for ``nbytes`` and create the temporary file that reserves it; both under the
        directory's lock, so concurrent fetches (of any process) see each other. None when the
        room is held by other downloads still in flight (they cannot be evicted)."""
        with files.locked(self.root / "lock"):
            total = self._read_ledger()
            if total is None or total + nbytes > self.max_bytes:
                total = self._evict(nbytes)
            if total + nbytes > self.max_bytes:
                return None  # in-flight downloads hold the room: read this object remotely
            part = self.root / "tmp" / f"{name}.{nbytes}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
            part.touch()
            self._write_ledger(total + nbytes)
            return part

    def _evict(self, nbytes: int) -> int:
        """Scan, then evict least recently used entries until ``nbytes`` more fit under the low
        water mark (the caller holds the directory lock); the bytes held afterwards."""
        total, entries = self._usage()
        goal = max(0, min(self.max_bytes - nbytes, int(self.max_bytes * LOW_WATER) - nbytes))
        for _mtime, size, entry in sorted(entries):
            if total <= goal:
                break
            files.unlink(entry)
            files.unlink(self.root / "locks" / entry.name)
            total -= size
        return total

    def _read_ledger(self) -> int | None:
        try:
            return int((self.root / "usage").read_text())
        except (OSError, ValueError):  # missing or half-written: the caller scans instead
            return None

    def _write_ledger(self, total: int) -> None:
        (self.root / "usage").write_text(str(max(0, total)))

    def _add_to_ledger(self, delta: int) -> None:
        total = self._read_ledger()
        if total is not None:
            self._write_ledger(total + delta)

    def _usage(self) -> tuple[int, list[tuple[float, int, Path]]]:
        """Bytes held (entries + reservations of in-flight fetches) and the entries, oldest first."""
        self.scans += 1
        total, entries = 0, []
        for sub in files.scandir(self.root / "objects"):
            for entry in files.scandir(Path(sub.path)):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                total += st.st_size
                entries.append((st.st_mtime, st.st_size, Path(entry.path)))
        now = time.time()
        for entry in files.scandir(self.root / "tmp"):
            try:
                age = now - entry.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > STALE_PART_SECONDS:
                files.unlink(Path(entry.path))
            else:
                parts = entry.name.split(".")
                total += int(parts[1]) if len(parts) == 5 and parts[1].isdigit() else 0
        return total, entries

    def cached_bytes(self) -> int:
        return self._usage()[0]

    # ---- everything else goes to the store ----------------------------------------------
    def write_atomic(self, key: str, data: bytes) -> None:
        self.remote.write_atomic(key, data)

    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        self.remote.write_parts(key, parts)

    def write_many(self, objects: Sequence[tuple[str, Sequence[Any]]]) -> None:
        self.remote.write_many(objects)

    def write_new(self, key: str, data: bytes) -> bool:
        return self.remote.write_new(key, data)

    def delete(self, key: str) -> None:
        self.remote.delete(key)

    def exists(self, key: str) -> bool:
        return self.remote.exists(key)

    def size(self, key: str) -> int:
        return self.remote.size(key)

    def list_dir(self, prefix: str) -> list[str]:
        return self.remote.list_dir(prefix)

    def list_names(self, prefix: str, start: str) -> list[str]:
        return self.remote.list_names(prefix, start)

    def list_fingerprints(self, prefix: str) -> dict[str, str]:
        return self.remote.list_fingerprints(prefix)

    def get_file(self, key: str, local_path: str) -> None:
        self.remote.get_file(key, local_path)

    @property
    def local_cache(self) -> CachingStorage:
        return self

    @property
    def is_remote(self) -> bool:
        return self.remote.is_remote

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.retired = True
                if handle.refs == 0:
                    os.close(handle.fd)
            self._handles.clear()
        self.remote.close()


def parse_size(value: int | str, what: str = "size") -> int:
    """``1073741824``, ``"1GiB"``, ``"500MB"``, ``"2 TiB"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", str(value), re.I)
        if not match:
            raise ConfigError(f"{what}: {value!r} is not a size (e.g. 500MB, 20GiB)")
        number, unit = float(match.group(1)), (match.group(2) or "").upper()
    scale = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(number * scale)
    if size <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return size
