"""The storage interface under the feature store: a small key/value API (``Storage``) that a
backend implements, for local disk (``featstore.local_storage``) or any fsspec URL
(``featstore.object_storage``); ``featstore.backends.open_storage`` picks one from the URL.
Every backend passes one conformance suite (tests/featstore/storage_conformance.py).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CorruptionError

__all__ = ["ReadRequest", "Storage", "check_key"]

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

