"""Ctrl-C and SIGTERM during ``mmcache encode``: the first one stops the job at a sample boundary
(no task is submitted after it, the running ones commit what they have encoded: worker.stopping),
then the command exits 130 (SIGINT) or 143 (SIGTERM) with one line; a re-run encodes the rest.
A second one exits at once: every commit is atomic, so that loses only what was not committed."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

# What the one line calls each signal.
NAMES = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)"}


class Interrupted(BaseException):
    """The job was stopped by a signal (a BaseException, like KeyboardInterrupt: no ``except
    Exception`` on the way out may take it for a failure of its own)."""

    def __init__(self, signum: int, done: str = "", then: str = "") -> None:
        self.signum, self.done, self.then = signum, done, then
        super().__init__(self.line())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        what = NAMES.get(signal.Signals(self.signum), f"stopped by signal {self.signum}")
        done = self.done or "stopped before it was done (each write is committed whole or not at all: what was committed stays)"
        return f"{what}: {done}; {self.then or 'run the same command again to finish'}"


class StopRequest:
    """The first stopping signal of a block: ``signum`` (None: none came)."""

    def __init__(self) -> None:
        self.signum: int | None = None


@contextlib.contextmanager
def raising_on_signals() -> Iterator[None]:
    """SIGTERM raises ``Interrupted`` as Ctrl-C raises KeyboardInterrupt (it would kill the
    process unseen: no line, a crash journal left behind as if it had died)."""
    with _handlers(lambda signum, frame: _raise(signum)):
        yield


@contextlib.contextmanager
def stop_on_signals(on_stop: Callable[[], None]) -> Iterator[StopRequest]:
    """The block's first SIGINT or SIGTERM calls ``on_stop`` (tell the running tasks) and is
    recorded in the request the caller checks; a second one exits the process at once."""
    request = StopRequest()

    def handle(signum: int, frame: FrameType | None) -> None:
        if request.signum is not None:
            sys.stderr.write(f"{NAMES.get(signal.Signals(signum), 'signal')} again: exiting now, without waiting for the running "
                             "tasks (what they had not committed is encoded by the re-run)\n")
            sys.stderr.flush()
            os._exit(128 + signum)  # threads may be inside an encoder: no interpreter shutdown around them
        request.signum = signum
        on_stop()

    with _handlers(handle):
        yield request


def _raise(signum: int) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _handlers(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM in the block (signal handlers belong to the main
    thread: elsewhere, an API caller's thread, nothing changes). A signal this process ignores
    (``nohup``, a background job's SIGINT) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, handler) for s in NAMES if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, old in before.items():
            signal.signal(s, old)
