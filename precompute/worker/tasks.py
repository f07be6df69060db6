"""What runs where the tasks run (a Dask worker, or a thread of the in-process executor): one task's
rows turned into one committed shard.

A task is a fixed list of input rows with a deterministic shard name (a hash of the rows and the
encoders' fingerprints). It reads and decodes its media on a few CPU threads while the encoder
works through batches on the worker's device, writes the shard's data, and commits it; rows that
fail become rejects in the same commit. Nothing but a small summary travels back to the client."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...featstore.errors import DuplicateSampleError, ShardCommittedError
from ...featstore.reader import open_store
from ...featstore.secrets import redact_url
from ..inputs.located import read_recorded
from ..inputs.rows import InputRow
from ..inputs.source_bytes import read_source
from ..media.clips import clip_id
from ..media.errors import MediaError
from .specs import EncoderSpec, TaskSettings, TaskSpec
from .daemon_pool import DaemonPool, handed_over, kept_ahead
from .deaths import Deaths, died_reason, verdict
from .commit_ahead import commit_ahead
from .encoder_cache import EncoderCache, loaded_encoders
from .encoder_inputs import GEOMETRY, encoder_input, prepare_clip_sections, prepare_recorded_clip, size_rule_for, text_input
from .stopping import halt_of
from .unit_encode import encode_unit


@dataclass(kw_only=True)
class TaskResult:
    shard: str
    samples: int = 0
    rejected: int = 0
    dropped: int = 0  # encoded, but another writer had committed them meanwhile: left out
    members: int = 0  # a unit's members read, whatever came of them (precompute.progress sizes unread tars by it)
    skipped: bool = False
    stopped: bool = False  # its job was stopped (Ctrl-C): it committed only what it had encoded
    seconds: float = 0.0
    died: int = 0  # not run: its earlier attempts' worker died this often; the client splits it
    poisoned: list = field(default_factory=list)  # [source, reason] of inputs rejected because their worker died decoding them
    rejects: list = field(default_factory=list, repr=False)  # (row, reason); not sent back

    def summary(self) -> TaskResult:
        """What goes back to the client: the counts, without the rejected rows (in the shard)."""
        return replace(self, rejects=[])


def encode_task(
    task: TaskSpec,
    *,
    store_url: str,
    storage_options: dict[str, Any] | None,
    specs: list[EncoderSpec],
    device: str,
    threads: int,
    settings: TaskSettings,
    known_shards: list[str] | None = None,
    cache: EncoderCache | None = None,
    attempt: contextlib.AbstractContextManager[Deaths] | None = None,
    job: str | None = None,
) -> TaskResult:
    """Encode one task into one committed shard; idempotent (a committed shard is skipped, and so
    is one another writer commits first). ``known_shards``: the shards the client planned from,
    and the names of its sibling tasks (which hold none of this task's rows). ``attempt``
    (on a Dask worker: ``worker.deaths.counted_attempt``) is held while the rows are read and
    encoded, and says how often that killed the worker before: then the task is split, or its
    one row rejected, instead (``worker.deaths.verdict``). Once ``job`` is stopped
    (``worker.stopping``), the task ends at its next sample boundary and commits what it has."""

    start = time.perf_counter()
    result = TaskResult(shard=task.shard)
    halt = halt_of(job)
    # The client planned disjoint tasks from its snapshot; a task only adds one shard. It opens
    # the store from the manifest the client planned with (no request).
    store = open_store(store_url, storage_options, mode="a", load_index=False, manifest=settings.store_manifest)
    try:
        # Whether this shard is committed already (by an earlier try of this task, or a concurrent
        # run of the same plan) is found by the commit's own check, which refuses the name: no
        # request of its own per task (a listing, on an object store the dearest request there
        # is), at the price of encoding such a rare task's rows for nothing.
        # What the client planned around need not be re-read before this task commits; only
        # shards committed since (by a concurrent run) are.
        store.assume_checked(known_shards or ())
        if task.units:
            # Tars or Parquet row groups: their parts commit as they are read, so a worker death
            # re-runs the task from its last committed part (Dask's retries); it is not split by rows.
            encode_unit(task, settings, result, set(known_shards or ()), halt=halt,
                        encode_rows=lambda sub, part, given: _encode_rows(sub, store, specs, device, threads, settings, part, cache, given),
                        write_shard=lambda sub, done, part, ahead: _write_shard(sub, store, done, part, ahead))
        else:
            with attempt or contextlib.nullcontext(Deaths()) as deaths:
                action = verdict(task, deaths.count)
                if action == "split":
                    return replace(result, died=deaths.count)
                done = _rejected_as_poison(task, result, died_reason(deaths.exit)) if action == "reject" else \
                    _encode_rows(task, store, specs, device, threads, settings, result, cache, halt=halt)
            if done or result.rejects or not result.stopped:  # a task stopped before its first sample leaves no empty shard
                _write_shard(task, store, done, result, settings.commit_ahead_bytes)
        if not result.skipped:  # a shard another writer committed first took this task no time
            result.seconds = time.perf_counter() - start
        return result.summary()
    finally:
        store.close()


def _rejected_as_poison(task: TaskSpec, result: TaskResult, reason: str) -> list:
    """The one row whose decoding killed its worker again and again, recorded as a reject."""
    result.poisoned = [[row.source, reason] for row in task.rows]
    result.rejects = [(row, reason) for row in task.rows]
    result.rejected = len(task.rows)
    return []


def _write_shard(task: TaskSpec, store: Any, done: list, result: TaskResult, commit_ahead_bytes: int) -> None:
    """The task's samples and rejects committed as its one shard (``result`` says what came of it)."""
    writer = store.writer(shard_prefix=task.shard[:60], shard_bytes=1 << 62, fields=task.fields, checkpoint_at_close=False)
    # One task is one shard, whatever its size: an automatic mid-task commit would get a name
    # a retried task could collide with.
    for row, reason in result.rejects:
        writer.reject(row.source, reason, id=row.sample_id)
    late = 0
    for row, arrays, meta in done:
        if arrays is None:
            continue
        try:
            writer.add(row.sample_id, arrays, meta)
        except DuplicateSampleError:  # another job on this store committed it after this one planned: theirs is kept
            late += 1
    # The worker may start its next task while this one commits (precompute.worker.commit_ahead).
    with commit_ahead(writer.pending_bytes, commit_ahead_bytes):
        try:
            writer.commit(task.shard)
        except ShardCommittedError:
            # An earlier try of this task, a zombie of it (its worker was presumed dead) or a
            # concurrent run of the same plan committed it first: theirs is kept, ours discarded.
            result.skipped = True
            return
    result.dropped = len(writer.dropped) + late
    result.samples = sum(1 for _, arrays, _ in done if arrays is not None) - result.dropped


def _encode_rows(task: TaskSpec, store, specs, device, threads, settings: TaskSettings, result: TaskResult,
                 cache: EncoderCache | None = None, given: Iterable[tuple[InputRow, bytes | None]] | None = None,
                 halt: Callable[[], bool] = lambda: False) -> list:
    """(row, arrays or None, meta) for each row that was not rejected; rejects go to ``result``.
    Once ``halt()`` says so, the rows not yet in a batch are left (``result.stopped``): a re-run plans them."""
    configured = loaded_encoders(specs, device, threads, cache)
    # Only the encoders of the fields this task writes run (a field added to committed samples).
    encoders = {section: encoder for section, encoder in configured.items() if set(encoder.fields()) & set(task.fields)}

    def reject(row: InputRow, reason: str) -> None:
        result.rejects.append((row, reason))
        result.rejected += 1

    # Each visual encoder gets the pixel size its own rule gives (a VAE: any multiple of its
    # patch; a ViT: often one fixed size), the same whichever of them runs in this task, so a
    # field added later sees the input it would have had in the first run.
    rules = {section: size_rule_for(configured[section], settings.size_multiple) for section in ("vae", "vit") if section in encoders}
    # The config's first visual encoder owns the plain provenance columns (crop_*, width, height);
    # another with a different input gets them prefixed with its section ("vit_width", ...).
    primary = next((section for section in ("vae", "vit") if section in configured), None)
    done: list[tuple[InputRow, dict[str, np.ndarray], dict[str, Any]]] = []
    timeout = settings.task_timeout or None
    # Decoding runs ahead on CPU threads (Pillow and PyAV release the GIL) while the encoder works
    # on the batches already formed. A thread stuck on an input (a hung read) must not keep the
    # task, nor the process, from finishing once the deadline turned it into a reject.
    pool = DaemonPool(settings.decode_threads, "decode")
    try:
        submitted = ((row, pool.submit(_prepare_row, row, rules, task.new_samples, settings, data))
                     for row, data in (given if given is not None else ((r, None) for r in task.rows)))
        # ``given``: a unit's rows with their bytes, read on a thread of its own that hands each
        # to a decoder as it arrives, so batches encode while the rest is read; else the task's
        # rows, each read on its decoding thread.
        # Decoding runs at most a few batches ahead of the encoder: a task is up to
        # run.samples_per_task inputs, and their decoded pixels must not all wait in memory at once.
        ahead = 2 * settings.batch_size + settings.decode_threads
        futures = handed_over(submitted, "read-unit", ahead) if given is not None else kept_ahead(submitted, ahead)
        for batch in _bucketed(futures, settings.batch_size, reject, MediaError, timeout):
            if halt():
                result.stopped = True
                break
            _encode_batch(batch, encoders, reject, done, primary, settings.max_caption_chars)
    finally:
        pool.shutdown()
    _encode_text(done, encoders.get("text"), settings.batch_size, reject, settings.max_caption_chars)
    return done


def _prepare_row(row: InputRow, rules: dict[str, Any], new_sample: bool, settings: TaskSettings,
                 given: bytes | None = None) -> list[tuple[InputRow, dict[str, Any] | None]]:
    """The samples a row makes, each with its media prepared for each visual section this task
    runs (None: no media to prepare): one, or one per clip of a video under ``frames.clips`` (ids
    ``<id>=<first frame>``); ``given``: its bytes, read already (a tar member, a Parquet cell)."""
    if row.modality == "text":
        return [(row, None)]  # a text-only row: no media to read (its task writes text fields only)
    if not rules and not new_sample:
        return [(row, None)]  # only a text field added to committed samples: their media need no reading
    # Read even when no visual encoder runs: a new sample's media must exist and be readable.
    if given is not None:
        data = given
    elif new_sample:  # a row of a manifest, a folder, a LLaVA JSON: its own file
        data = read_source(row.uri, settings.input_storage_options, settings.max_input_bytes, row.root)
    else:  # a committed sample's, maybe a tar member or a Parquet row (inputs.located)
        data = read_recorded(row.uri, settings.input_storage_options, settings.max_input_bytes, row.root,
                             offset=row.offset, size=row.size, column=settings.media_column)
    if row.content_hash and not new_sample and hashlib.sha256(data).hexdigest() != row.content_hash:
        raise MediaError(CHANGED_SINCE_ENCODED, redact_url(row.uri))
    if not rules:
        return [(row, None)]
    if row.frames is not None and not new_sample:  # a committed clip: the field from its own frames
        return [(row, prepare_recorded_clip(data, redact_url(row.uri), row.frames, rules, resize=settings.resize, frames=settings.frames,
                                            max_pixels=settings.max_pixels))]
    # Provenance and messages get the URL without a signature or token, never the credential.
    clips = prepare_clip_sections(data, redact_url(row.uri), row.modality, rules, resize=settings.resize, frames=settings.frames,
                                  max_pixels=settings.max_pixels, span=(row.start, row.end))
    if settings.frames.clips is None or row.modality != "video":
        return [(row, clips[0])]
    return [(replace(row, sample_id=clip_id(row.sample_id, next(iter(clip.values())).provenance["frame_indices"][0])), clip)
            for clip in clips]


CHANGED_SINCE_ENCODED = ("input changed since its sample was encoded (content hash differs): the field is not added from other "
                         "bytes, and its committed features are kept; restore the input and run again with data.retry_rejects=true, "
                         "or encode the inputs into a new store")


def _bucketed(futures, batch_size: int, reject, media_error, timeout: float | None = None) -> Iterator[list[tuple[InputRow, Any]]]:
    """Prepared inputs grouped by shape (the encoder stacks a batch), in batches of batch_size.
    An input not read and decoded within ``timeout`` seconds of being waited for is rejected (the
    wait starts once the inputs before it are taken: a task's size does not eat into it)."""
    buckets: dict[tuple, list[tuple[InputRow, Any]]] = {}
    for row, future in futures:
        try:
            samples = future.result(timeout=timeout)
        except media_error as exc:
            reject(row, exc.reason)
            continue
        except FutureTimeout:
            future.cancel()
            reject(row, f"not read and decoded within run.task_timeout={timeout:g}s (a stuck input: a FIFO, a hung network read?)")
            continue
        for sample, prepared in samples:
            # Tiled images batch by tile size, whatever their tile count (the ViT runs tiles flat).
            shapes = (p.pixels.shape[1:] if "tiles" in p.provenance else p.pixels.shape for p in (prepared or {}).values())
            key = (sample.modality, *shapes) if prepared is not None else ("text",)
            bucket = buckets.setdefault(key, [])
            bucket.append((sample, prepared))
            if len(bucket) >= batch_size:
                yield buckets.pop(key)
    yield from (b for b in buckets.values() if b)


_TILES = ("tiles", "tile_rows", "tile_cols")


def _meta(row: InputRow, prepared: dict[str, Any] | None, primary: str | None, max_chars: int) -> dict[str, Any]:
    """Caption and provenance of one sample: the primary visual encoder's input geometry under the
    plain names, any other's prefixed with its section ("vit_width", ...)."""
    # source_path: the path as the manifest wrote it (relative to the input root unless a URL), so
    # a live encoder finds the media under another root (``--media ROOT``) after they moved.
    meta: dict[str, Any] = {"caption": row.caption[:max_chars], "modality": row.modality, "source_path": row.source}
    if len(row.caption) > max_chars or any(len(text) > max_chars for _, text in row.conversations or ()):
        # Stored as the text encoder takes it (``text_input`` cuts alike), with the cut and the
        # caption's length, with a text encoder or without: a 20 MB caption would otherwise sit
        # whole in the index every reader loads (benchmarks/caption_rss_bench.py).
        meta.update(caption_chars=len(row.caption), text_cut_at_chars=max_chars)
    if row.conversations is not None:  # so a re-run can tell edited turns (precompute.planning.stale)
        meta["conversations_sha256"] = row.conversations_sha256
    if row.metadata is not None:  # a WebDataset sample's .json sidecar, as written
        meta["source_json"] = row.metadata
    if row.input:
        meta["input"] = row.input
    if row.offset is not None:  # a tar member: where it lies, so it is read again alone (inputs.located)
        meta.update(source_offset=row.offset, source_size=row.size)
    if not prepared:
        return {**meta, "source_uri": redact_url(row.uri)} if row.uri else meta
    for section, media in prepared.items():
        provenance = {k: v for k, v in media.provenance.items() if k not in _TILES}
        if section == primary:
            meta.update(provenance)
        else:
            meta.update({k: v for k, v in provenance.items() if k not in GEOMETRY})  # source, hash, frames: shared
            meta.update({f"{section}_{k}": provenance[k] for k in GEOMETRY})
        if section == "vit":  # the VLM contract: the tile grid of every ViT feature, 1x1 untiled
            meta.update({f"vit_{k}": media.provenance.get(k, 1) for k in _TILES})
    return meta


def _encode_isolating(encoder: Any, items: list, why: Callable[[Exception], str]) -> list[dict[str, np.ndarray] | str]:
    """``encoder.encode(items)``; where the batch fails on a bad input (or a NaN output), each
    item again on its own, so only the bad one fails: its reason (``why(error)``) in its place."""
    # lazy: the encoders import torch; importing tasks stays torch-free
    from ..encoders.base import EncoderInputError, EncoderOutputError

    try:
        return list(encoder.encode(items))
    except (EncoderInputError, EncoderOutputError):
        pass
    out: list[dict[str, np.ndarray] | str] = []
    for item in items:
        try:
            out.extend(encoder.encode([item]))
        except (EncoderInputError, EncoderOutputError) as exc:
            out.append(why(exc))
    return out


def _encode_batch(batch, encoders: dict[str, Any], reject, done: list, primary: str | None, max_chars: int) -> None:
    outputs: list[dict[str, Any]] = [{} for _ in batch]
    for section in ("vae", "vit"):
        encoder = encoders.get(section)
        if encoder is None:
            continue
        items = [encoder_input(section, row.modality, prepared[section].pixels) for row, prepared in batch]
        encoded = _encode_isolating(encoder, items, lambda exc: f"encoder rejected input: {exc}")
        for (row, _), out, features in zip(batch, outputs, encoded, strict=True):
            if isinstance(features, str):
                reject(row, features)
                out.clear()
                out["__rejected__"] = True
            elif "__rejected__" not in out:
                out.update(features)
    for (row, prepared), out in zip(batch, outputs, strict=True):
        if "__rejected__" in out:
            continue
        done.append((row, out, _meta(row, prepared, primary, max_chars)))


def _text_failure(exc: Exception) -> str:
    # lazy: the encoders import torch; importing tasks stays torch-free
    from ..encoders.base import EncoderOutputError

    if isinstance(exc, EncoderOutputError):
        return "text encoder produced NaN/inf for the caption"
    return f"text encoder rejected input: {exc}"


def _encode_text(done: list, encoder: Any, batch_size: int, reject, max_chars: int) -> None:
    if encoder is None or not done:
        return
    items = [text_input(encoder, row.caption, row.conversations, row.modality, max_chars) for row, _, _ in done]
    # Identical texts are encoded once for the whole task, not once per batch.
    distinct = list(dict.fromkeys(items))
    encoded: dict[Any, dict[str, np.ndarray] | str] = {}
    for start in range(0, len(distinct), batch_size * 4):
        chunk = distinct[start : start + batch_size * 4]
        encoded.update(zip(chunk, _encode_isolating(encoder, chunk, _text_failure), strict=True))
    for index, ((row, arrays, meta), text) in enumerate(zip(done, items, strict=True)):
        result = encoded[text]
        if isinstance(result, str):
            reject(row, result)
            done[index] = (row, None, meta)
        else:
            arrays.update(result)
