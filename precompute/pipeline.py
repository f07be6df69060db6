"""The client side of ``mmcache encode``: plan the job, run it on a Dask cluster, report.

1. Read the input manifest (bad rows become rejects at once).
2. Ask one worker to load the encoders and describe them (fields, fingerprints), so the client
   never loads a model; create the store, or check that an existing one was made by the same
   encoders (fail closed).
3. Skip every row already committed (or already rejected), group the rest into tasks of
   ``run.samples_per_task`` rows, each named by a hash of its rows and the encoders' digests,
   and map them over the workers. Each task commits one shard.
A job killed at any moment loses nothing committed; running it again does only what is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import featstore
from featstore import secrets
from featstore.config import from_dict
from featstore.errors import FingerprintMismatchError
from featstore.secrets import RedactedOptions
from precompute.config import TINY_PATH, EncodeConfig, default_cache_dir
from precompute.devices import resolve_device, worker_device
from precompute.inputs import InputRow, Reject, read_inputs
from precompute.prompts import store_prompt_embeddings
from precompute.stale import describe as describe_stale
from precompute.stale import stale_samples
from precompute.tasks import QUIET_OFFLINE_ENV, EncoderSpec, TaskSpec, describe_encoders, encode_task


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

    def line(self) -> str:
        rate = self.samples_written / self.seconds if self.seconds > 0 else 0.0
        changed = f" ({self.stale} of them changed since: see the warning)" if self.stale else ""
        return (
            f"encoded {self.samples_written} sample(s) in {self.tasks - self.tasks_skipped} task(s) "
            f"({rate:.1f} samples/s; start-up {self.startup_seconds:.1f}s), {self.rejected} rejected, "
            f"{self.samples_skipped} already in the store{changed} -> {self.store_url}"
        )


def encoder_specs(config: EncodeConfig, cache_dir: Path | None = None) -> list[EncoderSpec]:
    """Config sections -> specs with concrete model folders (``path: tiny`` built on demand)."""
    from precompute.encoders import encoder_class

    specs = []
    for section, raw in config.encoder_sections().items():
        options = dict(raw)
        name = options.pop("encoder")
        cls = encoder_class(name)
        if options.get("path") == TINY_PATH:
            from precompute.encoders.tiny import ensure_tiny_models

            options["path"] = str(ensure_tiny_models((cache_dir or default_cache_dir()) / "tiny", [name])[name])
        elif "path" in options:
            options["path"] = str(Path(options["path"]).expanduser().resolve())
        field_names = {f.name for f in dataclasses.fields(cls.Config)}
        if section == "vae" and "modality" in field_names:
            # One latent field holds images and videos alike: an image is a one-frame video.
            options["modality"] = "video"
        # Checked here, on the client, so a bad option is one clear error before any worker starts.
        from_dict(cls.Config, options, where=section)
        specs.append(EncoderSpec(section=section, name=name, options=options))
    return specs


def plan_tasks(rows: list[InputRow], specs_digest: str, per_task: int, fields: list[str], new_samples: bool = True, salt: str = "") -> list[TaskSpec]:
    """Tasks of ``per_task`` rows that write ``fields``, each named by a hash of what it does
    (and ``salt``: what makes a retry of the same rows a different task)."""
    tasks = []
    for start in range(0, len(rows), per_task):
        chunk = rows[start : start + per_task]
        # Conversations only where present, so the names of caption-only tasks stay as they were.
        rows_body = [(r.sample_id, r.uri, r.caption, *([r.conversations] if r.conversations else [])) for r in chunk]
        body = json.dumps([specs_digest, fields, rows_body] + ([salt] if salt else []))
        name = f"t-{hashlib.sha256(body.encode()).hexdigest()[:24]}"
        tasks.append(TaskSpec(shard=name, rows=chunk, fields=fields, new_samples=new_samples))
    return tasks


def takes_text_only(specs: list[EncoderSpec]) -> bool:
    """Text-only rows (no media) are samples only for an LLM's tokenizer: a diffusion model has
    nothing to learn from a caption without its image."""
    from precompute.encoders import encoder_class

    return any(spec.section == "text" and encoder_class(spec.name).text_input == "sample" for spec in specs)


def fields_to_write(rows: list[InputRow], store: featstore.Store, fields: list[str],
                    text_fields: set[str] | None = None) -> dict[tuple[tuple[str, ...], bool], list[InputRow]]:
    """Rows grouped by (the configured fields they still lack, whether the sample is new): all
    fields for a new sample, the fields added to the store since for a committed one; a sample
    that has them all is left out. A text-only row has only ``text_fields`` (no image field:
    zero image tokens), so its task runs no visual encoder."""
    groups: dict[tuple[tuple[str, ...], bool], list[InputRow]] = {}
    for row in rows:
        new = row.sample_id not in store
        have = set() if new else set(store.fields_of(row.sample_id))
        own = fields if row.modality != "text" else [f for f in fields if f in (text_fields or set())]
        missing = tuple(f for f in own if f not in have)
        if missing:
            groups.setdefault((missing, new), []).append(row)
    return groups


@contextlib.contextmanager
def preserved_environ():
    """Put ``os.environ`` back as it was on the way out. ``run_encode`` wears it as a decorator:
    it sets quiet/offline variables for the workers, and Dask's nanny writes its own here."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


