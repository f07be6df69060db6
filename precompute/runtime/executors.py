"""Where the tasks of ``mmcache encode`` run: ``ThreadExecutor`` (this process's threads, with its
crash journal) or ``DaskExecutor`` (a local cluster of worker processes, or an external
``--scheduler`` cluster), opened per job by ``open_executor`` / ``connect``. Both take the same
tasks and make the same store; which one a job takes is ``runtime.placement``'s choice. How each
survives a dying worker: docs/design/encode.md, "Executors"."""

from __future__ import annotations

import contextlib
import queue
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ...featstore.reader import open_store
from ..config import NO_WORKER_TIMEOUT, EncodeConfig, default_cache_dir
from ..output.prompts import encode_and_store_prompts
from ..planning.feature_bytes import FieldsOutline, outline
from ..worker.specs import EncoderSpec, TaskSettings, TaskSpec, encoder_specs, takes_text_only
from . import crash_journal
from ..worker.daemon_pool import DaemonPool
from .devices import resolve_device, worker_device
from .local_cluster import _has_bokeh, local_cluster
from .nanny_log import nanny_log
from .placement import Placement
from ..worker.deaths import counted_attempt, forget_job
from .worker_watch import WorkerWatch, local_watch, scheduler_watch
from ..worker.encoder_cache import PROCESS_ENCODERS, describe_encoders, loaded_encoders
from ..worker import stopping
from ..worker.tasks import TaskResult, encode_task

# A task that Dask gave up on (KilledWorker: its workers died ``allowed-failures`` + 1 times while
# it was running or queued there) is submitted again this often: it may have been only queued on
# workers that another task killed. Past it the job fails, saying so, instead of looping.
RESUBMITS = 3


class WorkersDiedError(ValueError):
    """The workers running a task kept dying, and no input of it was to blame."""


class ThreadClient:
    """The part of dask.distributed.Client's API that an encode job uses (submit, map), on this
    process's threads; ``retries`` as Dask's: a call that raises runs again, up to that often.
    Daemon threads: a job that fails or is interrupted exits without waiting for the tasks still
    running, as a killed job would (each task's shard commits atomically or not at all)."""

    def __init__(self, threads: int) -> None:
        self._pool = DaemonPool(threads, "encode")

    def submit(self, fn: Callable, *args: Any, retries: int = 0, key: str | None = None, pure: bool | None = None,
               workers: Any = None, **kwargs: Any) -> Future:
        def attempt() -> Any:
            for tries_left in range(retries, -1, -1):
                try:
                    return fn(*args, **kwargs)
                except Exception:
                    if not tries_left:
                        raise
            raise AssertionError("unreachable")

        return self._pool.submit(attempt)

    def map(self, fn: Callable, items: Iterable, **kwargs: Any) -> list[Future]:
        return [self.submit(fn, item, **kwargs) for item in items]

    def close(self) -> None:
        self._pool.shutdown()  # tasks not started are dropped


class ThreadExecutor:
    """Tasks on threads of this process, with its own encoder cache (loaded once per process)."""

    kind = "threads"
    dashboard_link = None

    def __init__(self, placement: Placement, journal: crash_journal.Journal) -> None:
        self.notes: list[str] = []  # what the job's log says of where it runs
        self.placement, self.journal = placement, journal
        self.device = worker_device(placement.device_type, placement.device_count, 0)
        self.client = ThreadClient(placement.workers)
        self.workers = placement.workers
        self.job = uuid.uuid4().hex  # what worker.stopping knows this job's tasks by

    def stop(self) -> None:
        """The running tasks stop at their next sample boundary (worker.stopping)."""
        stopping.stop(self.job)

    def load_encoders(self, specs: list[EncoderSpec], requested: str) -> Future:
        """Loads in the background (the caller opens the store meanwhile); -> {fields, loaded}."""
        loader = DaemonPool(1, "load-encoders")
        future = loader.submit(describe_encoders, specs, self.device, self.placement.threads, PROCESS_ENCODERS)
        loader.shutdown(cancel_pending=False)  # its thread ends after the load
        return future

    def share(self, value: Any) -> Any:
        return value  # one process: every task sees the same object

    def map(self, fn: Callable, items: Iterable, **kwargs: Any) -> list[Future]:
        return self.client.map(fn, items, **kwargs)

    def store_prompts(self, specs, requested, sections, prompts, store, output_url, storage_options) -> int:
        return encode_and_store_prompts(loaded_encoders(specs, self.device, self.placement.threads, PROCESS_ENCODERS), store, sections, prompts)

    def submit_task(self, task: TaskSpec, output_url: str, storage_options: dict[str, Any] | None, specs: list[EncoderSpec],
                    settings: TaskSettings, known: Any) -> Future:
        return self.client.submit(
            _journaled, self.journal.running(task.shard), task, store_url=output_url, storage_options=storage_options, specs=specs,
            device=self.device, threads=self.placement.threads, settings=settings, known_shards=known, cache=PROCESS_ENCODERS, retries=3,
            job=self.job,
        )

    def as_completed(self, futures: list) -> _Completion:
        return _Completion(futures)

    def result(self, future: Future, task: TaskSpec) -> TaskResult | None:
        return future.result()


