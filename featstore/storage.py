"""A small key/value storage layer under the feature store: local disk or any fsspec URL.

Two implementations of one interface, chosen from the URL. Local paths go straight to the OS
(``os.preadv`` into caller-owned buffers, write-to-temp + ``os.replace`` for atomic commits),
because per-call overhead, not bandwidth, decides small reads. Everything else (``memory://``,
``s3://``, ...) goes through fsspec, whose single-object PUTs are atomic and whose
``cat_ranges`` batches many ranged reads into few requests.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from featstore.errors import CorruptionError


class Storage:
    """Keys are '/'-separated paths relative to the store root."""

    url: str

    def read(self, key: str) -> bytes:
        raise NotImplementedError

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        """Fill ``out`` (a flat uint8 buffer) with the concatenation of the byte ranges."""
        raise NotImplementedError

    def read_many(self, requests: Sequence[tuple[str, int, int]]) -> list[bytes]:
        return [self.read_range(key, start, end) for key, start, end in requests]

    def read_range(self, key: str, start: int, end: int) -> bytes:
        out = np.empty(end - start, dtype=np.uint8)
        self.read_ranges(key, [(start, end)], out)
        return out.tobytes()

    def write_atomic(self, key: str, data: bytes) -> None:
        """Publish ``data`` under ``key`` so that readers see all of it or nothing."""
        raise NotImplementedError

    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        """Write a large object from buffers without joining them first (need not be atomic)."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def size(self, key: str) -> int:
        raise NotImplementedError

    def list_dir(self, prefix: str) -> list[str]:
        """Names (not paths) directly under ``prefix``; empty if it does not exist."""
        raise NotImplementedError

    def is_empty(self) -> bool:
        return not self.list_dir("")

    def close(self) -> None:
        pass


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    text = os.fspath(url)
    if "://" not in text or text.startswith("file://"):
        return LocalStorage(text.removeprefix("file://"))
    return FsspecStorage(text, storage_options or {})


class LocalStorage(Storage):
    # Readers keep shard objects open across reads; cap the number so a store with many shards
    # does not exhaust file descriptors.
    MAX_OPEN_FILES = 256

    def __init__(self, path: str) -> None:
        self.root = Path(path).expanduser().resolve()
        self.url = str(self.root)
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def _fd(self, key: str) -> int:
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                fd = os.open(self._path(key), os.O_RDONLY)
                self._fds[key] = fd
                if len(self._fds) > self.MAX_OPEN_FILES:
                    os.close(self._fds.popitem(last=False)[1])
            else:
                self._fds.move_to_end(key)
            return fd

    def read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        fd = self._fd(key)
        view = memoryview(out).cast("B")
        pos = 0
        for start, end in ranges:
            want = end - start
            got = os.preadv(fd, [view[pos : pos + want]], start)
            if got != want:
                raise CorruptionError(f"{self._path(key)}: expected {want} bytes at offset {start}, got {got} (truncated)")
            pos += want

    def write_atomic(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._forget(key)
        with open(path, "wb") as fh:
            for part in parts:
                fh.write(part)
            fh.flush()
            # Data must be durable before the index part that commits it is.
            os.fsync(fh.fileno())

    def _forget(self, key: str) -> None:
        with self._lock:
            fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class FsspecStorage(Storage):
    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, tuple) else self.fs.protocol
        self.url = f"{protocol}://{self.root.removeprefix('/')}" if protocol != "memory" else f"memory://{self.root}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        path = self._path(key)
        blobs = self.fs.cat_ranges([path] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges])
        view = memoryview(out).cast("B")
        pos = 0
        for (start, end), blob in zip(ranges, blobs, strict=True):
            if isinstance(blob, BaseException):
                raise blob
            if len(blob) != end - start:
                raise CorruptionError(f"{self.url}/{key}: expected {end - start} bytes at offset {start}, got {len(blob)} (truncated)")
            view[pos : pos + len(blob)] = blob
            pos += len(blob)

    def read_many(self, requests: Sequence[tuple[str, int, int]]) -> list[bytes]:
        blobs = self.fs.cat_ranges([self._path(k) for k, _, _ in requests], [s for _, s, _ in requests], [e for _, _, e in requests])
        for (key, start, end), blob in zip(requests, blobs, strict=True):
            if isinstance(blob, BaseException):
                raise blob
            if len(blob) != end - start:
                raise CorruptionError(f"{self.url}/{key}: expected {end - start} bytes at offset {start}, got {len(blob)} (truncated)")
        return blobs

    def write_atomic(self, key: str, data: bytes) -> None:
        # One PUT: object stores (and the in-memory fs) publish it whole or not at all.
        self.fs.pipe_file(self._path(key), bytes(data))

    def write_parts(self, key: str, parts: Iterable[Any]) -> None:
        with self.fs.open(self._path(key), "wb") as fh:
            for part in parts:
                fh.write(part)

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def size(self, key: str) -> int:
        return int(self.fs.size(self._path(key)))

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        # Listings are cached by some filesystems (s3fs); a reader must see fresh commits.
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path.rstrip("/")})
