"""What the Dask nannies of a local cluster log, in this process, for the cluster's lifetime
(``nanny_log``): the newest lines, kept for the worker watch (``runtime.worker_watch``), which says
how the last worker process ended; and not the traceback a nanny logs when the cluster's close
cancels its restart of a worker (the close doing its work is not an error). Why: docs/design/encode.md,
"The nannies' log"."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Iterator

NANNY_LOGGER = "distributed.nanny"  # its children too: distributed.nanny.memory, the memory monitor's kills


class NannyLines(logging.Handler):
    """The newest ``KEEP`` lines the nannies of this process logged, newest first (``lines()``)."""

    KEEP = 200

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._lines: collections.deque[str] = collections.deque(maxlen=self.KEEP)

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.appendleft(record.getMessage())  # on the cluster's event loop thread

    def lines(self) -> list[str]:
        return list(self._lines)  # one C call: no line is appended midway (another thread may read)


class _CancelledRestarts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


@contextlib.contextmanager
def nanny_log() -> Iterator[NannyLines]:
    """The nannies' newest lines kept, their cancelled restarts' tracebacks dropped, while the
    block runs (a local cluster's lifetime, its close included)."""
    logger = logging.getLogger(NANNY_LOGGER)
    kept, quiet = NannyLines(), _CancelledRestarts()
    logger.addHandler(kept)
    logger.addFilter(quiet)
    try:
        yield kept
    finally:
        logger.removeFilter(quiet)
        logger.removeHandler(kept)
