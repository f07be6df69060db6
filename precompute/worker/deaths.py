"""Which encode tasks were running when their Dask worker died, and what becomes of them: each
attempt counts itself in the scheduler's task metadata while it runs; a task of several rows whose
attempt died is split in two (``split_task``), down to one row; one row that died again alone is
committed as a reject (``died_reason``), naming how the process ended when its nanny logged it.
Imports ``distributed`` in the functions a Dask worker or client calls. Why: docs/design/encode.md,
"Tasks whose worker died"."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from .specs import TaskSpec

# The scheduler's task metadata: {root: {job: {shard: {"deaths": n, "host": ..., "pid": ...}}}}.
METADATA_ROOT = "mmcache-attempts"
# Deaths of tasks holding a row, the last with the row alone, after which it is a reject.
DEATHS_TO_REJECT = 2
DIED_REASON = ("worker died decoding this input (its process was killed: likely out of memory); "
               "check the file, or encode it on a machine with more memory with data.retry_rejects=true")
# How a nanny logs its worker's end (distributed.nanny.WorkerProcess._death_message), and its
# memory monitor's kill of a worker over distributed.worker.memory.terminate (worker_memory).
_DEATH_LINE = re.compile(r"Worker process (\d+) (?:was killed by signal (\d+)|exited with status (\d+))")
_MEMORY_LINE = re.compile(r"\(pid=(\d+)\) exceeded (\d+)% memory budget")


@dataclass(frozen=True)
class Deaths:
    count: int = 0  # earlier attempts of the task whose worker died while they ran it
    exit: str = ""  # how the last one's process ended ("killed, signal 9"), when its nanny said


@contextlib.contextmanager
def counted_attempt(job: str, shard: str) -> Iterator[Deaths]:
    """Count this attempt of task ``shard`` as running (on a Dask worker) while the block runs;
    yields how many earlier attempts of it died running it, and how the last one's process ended."""
    from distributed import get_client, get_worker

    client = get_client()
    keys = [METADATA_ROOT, job, shard]
    last = client.get_metadata(keys, default=None) or {}
    deaths = int(last.get("deaths", 0))
    me = {"deaths": deaths + 1, "pid": os.getpid(), "host": urlsplit(get_worker().address).hostname}
    client.set_metadata(keys, me)
    try:
        yield Deaths(deaths, _exit_of(client, last) if deaths else "")
    finally:
        client.set_metadata(keys, {**me, "deaths": deaths})  # ended: not a death, whether it returned or raised


def died_reason(exit: str) -> str:
    """The reject reason of an input whose worker died decoding it, its process ended as ``exit``."""
    if not exit:
        return DIED_REASON
    likely = "likely out of memory" if exit == f"killed, signal {int(signal.SIGKILL)}" else "a crash in its decoder?"
    return (f"worker died decoding this input ({exit}); {likely}; check the file, or encode it on a machine with more "
            "memory with data.retry_rejects=true")


def _exit_of(client: Any, attempt: dict) -> str:
    """How the process of an earlier ``attempt`` ended, from the newest line its host's nannies
    logged about its pid; "" when none did."""
    if "pid" not in attempt:
        return ""
    try:
        logs = client.get_worker_logs(nanny=True)
    except OSError:  # a nanny of the cluster did not answer: the reject goes on with the general reason
        return ""
    for worker, entries in logs.items():
        if urlsplit(worker).hostname != attempt.get("host"):
            continue  # the same pid on another machine is another process
        for _, text in entries:  # newest first
            if (death := _death(text)) and death[0] == int(attempt["pid"]):
                return death[1]
    return ""


def _death(text: str) -> tuple[int, str] | None:
    """(pid, how it ended: "killed, signal 9") of a nanny's line on its worker's end, else None."""
    if not (found := _DEATH_LINE.search(text)):
        return None
    pid, killed, status = found.groups()
    return int(pid), f"killed, signal {killed}" if killed else f"exited with status {status}"


def newest_death(lines: Iterable[str]) -> str:
    """How the newest worker death that nanny log ``lines`` (newest first) tell of came about:
    "exited with status 7", "killed, signal 15, over 95% of its memory limit" when the nanny's
    memory monitor killed it; "" when they tell of none."""
    lines = list(lines)
    death = next(filter(None, map(_death, lines)), None)
    if death is None:
        return ""
    over = next((m.group(2) for m in map(_MEMORY_LINE.search, lines) if m and int(m.group(1)) == death[0]), None)
    return f"{death[1]}, over {over}% of its memory limit (distributed.worker.memory.terminate)" if over else death[1]


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