def _journaled(in_flight: Any, task: TaskSpec, **kwargs: Any) -> TaskResult:
    with in_flight:  # the task is in this process's crash journal while it runs
        return encode_task(task, **kwargs)


class _Completion:
    """concurrent.futures' as_completed, to which futures may be added while it is iterated."""

    def __init__(self, futures: list[Future]) -> None:
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._left = 0
        for future in futures:
            self.add(future)

    def add(self, future: Future) -> None:
        self._left += 1
        future.add_done_callback(self._done.put)

    def __iter__(self) -> Iterator[Future]:
        while self._left:
            self._left -= 1
            yield self._done.get()


class DaskExecutor:
    """Tasks on a Dask cluster: a LocalCluster of worker processes, or an external one."""

    def __init__(self, client: Any, placement: Placement, wait_for: int, *, watch: WorkerWatch | None = None,
                 log: Callable[[str], Any] = print) -> None:
        # lazy: worker_plugin imports distributed, only once a Dask client exists
        from ..worker.plugin import EncoderPlugin

        self.client, self.placement, self.kind = client, placement, placement.kind
        self.notes: list[str] = []  # what the job's log says of where it runs
        self.dashboard_link = client.dashboard_link if _has_bokeh() else None
        # Idempotent: on a long-lived cluster the plugin a previous job left keeps its encoders.
        client.register_plugin(EncoderPlugin())
        # The job's futures are tracked by the watch, which cancels them if every worker is gone for
        # good; without one (a bare executor) the wait for workers is bounded all the same.
        self.watch = watch or WorkerWatch(client, NO_WORKER_TIMEOUT, where="the cluster", advice="start workers for it")
        # A local cluster: all its workers; an external one: at least one (more may join later).
        self.addresses = self.watch.wait_for_workers(wait_for, log)
        self.workers = len(self.addresses)
        # Names this job's counts of running task attempts on the scheduler (worker.deaths).
        self.job = uuid.uuid4().hex
        self._submitted: dict[str, int] = {}  # shard -> times submitted before

    def stop(self) -> None:
        """Every worker's running tasks of this job stop at their next sample boundary
        (worker.stopping). Told from a thread of its own: this is called by a signal handler,
        which must not wait on the client's event loop."""

        def tell() -> None:
            try:
                self.client.run(stopping.stop, self.job)
            except Exception as exc:  # noqa: BLE001 - said; the running tasks then finish whole instead
                warnings.warn(f"could not tell the workers to stop ({type(exc).__name__}: {exc}); their running tasks finish whole",
                              RuntimeWarning, stacklevel=1)

        threading.Thread(target=tell, name="stop-workers", daemon=True).start()

    def resolve_specs(self, config: EncodeConfig) -> tuple[list[EncoderSpec], bool, FieldsOutline]:
        """(the encoders' specs, whether text-only rows are samples: ``takes_text_only``, their
        fields and estimated bytes: ``feature_bytes.outline``), resolved by a worker: the encoder classes that check the options import torch, which the client of
        an external cluster need not (a worker has it already). ``path: tiny`` is built, by that
        worker, where this process would have built it (its MMCACHE_CACHE)."""
        return self.watch.track(self.client.submit(_specs_on_worker, config, str(default_cache_dir()), pure=False)).result()

    def load_encoders(self, specs: list[EncoderSpec], requested: str) -> Any:
        """Every worker loads its encoders now, in parallel, rather than inside its first task. Each
        load asks for its worker but may run on any (allow_other_workers): pinned to a worker that
        died meanwhile (a nanny restarts it under a new address), it would wait forever."""
        loads = [self.watch.track(self.client.submit(_describe_on_worker, specs, requested, self.placement.threads, workers=[a],
                                                     allow_other_workers=True, pure=False))
                 for a in self.addresses]
        return _AllOf(loads)

    def store_prompts(self, specs, requested, sections, prompts, store, output_url, storage_options) -> int:
        """Encoded and written by the first worker, with the encoders it has loaded: the client
        never loads a model, nor handles an embedding (a bfloat16 one would import ml_dtypes)."""
        return self.watch.track(self.client.submit(
            _prompts_on_worker, specs, requested, self.placement.threads, sections, prompts, output_url, storage_options,
            store.manifest, workers=[self.addresses[0]], allow_other_workers=True, pure=False,
        )).result()

    def share(self, value: Any) -> Any:
        # A task's result, not scattered data: if the worker holding it dies, it is recomputed.
        future = self.watch.track(self.client.submit(list, value, pure=False))
        # Held by every worker: Dask places a task on a worker that holds its dependencies, so with
        # this one on a single worker every encode task queued there and work stealing moved them
        # late (measured: a worker idle 1.2 s of a 5 s job, 0.78x the encoders' throughput).
        try:
            self.client.replicate([future])
        except Exception as exc:  # noqa: BLE001 - placement only; said, and the job goes on
            # The scheduler's replicate asserts when a worker died in the moment before it (seen
            # under SIGKILL tests); the list is a task result, recomputed where it is needed.
            if self.watch.error is not None:  # no worker left at all: the job ends, saying that alone
                raise self.watch.error from None
            warnings.warn(f"could not copy the job's shard list to every worker ({type(exc).__name__}: {exc}); "
                          "tasks fetch it from the worker that holds it", RuntimeWarning, stacklevel=2)
        return future

    def submit_task(self, task: TaskSpec, output_url: str, storage_options: dict[str, Any] | None, specs: list[EncoderSpec],
                    settings: TaskSettings, known: Any) -> Any:
        # No placement hints: the scheduler spreads the tasks, and a task whose worker died (an OOM
        # kill) runs on whichever worker is alive, the nanny's restart of it included. A task pinned
        # to the dead worker's address would wait for it forever. A task whose worker died while it
        # ran comes back unrun, to be split (precompute.worker.deaths); a task Dask gave up on
        # (KilledWorker) is submitted again under a new key (``result``).
        tries = self._submitted[task.shard] = self._submitted.get(task.shard, -1) + 1
        return self.watch.track(self.client.submit(
            _run_on_worker, task, output_url, storage_options, specs, self.placement.threads, settings, known, self.job,
            key=f"encode-{task.shard}" + (f"-{tries}" if tries else ""), retries=3, pure=False,
        ))

    def map(self, fn: Callable, items: Iterable, **kwargs: Any) -> list:
        """``client.map``, its futures tracked by the watch (precompute.planning.stale's hashing)."""
        return [self.watch.track(future) for future in self.client.map(fn, items, **kwargs)]

    def as_completed(self, futures: list) -> Any:
        from distributed import as_completed

        return as_completed(futures)

    def result(self, future: Any, task: TaskSpec) -> TaskResult | None:
        """The task's result, or None when Dask gave up on it after its workers died (KilledWorker):
        submit it again; its attempts' own counts (worker.deaths) say whether it was to blame."""
        from distributed.scheduler import KilledWorker

        try:
            return future.result()
        except KilledWorker as exc:
            if self._submitted[task.shard] < RESUBMITS:
                return None
            raise WorkersDiedError(
                f"the Dask workers running or holding task {task.shard} ({len(task.rows)} input(s), the first "
                f"{task.rows[0].source}) died at least {(exc.allowed_failures + 1) * (RESUBMITS + 1)} times without its inputs "
                "being to blame: is the machine out of memory while loading the encoders? Free some, or use fewer --workers"
            ) from None

    def close(self) -> None:
        forget_job(self.client, self.job)


