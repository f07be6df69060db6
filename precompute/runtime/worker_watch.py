"""A Dask job's watch on its workers: a job left without one live worker ends, in bounded time, with
one line saying so, instead of waiting for its tasks forever. It waits for workers at most
``run.no_worker_timeout`` seconds (``WorkerWatch.wait_for_workers``), then polls the scheduler and,
after that long with none, cancels the job's futures (``track``) with ``NoWorkerError``. Imports
``distributed`` in its methods only. Why: docs/design/encode.md, "The worker watch"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

from .nanny_log import NannyLines
from ..worker.deaths import newest_death

KEPT = "the shards committed so far are kept, and a re-run encodes only what is left"


class NoWorkerError(ValueError):
    """A Dask job had no live worker for ``run.no_worker_timeout`` seconds."""


class WorkerWatch:
    """Watches the workers of ``client``'s scheduler while its ``with`` block runs. ``where`` names
    the cluster in messages ("the local cluster", "the scheduler at tcp://..."), ``advice`` says
    what to do, ``cause`` -> how the last worker died ("" when unknown)."""

    def __init__(self, client: Any, timeout: float, *, where: str, advice: str, cause: Callable[[], str] = lambda: "") -> None:
        self.client, self.timeout, self.where, self.advice, self.cause = client, timeout, where, advice, cause
        self.poll = max(0.05, min(1.0, timeout / 10))  # a fraction of the bound, never a busy loop
        self.error: NoWorkerError | None = None
        self._pending: set = set()  # futures the job waits on: cancelled when the watch gives up
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._armed = False  # only inside the with block: a watch nobody closes starts no thread

    def __enter__(self) -> WorkerWatch:
        self._armed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # The job's wait on a future the watch cancelled: the watch's one line, not Dask's.
        if isinstance(exc, CancelledError) and self.error is not None:
            raise self.error from None

    def wait_for_workers(self, count: int, log: Callable[[str], Any]) -> list[str]:
        """The addresses of the scheduler's workers once ``count`` are up, or of those up after
        ``timeout`` seconds; ``NoWorkerError`` when none is. Then the watch starts (in its block)."""
        from distributed.exceptions import WorkerStartTimeoutError

        if not self.client.nthreads():
            log(f"waiting up to {self.timeout:g}s for a Dask worker to join {self.where} (run.no_worker_timeout)")
        try:
            self.client.wait_for_workers(count, timeout=self.timeout)
        except WorkerStartTimeoutError:
            if not self.client.nthreads():
                raise NoWorkerError(f"no Dask worker was running on {self.where} after {self.timeout:g}s "
                                    f"(run.no_worker_timeout){self._cause()}: {self.advice}") from None
        if self._armed and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mmcache-worker-watch", daemon=True)
            self._thread.start()
        return sorted(self.client.nthreads())

    def track(self, future: Any) -> Any:
        """``future``, waited on by the job: cancelled, with the watch's message, if it gives up."""
        with self._lock:
            if self.error is not None:
                raise self.error  # gave up already: a task submitted now would wait forever
            self._pending = {f for f in self._pending if not f.done()}
            self._pending.add(future)
        return future

    def _watch(self) -> None:
        since: float | None = None  # when the scheduler was last seen without a worker, in a row
        failure = ""
        while not self._stop.wait(self.poll):
            try:
                alive = bool(self.client.nthreads())
            except (OSError, TimeoutError) as exc:  # the scheduler is gone: no worker runs for this job
                alive, failure = False, f"; the scheduler did not answer ({type(exc).__name__}: {exc})"
            if alive:
                since, failure = None, ""
                continue
            since = since or time.monotonic()
            if time.monotonic() - since >= self.timeout:
                self._give_up(f"every Dask worker of {self.where} died and none was running again for {self.timeout:g}s "
                              f"(run.no_worker_timeout){self._cause()}{failure}: {self.advice}; {KEPT}")
                return

    def _give_up(self, message: str) -> None:
        with self._lock:
            self.error = NoWorkerError(message)
            pending, self._pending = list(self._pending), set()
        if pending:
            self.client.cancel(pending, reason="no-worker", msg=message)

    def _cause(self) -> str:
        cause = self.cause()
        return f"; the last worker process ended: {cause}" if cause else ""


def local_watch(client: Any, nannies: NannyLines, timeout: float) -> WorkerWatch:
    """The watch of a local cluster, whose nannies log in this process (``nannies``): how its last
    worker died is read there even with no worker left (a remote nanny is reached through its
    worker only, so an external cluster's watch says nothing of a cause)."""
    return WorkerWatch(client, timeout, where="the local cluster", cause=lambda: newest_death(nannies.lines()),
                       advice="is the machine out of memory, or does a worker fail as it starts? Free some memory, "
                              "or encode with fewer --workers")


def scheduler_watch(client: Any, address: str, timeout: float) -> WorkerWatch:
    """The watch of an external cluster, the scheduler at ``address`` (``--scheduler``)."""
    return WorkerWatch(client, timeout, where=f"the scheduler at {address}",
                       advice=f"start workers for it (`dask worker {address}`), or check their logs for why they die; "
                              "raise run.no_worker_timeout for a cluster that scales up from zero workers")
