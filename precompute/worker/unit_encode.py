"""The task of units (WebDataset tars, Parquet row groups: ``precompute.inputs.stream``; small
ones several to a task, ``precompute.planning.plan.group_units``): their members read once, front to back,
one unit after another, decoded as they arrive, and committed in parts of
``run.samples_per_task`` members under names a re-run finds again. Each part is encoded and
written by the task's own steps (``precompute.worker.tasks``), handed in, so this module needs nothing
of that one's.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ..inputs.registry import Member, SourceUnit, duplicate_reason, file_name
from ..inputs.rows import InputRow, Reject
from ..inputs.source_bytes import InputFileError, read_failure
from ..inputs.stream import open_unit
from ..media.clips import clip_parent
from .specs import TaskSettings, TaskSpec
from .daemon_pool import DaemonPool


def encode_unit(task: TaskSpec, settings: TaskSettings, result: Any, committed: set[str], *,
                encode_rows: Callable[[TaskSpec, Any, Iterator[tuple[InputRow, bytes | None]]], list],
                write_shard: Callable[[TaskSpec, list, Any, int], None], halt: Callable[[], bool] = lambda: False) -> None:
    """The samples of the task's tars (or row groups), read once front to back, one unit after
    another, and decoded as they arrive, committed in parts of ``task.part_size`` members: each part a later member follows as
    ``<shard>-pNNNNN``, the last one (full or not) as ``<shard>``, which marks the unit done.
    Parts an earlier run committed are read past, not encoded. ``encode_rows(sub, part, rows)``
    and ``write_shard(sub, done, part, commit_ahead_bytes)`` are the task's own steps
    (precompute.worker.tasks); ``result`` gets every part's counts. Once ``halt()`` says so, the
    task ends before its next part: the unit is not done, and a re-run reads past the parts
    committed."""
    assert task.units
    parts = _UnitParts(task, settings, result, write_shard)
    members = _Pushback(_counted(_opened(task.units, settings), result))
    index = 0
    try:
        while True:
            name = f"{task.shard}-p{index:05d}"
            if name in committed:  # then a member followed it in that run, and follows it now
                parts.pass_over(members)
            elif halt():  # the unit is not done: a re-run reads past the parts committed
                return
            else:
                part = type(result)(shard=name)
                sub = replace(task, shard=name, rows=[], units=())
                found: list = []  # the members' own rejects, kept apart while they are read on another thread
                done = encode_rows(sub, part, parts.rows(members, found))
                part.rejects.extend(found)
                part.rejected += len(found)
                following = next(members, None)
                if following is None:
                    parts.commit(replace(sub, shard=task.shard), done, replace(part, shard=task.shard), last=True)
                    return
                parts.commit(sub, done, part, last=False)
                members.push(following)
            index += 1
    finally:
        parts.close()


def _opened(units: Sequence[SourceUnit], settings: TaskSettings) -> Iterator[Member]:
    """The units' members, unit after unit; one that cannot be opened (not a regular file,
    missing) is one reject."""
    for unit in units:
        try:
            yield from open_unit(unit, settings.input_storage_options, settings.max_input_bytes)
        except InputFileError as exc:
            yield Member(reject=Reject(source=unit.shown, reason=exc.reason))
        except FileNotFoundError as exc:
            # A missing input is a reject; one that an unreachable object store only seems to lack fails the task (retried).
            read_failure(exc, unit.shown)
            yield Member(reject=Reject(source=unit.shown, reason="missing file"))


def _counted(members: Iterator[Member], result: Any) -> Iterator[Member]:
    """``members``, each counted in ``result.members`` as it is read (encoded, rejected, left
    out or read past): what the unit held, which sizes the progress of the tars not read yet."""
    for member in members:
        result.members += 1
        yield member


class _Pushback:
    """An iterator that can take back the one item it was asked for ahead (the member that told a
    part was not the last)."""

    def __init__(self, items: Iterator[Member]) -> None:
        self.items = items
        self.back: Member | None = None

    def __iter__(self) -> Iterator[Member]:
        return self

    def __next__(self) -> Member:
        item, self.back = self.back, None
        return item if item is not None else next(self.items)

    def push(self, item: Member) -> None:
        assert self.back is None, "one member of lookahead"
        self.back = item


class _UnitParts:
    """The parts of one unit: the members of each (rejects into its result, samples to encode),
    and their commits. Each part but the last commits on a thread of its own while the next part
    is read and encoded (one commit in flight: one part's features held besides the one
    encoding); the last commits as a task's shard does (precompute.worker.commit_ahead: a Dask task can
    leave its worker's thread pool only once)."""

    def __init__(self, task: TaskSpec, settings: TaskSettings, result: Any, write_shard: Callable[[TaskSpec, list, Any, int], None]) -> None:
        self.task, self.settings, self.result, self.write_shard = task, settings, result, write_shard
        self.pool = DaemonPool(1, "commit-part")
        self.pending: Any = None

    def rows(self, members: Iterator[Member], rejects: list) -> Iterator[tuple[InputRow, bytes | None]]:
        """The next ``part_size`` members as (row, bytes), lazily: decoding starts as they arrive;
        the others' (reject, reason) into ``rejects``. A member whose id is committed or rejected
        already is left out if that was this input's (a resume), and is a reject naming the other
        input if it was another's, or if its bytes are not the committed ones (two shards of one
        name from two datasets: ``laion/00000.tar``, then ``coyo/00000.tar``)."""
        for member in itertools.islice(members, self.task.part_size):
            if member.reject is not None:
                if member.reject.sample_id not in self.task.skip:
                    rejects.append((member.reject, member.reject.reason))
            elif member.row is not None:
                earlier = self.task.skip.get(member.row.sample_id)
                if earlier is None:
                    yield member.row, member.data
                elif not same_input(earlier[0], member.row.input) or _other_content(earlier[1], member.data):
                    rejects.append((member.row, duplicate_reason(member.row.sample_id, earlier[0])))

    def pass_over(self, members: Iterator[Member]) -> None:
        """Reads past a committed part's members, encoding and keeping nothing of them."""
        for _ in itertools.islice(members, self.task.part_size):
            pass

    def commit(self, sub: TaskSpec, done: list, part: Any, *, last: bool) -> None:
        self.wait()
        if last:
            self._commit(sub, done, part, self.settings.commit_ahead_bytes)
            self.result.skipped = part.skipped
        else:
            self.pending = self.pool.submit(self._commit, sub, done, part, 0)

    def _commit(self, sub: TaskSpec, done: list, part: Any, ahead: int) -> None:
        self.write_shard(sub, done, part, ahead)
        self.result.samples += part.samples
        self.result.rejected += part.rejected
        self.result.dropped += part.dropped

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # a failed commit fails the task

    def close(self) -> None:
        self.wait()
        self.pool.shutdown(cancel_pending=False)


