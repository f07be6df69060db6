"""The client side of ``mmcache encode``: start the job, plan it, run it where it fits (this
process's threads, a local cluster of worker processes, an external Dask cluster: ``runtime.executors``).
Survey the inputs (``planning.survey``); have the workers load and describe the encoders while the
store is opened, created or checked (``output.store``); plan (``planning.plan.plan_encode``, pure);
execute, a few tasks per worker in flight. A job killed at any moment loses nothing committed;
running it again does only what is left. The steps in full: docs/design/encode.md, "The client side of a job"."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import featstore
from ..featstore import secrets
from ..featstore.secrets import RedactedOptions
from .config import EncodeConfig
from .inputs.located import recorded_rows
from .inputs.registry import SourceOptions
from .inputs.stream import InputStream
from .output.compaction import compact_after_job
from .output.prompts import store_prompt_embeddings
from .output.store import commit_plan_rejects, open_existing, open_or_create
from .planning.feature_bytes import FieldsOutline, outline
from .planning.plan import EncodePlan, plan_encode
from .worker.specs import EncoderSpec, TaskSettings, TaskSpec, encoder_specs, takes_text_only, with_client_paths
from .planning.stale import describe as describe_stale
from .planning.stale import stale_samples
from .planning.survey import Survey, survey
from .progress import UNREAD_UNIT_SAMPLES, ProgressMeter, SampleTotal
from .runtime.executors import DaskExecutor, ThreadExecutor, connect, open_executor
from .runtime.interrupt import Interrupted, StopRequest, stop_on_signals
from .runtime.local_cluster import preserved_environ
from .runtime.placement import Placement, choose_placement
from .worker.deaths import split_task
from .worker.encoder_cache import quiet_offline_env

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
    samples_by_others: int = 0  # another writer (a second job on this store) committed them first
    executor: str = ""  # where the tasks ran: threads | processes | scheduler (precompute.runtime.executors)

    def line(self) -> str:
        rate = self.samples_written / self.seconds if self.seconds > 0 else 0.0
        changed = f" ({self.stale} of them changed since: see the warning)" if self.stale else ""
        others = f", {self.samples_by_others} committed meanwhile by another writer (kept theirs)" if self.samples_by_others else ""
        return (
            f"encoded {self.samples_written} sample(s) in {self.tasks - self.tasks_skipped} task(s) "
            f"({rate:.1f} samples/s; start-up {self.startup_seconds:.1f}s), {self.rejected} rejected, "
            f"{self.samples_skipped} already in the store{changed}{others} -> {self.store_url}"
        )


@dataclass(kw_only=True)
class _Started:
    """What the job has once its executor is open: where it runs, its encoders, its inputs surveyed."""

    executor: Executor
    placement: Placement
    specs: list[EncoderSpec]
    outline: FieldsOutline  # the encoders' fields and a sample's estimated bytes, before any loads
    inputs: InputStream  # read again, in batches, to make the tasks
    survey: Survey  # the inputs' first pass: counts, rejects, duplicates (precompute.planning.survey)
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
                     storage_options=storage_options, input_storage_options=input_storage_options, log=log)
        if job.executor.dashboard_link:
            log(f"dask dashboard: {job.executor.dashboard_link}")
        for note in job.executor.notes:
            log(note)
        store, fields, loaded = _open_store(job, config, output_url, storage_options, prompts or [], log)
        startup = time.perf_counter() - t0
        log(_ready_line(job, loaded, startup))
        stale = _stale(job, store, config, input_storage_options)
        if stale:
            log(describe_stale(stale))
        plan = plan_encode(config, inputs=job.inputs, survey=job.survey, store=store, fields=fields, specs=job.specs,
                           workers=job.executor.workers, output_url=output_url, sample_bytes=job.outline.mean_bytes(job.survey.kinds),
                           storage_options=storage_options, input_storage_options=input_storage_options)
        for note in plan.notes:
            log(note)
        executed = execute(plan, job.executor, progress=progress, log=log)
        compact_after_job(config, store, storage_options, executor=job.executor, workers=job.executor.workers,
                          tasks_done=executed.tasks - executed.tasks_skipped, samples_written=executed.samples_written, log=log)
        return EncodeSummary(store_url=store.url, seconds=time.perf_counter() - t0 - startup, samples_skipped=plan.samples_skipped,
                             startup_seconds=startup, stale=len(stale), executor=job.placement.kind, **dataclasses.asdict(executed))


def source_options(config: EncodeConfig, storage_options: dict[str, Any] | None, text_only: bool) -> SourceOptions:
    """What the input sources read with: the config's ``data`` section."""
    data = config.data
    return SourceOptions(
        storage_options=storage_options, allow_empty_caption=data.allow_empty_caption,
        allow_outside_root=data.allow_outside_root, max_input_bytes=int(data.max_input_bytes),
        allow_empty=data.allow_empty, allow_text_only=text_only, caption_key=data.caption_key,
        media_column=data.media_column, caption_column=data.caption_column, media_root=data.media_root,
    )


