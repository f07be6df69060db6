"""Daemon threads with futures, for work that may hang on an input (a FIFO, a stuck network
read): an encode task's decoding threads, the in-process executor's task threads, a live
encoder's pinned thread (``mmcache.train.live.reattach``), a unit's reader (``handed_over``).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class DaemonPool:
    """A few daemon threads running submitted calls, with concurrent.futures Futures. Unlike a
    ThreadPoolExecutor's threads, which the interpreter joins at exit, one stuck on an input that
    never arrives cannot keep the process from exiting after its task gave up on it: with the
    in-process executor, that process is the user's command."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = threads
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self, *, cancel_pending: bool = True) -> None:
        """Each thread ends after the calls submitted (``cancel_pending``: after the call it is in,
        if that ever returns; the others are cancelled)."""
        with contextlib.suppress(queue.Empty):
            while cancel_pending:
                item = self._queue.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in range(self._threads):
            self._queue.put(None)


def handed_over(items: Iterator[T], name: str, ahead: int) -> Iterator[T]:
    """``items``, iterated on a daemon thread of its own and handed over as each arrives: the
    caller works on the first while the thread reads on (a tar's members: its reads overlap the
    encoding of those read already), at most ``ahead`` items ahead of the caller, so a part of
    thousands of members is never held in memory whole. What ``items`` raises is raised here,
    after the items before it. A caller that stops early (closes this generator) stops the thread
    at its next item."""
    handoff: queue.Queue = queue.Queue(maxsize=max(1, ahead))
    stop = threading.Event()
    end = object()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                handoff.put(entry, timeout=0.1)
                return True
        return False

    def run() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            put((end, exc))
            return
        put((end, None))

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        while (entry := handoff.get())[0] is not end:
            yield entry[0]
    finally:
        stop.set()
    if entry[1] is not None:
        raise entry[1]


def kept_ahead(items: Iterator[T], ahead: int) -> Iterator[T]:
    """``items``, advanced up to ``ahead`` items before the caller takes them: where advancing
    submits work (a decode), that much runs ahead of the caller, and no more."""
    window: collections.deque[T] = collections.deque()
    for item in items:
        window.append(item)
        if len(window) > ahead:
            yield window.popleft()
    yield from window
