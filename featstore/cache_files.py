"""The files of the local read-through cache (featstore.cache): open entries shared by readers,
positioned reads, whole-file checksums, the directory's lock files.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from . import checksums
from .errors import CorruptionError

CHUNK = 8 << 20  # a whole-file checksum reads this much at a time


class Handle:
    """An entry's open descriptor, shared by the reads in flight (``refs``)."""

    __slots__ = ("fd", "refs", "retired")

    def __init__(self, fd: int) -> None:
        self.fd, self.refs, self.retired = fd, 1, False


def pread_ranges(fd: int, ranges: Sequence[tuple[int, int]], out: np.ndarray, where: str) -> None:
    view = memoryview(out).cast("B")
    pos = 0
    for start, end in ranges:
        want = end - start
        got = os.preadv(fd, [view[pos : pos + want]], start)
        if got != want:
            raise CorruptionError(f"{where}: expected {want} bytes at offset {start}, got {got} (truncated cache entry)")
        pos += want


def unlinked(fd: int) -> bool:
    """True when the file open as ``fd`` has no name left (its entry was evicted)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def file_crc(fd: int, nbytes: int) -> int:
    crc, pos = 0, 0
    buf = bytearray(min(CHUNK, max(nbytes, 1)))
    view = memoryview(buf)
    while pos < nbytes:
        got = os.preadv(fd, [view[: min(len(buf), nbytes - pos)]], pos)
        if got <= 0:
            break
        crc = checksums.crc32c(np.frombuffer(buf, dtype=np.uint8, count=got), crc)
        pos += got
    return crc


@contextmanager
def locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def unlink(path: Path) -> bool:
    """Remove ``path``; True if this call removed it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
