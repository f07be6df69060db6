"""Committing a task's shard while its worker already encodes the next task: a task that has encoded
its shard secedes from the Dask worker's thread pool before committing (``commit_ahead``), while
the shards still committing in this process stay within ``run.commit_ahead_bytes``; otherwise, and
outside a Dask worker, it commits in place. The task still reports success only once its index part
is written. Why: docs/design/encode.md, "Committing ahead"."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_committing = [0]  # encoded bytes of this process's seceded tasks not yet committed


def _secede() -> bool:
    """Leave the Dask worker's thread pool, if this thread runs a Dask task."""
    try:
        from distributed import get_worker, secede
    except ImportError:
        return False
    try:
        get_worker()
    except ValueError:  # not a Dask worker's task thread
        return False
    secede()
    return True


@contextlib.contextmanager
def commit_ahead(nbytes: int, limit: int) -> Iterator[bool]:
    """Run the block (a shard's commit) off the worker's thread pool when ``nbytes`` more still
    fit within ``limit`` (one shard always may, if nothing else is committing); yields whether
    it did."""
    with _lock:
        fits = limit > 0 and (_committing[0] == 0 or _committing[0] + nbytes <= limit)
        if fits:
            _committing[0] += nbytes
    seceded = fits and _secede()
    if fits and not seceded:
        _release(nbytes)
    try:
        yield seceded
    finally:
        if seceded:
            _release(nbytes)


def _release(nbytes: int) -> None:
    with _lock:
        _committing[0] -= nbytes


def committing_bytes() -> int:
    """Encoded bytes of this process's tasks committing off the thread pool now."""
    with _lock:
        return _committing[0]