def _start(stack: contextlib.ExitStack, config: EncodeConfig, input_url: str | list[str], output_url: str, *, workers: int | None,
           scheduler: str | None, storage_options: dict[str, Any] | None,
           input_storage_options: dict[str, Any] | None, log: Callable[[str], Any]) -> _Started:
    """The executor opened (on ``stack``), the encoders' specs resolved, the inputs surveyed
    (their first pass) against the output store's snapshot, read once."""
    executor: Executor | None = None
    if scheduler:
        # An external cluster's placement does not depend on the job's size: connect first and
        # let a worker resolve the encoders (check their options, build ``path: tiny``). Their
        # classes import torch, which this process, planning the job only, then never does: on
        # a warm cluster the job starts in the time of a few round trips.
        placement = choose_placement(config, scheduler=scheduler, workers=workers, output_url=output_url, samples=lambda: 0)
        executor = stack.enter_context(connect(placement, scheduler, no_worker_timeout=config.run.no_worker_timeout, log=log))
        specs, text_only, fields_outline = executor.resolve_specs(with_client_paths(config))
    else:
        specs = encoder_specs(config)
        text_only, fields_outline = takes_text_only(specs), outline(specs, config)
    inputs = InputStream(input_url, source_options(config, input_storage_options, text_only))
    existing = open_existing(output_url, storage_options)
    surveyed = survey(inputs, existing, fields_outline.fields, clips=config.frames.clips is not None,
                      retry_rejects=config.data.retry_rejects)
    size = surveyed.todo + sum(u.estimated_samples or UNREAD_UNIT_SAMPLES for u in surveyed.units)
    if executor is None:
        placement = choose_placement(config, scheduler=None, workers=workers, output_url=output_url, samples=lambda: size)
        executor = stack.enter_context(open_executor(placement, output_url, no_worker_timeout=config.run.no_worker_timeout, log=log))
    loading = executor.load_encoders(specs, config.device)
    return _Started(executor=executor, placement=placement, specs=specs, outline=fields_outline, inputs=inputs, survey=surveyed,
                    existing=existing, loading=loading)


def _stale(job: _Started, store: featstore.Store, config: EncodeConfig, input_storage_options: dict[str, Any] | None) -> dict[str, str]:
    """Committed samples whose input changed since (precompute.planning.stale): what the survey found, or
    with ``data.check_content`` a pass over the inputs that hashes their bytes too."""
    if not config.data.check_content or job.existing is None or not len(job.existing):
        return job.survey.stale
    # A tar's or Parquet file's recorded caption is what the store has: only its bytes can change.
    rows = itertools.chain((row for _, batch in job.inputs.batches() for row in batch.rows),
                           recorded_rows(store, job.inputs.units, job.inputs.ids_of))
    return stale_samples(rows, store, client=job.executor, storage_options=input_storage_options,
                         check_content=True, media_column=config.data.media_column)


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
    samples_by_others: int = 0  # encoded here, but another writer committed them first: theirs kept


# Tasks in flight per worker: one running, one queued behind it (no idle gap between tasks), one
# more for a task that commits while the next encodes (precompute.worker.commit_ahead). More are
# submitted as tasks finish: the client never holds the job's tasks, nor the scheduler.
IN_FLIGHT_PER_WORKER = 3


