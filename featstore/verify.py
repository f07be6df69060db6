"""Integrity checks behind ``mmcache verify`` and the summary behind ``mmcache info``.

``verify`` re-reads every byte a commit record lists: object sizes and whole-object CRC-32C
(any flipped, missing or truncated byte), zarr metadata against the commit record, each shard
index, and each sample's CRC-32C and extent (index/data disagreement), and every prompt-embedding
object (``prompts/``: each embedding's CRC-32C and shape, the object's metadata against its
name, its field against the manifest). Problems name the shard, object or sample at fault.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import checksums
from . import checkpoints
from . import format as fmt
from . import manifest as manifests
from .errors import CorruptionError, FormatVersionError
from .idhash import id_hashes
from .index import IN_RECORD, list_index, parse_index_part_record
from .prompts import PROMPTS_DIR, parse_part_name, read_part
from .store import Store
from .rewrite import check_replaced
from .storage import Storage


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    shards_checked: int = 0
    samples_checked: int = 0
    bytes_checked: int = 0
    prompts_checked: int = 0  # prompt-embedding objects
    replaced: list[str] = field(default_factory=list)  # shards a data compaction replaced, still there (featstore.rewrite)

    @property
    def ok(self) -> bool:
        return not self.problems


def store_info(store: Store) -> dict[str, Any]:
    reasons = Counter(store.rejects.column("reason").to_pylist()) if store.num_rejected() else Counter()
    return {
        "url": store.url,
        "format_version": store.format_version,
        "num_samples": len(store),
        "num_shards": len(store.shards),
        "fields": {name: spec.to_dict() for name, spec in store.fields.items()},
        # Samples holding each field: fewer than num_samples for a field added to the store later.
        "samples_per_field": store.samples_per_field(),
        "bytes": store.nbytes(),
        "num_rejected": store.num_rejected(),
        "rejects_by_reason": dict(reasons.most_common()),
        # Samples per input they were encoded from (the `input` column `mmcache encode` writes).
        "samples_by_input": _samples_by_input(store),
        "attrs": store.attrs,
        # The index checkpoint the open used (featstore.checkpoints), and how many parts it covered.
        "checkpoint": {"key": store.checkpoint, "covered": store.checkpoint_covered},
    }


def _samples_by_input(store: Store) -> dict[str, int]:
    if "input" not in store.index.column_names:
        return {}  # a store written before encode recorded it, or not by mmcache encode
    return dict(Counter(i for i in store.index.column("input").to_pylist() if i).most_common())


def verify_store(store: Store, progress: Callable[[str], None] | None = None) -> VerifyReport:
    report = VerifyReport()
    # The index parts' own checksums were checked when the store was opened (strict=False).
    for name, reason in store.damaged.items():
        report.problems.append(f"shard {name!r}: {reason}")
    # A sample may be spread over shards (fields added later), but each of its fields is read
    # from one: racing writers may have committed it twice, and readers take the earliest commit.
    for sample_id, field_name, shard in store.duplicates:
        report.warnings.append(
            f"sample {sample_id!r} field {field_name!r} is also committed in shard {shard!r}, which readers ignore "
            "(an earlier commit holds it); `mmcache repair` removes such rows"
        )
    for name, info in store.shards.items():
        if progress:
            progress(name)
        _verify_shard(store, name, info, report)
        report.shards_checked += 1
    # The manifest's own checksum covers its content; the bytes around it must be exactly what
    # mmcache writes, or other zarr readers may read something else.
    root = store.storage.read(fmt.MANIFEST_KEY)
    if root != fmt.root_group_json(fmt.parse_root_group(root, store.url)):
        report.problems.append(f"{fmt.MANIFEST_KEY}: root group metadata was altered outside mmcache")
    try:
        if store.storage.read(f"{fmt.SHARDS_DIR}/zarr.json") != fmt.group_json():
            report.problems.append(f"{fmt.SHARDS_DIR}/zarr.json is not the group metadata mmcache writes (corrupted?)")
    except FileNotFoundError:
        report.problems.append(f"{fmt.SHARDS_DIR}/zarr.json is missing")
    report.problems.extend(manifests.declaration_problems(store.storage))  # an open reads only those not yet in effect
    # An open takes the rows of most parts from an index checkpoint: it must agree with them.
    check_checkpoints(store.storage, report.problems, report.warnings, present=store.__contains__)
    _verify_prompts(store, report)
    committed = {info.data_root.rsplit("/", 1)[-1] for info in store.shards.values() if info.num_samples}
    committed |= check_replaced(store, report)  # checked against the snapshot; not leftovers
    for leftover in store.storage.list_dir(fmt.SHARDS_DIR):
        if leftover not in committed and leftover != "zarr.json":
            report.warnings.append(f"shard {leftover!r} has data but no index part (a writer stopped before committing it); it is ignored")
    return report


def _verify_prompts(store: Store, report: VerifyReport) -> None:
    """Every ``prompts/`` object: readable, its CRC-32Cs, its metadata against its name, a field the
    manifest declares in that field's dtype. Embeddings of another encoder than the field's
    current one, and a prompt whose embedding differs between two objects, are warnings: readers
    ignore the former and take the first object in name order for the latter."""
    seen: dict[tuple[str, str, str], tuple[str, Any]] = {}  # (field, digest, prompt) -> (first key, embedding)
    for name in store.storage.list_dir(PROMPTS_DIR):
        key = f"{PROMPTS_DIR}/{name}"
        if parse_part_name(name) is None:
            report.warnings.append(f"{key} is not a prompt-embedding object (a writer's temporary file?); readers ignore it")
            continue
        raw = store.storage.read(key)
        report.bytes_checked += len(raw)
        report.prompts_checked += 1
        try:
            part = read_part(raw, key, store.url)
        except CorruptionError as exc:
            report.problems.append(f"{exc}; delete it and run `mmcache encode ... --prompts FILE` again to rewrite it")
            continue
        spec = store.fields.get(part.field)
        if spec is None:
            report.problems.append(f"{key}: prompt embeddings of field {part.field!r}, which the store manifest does not declare")
            continue
        wrong = sorted({dtype for dtype, shape, _ in part.embeddings.values() if dtype != spec.dtype or (spec.ndim is not None and len(shape) != spec.ndim)})
        if wrong:
            report.problems.append(f"{key}: embeddings of dtype {', '.join(wrong)} or another rank than field {part.field!r} ({spec.dtype}, ndim {spec.ndim})")
        current = (spec.meta.get("fingerprint") or {}).get("digest")
        if part.digest != current:
            report.warnings.append(f"{key}: made by encoder {part.digest}, not field {part.field!r}'s current one ({current}); readers ignore it")
        for prompt, value in part.embeddings.items():
            first = seen.setdefault((part.field, part.digest, prompt), (key, value))
            if first[1] != value:
                shown = "the empty prompt" if prompt == "" else repr(prompt[:40])
                report.warnings.append(f"{key}: its embedding of {shown} differs from the one in {first[0]}, which readers take")


def check_checkpoints(storage: Storage, problems: list[str], notes: list[str], present: Callable[[str], bool]) -> int:
    """``mmcache verify``: every checkpoint listed must be intact, and agree with each index part
    it covers that is still listed as it was (commit record and rows; the part's own CRC-32C is
    checked too, since readers no longer read it). A part it covers that is gone while samples of
    it are in no other (``present``: the store's) lost committed samples: a problem. Returns the
    number of parts compared."""
    listing = list_index(storage)
    parsed: dict[str, tuple[pa.Table, dict[str, Any]] | None] = {}
    gone: set[str] = set()
    compared = 0
    published = {digest for _, digest, _ in checkpoints.markers(listing)}
    for name in storage.list_dir(checkpoints.CHECKPOINT_DIR):
        if name.split(".", 1)[0] not in published:
            notes.append(f"{checkpoints.CHECKPOINT_DIR}/{name} has no marker in {fmt.INDEX_DIR}/ (a compaction stopped before publishing it, or a concurrent one is); it is ignored")
    for _, digest, marker in checkpoints.markers(listing):
        try:
            checkpoint = checkpoints.read_checkpoint(storage, digest, marker)
        except FileNotFoundError:
            notes.append(f"{fmt.INDEX_DIR}/{marker} names a checkpoint whose objects are gone (pruned, or deleted by hand); readers skip it, `mmcache compact` removes it")
            continue
        except FormatVersionError as exc:
            notes.append(f"{exc}; not checked")
            continue
        except CorruptionError as exc:
            problems.append(f"{exc}; readers ignore it and read the index parts instead; `mmcache compact` replaces it")
            continue
        if why := checkpoints.marker_problem(storage, checkpoint, digest, marker):
            problems.append(f"{fmt.INDEX_DIR}/{marker}: {why}; readers may skip its checkpoint or read it whole. "
                            f"Run `mmcache compact --rebuild {storage.url}` to replace it from the parts")
        if why := _summaries_differ(storage, checkpoint, digest, marker):
            problems.append(f"index checkpoint {checkpoint.key}: {why}; readers may count its samples wrong. "
                            f"Run `mmcache compact --rebuild {storage.url}` to replace it from the parts")
        for entry, part in checkpoint.parts.items():
            if entry not in listing and entry not in gone:
                gone.add(entry)
                _lost(checkpoint, entry, part, present, problems)
            if listing.get(entry) != part.listed:
                continue  # deleted or rewritten since: readers read the part itself, not these rows
            key = f"{fmt.INDEX_DIR}/{entry}"
            if entry not in parsed:
                parsed[entry] = None
                try:
                    name_crc = fmt.parse_index_part_name(entry)
                    assert name_crc is not None
                    parsed[entry] = parse_index_part_record(storage.read(key), part.info.name, key, storage.url, name_crc[1])
                except CorruptionError as exc:
                    problems.append(f"{exc} (readers take its rows from {checkpoint.key})")
                except FileNotFoundError:
                    continue
            if parsed[entry] is None:
                continue
            table, record = parsed[entry]  # type: ignore[misc]
            compared += 1
            why = ("its commit record differs" if fmt.store_json(part.record) != record
                   else f"its first id {part.info.first_id!r} is not the record's (an epoch order would visit the shard elsewhere)"
                   if part.info.first_id not in (IN_RECORD, record.get("first_id"))
                   else _rows_differ(checkpoint.table.slice(part.start, part.info.num_samples), table, part.info.name))
            if why:
                problems.append(f"index checkpoint {checkpoint.key} disagrees with {key}: {why}; readers would use the checkpoint's rows. "
                                f"Run `mmcache compact --rebuild {storage.url}` to replace it from the parts")
    return compared


def _lost(checkpoint: checkpoints.Checkpoint, entry: str, part: Any, present: Callable[[str], bool], problems: list[str]) -> None:
    """A problem when samples a checkpoint records of a part that is gone are in no part now (a
    compaction's replaced parts and repair's uncommitted ones hold samples found elsewhere)."""
    lost = [i for i in checkpoint.table.slice(part.start, part.info.num_samples).column("id").to_pylist() if not present(i)]
    if lost:
        problems.append(f"{len(lost)} committed sample(s) of shard {part.info.name!r} (e.g. {lost[0]!r}), recorded by index checkpoint "
                        f"{checkpoint.key}, are in no index part: its part {fmt.INDEX_DIR}/{entry} was deleted, and readers no longer "
                        "see them. Restore that object, or encode those inputs again (a re-run encodes what the store lacks)")


def _summaries_differ(storage: Storage, checkpoint: checkpoints.Checkpoint, digest: str, marker: str) -> str:
    """Why what a checkpoint says of its ids (their count, their hashes: what readers answer
    ``len`` from, docs/FORMAT.md "Two-level index") is not what its rows hold ('' when it is)."""
    ids = checkpoint.table.column("id")
    distinct = pc.count_distinct(ids).as_py()
    if checkpoint.samples is not None and checkpoint.samples != distinct:
        return f"it says its rows hold {checkpoint.samples} distinct ids, they hold {distinct}"
    try:
        hashes = checkpoints.open_checkpoint(storage, digest, marker).id_hashes()
    except (CorruptionError, FileNotFoundError) as exc:
        return f"its id hashes cannot be used ({exc})"
    if hashes is not None and not np.array_equal(hashes, np.unique(id_hashes(ids))):
        return "its id hashes are not those of its ids"
    return ""


def _rows_differ(mine: pa.Table, theirs: pa.Table, shard: str) -> str:
    """Why a checkpoint's rows of one part are not that part's rows ('' when they are)."""
    if mine.num_rows != theirs.num_rows:
        return f"{mine.num_rows} rows, the part has {theirs.num_rows}"
    if mine.column("shard").to_pylist() != [shard] * mine.num_rows:
        return "rows of another shard"
    for name in theirs.column_names:
        if name not in mine.column_names:
            return f"column {name!r} is missing"
        try:
            same = mine.column(name).cast(theirs.schema.field(name).type).equals(theirs.column(name))
        except pa.ArrowException:
            same = False
        if not same:
            return f"column {name!r} differs"
    for name in set(mine.column_names) - set(theirs.column_names) - {"shard"}:
        if mine.column(name).null_count != mine.num_rows:
            return f"column {name!r} has values the part does not have"
    return ""


def _fetch(store: Store, keys: list[str]) -> list[bytes | CorruptionError | None]:
    """Whole objects (None for a missing one, the error for one that is no object of a store:
    a FIFO, a link, ...); from an object store several at once."""

    def get(key: str) -> bytes | CorruptionError | None:
        try:
            return store.storage.read(key)
        except FileNotFoundError:
            return None
        except CorruptionError as exc:
            return exc

    if not store.storage.is_remote or len(keys) < 2:
        return [get(key) for key in keys]
    with ThreadPoolExecutor(min(8, len(keys)), thread_name_prefix="featstore-verify") as pool:
        return list(pool.map(get, keys))


def _verify_shard(store: Store, name: str, info: Any, report: VerifyReport) -> None:
    blobs: dict[str, bytes] = {}
    for (key, expected), blob in zip(info.objects.items(), _fetch(store, list(info.objects)), strict=True):
        if blob is None:
            report.problems.append(f"shard {name!r}: object {key} is missing")
            continue
        if isinstance(blob, CorruptionError):
            report.problems.append(f"shard {name!r}: {blob}")
            continue
        report.bytes_checked += len(blob)
        if len(blob) != expected["nbytes"]:
            report.problems.append(f"shard {name!r}: object {key} has {len(blob)} bytes, expected {expected['nbytes']} (truncated or overwritten)")
        elif checksums.crc32c(blob) != expected["crc32c"]:
            report.problems.append(f"shard {name!r}: object {key} fails its checksum (corrupted bytes)")
        else:
            blobs[key] = blob
    rows = store.shard_rows(name)
    samples = store.sample_index
    # Counted once per sample, at its first row (a sample spread over shards is one sample).
    report.samples_checked += sum(1 for row in rows if samples.is_first(row))
    if info.num_samples and not info.layouts:
        report.problems.append(f"shard {name!r}: {info.num_samples} samples but no field layouts recorded")
    for fname, layout in info.layouts.items():
        spec = store.fields.get(fname)
        if spec is None:
            report.problems.append(f"shard {name!r}: holds field {fname!r}, which the store manifest does not declare")
            continue
        if not info.num_samples:
            break
        data_key = info.data_key(fname)
        meta_key = f"{info.data_root}/{fname}/zarr.json"
        if meta_key in blobs:
            _check_array_metadata(blobs[meta_key], spec, layout, f"shard {name!r} field {fname!r}", report)
        if data_key not in blobs:
            continue  # already reported above
        blob = blobs[data_key]
        itemsize = np.dtype(spec.zarr_dtype).itemsize
        try:
            chunks = fmt.parse_shard_index(blob[-fmt.index_nbytes(layout.num_chunks) :], layout.num_chunks, data_key)
        except ValueError as exc:
            report.problems.append(f"shard {name!r}: {exc}")
            continue
        buffer = np.frombuffer(blob, dtype=np.uint8)
        for row in rows:
            sample_id = samples.ids[row]
            shape = samples.shapes[fname][row]
            count = math.prod(shape)  # Python integers: an absurd shape must not wrap around
            start = int(samples.offsets[fname][row])
            if len(shape) != (spec.ndim if spec.ndim is not None else len(shape)):
                report.problems.append(f"sample {sample_id!r} field {fname!r}: shape {shape} does not have {spec.ndim} dimensions")
            if start < 0 or start + count > layout.elements:
                report.problems.append(f"sample {sample_id!r} field {fname!r}: index points outside the data of shard {name!r}")
                continue
            parts = [buffer[a:b] for a, b in fmt.byte_ranges(chunks, layout, start, count, itemsize)]
            crc = 0
            for part in parts:
                crc = checksums.crc32c(part, crc)
            if crc != int(samples.crcs[fname][row]):
                report.problems.append(f"sample {sample_id!r} field {fname!r} in shard {name!r} fails its checksum")


def _check_array_metadata(raw: bytes, spec: fmt.FieldSpec, layout: fmt.ChunkLayout, where: str, report: VerifyReport) -> None:
    try:
        doc = fmt.store_json(raw)
        shape, dtype = doc["shape"], doc["data_type"]
    except (ValueError, KeyError, TypeError):
        report.problems.append(f"{where}: zarr.json is not valid zarr array metadata")
        return
    if shape != [layout.elements] or dtype != spec.zarr_dtype:
        report.problems.append(f"{where}: zarr metadata says shape {shape} {dtype}, commit record says [{layout.elements}] {spec.zarr_dtype}")
