"""Which encode tasks were running when their Dask worker died, and what becomes of them.

An input can kill the worker that decodes it (a picture that takes more memory than the machine
has: the OOM killer's SIGKILL). Dask runs such a task again on another worker, and again, until
``distributed.scheduler.allowed-failures``; then the job would end with a ``KilledWorker`` that
names no input, and a re-run would die on it again. Instead:

- each attempt of an encode task counts itself, in the scheduler's task metadata, while it reads,
  decodes and encodes its rows, and uncounts itself when that part ends (done or raised), so the
  next attempt knows how many before it vanished midway: their worker died. Only what was
  running counts, not the tasks merely queued on the dead worker (Dask's own count cannot tell
  those apart);
- a task of several rows whose attempt died is split in two (``split_task``; its rows carry the
  deaths on), down to one row; one row that died again, alone, is committed as a reject
  (``died_reason``), so a re-run skips it like any reject, and the rest of its task is encoded;
- a local cluster's nannies (``exit_reporting_nanny``) log each worker process's exit code to
  the scheduler, so the reject says how the process died (killed by signal 9: out of memory).

Imports ``distributed`` in the functions a Dask worker or client calls: the in-process executor
never needs it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from mmcache.precompute.specs import TaskSpec

# The scheduler's task metadata: {root: {job: {shard: [deaths, address of the last attempt]}}}.
METADATA_ROOT = "mmcache-attempts"
EXITS_TOPIC = "mmcache-worker-exits"  # scheduler events: {"worker": address, "exitcode": code}
# Deaths of tasks holding a row, the last with the row alone, after which it is a reject.
DEATHS_TO_REJECT = 2
DIED = "worker died decoding this input"


def died_reason(exitcode: int | None) -> str:
    """The reject reason of an input that killed its worker; ``exitcode`` as multiprocessing gives
    it (-N: killed by signal N), None when no nanny reported it."""
    if exitcode is None:
        how, why = "its process was killed", "likely out of memory."
    elif exitcode < 0:
        how, why = f"killed, signal {-exitcode}", "likely out of memory." if exitcode == -9 else "a crash in its decoder?"
    else:
        how, why = f"its process exited with status {exitcode}", "a crash in its decoder?"
    return f"{DIED} ({how}); {why} Check the file, or encode it with more memory and data.retry_rejects=true"


@dataclass(frozen=True)
class Seen:
    """What an attempt knows of the earlier attempts of its task."""

    deaths: int = 0  # how many died running it
    last_worker: str | None = None  # where the last of them ran

    def reason(self) -> str:
        """``died_reason`` of the last death, with the exit code its nanny reported, if any."""
        return died_reason(_exit_code(self.last_worker))


@contextlib.contextmanager
def counted_attempt(job: str, shard: str) -> Iterator[Seen]:
    """Count this attempt of task ``shard`` as running (on a Dask worker) while the block runs;
    yields what the earlier attempts of it left: how many died, where the last one ran."""
    from distributed import get_client, get_worker

    client = get_client()
    keys = [METADATA_ROOT, job, shard]
    deaths, last = client.get_metadata(keys, default=[0, None])
    client.set_metadata(keys, [deaths + 1, get_worker().address])
    try:
        yield Seen(deaths=deaths, last_worker=last)
    finally:
        client.set_metadata(keys, [deaths, last])  # ended: not a death, whether it returned or raised


def _exit_code(worker: str | None, wait: float = 3.0) -> int | None:
    """The exit code a nanny reported for ``worker``'s process (EXITS_TOPIC), waiting a little:
    the task may run again on another worker before the dead one's nanny has told the scheduler."""
    from distributed import get_client

    client, deadline = get_client(), time.monotonic() + wait
    while True:
        codes = [msg["exitcode"] for _, msg in client.get_events(EXITS_TOPIC) if msg.get("worker") == worker]
        if codes or worker is None or time.monotonic() > deadline:
            return codes[-1] if codes else None
        time.sleep(0.1)


@functools.cache
def exit_reporting_nanny() -> type:
    """Dask's Nanny, which also logs its worker process's exit code to the scheduler
    (EXITS_TOPIC) when the process dies under it (not when the nanny closes)."""
    from distributed import Nanny
    from distributed.core import Status

    class ExitReportingNanny(Nanny):
        async def _on_worker_exit(self, exitcode: int) -> None:
            # The nanny's own hook on its process's exit, before it restarts it; the address is
            # still the dead worker's here.
            if exitcode and self.status == Status.running:
                self.log_event(EXITS_TOPIC, {"worker": self.worker_address, "exitcode": exitcode})
            await super()._on_worker_exit(exitcode)

    return ExitReportingNanny


def forget_job(client: Any, job: str) -> None:
    """Drop a finished job's counts from the scheduler (a long-lived cluster serves many jobs)."""
    client.set_metadata([METADATA_ROOT, job], None)


def verdict(task: TaskSpec, deaths: int) -> str:
    """What an attempt does with a task whose earlier attempts died ``deaths`` times: "run" it,
    "split" it (several rows; the client plans the halves), or "reject" its one row."""
    if not deaths:
        return "run"
    if len(task.rows) > 1:
        return "split"
    return "reject" if task.deaths + deaths >= DEATHS_TO_REJECT else "run"


def split_task(task: TaskSpec, deaths: int) -> list[TaskSpec]:
    """The two halves of a task whose worker died ``deaths`` times running it, each a task of its
    own (named after the task and its half), carrying the deaths of their rows on."""
    half = (len(task.rows) + 1) // 2
    return [replace(task, shard=_half_name(task.shard, i), rows=rows, deaths=task.deaths + deaths)
            for i, rows in enumerate((task.rows[:half], task.rows[half:])) if rows]


def _half_name(shard: str, half: int) -> str:
    return f"t-{hashlib.sha256(f'{shard}/{half}'.encode()).hexdigest()[:24]}"