@preserved_environ()
def run_encode(
    config: EncodeConfig,
    input_url: str,
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
    from distributed import Client

    # Workers inherit the environment: models load from local folders only, without progress
    # bars or hub look-ups cluttering the job's output.
    for key, value in QUIET_OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    # Storage options may hold credentials and travel to the workers as task arguments, which
    # Dask prints when a task fails: they go as a dict whose repr hides the values.
    storage_options = RedactedOptions(storage_options) if storage_options else None
    input_storage_options = RedactedOptions(input_storage_options) if input_storage_options else None
    for options in (storage_options, input_storage_options):
        secrets.register(options or {})
    t0 = time.perf_counter()
    specs = encoder_specs(config)
    rows, plan_rejects = read_inputs(
        input_url,
        storage_options=input_storage_options,
        allow_empty_caption=config.data.allow_empty_caption,
        allow_outside_root=config.data.allow_outside_root,
        max_input_bytes=int(config.data.max_input_bytes),
        allow_empty=config.data.allow_empty,
        allow_text_only=takes_text_only(specs),
    )
    cores = os.cpu_count() or 1
    # Sizing a local cluster needs this machine's devices; an external cluster's workers resolve
    # their own (the client may have none).
    device_type, device_count = resolve_device(config.device) if not scheduler else (config.device, 0)
    if workers is None:
        workers = device_count if device_type not in ("cpu", "auto") and device_count else max(1, min(cores, 4))
    threads = config.run.threads_per_worker or max(1, cores // workers)
    in_process = output_url.startswith("memory://")  # memory:// lives in this process only

    with contextlib.ExitStack() as stack:
        if scheduler:
            client = stack.enter_context(Client(scheduler))
            cluster = None
        else:
            cluster = stack.enter_context(local_cluster(workers, processes=not in_process, dashboard=_has_bokeh()))
            client = stack.enter_context(Client(cluster))
        if client.dashboard_link and _has_bokeh():
            log(f"dask dashboard: {client.dashboard_link}")
        # A local cluster: all its workers; an external one: at least one (more may join later).
        client.wait_for_workers(workers if cluster is not None else 1, timeout=300)
        addresses = sorted(client.scheduler_info()["workers"])
        # Each worker resolves its own device (it, not the client, has the accelerators); the
        # values here are only for the log line.
        devices = {addr: config.device for addr in addresses}
        # Every worker loads its encoders now, in parallel, rather than inside its first task.
        loads = [client.submit(_describe_on_worker, specs, config.device, threads, workers=[a], pure=False) for a in addresses]
        described = loads[0].result()
        for load in loads[1:]:
            load.result()
        fields = described["fields"]
        settings = {
            "resize": dataclasses.asdict(config.resize),
            "frames": dataclasses.asdict(config.frames),
            "size_multiple": config.size_multiple,
            "batch_size": config.run.batch_size,
            "decode_threads": config.run.decode_threads,
            "input_storage_options": input_storage_options,
            "task_timeout": config.run.task_timeout,
            "device": config.device,
            "max_input_bytes": config.data.max_input_bytes,
        }
        transform = {k: settings[k] for k in ("resize", "frames", "size_multiple")}
        for spec in fields.values():
            # Each field's record names its input preparation too, so it rebuilds on its own.
            spec["meta"]["encoder"]["transform"] = transform
        store = _open_or_create(output_url, fields, storage_options, transform, log)
        # The empty prompt's embedding always, and the validation prompts' when given.
        store_prompt_embeddings(client, addresses[0], specs, config.device, threads, fields, store, prompts or [], log)
        startup = time.perf_counter() - t0
        log(f"encoders ready on {len(devices)} worker(s) ({device_type}) in {startup:.1f}s")

        rejected = _rejected_sources(store)
        rejected_before = rejected if not config.data.retry_rejects else set()
        stale = stale_samples(rows, store, client=client, storage_options=input_storage_options, check_content=config.data.check_content)
        if stale:
            log(describe_stale(stale))
        text_fields = {name for name, spec in fields.items() if spec["meta"]["section"] == "text"}
        groups = fields_to_write([r for r in rows if r.source not in rejected_before], store, list(fields), text_fields)
        todo = sum(len(g) for g in groups.values())
        skipped = len(rows) - todo
        new_plan_rejects = [r for r in plan_rejects if r.source not in rejected_before]
        if new_plan_rejects:
            _commit_plan_rejects(store, new_plan_rejects)
        for (missing, new), group in groups.items():
            if not new:
                log(f"adding {', '.join(missing)} to {len(group)} sample(s) already in the store")
        digest = hashlib.sha256(json.dumps({k: v["meta"]["fingerprint"]["digest"] for k, v in fields.items()}, sort_keys=True).encode()).hexdigest()
        # At least two tasks per worker when the job is small, so no worker sits idle.
        per_task = max(1, min(config.run.samples_per_task, -(-todo // (2 * len(addresses)))))
        # A retried reject gets a task of a new name: the one that rejected it is committed.
        retry = _retry_salt(store) if config.data.retry_rejects and any(r.source in rejected for g in groups.values() for r in g) else ""
        tasks = [task for (missing, new), group in groups.items() for task in plan_tasks(group, digest, per_task, list(missing), new, salt=retry)]
        # Every task is told which shards this plan saw, so that before committing it re-reads
        # only those committed since (by a concurrent run), not the whole index. Nor does it read
        # its sibling tasks' parts: a shard's name is a hash of its rows and fields, so one named
        # like a sibling holds that sibling's rows, none of this task's (a request per sibling
        # committed first, saved).
        # (A task's result, not scattered data: if the worker holding it dies, it is recomputed.)
        known = client.submit(list, sorted(set(store.shards) | {t.shard for t in tasks}), pure=False) if tasks else None
        summary = _run_tasks(client, tasks, known, output_url, storage_options, specs, threads, settings, progress, log)
        summary.update(samples_skipped=skipped, startup_seconds=startup, stale=len(stale))
        summary["rejected"] += len(new_plan_rejects)
        return EncodeSummary(store_url=store.url, seconds=time.perf_counter() - t0 - startup, **summary)


@contextlib.contextmanager
def local_cluster(workers: int, *, processes: bool = True, dashboard: bool = False):
    """A LocalCluster for encoding (one thread per worker, WORKER_CONFIG applied) that leaves this
    process's environment as it found it. Dask's nanny puts its pre-spawn variables
    (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, MALLOC_TRIM_THRESHOLD_ unless told otherwise) into
    the parent's own ``os.environ`` before it spawns a worker, so without this they leak into the
    caller and into everything it starts afterwards: measured here, a plain torch process started
    after another cluster's run inherited MALLOC_TRIM_THRESHOLD_ and ran its conv encoder ~15%
    slower, and so did the next cluster's workers (an inherited variable cannot be unset by
    pre-spawn-environ, so the workers here are spawned without it)."""
    import dask
    from distributed import LocalCluster

    with preserved_environ():
        # Workers inherit this process's environment at spawn, and glibc reads the variable only
        # then: one left here by an earlier cluster's nanny would reach them despite WORKER_CONFIG.
        os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
        with dask.config.set(WORKER_CONFIG):
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=processes,
                                   dashboard_address=":0" if dashboard else None, silence_logs=40)
        with cluster:
            yield cluster




def _run_tasks(client, tasks, known, output_url, storage_options, specs, threads, settings, progress, log) -> dict[str, int]:
    from distributed import as_completed

    total = sum(len(t.rows) for t in tasks)
    meter = ProgressMeter(total, enabled=sys.stderr.isatty() if progress is None else progress)
    # No placement hints: the scheduler spreads the tasks, and a task whose worker died (an OOM
    # kill) runs on whichever worker is alive, the nanny's restart of it included. A task pinned
    # to the dead worker's address would wait for it forever. Dask gives up on a task that kills
    # its worker repeatedly (distributed.scheduler.allowed-failures) and the job fails saying so.
    futures = [
        client.submit(
            _run_on_worker, task, output_url, storage_options, specs, settings["device"], threads, settings, known,
            key=f"encode-{task.shard}", retries=3, pure=False,
        )
        for task in tasks
    ]
    counts = {"tasks": len(tasks), "tasks_skipped": 0, "samples_written": 0, "rejected": 0}
    for future in as_completed(futures):
        result = future.result()
        counts["tasks_skipped"] += result["skipped"]
        counts["samples_written"] += result["samples"]
        counts["rejected"] += result["rejected"]
        meter.update(result["samples"] + result["rejected"] + result["dropped"], result["rejected"])
    meter.close()
    return counts


def _retry_salt(store: featstore.Store) -> str:
    """Names the rejects a retry follows, so retrying them again later is again a new task."""
    return hashlib.sha256(" ".join(sorted(n for n, info in store.shards.items() if info.num_rejected)).encode()).hexdigest()[:16]


def _device_here(requested: str) -> str:
    """This worker's device: one worker per device, worker ``n`` (a LocalCluster name, kept across
    restarts) on device ``n``; workers with other names (one per device, each launched with its own
    CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES) on device 0."""
    from distributed import get_worker

    device_type, count = resolve_device(requested)
    name = get_worker().name
    return worker_device(device_type, count, name if isinstance(name, int) else 0)


def _describe_on_worker(specs, requested, threads):
    return describe_encoders(specs, _device_here(requested), threads)


def _run_on_worker(task, output_url, storage_options, specs, requested, threads, settings, known):
    device = _device_here(requested)
    return encode_task(task, store_url=output_url, storage_options=storage_options, specs=specs, device=device, threads=threads, settings=settings, known_shards=known)


def _open_or_create(url: str, fields: dict[str, Any], storage_options: dict[str, Any] | None, transform: dict[str, Any], log) -> featstore.Store:
    """The output store: created with the configured fields, or an existing one checked against
    them (fail closed). Configured fields it lacks are added to it, so a new encoder (or a changed
    one under a new field name) extends a store in place."""
    try:
        store = featstore.open(url, storage_options, mode="a")
    except featstore.NotAStoreError:
        from featstore.reader import create_store

        return create_store(url, fields, storage_options=storage_options, attrs={"transform": transform})
    if store.attrs.get("transform") != json.loads(json.dumps(transform)):
        raise FingerprintMismatchError(
            f"{store.url} was encoded with other preprocessing (resize/frames/size_multiple: {store.attrs.get('transform')}); "
            "encode into a new --output, or use the same settings"
        )
    new = {}
    for name, spec in fields.items():
        have = store.fields.get(name)
        if have is None:
            new[name] = spec
            continue
        want_digest = spec["meta"]["fingerprint"]["digest"]
        have_digest = have.meta.get("fingerprint", {}).get("digest")
        if have_digest != want_digest or have.dtype != spec["dtype"]:
            raise FingerprintMismatchError(
                f"{store.url}: field {name!r} was made by a different encoder or settings "
                f"(store fingerprint {have_digest}, this config {want_digest}); to keep both, write the new features "
                f"under a new field name, which is added to this store (e.g. --set {spec['meta']['section']}.field={name}_v2), "
                "or write to a new --output"
            )
    if unwritten := [name for name in store.fields if name not in fields]:
        log(f"note: this config does not write {', '.join(unwritten)}, which {store.url} holds: new samples will lack it")
    if new:
        log(f"adding field(s) {', '.join(new)} to {store.url} (it holds {', '.join(store.fields)})")
        store.add_fields(new)
    return store


def _rejected_sources(store: featstore.Store) -> set[str]:
    return set(store.rejects.column("source").to_pylist()) if store.num_rejected() else set()


def _commit_plan_rejects(store: featstore.Store, rejects: list[Reject]) -> None:
    body = json.dumps([(r.source, r.reason) for r in rejects])
    name = f"r-{hashlib.sha256(body.encode()).hexdigest()[:24]}"
    if store.has_shard(name):
        return
    writer = store.writer()
    for r in rejects:
        writer.reject(r.source, r.reason, id=r.sample_id)
    writer.commit(name)


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None


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
