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
  (``DIED_REASON``), so a re-run skips it like any reject, and the rest of its task is encoded.

Imports ``distributed`` in the functions a Dask worker or client calls: the in-process executor
never needs it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from mmcache.precompute.specs import TaskSpec

METADATA_ROOT = "mmcache-attempts"  # the scheduler's task metadata: {root: {job: {shard: deaths}}}
# Deaths of tasks holding a row, the last with the row alone, after which it is a reject.
DEATHS_TO_REJECT = 2
DIED_REASON = ("worker died decoding this input (its process was killed: likely out of memory); "
               "check the file, or encode it on a machine with more memory with data.retry_rejects=true")


@contextlib.contextmanager
def counted_attempt(job: str, shard: str) -> Iterator[int]:
    """Count this attempt of task ``shard`` as running (on a Dask worker) while the block runs;
    yields how many earlier attempts of it died running it."""
    from distributed import get_client

    client = get_client()
    keys = [METADATA_ROOT, job, shard]
    deaths = int(client.get_metadata(keys, default=0))
    client.set_metadata(keys, deaths + 1)
    try:
        yield deaths
    finally:
        client.set_metadata(keys, deaths)  # ended: not a death, whether it returned or raised


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
