"""The client side of ``mmcache encode``: start the job, plan it, run it where it fits (this
process's threads, a local cluster of worker processes, an external Dask cluster:
precompute.executors).

1. Read the input manifest (bad rows become rejects at once).
2. Have the workers load the encoders and describe them (fields, fingerprints), while the store
   is opened; create the store, or check that the existing one was made by the same encoders
   (fail closed: precompute.output_store). With the in-process executor the encoders load here,
   once, in the background.
3. Plan (``precompute.plan.plan_encode``, pure): skip every row already committed (or already
   rejected), group the rest into named tasks. ``execute`` maps them over the workers; each
   task commits one shard.
A job killed at any moment loses nothing committed; running it again does only what is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmcache import featstore
from mmcache.featstore import secrets
from mmcache.featstore.secrets import RedactedOptions
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.executors import (
    DaskExecutor,
    Placement,
    ThreadExecutor,
    choose_placement,
    connect,
    open_executor,
    preserved_environ,
)
from mmcache.precompute.input_sources import SourceOptions, SourceUnit, read_all
from mmcache.precompute.inputs import InputRow, Reject
from mmcache.precompute.output_store import commit_plan_rejects, open_existing, open_or_create
from mmcache.precompute.plan import EncodePlan, plan_encode, samples_to_encode
from mmcache.precompute.prompts import store_prompt_embeddings
from mmcache.precompute.specs import EncoderSpec, TaskSettings, TaskSpec, encoder_specs, takes_text_only, with_client_paths
from mmcache.precompute.stale import describe as describe_stale
from mmcache.precompute.stale import stale_samples
from mmcache.precompute.tasks import quiet_offline_env
from mmcache.precompute.worker_deaths import DIED_REASON, split_task

Executor = ThreadExecutor | DaskExecutor


@dataclass(kw_only=True)
class EncodeSummary:
    store_url: str
    tasks: int
    tasks_skipped: int
    samples_written: int
    samples_skipped: int
    rejected: int
    seconds: float
    startup_seconds: float
    stale: int = 0  # committed samples whose input changed since (reported, not re-encoded)
    executor: str = ""  # where the tasks ran: threads | processes | scheduler (precompute.executors)

    def line(self) -> str:
        rate = self.samples_written / self.seconds if self.seconds > 0 else 0.0
        changed = f" ({self.stale} of them changed since: see the warning)" if self.stale else ""
        return (
            f"encoded {self.samples_written} sample(s) in {self.tasks - self.tasks_skipped} task(s) "
            f"({rate:.1f} samples/s; start-up {self.startup_seconds:.1f}s), {self.rejected} rejected, "
            f"{self.samples_skipped} already in the store{changed} -> {self.store_url}"
        )


@dataclass(kw_only=True)
class _Started:
    """What the job has once its executor is open: where it runs, its encoders, its input rows."""

    executor: Executor
    placement: Placement
    specs: list[EncoderSpec]
    rows: list[InputRow]
    rejects: list[Reject]
    units: list[SourceUnit]  # tars, Parquet row groups: read by the tasks themselves
    existing: featstore.Store | None  # the output store's snapshot before this job (None: no store yet)
    loading: Any  # the encoders loading where the tasks run: .result() -> {fields, loaded}


@preserved_environ()
def run_encode(
    config: EncodeConfig,
    input_url: str | list[str],
    output_url: str,
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    storage_options: dict[str, Any] | None = None,
    input_storage_options: dict[str, Any] | None = None,
    progress: bool | None = None,
    prompts: list[str] | None = None,
    log=print,
) -> EncodeSummary:
    """Encode the rows of ``input_url`` into the store at ``output_url``: start the executor and
    the store, ``plan_encode``, then ``execute``."""
    # Workers inherit the environment: models load from local folders only, without progress
    # bars or hub look-ups cluttering the job's output.
    quiet_offline_env()
    # Storage options may hold credentials and travel to the workers as task arguments, which
    # Dask prints when a task fails: they go as a dict whose repr hides the values.
    storage_options = RedactedOptions(storage_options) if storage_options else None
    input_storage_options = RedactedOptions(input_storage_options) if input_storage_options else None
    for options in (storage_options, input_storage_options):
        secrets.register(options or {})
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        job = _start(stack, config, input_url, output_url, workers=workers, scheduler=scheduler,
                     storage_options=storage_options, input_storage_options=input_storage_options)
        if job.executor.dashboard_link:
            log(f"dask dashboard: {job.executor.dashboard_link}")
        for note in job.executor.notes:
            log(note)
        store, fields, loaded = _open_store(job, config, output_url, storage_options, prompts or [], log)
        startup = time.perf_counter() - t0
        log(_ready_line(job, loaded, startup))
        stale = stale_samples(job.rows, store, client=job.executor.client, storage_options=input_storage_options,
                              check_content=config.data.check_content)
        if stale:
            log(describe_stale(stale))
        plan = plan_encode(config, rows=job.rows, rejects=job.rejects, store=store, fields=fields, specs=job.specs,
                           workers=job.executor.workers, output_url=output_url, storage_options=storage_options,
                           input_storage_options=input_storage_options, units=job.units)
        for note in plan.notes:
            log(note)
        executed = execute(plan, job.executor, progress=progress, log=log)
        return EncodeSummary(store_url=store.url, seconds=time.perf_counter() - t0 - startup, samples_skipped=plan.samples_skipped,
                             startup_seconds=startup, stale=len(stale), executor=job.placement.kind, **dataclasses.asdict(executed))


def _start(stack: contextlib.ExitStack, config: EncodeConfig, input_url: str | list[str], output_url: str, *, workers: int | None,
           scheduler: str | None, storage_options: dict[str, Any] | None,
           input_storage_options: dict[str, Any] | None) -> _Started:
    """The executor opened (on ``stack``), the encoders' specs resolved, the manifest read, and
    the output store's snapshot (read at most once: by the size estimate when the choice of
    executor needs it, else here, while the encoders load)."""
    executor: Executor | None = None
    if scheduler:
        # An external cluster's placement does not depend on the job's size: connect first and
        # let a worker resolve the encoders (check their options, build ``path: tiny``). Their
        # classes import torch, which this process, planning the job only, then never does: on
        # a warm cluster the job starts in the time of a few round trips.
        placement = choose_placement(config, scheduler=scheduler, workers=workers, output_url=output_url, samples=lambda: 0)
        executor = stack.enter_context(connect(placement, scheduler))
        specs, text_only = executor.resolve_specs(with_client_paths(config))
    else:
        specs = encoder_specs(config)
        text_only = takes_text_only(specs)
    data = config.data
    inputs = read_all(input_url, SourceOptions(
        storage_options=input_storage_options, allow_empty_caption=data.allow_empty_caption,
        allow_outside_root=data.allow_outside_root, max_input_bytes=int(data.max_input_bytes),
        allow_empty=data.allow_empty, allow_text_only=text_only, caption_key=data.caption_key,
        media_column=data.media_column, caption_column=data.caption_column, media_root=data.media_root,
    ))
    rows, rejects = inputs.rows, inputs.rejects
    # A unit's size is known only once read (a tar) or from its footer (Parquet): a tar counts as one task's worth.
    unit_samples = sum(u.estimated_samples or config.run.samples_per_task for u in inputs.units)
    existing: list[featstore.Store | None] = []

    def job_size() -> int:
        if len(rows) + unit_samples <= config.run.threads_max_samples:
            return len(rows) + unit_samples  # an upper bound that already decides
        existing.append(open_existing(output_url, storage_options))
        return samples_to_encode(rows, existing[0], specs) + unit_samples

    if executor is None:
        placement = choose_placement(config, scheduler=None, workers=workers, output_url=output_url, samples=job_size)
        executor = stack.enter_context(open_executor(placement, output_url))
    loading = executor.load_encoders(specs, config.device)
    snapshot = existing[0] if existing else open_existing(output_url, storage_options)
    return _Started(executor=executor, placement=placement, specs=specs, rows=rows, rejects=rejects, units=inputs.units, existing=snapshot,
                    loading=loading)


def _open_store(job: _Started, config: EncodeConfig, output_url: str, storage_options: dict[str, Any] | None,
                prompts: list[str], log: Callable[[str], Any]) -> tuple[featstore.Store, dict[str, Any], int]:
    """(the output store, created or checked against the encoders' fields, those fields, how many
    models the workers loaded), with the prompts' embeddings stored."""
    described = job.loading.result()
    fields = described["fields"]
    transform = TaskSettings.from_config(config, None).transform()
    for spec in fields.values():
        # Each field's record names its input preparation too, so it rebuilds on its own.
        spec["meta"]["encoder"]["transform"] = transform
    store = open_or_create(output_url, fields, storage_options, transform, log, job.existing)
    # The empty prompt's embedding always, and the validation prompts' when given.
    store_prompt_embeddings(job.executor, job.specs, config.device, fields, store, prompts, log,
                            output_url=output_url, storage_options=storage_options, new_store=job.existing is None)
    return store, fields, described["loaded"]


