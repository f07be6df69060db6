"""What an encode job will do, decided from what the client has read: its inputs (streamed,
``planning.survey``), the store's snapshot and the encoders' description. ``plan_encode`` loads no
encoder and writes nothing; its tasks are made as they are asked for (the inputs' second pass).
Rows the store holds already (or rejected before) are skipped; the rest is grouped into tasks of
``rows_per_task`` rows, each named by a hash of its rows and the encoders' digests, so re-planning
names the same shards. More: docs/design/encode.md, "The plan"."""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ... import featstore
from ...featstore.format import EXCLUSIVE_COMMIT_VERSION
from ..config import EncodeConfig
from ..inputs.located import recorded_rows
from ..inputs.registry import SourceUnit
from ..inputs.rows import InputRow, Reject
from ..inputs.stream import InputStream
from ..media.clips import clip_parent
from ..worker.specs import EncoderSpec, TaskSettings, TaskSpec
from .survey import GroupKey, RowClassifier, Survey, rejected_sources
from ..worker.unit_encode import known_sources


@dataclass(kw_only=True)
class EncodePlan:
    """A job, ready to run: where it writes, with which encoders and settings, which tasks."""

    output_url: str  # as the user named it: what the tasks open
    store: featstore.Store = field(repr=False)  # the snapshot planned from (execute records plan_rejects in it)
    storage_options: dict[str, Any] | None
    specs: list[EncoderSpec]
    settings: TaskSettings
    tasks: Iterator[TaskSpec] = field(repr=False)  # made as they are asked for (each asks the inputs for its rows)
    # Every shard this plan saw: a task re-reads only those committed since before it commits
    # (by a concurrent run); execute adds the names of the tasks it has submitted.
    known_shards: list[str]
    samples: int = 0  # rows to encode, and the rows of Parquet row groups (a tar's count is known once read)
    units: list[SourceUnit] = field(default_factory=list)  # the units its tasks read (tars: progress estimates their samples)
    plan_rejects: list[Reject] = field(default_factory=list)  # rows the input readers rejected, not recorded yet
    # Duplicate ids, confirmed while the tasks are made: complete once ``tasks`` is exhausted.
    duplicate_rejects: list[Reject] = field(default_factory=list)
    samples_skipped: int = 0  # rows the store has (or rejected) already
    notes: list[str] = field(default_factory=list)  # what the job's log says of the plan


def plan_encode(config: EncodeConfig, *, inputs: InputStream, survey: Survey, store: featstore.Store, fields: dict[str, Any],
                specs: list[EncoderSpec], workers: int, output_url: str, sample_bytes: int,
                storage_options: dict[str, Any] | None = None, input_storage_options: dict[str, Any] | None = None) -> EncodePlan:
    """The plan of encoding ``inputs`` (surveyed: ``survey``) into ``store`` (opened, with
    ``fields`` as the workers described them) on ``workers`` workers, a sample's features
    estimated at ``sample_bytes``. Reads only what the store snapshot holds."""
    per_task = rows_per_task(config, survey.todo, workers, sample_bytes)
    # A retried reject gets a task of a new name: the one that rejected it is committed.
    salt = retry_salt(store) if config.data.retry_rejects and survey.retried else ""
    settings = TaskSettings.from_config(config, input_storage_options)
    # Units (tars, row groups) are read by tasks of one or several (group_units); a task's parts are
    # shards of about shard_bytes, sized alike on every run, so a re-run finds the parts committed
    # before under their names.
    units, unit_skips = unit_tasks(inputs.units, store, config, list(fields), part_size=rows_per_task(config, 1 << 62, 1, sample_bytes),
                                   workers=workers, sample_bytes=sample_bytes, ids_of=inputs.ids_of)
    refilled, refill, refill_notes = committed_unit_tasks(inputs.units, store, fields, config, workers=workers, sample_bytes=sample_bytes,
                                                          ids_of=inputs.ids_of)
    if survey.todo or units or refilled:
        # Raised here once (an older store), so that the tasks, which open the store from the
        # manifest planned with, do not each declare it again.
        store.require_format_version(EXCLUSIVE_COMMIT_VERSION)
        settings = replace(settings, store_manifest=store.manifest)
    rejected_before = rejected_sources(store) if not config.data.retry_rejects else set()
    notes = [f"adding {', '.join(missing)} to {n} sample(s) already in the store"
             for (missing, new), n in survey.groups.items() if not new] + refill_notes
    plan = EncodePlan(output_url=output_url, store=store, storage_options=storage_options, specs=specs, settings=settings,
                      tasks=iter(()), known_shards=sorted(set(store.shards) | set(store.replaced) | {t.shard for t in units}),
                      samples=survey.todo + refilled + sum(u.estimated_samples for t in units for u in t.units),
                      units=[u for t in units for u in t.units],
                      plan_rejects=[r for r in survey.rejects if r.source not in rejected_before],
                      samples_skipped=survey.skipped + unit_samples_committed(inputs.units, store, inputs.ids_of), notes=notes)
    groups = _RowGroups(store, fields, config, survey, per_task, salt, plan.duplicate_rejects, rejected_before, unit_skips)
    if survey.unframed:
        plan.notes.append(f"warning: {survey.unframed} committed clip sample(s) lack one of the fields {list(fields)} and record "
                          "no frames (encoded before mmcache recorded them): a field is not added to them; encode those inputs into a new store to have it")
    # The second pass over the inputs only where it has work: a re-run of a complete job reads them once.
    rows = groups.tasks(inputs) if survey.todo or survey.unsettled_duplicates else iter(())
    plan.tasks = itertools.chain(rows, refill, units)
    return plan


