"""The client side of ``mmcache encode``: plan the job, run it where it fits (this process's
threads, a local cluster of worker processes, an external Dask cluster: precompute.executors).

1. Read the input manifest (bad rows become rejects at once).
2. Have the workers load the encoders and describe them (fields, fingerprints), while the store
   is opened; create the store, or check that the existing one was made by the same encoders
   (fail closed). With the in-process executor the encoders load here, once, in the background.
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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcache import featstore
from mmcache.featstore import secrets
from mmcache.featstore.config import from_dict
from mmcache.featstore.errors import FingerprintMismatchError
from mmcache.featstore.format import EXCLUSIVE_COMMIT_VERSION
from mmcache.featstore.secrets import RedactedOptions
from mmcache.precompute.config import TINY_PATH, EncodeConfig, default_cache_dir
from mmcache.precompute.executors import DaskExecutor, ThreadExecutor, choose_placement, connect, open_executor, preserved_environ
from mmcache.precompute.inputs import InputRow, Reject, read_inputs
from mmcache.precompute.prompts import store_prompt_embeddings
from mmcache.precompute.stale import describe as describe_stale
from mmcache.precompute.stale import stale_samples
from mmcache.precompute.tasks import EncoderSpec, TaskSpec, quiet_offline_env


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


def _local_model_path(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def with_client_paths(config: EncodeConfig) -> EncodeConfig:
    """``config`` with model folders named relative to this process's directory (or ``~``)
    made absolute here: a worker of an external cluster that resolves the specs would read them
    against its own directory and home."""
    resolved = {section: {**raw, "path": _local_model_path(raw["path"])}
                for section, raw in config.encoder_sections().items() if "path" in raw and raw["path"] != TINY_PATH}
    return dataclasses.replace(config, **resolved) if resolved else config


def encoder_specs(config: EncodeConfig, cache_dir: Path | None = None) -> list[EncoderSpec]:
    """Config sections -> specs with concrete model folders (``path: tiny`` built on demand)."""
    from mmcache.precompute.encoders import encoder_class

    specs = []
    for section, raw in config.encoder_sections().items():
        options = dict(raw)
        name = options.pop("encoder")
        cls = encoder_class(name)
        if options.get("path") == TINY_PATH:
            from mmcache.precompute.encoders.tiny import ensure_tiny_models

            options["path"] = str(ensure_tiny_models((cache_dir or default_cache_dir()) / "tiny", [name])[name])
        elif "path" in options:
            options["path"] = _local_model_path(options["path"])
        field_names = {f.name for f in dataclasses.fields(cls.Config)}
        if section == "vae" and "modality" in field_names:
            # One latent field holds images and videos alike: an image is a one-frame video.
            options["modality"] = "video"
        # Checked here, before any task (on the client; for an external cluster on one worker), so
        # a bad option is one clear error before anything is encoded.
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
    from mmcache.precompute.encoders import encoder_class

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
        executor: ThreadExecutor | DaskExecutor | None = None
        if scheduler:
            # An external cluster's placement does not depend on the job's size: connect first and
            # let a worker resolve the encoders (check their options, build ``path: tiny``). Their
            # classes import torch, which this process, planning the job only, then never does: on
            # a warm cluster the job starts in the time of a few round trips.
            placement = choose_placement(config, scheduler=scheduler, workers=workers, output_url=output_url, samples=lambda: 0)
            cluster = stack.enter_context(connect(placement, scheduler))
            specs, text_only = cluster.resolve_specs(with_client_paths(config))
            executor = cluster
        else:
            specs = encoder_specs(config)
            text_only = takes_text_only(specs)
        rows, plan_rejects = read_inputs(
            input_url,
            storage_options=input_storage_options,
            allow_empty_caption=config.data.allow_empty_caption,
            allow_outside_root=config.data.allow_outside_root,
            max_input_bytes=int(config.data.max_input_bytes),
            allow_empty=config.data.allow_empty,
            allow_text_only=text_only,
        )
        # The store's snapshot: read here at most once, by the size estimate when the choice of
        # executor needs it, else while the encoders load.
        existing: list[featstore.Store | None] = []

        def samples_to_encode() -> int:
            if len(rows) <= config.run.threads_max_samples:
                return len(rows)  # an upper bound that already decides
            existing.append(_open_existing(output_url, storage_options))
            return _samples_to_encode(rows, existing[0], specs)

        if executor is None:
            placement = choose_placement(config, scheduler=None, workers=workers, output_url=output_url, samples=samples_to_encode)
            executor = stack.enter_context(open_executor(placement))
        if executor.dashboard_link:
            log(f"dask dashboard: {executor.dashboard_link}")
        loading = executor.load_encoders(specs, config.device)
        if not existing:
            existing.append(_open_existing(output_url, storage_options))
        described = loading.result()
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
            "commit_ahead_bytes": config.run.commit_ahead_bytes,
        }
        transform = {k: settings[k] for k in ("resize", "frames", "size_multiple")}
        for spec in fields.values():
            # Each field's record names its input preparation too, so it rebuilds on its own.
            spec["meta"]["encoder"]["transform"] = transform
        store = _open_or_create(output_url, fields, storage_options, transform, log, existing[0])
        # The empty prompt's embedding always, and the validation prompts' when given.
        store_prompt_embeddings(executor, specs, config.device, fields, store, prompts or [], log,
                                output_url=output_url, storage_options=storage_options, new_store=existing[0] is None)
        startup = time.perf_counter() - t0
        unit = "thread(s) of this process" if placement.kind == "threads" else "worker(s)"
        loaded = f"{described['loaded']} model load(s)" if described["loaded"] else "all models already loaded"
        log(f"encoders ready in {startup:.1f}s on {executor.workers} {unit} ({placement.device_type}; "
            f"{placement.kind}: {placement.reason}), {loaded}")

        rejected = _rejected_sources(store)
        rejected_before = rejected if not config.data.retry_rejects else set()
        stale = stale_samples(rows, store, client=executor.client, storage_options=input_storage_options, check_content=config.data.check_content)
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
        per_task = max(1, min(config.run.samples_per_task, -(-todo // (2 * executor.workers))))
        # A retried reject gets a task of a new name: the one that rejected it is committed.
        retry = _retry_salt(store) if config.data.retry_rejects and any(r.source in rejected for g in groups.values() for r in g) else ""
        tasks = [task for (missing, new), group in groups.items() for task in plan_tasks(group, digest, per_task, list(missing), new, salt=retry)]
        # Every task is told which shards this plan saw, so that before committing it re-reads
        # only those committed since (by a concurrent run), not the whole index. Nor does it read
        # its sibling tasks' parts: a shard's name is a hash of its rows and fields, so one named
        # like a sibling holds that sibling's rows, none of this task's (a request per sibling
        # committed first, saved).
        known = executor.share(sorted(set(store.shards) | {t.shard for t in tasks})) if tasks else None
        if tasks:
            # Raised here once (an older store), so that the tasks, which open the store from the
            # manifest planned with, do not each declare it again.
            store.require_format_version(EXCLUSIVE_COMMIT_VERSION)
            settings["store_manifest"] = store.manifest
        summary = _run_tasks(executor, tasks, known, output_url, storage_options, specs, settings, progress)
        summary.update(samples_skipped=skipped, startup_seconds=startup, stale=len(stale), executor=placement.kind)
        summary["rejected"] += len(new_plan_rejects)
        return EncodeSummary(store_url=store.url, seconds=time.perf_counter() - t0 - startup, **summary)


def _run_tasks(executor, tasks, known, output_url, storage_options, specs, settings, progress) -> dict[str, int]:
    total = sum(len(t.rows) for t in tasks)
    meter = ProgressMeter(total, enabled=sys.stderr.isatty() if progress is None else progress)
    futures = [executor.submit_task(task, output_url, storage_options, specs, settings["device"], settings, known) for task in tasks]
    counts = {"tasks": len(tasks), "tasks_skipped": 0, "samples_written": 0, "rejected": 0}
    for future in executor.as_completed(futures):
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


def _open_existing(url: str, storage_options: dict[str, Any] | None) -> featstore.Store | None:
    """The output store as it is now (its snapshot), or None where there is none yet."""
    try:
        return featstore.open(url, storage_options, mode="a")
    except featstore.NotAStoreError:
        return None


def _samples_to_encode(rows: list[InputRow], store: featstore.Store | None, specs: list[EncoderSpec]) -> int:
    """How many rows lack one of the configured fields (the job's size, before any model loads:
    an encoder names its fields from its config). Rows rejected before count too: a bound."""
    if store is None:
        return len(rows)
    from mmcache.precompute.encoders import build_encoder

    names = [name for spec in specs for name in build_encoder(spec.name, spec.options).fields()]
    return sum(len(group) for group in fields_to_write(rows, store, names).values())


def _open_or_create(url: str, fields: dict[str, Any], storage_options: dict[str, Any] | None, transform: dict[str, Any], log,
                    store: featstore.Store | None) -> featstore.Store:
    """The output store: created with the configured fields, or the existing ``store`` checked
    against them (fail closed). Configured fields it lacks are added to it, so a new encoder (or a
    changed one under a new field name) extends a store in place."""
    if store is None:
        from mmcache.featstore.reader import create_store

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