def known_sources(store: Any, *, rejects: bool, clips: bool = False, keep: Callable[[str], bool] | None = None) -> dict[str, tuple[str, str]]:
    """Committed ids (and with ``rejects`` rejected ones) -> (where each came from, the sha256 of
    its media): a sample's ``source_uri`` and ``content_hash``, a reject's source ('' where a
    store does not say). With ``clips``, the video of each clip id ``<id>=<frame>`` too (its
    clips commit together, in one part). ``keep``: only the ids it accepts (a re-run's pending
    units'), the index read a batch at a time: no entry, nor Python string, per id of a large store."""
    index = store.index
    names = [name for name in ("id", "source_uri", "content_hash") if name in index.column_names]
    known: dict[str, tuple[str, str]] = {}
    for batch in index.select(names).to_batches(max_chunksize=1 << 16):
        ids = batch.column("id").to_pylist()
        sources, hashes = (batch.column(name).to_pylist() if name in names else [None] * len(ids) for name in ("source_uri", "content_hash"))
        known.update((i, (s or "", h or "")) for i, s, h in zip(ids, sources, hashes, strict=True) if i and _kept(i, keep, clips))
    if rejects and store.num_rejected() and "id" in store.rejects.column_names:
        table = store.rejects
        for sample_id, source in zip(table.column("id").to_pylist(), table.column("source").to_pylist(), strict=True):
            if sample_id and _kept(sample_id, keep, clips):
                known.setdefault(sample_id, (source or "", ""))
    if clips:
        known.update({parent: entry for sample_id, entry in list(known.items()) if (parent := clip_parent(sample_id)) is not None})
    return known


def _kept(sample_id: str, keep: Callable[[str], bool] | None, clips: bool) -> bool:
    """Whether ``keep`` takes the id, or (with clips) its video's: a clip ``<id>=<frame>`` stands
    for its video, whose id may be one a Parquet file's ``id`` column gave."""
    return keep is None or keep(sample_id) or (clips and (parent := clip_parent(sample_id)) is not None and keep(parent))


def same_input(source: str, shown: str) -> bool:
    """Whether ``source`` (a source_uri, a reject's source) names the input ``shown`` or a member of
    it: by its file name, so an input spelled or placed otherwise than in an earlier run (a relative
    path from another folder, the tars copied to a bucket) resumes rather than repeats every id."""
    if source == shown or source.startswith(shown + "#"):
        return True
    return file_name(source) == file_name(shown)


def _other_content(content_hash: str, data: bytes | None) -> bool:
    """Whether ``data`` is not the media a committed sample was made from (unknown: it is)."""
    return bool(content_hash) and data is not None and hashlib.sha256(data).hexdigest() != content_hash