def rows_per_task(config: EncodeConfig, todo: int, workers: int, sample_bytes: int) -> int:
    """Rows per task: a shard of about ``run.shard_bytes`` of features, fewer when the job is
    smaller than one such shard per worker (no worker sits idle), and at most
    ``run.samples_per_task``."""
    by_bytes = max(1, int(config.run.shard_bytes) // max(1, sample_bytes))
    return max(1, min(config.run.samples_per_task, by_bytes, -(-todo // max(1, workers))))


class _RowGroups:
    """The inputs' second pass: each usable row, not a duplicate, not done, into the group of
    what it lacks; a group's every ``per_task`` rows are a task, its rest one more at the end."""

    def __init__(self, store: featstore.Store, fields: dict[str, Any], config: EncodeConfig, survey: Survey, per_task: int,
                 salt: str, duplicates: list[Reject], rejected_before: set[str],
                 unit_skips: dict[str, dict[str, tuple[str, str]]]) -> None:
        modalities = {name: spec["meta"].get("modality", "") for name, spec in fields.items()}
        self.lacking = RowClassifier(store, modalities, clips=config.frames.clips is not None, retry_rejects=config.data.retry_rejects)
        self.store = store
        self.digest, self.per_task, self.salt = fields_digest(fields), per_task, salt
        self.suspects, self.duplicates, self.rejected_before = survey.duplicate_hashes, duplicates, rejected_before
        self.first: dict[int, dict[str, int]] = {}  # a suspect hash -> the ids seen with it -> their input
        # Id prefix of a tar (or Parquet file) of the job -> what its task leaves out. A row of this
        # job whose id has that prefix joins it, before the unit tasks are made (they come after
        # the rows' tasks), so a member with that id is a reject naming the row, not dropped unsaid.
        self.unit_skips = unit_skips

    def tasks(self, inputs: InputStream) -> Iterator[TaskSpec]:
        pending: dict[GroupKey, list[InputRow]] = {}
        for index, batch in inputs.batches():
            for row in batch.rows:
                if self._duplicate(row, index) or self.lacking.blocked(row, self.rejected_before) or (key := self.lacking(row)) is None:
                    continue
                if self.unit_skips and (skip := self.unit_skips.get(row.sample_id.split(":", 1)[0] + ":")) is not None:
                    skip.setdefault(row.sample_id, (row.source, ""))
                for key, row in self._samples(row, key):
                    group = pending.setdefault(key, [])
                    group.append(row)
                    if len(group) == self.per_task:
                        yield from plan_tasks(group, self.digest, self.per_task, list(key[0]), key[1], salt=self.salt)
                        pending[key] = []
        for (missing, new), group in pending.items():
            yield from plan_tasks(group, self.digest, self.per_task, list(missing), new, salt=self.salt)

    def _samples(self, row: InputRow, key: GroupKey) -> Iterator[tuple[GroupKey, InputRow]]:
        """The row's sample, or (a video whose committed clips lack a field) each such clip, as a
        row of its own frames. A field added to a committed sample is made from the bytes it was
        encoded from (its recorded hash is checked)."""
        if key[1]:
            yield key, row
        elif clips := self.lacking.clips_lacking(row.sample_id, row.source):
            for clip, missing, frames in clips:
                yield (missing, False), replace(row, sample_id=clip, content_hash=self._recorded(clip, "content_hash"), frames=tuple(frames))
        else:
            yield key, replace(row, content_hash=self._recorded(row.sample_id, "content_hash"))

    def _recorded(self, sample_id: str, column: str) -> Any:
        index = self.store.index
        return index.column(column)[self.store.row(sample_id)].as_py() if column in index.column_names else None

    def _duplicate(self, row: InputRow, index: int) -> bool:
        """Whether an earlier row has this row's id (then it is recorded as a reject)."""
        if not self.suspects or (h := hash(row.sample_id)) not in self.suspects:
            return False
        seen = self.first.setdefault(h, {})
        if row.sample_id not in seen:
            seen[row.sample_id] = index
            return False
        reason = f"duplicate id {row.sample_id!r}"
        if seen[row.sample_id] != index:
            reason += " (an earlier input has it)"
        elif row.modality == "text" and row.source == f"text:{row.sample_id}" and row.sample_id.startswith("text-"):
            reason += " (the same text twice: give the rows ids)"
        if row.source not in self.rejected_before:  # recorded by an earlier run
            self.duplicates.append(Reject(source=row.source, reason=reason, sample_id=row.sample_id))
        return True


def plan_tasks(rows: list[InputRow], specs_digest: str, per_task: int, fields: list[str], new_samples: bool = True, salt: str = "") -> list[TaskSpec]:
    """Tasks of ``per_task`` rows that write ``fields``, each named by a hash of what it does
    (and ``salt``: what makes a retry of the same rows a different task)."""
    tasks = []
    for start in range(0, len(rows), per_task):
        chunk = rows[start : start + per_task]
        # Conversations only where present, so the names of caption-only tasks stay as they were.
        rows_body = [(r.sample_id, r.uri, _named_by(r.caption), *([r.conversations] if r.conversations else [])) for r in chunk]
        body = json.dumps([specs_digest, fields, rows_body] + ([salt] if salt else []))
        name = f"t-{hashlib.sha256(body.encode()).hexdigest()[:24]}"
        tasks.append(TaskSpec(shard=name, rows=chunk, fields=fields, new_samples=new_samples))
    return tasks


def _named_by(caption: str) -> str:
    """A caption as a task's name takes it: itself (the names of earlier runs' tasks), or, past
    4 KiB, its digest, so that naming the tasks of a 20 MB caption holds no copies of it."""
    return caption if len(caption) <= 4096 else "sha256:" + hashlib.sha256(caption.encode("utf-8", "surrogatepass")).hexdigest()


def committed_unit_tasks(units: list[SourceUnit], store: featstore.Store, fields: dict[str, Any], config: EncodeConfig, *,
                         workers: int, sample_bytes: int,
                         ids_of: dict[tuple[str, tuple[int, ...]], list[str]] | None = None) -> tuple[int, Iterator[TaskSpec], list[str]]:
    """(how many samples, their tasks, log notes) adding the configured fields that committed
    samples of this job's tars and Parquet files lack: each such sample is a row built from its
    record (``recorded_rows``), its media read again alone (``read_recorded``) and checked against
    its recorded hash, grouped as manifest rows lacking a field are, the tasks made as they are
    asked for (the store's records read a batch at a time, twice: to count, then to make them).
    A sample whose re-reading was rejected before is not tried again (unless data.retry_rejects).
    A video sample's field is made from its recorded frames (a clip of ``frames.clips`` too); one
    recorded without them, under ``frames.clips``, is left out (it would make every clip)."""
    if not units or not len(store):
        return 0, iter(()), []
    per_field = store.samples_per_field()  # counted in arrays: no list of the store's ids on every re-run
    if all(per_field.get(name, -1) == len(store) for name in fields):
        return 0, iter(()), []  # every sample has every field (a re-run): no row is built
    lacking = RowClassifier(store, {name: spec["meta"].get("modality", "") for name, spec in fields.items()}, clips=False,
                            retry_rejects=config.data.retry_rejects)
    # A sample whose field was refused (its input changed) is not tried again: by its id and
    # source, as the refusal recorded them. Not by source alone (a video's clips share one), nor
    # by id alone (another dataset's tar of the same name may have had a member of that id).
    retry = config.data.retry_rejects and store.num_rejected() > 0
    salt = retry_salt(store) if retry else ""  # a retried reject gets a task of a new name

    def wanted() -> Iterator[tuple[tuple[str, ...], InputRow]]:
        for row in recorded_rows(store, units, ids_of):
            if (row.sample_id, row.source) not in lacking.refused and (key := lacking(row)) is not None:
                yield key[0], row

    def clip(row: InputRow) -> bool:
        return row.modality == "video" and row.frames is None and (config.frames.clips is not None or clip_parent(row.sample_id) is not None)

    counts: collections.Counter[tuple[str, ...]] = collections.Counter()
    clipped = 0
    for missing, row in wanted():
        if clip(row):
            clipped += 1
        else:
            counts[missing] += 1
    digest, per_task = fields_digest(fields), rows_per_task(config, sum(counts.values()), workers, sample_bytes)

    def tasks() -> Iterator[TaskSpec]:
        pending: dict[tuple[str, ...], list[InputRow]] = {}
        for missing, row in wanted():
            if not clip(row):
                (group := pending.setdefault(missing, [])).append(row)
                if len(group) == per_task:
                    yield from plan_tasks(group, digest, per_task, list(missing), new_samples=False, salt=salt)
                    pending[missing] = []
        for missing, group in pending.items():
            yield from plan_tasks(group, digest, per_task, list(missing), new_samples=False, salt=salt)

    notes = [f"adding {', '.join(missing)} to {n} sample(s) already in the store" for missing, n in counts.items()]
    if clipped:
        notes.append(f"warning: {clipped} committed video sample(s) from tars or Parquet lack one of the fields {list(fields)} and "
                     "record no clip frames (encoded before mmcache recorded them): a field is not added to them; encode those "
                     "inputs into a new store to have it")
    return sum(counts.values()), tasks(), notes


def unit_tasks(units: list[SourceUnit], store: featstore.Store, config: EncodeConfig, fields: list[str], *,
               part_size: int, workers: int, sample_bytes: int,
               ids_of: dict[tuple[str, tuple[int, ...]], list[str]] | None = None) -> tuple[list[TaskSpec], dict[str, dict[str, tuple[str, str]]]]:
    """The tasks of the units not done yet (small ones grouped: ``group_units``), each told which
    of its units' ids to leave out, and those leave-out maps by id prefix. A task is done when
    its last shard (named like the task) is committed: the worker commits each full part of
    ``part_size`` samples as ``<task>-pNNNNN`` and the rest last, so a task killed mid-way
    resumes after its committed parts and a grown set of tars runs only the new. A unit whose ids
    have no common prefix (a Parquet ``id`` column) is told the committed ones among its ids
    (``ids_of``: what the client read of them), not every id of the store."""
    if not units:
        return [], {}
    salt = retry_salt(store) if config.data.retry_rejects and store.num_rejected() > 0 else ""
    pending = _pending_groups(units, store, config, part_size=part_size, workers=workers, sample_bytes=sample_bytes, salt=salt)
    if not pending:
        return [], {}  # every unit done (a re-run): no id of the store is looked at
    # id -> (where it came from, its media's hash) of the pending units' ids: the worker tells a
    # resume from a duplicate id.
    leave_out = known_sources(store, rejects=not config.data.retry_rejects, clips=config.frames.clips is not None,
                              keep=_pending_ids([unit for group, _ in pending for unit in group], ids_of or {}))
    by_prefix: dict[str, dict[str, tuple[str, str]]] = {}
    for sample_id, known in leave_out.items():
        by_prefix.setdefault(sample_id.split(":", 1)[0] + ":", {})[sample_id] = known
    tasks, skips = [], {}
    for group, name in pending:
        # One dict per prefix, shared by its units: the job's own rows of that prefix join it (_RowGroups).
        maps = {unit.id_prefix: by_prefix.setdefault(unit.id_prefix, {}) for unit in group if unit.id_prefix}
        skips.update(maps)
        given = [unit for unit in group if not unit.id_prefix]
        if given:
            maps[""] = _committed_of(given, leave_out, ids_of or {})
        skip = next(iter(maps.values())) if len(maps) == 1 else collections.ChainMap(*maps.values())
        tasks.append(TaskSpec(shard=name, rows=[], fields=fields, units=tuple(group), skip=skip, part_size=part_size))
    return tasks, skips


def unit_samples_committed(units: list[SourceUnit], store: featstore.Store, ids_of: dict[tuple[str, tuple[int, ...]], list[str]] | None) -> int:
    """The samples of ``units`` (tars, Parquet row groups) the store holds before this job: what
    the line of a re-run counts as already in the store, as it counts a manifest's rows (a
    unit's rows are read by its task, not by the plan). Counted in the index's id column at once,
    by id prefix (a tar's stem: its clips' ids too), or by the ids the client read (a Parquet
    ``id`` column)."""
    if not units or not len(store):
        return 0
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = store.index.column("id")
    prefixes = {unit.id_prefix.encode() for unit in units if unit.id_prefix}
    named = [i for unit in units if not unit.id_prefix for i in (ids_of or {}).get((unit.shown, unit.row_groups), ())]
    count = 0
    # Each id's first bytes, one slice per prefix length (as a rule one: 00000: .. 99999:), looked
    # up at once: ~8x less work than splitting every id at its colon (2M ids: 0.03 s).
    as_bytes = ids.cast(pa.binary()) if prefixes else None
    for length in sorted({len(p) for p in prefixes}):
        heads = pc.binary_slice(as_bytes, 0, length)
        count += pc.sum(pc.is_in(heads, value_set=pa.array(sorted(p for p in prefixes if len(p) == length), pa.binary()))).as_py() or 0
    if named:
        count += pc.sum(pc.is_in(ids, value_set=pa.array(named))).as_py() or 0
    return count


def _pending_ids(units: list[SourceUnit], ids_of: dict[tuple[str, tuple[int, ...]], list[str]]) -> Callable[[str], bool]:
    """Whether an id may be one of ``units``': of a unit's id prefix (a tar's, a Parquet file's
    stem), or one the client read of a unit without one (a Parquet ``id`` column; any id where
    those were not read)."""
    prefixes = {unit.id_prefix for unit in units if unit.id_prefix}
    unprefixed = [unit for unit in units if not unit.id_prefix]
    if any((unit.shown, unit.row_groups) not in ids_of for unit in unprefixed):
        return lambda sample_id: True
    named = {sample_id for unit in unprefixed for sample_id in ids_of[(unit.shown, unit.row_groups)]}
    return lambda sample_id: sample_id.split(":", 1)[0] + ":" in prefixes or sample_id in named


def _pending_groups(units: list[SourceUnit], store: featstore.Store, config: EncodeConfig, *, part_size: int, workers: int,
                    sample_bytes: int, salt: str) -> list[tuple[list[SourceUnit], str]]:
    """(units, task name) of the groups whose task is not done (its last shard not committed)."""
    done = set(store.shards) | set(store.replaced)  # a task's shard may be compacted since (featstore.rewrite)
    pending = []
    for every in group_units(units, config, workers=workers, sample_bytes=sample_bytes):
        # Not named by the fields: a task done is done (a field added later reaches its samples one by one: committed_unit_tasks).
        # Grouped whether done or not, so the groups are the same on every run. A unit its own task
        # read (an earlier mmcache's, one task a tar, or a run on another number of workers) is
        # left out, and the task is named by the units it reads: a resume reads past its committed
        # parts by counting members, which holds only for the same units in the same order.
        group = [unit for unit in every if len(every) == 1 or unit_task_name([unit], part_size, salt) not in done]
        name = unit_task_name(group, part_size, salt) if group else ""
        if group and name not in done:
            pending.append((group, name))
    return pending


def _committed_of(units: list[SourceUnit], leave_out: dict[str, tuple[str, str]],
                  ids_of: dict[tuple[str, tuple[int, ...]], list[str]]) -> dict[str, tuple[str, str]]:
    """The entries of ``leave_out`` of the units' own ids (all of ``leave_out`` where those are unknown)."""
    out: dict[str, tuple[str, str]] = {}
    for unit in units:
        ids = ids_of.get((unit.shown, unit.row_groups))
        if ids is None:
            return leave_out
        out.update((i, leave_out[i]) for i in ids if i in leave_out)
    return out


def unit_task_name(units: list[SourceUnit], part_size: int, salt: str) -> str:
    """A unit task's name, from what it reads (a single unit's as it has always been named)."""
    what: list = [[u.kind, u.shown, list(u.row_groups)] for u in units] if len(units) > 1 else [units[0].kind, units[0].shown, list(units[0].row_groups)]
    body = json.dumps([*what, part_size] + ([salt] if salt else []))
    return f"u-{hashlib.sha256(body.encode()).hexdigest()[:24]}"


def group_units(units: list[SourceUnit], config: EncodeConfig, *, workers: int, sample_bytes: int) -> list[list[SourceUnit]]:
    """Consecutive units of one kind, in input order, in groups of about one task's worth, as rows
    are: Parquet row groups (their rows counted) up to ``rows_per_task`` rows, tars (their samples
    unknown until read) up to ``run.shard_bytes`` of tar, each at most a worker's share of the
    job. So small tars or row groups make shards of a useful size, and as many tasks as workers at
    least, not one task (and one commit) each. A group closes where the running total first
    reaches its target: a set of tars grown at its end keeps the earlier groups, hence their
    names, unless the job was smaller than a shard per worker (or is run on another number of
    workers): then done tars are read again, their members left out, none encoded."""
    tar_bytes = sum(unit.nbytes for unit in units if not unit.estimated_samples)
    rows = sum(unit.estimated_samples for unit in units)
    target_bytes = max(1, min(int(config.run.shard_bytes), -(-tar_bytes // max(1, workers))))
    target_rows = rows_per_task(config, rows, workers, sample_bytes)
    groups: list[list[SourceUnit]] = []
    size = 0
    for unit in units:
        if not groups or unit.kind != groups[-1][-1].kind or size >= (target_rows if unit.estimated_samples else target_bytes):
            groups.append([])
            size = 0
        groups[-1].append(unit)
        # A tar of unknown size counts as a whole group: it may be large.
        size += unit.estimated_samples or unit.nbytes or target_bytes
    return groups


def fields_digest(fields: dict[str, Any]) -> str:
    """One hash of every field's fingerprint: what names a task after the encoders it runs."""
    return hashlib.sha256(json.dumps({k: v["meta"]["fingerprint"]["digest"] for k, v in fields.items()}, sort_keys=True).encode()).hexdigest()


def retry_salt(store: featstore.Store) -> str:
    """Names the rejects a retry follows, so retrying them again later is again a new task."""
    return hashlib.sha256(" ".join(sorted(n for n, info in store.shards.items() if info.num_rejected)).encode()).hexdigest()[:16]