def _ready_line(job: _Started, loaded: int, startup: float) -> str:
    placement = job.placement
    unit = "thread(s) of this process" if placement.kind == "threads" else "worker(s)"
    models = f"{loaded} model load(s)" if loaded else "all models already loaded"
    return (f"encoders ready in {startup:.1f}s on {job.executor.workers} {unit} ({placement.device_type}; "
            f"{placement.kind}: {placement.reason}), {models}")


@dataclass(kw_only=True)
class Executed:
    """What running a plan did (the counts of ``EncodeSummary``)."""

    tasks: int
    tasks_skipped: int = 0  # committed already (an earlier try, a concurrent run of the same plan)
    samples_written: int = 0
    rejected: int = 0  # by the manifest reader and by the tasks


def execute(plan: EncodePlan, executor: Executor, *, progress: bool | None = None, log: Callable[[str], Any] = print) -> Executed:
    """Run ``plan`` on ``executor``: record the manifest reader's rejects, then map the tasks over
    the workers (each commits its shard). A task whose worker died running it comes back
    unrun, and runs again as two halves (precompute.worker_deaths)."""
    commit_plan_rejects(plan.store, plan.plan_rejects)
    # Every task is told which shards this plan saw, so that before committing it re-reads only
    # those committed since (by a concurrent run), not the whole index (see EncodePlan).
    known = executor.share(plan.known_shards) if plan.tasks else None
    meter = ProgressMeter(plan.samples, enabled=sys.stderr.isatty() if progress is None else progress)

    def submit(task: TaskSpec) -> Any:
        future = executor.submit_task(task, plan.output_url, plan.storage_options, plan.specs, plan.settings, known)
        running[future] = task
        return future

    running: dict[Any, TaskSpec] = {}
    completed = executor.as_completed([submit(task) for task in plan.tasks])
    executed = Executed(tasks=len(plan.tasks), rejected=len(plan.plan_rejects))
    for future in completed:
        task = running.pop(future)
        result = executor.result(future, task)  # a task's summary (its rejects stay in its shard)
        if result is None or result.died:
            again = [task] if result is None else split_task(task, result.died)
            executed.tasks += len(again) - 1
            for part in again:
                completed.add(submit(part))
            continue
        for source in result.poisoned:
            log(f"rejected {source}: {DIED_REASON}")
        executed.tasks_skipped += result.skipped
        executed.samples_written += result.samples
        executed.rejected += result.rejected
        meter.update(result.samples + result.rejected + result.dropped, result.rejected)
    meter.close()
    return executed


class ProgressMeter:
    """One status line on stderr (samples/s, ETA, rejects) when it is a terminal; quiet otherwise."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.rejected = 0
        self.start = time.perf_counter()
        self.last_line = 0.0

    # Without a terminal (batch logs), a plain line at most this often.
    LOG_EVERY_S = 30.0

    def update(self, done: int, rejected: int) -> None:
        self.done += done
        self.rejected += rejected
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:5.0f}s" if eta != float("inf") else "    ?"
        line = f"{self.done}/{self.total} samples  {rate:6.1f}/s  ETA {eta_text}  rejected {self.rejected}"
        if self.enabled:
            sys.stderr.write(f"\r{line}   ")
            sys.stderr.flush()
        elif elapsed - self.last_line >= self.LOG_EVERY_S and self.done < self.total:
            self.last_line = elapsed
            sys.stderr.write(line + "\n")

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
