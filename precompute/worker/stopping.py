"""Which encode jobs were asked to stop (Ctrl-C, SIGTERM: ``precompute.runtime.interrupt``). A
task of a stopped job ends at its next sample boundary (a batch of rows; a tar's or row group's
next part) and commits what it encoded, so a stop loses no finished work and leaves nothing half
written. The set is this process's: the in-process executor's tasks see the client's own entry,
a Dask worker gets one from ``client.run(stop, job)``."""

from __future__ import annotations

import threading
from collections.abc import Callable

_lock = threading.Lock()
_stopped: set[str] = set()


def stop(job: str) -> None:
    """Ask the tasks of ``job`` running in this process to stop at their next sample boundary."""
    with _lock:
        _stopped.add(job)


def halt_of(job: str | None) -> Callable[[], bool]:
    """What a task of ``job`` asks between samples: whether to stop there (never, without a job)."""
    if not job:
        return lambda: False
    return lambda: job in _stopped
