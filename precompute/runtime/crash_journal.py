"""A small local record of an in-process encode job (its pid, start time, host and tasks in flight),
so that the next run on the same store knows when this one died mid-task and runs on worker
processes instead, where an input that kills its worker becomes a reject (``worker.deaths``).
Kept in this user's cache on this machine (``$XDG_CACHE_HOME/mmcache/journals``), named by a hash
of the store's URL, holding no URL or option. Why and how: docs/design/encode.md, "The crash journal"."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import psutil

# psutil computes a start time from the boot time and the process's start in clock ticks; the
# boot time it reads may move by a second when the clock is stepped. A pid reused by another
# process started at least this long after the journal's.
START_TOLERANCE_S = 1.0


def journal_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmcache" / "journals"


def store_key(output_url: str) -> str:
    """The journal name of a store: local paths as the store resolves them (``./out`` and its
    absolute path are one store), other URLs as given."""
    if "://" not in output_url or output_url.startswith("file://"):
        output_url = str(Path(output_url.removeprefix("file://")).expanduser().resolve())
    return hashlib.sha256(output_url.rstrip("/").encode()).hexdigest()[:32]


def previous_death(output_url: str) -> str:
    """Why this run should isolate its tasks in worker processes: a line naming the earlier
    in-process run on this store that died (and its tasks in flight), or "" when none did."""
    for _, record in _journals(output_url):
        if _dead(record):
            tasks = ", ".join(record.get("tasks", []))
            when = f"mid-task (task(s) in flight: {tasks})" if tasks else "before its tasks ran"
            return (f"a previous run on this store (process {record.get('pid')}) died {when}; this run isolates tasks in "
                    "worker processes, where an input that kills its worker becomes a reject")
    return ""


def forget_deaths(output_url: str) -> None:
    """A run on the store finished: the journals left by dead runs of it are done with (their
    tasks are committed now, or rejected)."""
    for path, record in _journals(output_url):
        if _dead(record) or not record:  # not record: damaged, it can tell nothing
            path.unlink(missing_ok=True)


class Journal:
    """This process's journal of an in-process job on one store (see the module's doc). One that
    cannot be written (a read-only home, a full disk) is dropped with a warning, and the job goes
    on without it: it protects the next run, it is not needed by this one."""

    def __init__(self, output_url: str) -> None:
        me = psutil.Process()
        self._record = {"pid": me.pid, "started": me.create_time(), "host": socket.gethostname()}
        self._tasks: list[str] = []
        self._lock = threading.Lock()
        self.path: Path | None = journal_dir() / f"{store_key(output_url)}-{me.pid}-{int(me.create_time())}.json"
        with self._lock:
            self._write()

    def running(self, shard: str) -> _InFlight:
        """Held while task ``shard`` runs: it is in the journal meanwhile (reusable across retries)."""
        return _InFlight(self, shard)

    def close(self) -> None:
        """Remove the journal (a clean finish, or a Python-level error: this process did not die).
        Tasks still running on daemon threads write nothing after it."""
        with self._lock:
            path, self.path = self.path, None
        if path is not None:
            path.unlink(missing_ok=True)

    def _update(self, shard: str, running: bool) -> None:
        with self._lock:
            if running:
                self._tasks.append(shard)
            else:
                self._tasks.remove(shard)
            self._write()

    def _write(self) -> None:
        """Under the lock: the journal as it stands now, replaced at once (a reader never sees half
        of one); nothing once closed."""
        if self.path is None:
            return
        temporary = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps({**self._record, "tasks": self._tasks}))
            os.replace(temporary, self.path)
        except OSError as exc:
            path, self.path = self.path, None
            warnings.warn(f"cannot keep the crash journal {path} ({exc.strerror or exc}); going on without it: if this run is "
                          "killed mid-task, the next one will not know to run its tasks in worker processes (run.executor="
                          "processes does)", RuntimeWarning, stacklevel=2)
            for leftover in (temporary, path):
                with contextlib.suppress(OSError):  # best effort: one left only sends the next run to processes
                    leftover.unlink(missing_ok=True)


class _InFlight:
    def __init__(self, journal: Journal, shard: str) -> None:
        self.journal, self.shard = journal, shard

    def __enter__(self) -> None:
        self.journal._update(self.shard, True)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.journal._update(self.shard, False)


@contextlib.contextmanager
def kept(output_url: str) -> Iterator[Journal]:
    """A journal for the block, removed when it ends by a return or a Python exception."""
    journal = Journal(output_url)
    try:
        yield journal
    finally:
        journal.close()


def _journals(output_url: str) -> Iterator[tuple[Path, dict]]:
    """The journals of this store, each with its record ({} for a damaged one). One removed
    meanwhile (its run ended) is passed over."""
    for path in sorted(journal_dir().glob(f"{store_key(output_url)}-*.json")):
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except ValueError:
            record = {}
        yield path, record if isinstance(record, dict) else {}


def _dead(record: dict) -> bool:
    """Left by a process of this host that is gone. Another host's pid tells nothing here (a
    home folder shared over NFS)."""
    return record.get("host") == socket.gethostname() and not _alive(record)


def _alive(record: dict) -> bool:
    try:
        started = psutil.Process(int(record["pid"])).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, KeyError, TypeError, ValueError):
        return False
    except psutil.AccessDenied:
        return True  # another user's process holds the pid: not ours to judge, keep it
    return abs(started - float(record.get("started", 0))) < START_TOLERANCE_S
