"""Where a job runs (``choose_placement`` -> ``Placement``): ``threads`` in this process,
``processes`` on a local Dask cluster, or ``scheduler`` (an existing cluster), with its worker
and thread counts and the reason, for the log. ``auto`` takes threads for a small job on at most
one device, unless an in-process run on the store died mid-task (``runtime.crash_journal``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..config import EncodeConfig
from . import crash_journal
from .devices import resolve_device


@dataclass(frozen=True, kw_only=True)
class Placement:
    kind: str          # "threads" | "processes" | "scheduler"
    workers: int       # worker processes, or task threads in this process
    threads: int       # torch intra-op threads per worker (per task thread in this process)
    device_type: str   # for this machine's executors; the config's request for an external cluster
    device_count: int
    reason: str        # why this kind, for the log


def choose_placement(config: EncodeConfig, *, scheduler: str | None, workers: int | None, output_url: str,
                     samples: Callable[[], int]) -> Placement:
    """Where this job runs; ``samples()`` (the job's size, which may read the store) is asked only
    when the choice depends on it."""
    cores = os.cpu_count() or 1
    run = config.run
    if scheduler:
        # An external cluster's workers resolve their own devices (the client may have none).
        count = workers or max(1, min(cores, 4))
        return Placement(kind="scheduler", workers=count, threads=run.threads_per_worker or max(1, cores // count),
                         device_type=config.device, device_count=0, reason=f"--scheduler {scheduler}")
    device_type, device_count = resolve_device(config.device)
    accelerated = device_type not in ("cpu", "auto") and device_count
    count = workers or (device_count if accelerated else max(1, min(cores, 4)))
    if output_url.startswith("memory://"):
        kind, reason = "threads", "a memory:// store lives in this process only"
    elif workers is not None:
        kind, reason = "processes", f"--workers {workers}"
    elif run.executor != "auto":
        kind, reason = run.executor, f"run.executor={run.executor}"
    elif device_count > 1:
        kind, reason = "processes", f"one worker per device ({device_count} {device_type})"
    elif died := crash_journal.previous_death(output_url):
        kind, reason = "processes", died  # an input may kill this process again (precompute.runtime.crash_journal)
    elif (n := samples()) <= run.threads_max_samples:
        kind, reason = "threads", f"{n} sample(s) to encode <= run.threads_max_samples={run.threads_max_samples}"
    else:
        kind, reason = "processes", f"{n} sample(s) to encode > run.threads_max_samples={run.threads_max_samples}"
    return Placement(kind=kind, workers=count, threads=run.threads_per_worker or max(1, cores // count),
                     device_type=device_type, device_count=device_count, reason=reason)
