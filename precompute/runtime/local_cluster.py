"""The Dask ``LocalCluster`` an encode job starts on this machine (``local_cluster``): one thread
per worker, ``WORKER_CONFIG`` applied, workers killed while starting started again, and this
process's environment left as it was found (``preserved_environ``): Dask's nannies write their
variables into it. Why each setting: docs/design/encode.md, "The local cluster"."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

# Dask settings for the workers of a LocalCluster (jobs/ sets the same for external clusters):
# - the nanny's MALLOC_TRIM_THRESHOLD_ turns off glibc's adaptive mmap threshold, so every large
#   activation is mmap'd and faulted in afresh (~15-20% of CPU encoder time measured here);
# - the worker's statistical profiler wakes every 10 ms to walk every thread's stack under the
#   GIL; with the encoder on all cores that cost ~5% of a worker's throughput in
#   benchmarks/encode_bench.py (its samples only feed the dashboard's profile page).
WORKER_CONFIG = {
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    "distributed.worker.profile.enabled": False,
}
# Ctrl-C reaches a local cluster's workers too (one process group), yet the client stops the job:
# they ignore it (worker.preload). Added to the preloads configured, not in their place.
PRELOAD = "mmcache.precompute.worker.preload"

# A worker process killed while the local cluster starts (before it registered: the OOM killer, a
# user's kill) fails its nanny's start, which LocalCluster(n_workers=N) turns into "Nanny failed to
# start." for the whole cluster. Such a worker is started again under its name (so on its device),
# up to this many times in all; the job then goes on with the workers that started.
WORKER_START_TRIES = 3


class WorkerStartError(ValueError):
    """No worker of the local cluster could start: the job cannot run here."""


@contextlib.contextmanager
def preserved_environ(keys: Iterable[str] | None = None):
    """Put ``os.environ`` (only ``keys`` of it, where given) back as it was on the way out.
    ``run_encode`` wears it as a decorator: it sets quiet/offline variables for the workers, and
    Dask's nanny writes its own here. A cluster kept open for long restores only the nanny's
    variables: what its caller sets meanwhile (a test's S3 endpoint) is the caller's to keep."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        restored = set(saved) | set(os.environ) if keys is None else set(keys)
        for key in restored:
            if key in saved:
                os.environ[key] = saved[key]
            else:
                os.environ.pop(key, None)


@contextlib.contextmanager
def local_cluster(workers: int, *, processes: bool = True, dashboard: bool = False):
    """A LocalCluster for encoding (one thread per worker, WORKER_CONFIG applied) that leaves this
    process's environment as it found it. Dask's nanny puts its pre-spawn variables
    (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, MALLOC_TRIM_THRESHOLD_ unless told otherwise) into
    the parent's own ``os.environ`` before it spawns a worker; without this they would leak into the
    caller and everything it starts afterwards, slowing it (docs/design/encode.md, "The local cluster")."""
    import dask
    from distributed import LocalCluster

    with dask.config.set(WORKER_CONFIG):  # the variables the nannies write into this process
        touched = {*(dask.config.get("distributed.nanny.pre-spawn-environ", None) or {}), "MALLOC_TRIM_THRESHOLD_"}
    before = dict(os.environ)
    with preserved_environ(touched):  # read on the way out: what starting the cluster changed joins it below
        # Workers inherit this process's environment at spawn, and glibc reads the variable only
        # then: one left here by an earlier cluster's nanny would reach them despite WORKER_CONFIG.
        os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
        # The scheduler serves HTTP (/health, metrics) even without a dashboard, by default on
        # port 8787, and warns ("Port 8787 is already in use") when another cluster holds it: a
        # free loopback port instead, so no warning reaches a user who asked for no dashboard.
        http = {"dashboard": dashboard, "dashboard_address": ":0" if dashboard else "127.0.0.1:0"}
        preloads = [*(dask.config.get("distributed.worker.preload", None) or []), PRELOAD]
        with dask.config.set({**WORKER_CONFIG, "distributed.worker.preload": preloads}):
            # The scheduler alone first: its workers start below, where one killed meanwhile is retried.
            cluster = LocalCluster(n_workers=0, threads_per_worker=1, processes=processes,
                                   dashboard_address=None, scheduler_kwargs=http, silence_logs=40)
            with cluster:
                _start_workers(cluster, workers)
                # And what else Dask wrote while it started (PYTHONHASHSEED, __DASK_PARENT_PID): a
                # nanny that restarts a worker later writes the same names again.
                touched.update(k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k))
                yield cluster


def _start_workers(cluster: Any, workers: int) -> None:
    """Start ``workers`` workers on ``cluster`` (which has none), in parallel. A worker whose
    process dies before it registers is started again under its name, ``WORKER_START_TRIES``
    times in all; then the cluster keeps those that run, or, when none does, ``WorkerStartError``
    (bounded: each try ends when every nanny has started or failed)."""
    from distributed.core import Status

    for _ in range(workers):
        cluster.worker_spec.update(cluster.new_worker_spec())
    failure: BaseException | None = None
    for _ in range(WORKER_START_TRIES):
        try:
            # SpecCluster's own step from its spec to running workers, which LocalCluster(n_workers=N)
            # takes in its constructor; here a failed nanny does not close the workers that started.
            cluster.sync(cluster._correct_state)
            return
        except (RuntimeError, OSError) as exc:  # "Nanny failed to start.", a comm closed by the death
            failure = exc
            for name in [name for name, nanny in cluster.workers.items() if nanny.status != Status.running]:
                del cluster.workers[name]  # the next try starts it again, under the same name
    for name in set(cluster.worker_spec) - set(cluster.workers):
        del cluster.worker_spec[name]
    if not cluster.workers:
        raise WorkerStartError(f"no Dask worker could start: each of {workers} was tried {WORKER_START_TRIES} times and its "
                               f"process died while starting ({failure}); is the machine out of memory? Free some, "
                               "or encode with fewer --workers")


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None