class _AllOf:
    """Waits for every worker's load; the first one's description, the models loaded by all."""

    def __init__(self, futures: list) -> None:
        self.futures = futures

    def result(self) -> dict[str, Any]:
        results = [f.result() for f in self.futures]
        return {**results[0], "loaded": sum(r["loaded"] for r in results)}


@contextlib.contextmanager
def open_executor(placement: Placement, output_url: str, *, no_worker_timeout: float = NO_WORKER_TIMEOUT,
                  log: Callable[[str], Any] = print) -> Iterator[ThreadExecutor | DaskExecutor]:
    """This process's threads, or a local cluster (an external one: ``connect``), for a job on the
    store at ``output_url``. In-process, the job keeps a crash journal (precompute.runtime.crash_journal);
    a clean finish clears the journals of earlier runs that died. A local cluster left without a
    live worker for ``no_worker_timeout`` seconds ends the job (precompute.runtime.worker_watch)."""
    if placement.kind == "threads":
        import torch

        # torch's thread count is the process's: the job sets it for its task threads (cores /
        # task threads, as a worker process would), and the caller gets its own back.
        saved = torch.get_num_threads()
        torch.set_num_threads(placement.threads)
        with crash_journal.kept(output_url) as journal:
            executor = ThreadExecutor(placement, journal)
            try:
                yield executor
            finally:
                executor.client.close()
                torch.set_num_threads(saved)
    else:
        yield from _local_cluster_executor(placement, no_worker_timeout, log)
    # A clean finish (an error skips this): the journals of runs that died before it are done with.
    crash_journal.forget_deaths(output_url)