def execute(plan: EncodePlan, executor: Executor, *, progress: bool | None = None, log: Callable[[str], Any] = print) -> Executed:
    """Run ``plan`` on ``executor``: record the input readers' rejects, then keep
    ``IN_FLIGHT_PER_WORKER`` tasks per worker running (each commits its shard), taking the next
    from the plan as one finishes. A task whose worker died running it comes back unrun, and runs
    again as two halves (precompute.worker.deaths). Duplicate ids found meanwhile are recorded last.
    Ctrl-C or SIGTERM: no task is submitted after it, the running ones commit what they have
    encoded, and ``Interrupted`` says how much that is (precompute.runtime.interrupt)."""
    commit_plan_rejects(plan.store, plan.plan_rejects)
    total = SampleTotal(plan.samples, plan.units)
    meter = ProgressMeter(total, enabled=sys.stderr.isatty() if progress is None else progress)
    executed = Executed(tasks=0, rejected=len(plan.plan_rejects))
    with stop_on_signals(executor.stop) as stop:
        _run_tasks(plan, executor, executed, meter, stop, log)
    meter.close()
    if stop.signum is not None:
        raise Interrupted(stop.signum, f"stopped at a sample boundary with {executed.samples_written} sample(s) of this run committed",
                          "run the same command again to encode the rest (committed samples are not encoded again)")
    commit_plan_rejects(plan.store, plan.duplicate_rejects)
    executed.rejected += len(plan.duplicate_rejects)
    return executed


def _run_tasks(plan: EncodePlan, executor: Executor, executed: Executed, meter: ProgressMeter, stop: StopRequest,
               log: Callable[[str], Any]) -> None:
    """``execute``'s loop: the plan's tasks, a few per worker in flight, until they are done (or,
    once ``stop`` has a signal, until the running ones are)."""
    flight = _Flight(plan, executor)
    completed = executor.as_completed([])
    executed.tasks += flight.refill(completed)
    for future in completed:
        task = flight.running.pop(future)
        result = executor.result(future, task)  # a task's summary (its rejects stay in its shard)
        if stop.signum is not None and (result is None or result.died):
            continue  # stopping: a task whose worker died is left to the re-run
        if result is None or result.died:
            again = [task] if result is None else split_task(task, result.died)
            executed.tasks += len(again) - 1
            flight.submit(again, completed)
            continue
        for source, reason in result.poisoned:
            log(f"rejected {source}: {reason}")
        executed.tasks_skipped += result.skipped
        executed.samples_written += result.samples
        executed.rejected += result.rejected
        executed.samples_by_others += result.dropped
        meter.update(result.samples + result.rejected + result.dropped, result.rejected, task.units, result.members)
        if stop.signum is None:
            executed.tasks += flight.refill(completed)


class _Flight:
    """The tasks running, and the plan's next ones. Each submission tells its tasks every shard
    the plan saw and every task submitted so far (``known``), so a task's commit re-reads only
    shards committed by others since, not its siblings' (EncodePlan.known_shards)."""

    def __init__(self, plan: EncodePlan, executor: Executor) -> None:
        self.plan, self.executor = plan, executor
        self.limit = IN_FLIGHT_PER_WORKER * max(1, executor.workers)
        self.known = set(plan.known_shards)
        self.shared: Any = None
        self.shared_size = 0
        self.running: dict[Any, TaskSpec] = {}

    def refill(self, completed: Any) -> int:
        """Submit the plan's next tasks up to the limit; how many."""
        tasks = list(itertools.islice(self.plan.tasks, max(0, self.limit - len(self.running))))
        self.submit(tasks, completed)
        return len(tasks)

    def submit(self, tasks: list[TaskSpec], completed: Any) -> None:
        if not tasks:
            return
        self.known.update(task.shard for task in tasks)
        # Shared again only when the list has doubled: a task that is not told of a sibling
        # submitted since reads that sibling's index part at its commit (correct, one request),
        # while sharing on every refill would send the whole growing list each time.
        if len(self.known) >= 2 * self.shared_size:
            self.shared, self.shared_size = self.executor.share(sorted(self.known)), len(self.known)
        plan = self.plan
        for task in tasks:
            future = self.executor.submit_task(task, plan.output_url, plan.storage_options, plan.specs, plan.settings, self.shared)
            self.running[future] = task
            completed.add(future)