def _local_cluster_executor(placement: Placement, no_worker_timeout: float, log: Callable[[str], Any]) -> Iterator[DaskExecutor]:
    assert placement.kind != "scheduler", "an external cluster is opened by connect()"
    from distributed import Client

    with (nanny_log() as nannies, local_cluster(placement.workers, dashboard=_has_bokeh()) as cluster, Client(cluster) as client,
          local_watch(client, nannies, no_worker_timeout) as watch):
        executor = DaskExecutor(client, placement, len(cluster.workers), watch=watch, log=log)
        if executor.workers < placement.workers:
            executor.notes.append(f"warning: {placement.workers - executor.workers} of {placement.workers} worker(s) could not "
                                  f"start (killed while starting: out of memory?); going on with {executor.workers}")
        yield executor
        executor.close()  # not on an error: a cluster that failed must not hide why behind another


@contextlib.contextmanager
def connect(placement: Placement, scheduler: str, *, no_worker_timeout: float = NO_WORKER_TIMEOUT,
            log: Callable[[str], Any] = print) -> Iterator[DaskExecutor]:
    """The executor of an external cluster (``--scheduler``), ready once one worker is (waited for
    ``no_worker_timeout`` seconds at most, and as long again for a worker once none is left)."""
    from distributed import Client

    with Client(scheduler) as client, scheduler_watch(client, scheduler, no_worker_timeout) as watch:
        executor = DaskExecutor(client, placement, 1, watch=watch, log=log)
        yield executor
        executor.close()  # not on an error: a cluster that failed must not hide why behind another


def _device_here(requested: str) -> str:
    """This worker's device: one worker per device, worker ``n`` (a LocalCluster name, kept across
    restarts) on device ``n``; workers with other names (one per device, each launched with its own
    CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES) on device 0."""
    from distributed import get_worker

    device_type, count = resolve_device(requested)
    name = get_worker().name
    return worker_device(device_type, count, name if isinstance(name, int) else 0)


def _describe_on_worker(specs, requested, threads):
    # worker_plugin imports distributed: imported where a Dask worker runs, not by every client.
    from ..worker.plugin import worker_cache

    return describe_encoders(specs, _device_here(requested), threads, worker_cache())


def _specs_on_worker(config, cache_dir):
    specs = encoder_specs(config, Path(cache_dir))
    return specs, takes_text_only(specs), outline(specs, config)


def _prompts_on_worker(specs, requested, threads, sections, prompts, output_url, storage_options, manifest):
    # lazy: worker_plugin imports distributed; this runs on a Dask worker
    from ..worker.plugin import worker_cache

    encoders = loaded_encoders(specs, _device_here(requested), threads, worker_cache())
    # The manifest the client just read or wrote: no request to read it again.
    store = open_store(output_url, storage_options, mode="a", load_index=False, manifest=manifest)
    try:
        return encode_and_store_prompts(encoders, store, sections, prompts)
    finally:
        store.close()


def _run_on_worker(task, output_url, storage_options, specs, threads, settings: TaskSettings, known, job: str):
    # lazy: worker_plugin imports distributed; this runs on a Dask worker
    from ..worker.plugin import worker_cache

    return encode_task(task, store_url=output_url, storage_options=storage_options, specs=specs, device=_device_here(settings.device),
                       threads=threads, settings=settings, known_shards=known, cache=worker_cache(),
                       attempt=counted_attempt(job, task.shard), job=job)
