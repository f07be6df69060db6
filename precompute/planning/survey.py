"""Planning's first pass over a job's inputs: what they hold and what the job will do, counted in a
few bytes per row (a 64-bit hash of its id and a 16-bit code of what it needs), never a Python
object per row. Duplicate ids are found by sorting the hashes once the pass ends (the second pass
confirms each by its id). ``mmcache encode --dry-run`` prints its counts; a run sizes its tasks from
them (``planning.plan``). More: docs/design/encode.md, "Planning's first pass"."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import featstore
from ...featstore.secrets import redact_url
from ..inputs.registry import SourceUnit
from ..inputs.rows import EmptyInputError, InputRow, Reject, RowKey
from ..inputs.stream import InputStream
from ..media.clips import clip_parent, clip_parents
from .stale import StaleCheck

_CHUNK = 1 << 18  # hashes looked up at a time: 2 MB of them
GroupKey = tuple[tuple[str, ...], bool]  # (the configured fields a row lacks, whether its sample is new)


@dataclass(kw_only=True)
class Survey:
    """The counts of one pass over the inputs (see the module's docstring)."""

    rows: int = 0  # usable rows read, duplicates included
    duplicates: int = 0  # rows whose id an earlier row has (by hash; confirmed by id when tasks are made)
    rejects: list[Reject] = field(default_factory=list)  # rows the readers rejected (duplicates aside)
    skipped: int = 0  # rows the store holds with every field, or rejected before
    groups: dict[GroupKey, int] = field(default_factory=dict)  # rows to encode, by what they lack
    kinds: dict[str, int] = field(default_factory=dict)  # rows to encode by kind: image, video, text
    retried: bool = False  # a row rejected before is encoded again (data.retry_rejects)
    unframed: int = 0  # committed clips lacking a field that record no frames (not given it)
    unsettled_duplicates: int = 0  # of ``duplicates``, those the tasks' pass must see (no reject recorded them yet, or would be encoded)
    stale: dict[str, str] = field(default_factory=dict)  # committed rows edited since (precompute.planning.stale), id -> what changed
    duplicate_hashes: frozenset[int] = frozenset()  # hashes two or more rows share
    units: list[SourceUnit] = field(default_factory=list)  # tars, Parquet row groups: read by their tasks

    @property
    def todo(self) -> int:
        return sum(self.groups.values())


def survey(inputs: InputStream, store: featstore.Store | None, fields: dict[str, str] | None, *, clips: bool,
           retry_rejects: bool) -> Survey:
    """One pass over ``inputs`` against ``store`` (its snapshot; None: no store yet) for encoders
    writing ``fields`` (name -> modality; None: unknown here, committed samples count as complete)."""
    rejected = rejected_sources(store) if store is not None else set()
    rejected_before = set() if retry_rejects else rejected
    missing = RowClassifier(store, fields, clips=clips, retry_rejects=retry_rejects)
    out = Survey()
    stale = StaleCheck(store) if store is not None and len(store) else None
    hashes, codes = array("q"), array("H")
    # A row's code: what it lacks, its kind, the samples it stands for, whether a reject recorded its source.
    code_of: dict[tuple[GroupKey | None, str, int, bool], int] = {}

    def code(row: RowKey) -> int:
        key = None if missing.blocked(row, rejected_before) else missing(row)
        return code_of.setdefault((key, row.modality, missing.samples(row) if key else 1, row.source in rejected_before), len(code_of))

    # Without a store a row's code is its kind's: looked up, not worked out (2M rows: ~2 s less).
    by_kind: dict[str, int] | None = {} if store is None else None
    for _, batch in inputs.batches(keys_only=True):
        out.rejects.extend(batch.rejects)
        rows = batch.rows
        hashes.extend([hash(row.sample_id) for row in rows])
        if by_kind is not None:
            codes.extend([by_kind[row.modality] if row.modality in by_kind else by_kind.setdefault(row.modality, code(row)) for row in rows])
        else:
            codes.extend([code(row) for row in rows])
        if stale is not None:
            stale.add(rows)
        out.retried = out.retried or (retry_rejects and any(row.source in rejected for row in rows))
    out.rows, out.units, out.unframed = len(hashes), list(inputs.units), missing.unframed
    out.stale = stale.stale if stale is not None else {}
    if len(inputs.urls) > 1 and not (out.rows or out.rejects or out.units) and not inputs.allow_empty:
        shown = ", ".join(redact_url(url) for url in inputs.urls[:3])
        raise EmptyInputError(f"inputs {shown}: no rows at all; nothing to encode (pass --allow-empty to accept an empty input)")
    counts = np.bincount(np.frombuffer(codes, dtype=np.uint16), minlength=len(code_of)) if len(codes) else np.zeros(len(code_of), int)
    later = _later_duplicates(np.frombuffer(hashes, dtype=np.int64) if len(hashes) else np.zeros(0, np.int64))
    if later.size:
        out.duplicate_hashes = frozenset(np.frombuffer(hashes, dtype=np.int64)[later].tolist())
        repeated = np.bincount(np.frombuffer(codes, dtype=np.uint16)[later], minlength=len(code_of))
        counts = counts - repeated
        out.duplicates = int(later.size)
        # The tasks' pass records a duplicate no reject recorded yet, and confirms by id one that
        # would be encoded (two ids of one hash are no duplicates): those need that pass.
        out.unsettled_duplicates = int(sum(repeated[at] for (key, *_, recorded), at in code_of.items() if not recorded or key is not None))
    for (key, kind, samples, _), at in code_of.items():
        n = int(counts[at]) * samples
        if key is None:
            out.skipped += n
        elif n:
            out.groups[key] = out.groups.get(key, 0) + n
            out.kinds[kind] = out.kinds.get(kind, 0) + n
    return out


def _later_duplicates(hashes: np.ndarray) -> np.ndarray:
    """Positions of the rows whose hash an earlier row has. The repeated hashes come from a sorted
    copy (8 bytes a row, freed at once; an argsort would hold three such arrays); the rows that
    have one, few as a rule, are then told apart in order: each hash's first row is no duplicate."""
    if hashes.size < 2:
        return np.zeros(0, np.int64)
    ordered = np.sort(hashes)
    repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    del ordered
    if not repeated.size:
        return np.zeros(0, np.int64)
    # Looked up a chunk at a time (np.isin would sort a copy of the whole array with them).
    chunks = []
    for start in range(0, hashes.size, _CHUNK):
        part = hashes[start : start + _CHUNK]
        found = repeated[np.minimum(np.searchsorted(repeated, part), repeated.size - 1)] == part
        chunks.append(np.flatnonzero(found) + start)
    candidates = np.concatenate(chunks)
    seen: set[int] = set()
    later = []
    for at, h in zip(candidates.tolist(), hashes[candidates].tolist()):
        if h in seen:
            later.append(at)
        seen.add(h)
    return np.asarray(later, dtype=np.int64)


class RowClassifier:
    """row -> (the configured fields it still lacks, whether its sample is new), or None when it
    lacks none: all fields for a new sample, those added to the store since for a committed one.
    A text-only row has only the text fields (no image field: zero image tokens), so its task runs
    no visual encoder. With ``clips`` (``frames.clips``), a video whose clips are committed is
    done, unless a clip lacks a field: then the row stands for those clips (``clips_lacking``),
    each given its fields from its own recorded frames. ``refused``: (id, source) of committed
    samples whose field an earlier run refused (``refused_pairs``): not tried again, unless
    ``retry_rejects``."""

    def __init__(self, store: featstore.Store | None, fields: dict[str, str] | None, *, clips: bool, retry_rejects: bool = False) -> None:
        self.store, self.names = store, list(fields) if fields is not None else ["*"]
        self.refused = refused_pairs(store) if store is not None and not retry_rejects else set()
        self.fields = fields
        self.text = [name for name, modality in (fields or {}).items() if modality == "text"]
        # Only under frames.clips: otherwise an id ``a=1`` is an ordinary id and says nothing of ``a``.
        ids = store.sample_ids() if clips and store is not None else []
        self.clipped = clip_parents(ids)
        # A video's clip ids, only where some sample lacks a field (a re-run of a complete store
        # keeps none); what each clip lacks is looked up when its video's row comes.
        self.clips_of: dict[str, list[str]] = {}
        self.unframed = 0  # clips lacking a field that record no frames (stores before they did): left as they are
        self._last: tuple[tuple[str, str], list[tuple[str, tuple[str, ...], list[int]]]] = (("", ""), [])
        if self.clipped and fields is not None and store is not None:
            per_field = store.samples_per_field()
            if any(per_field.get(name, -1) != len(store) for name in fields):
                for sample_id in ids:
                    if (parent := clip_parent(sample_id)) is not None:
                        self.clips_of.setdefault(parent, []).append(sample_id)

    def blocked(self, row: InputRow | RowKey, rejected_before: set[str]) -> bool:
        """Whether an earlier run's reject holds the row back: a new sample's by its source; a
        committed one's (or a clip's: ``clips_lacking``) only by a refusal of its own (id, source),
        not because another row of that source (a duplicate of it) was rejected."""
        if row.source not in rejected_before:
            return False
        if row.sample_id in self.clipped:
            return False
        return self.store is None or row.sample_id not in self.store or (row.sample_id, row.source) in self.refused

    def __call__(self, row: InputRow | RowKey) -> GroupKey | None:
        if row.sample_id in self.clipped:
            clips = self.clips_lacking(row.sample_id, row.source)
            return (tuple(sorted({f for _, missing, _ in clips for f in missing}, key=self.names.index)), False) if clips else None
        new = self.store is None or row.sample_id not in self.store
        if not new and self.fields is None:
            return None  # fields unknown on this client: a committed sample counts as complete
        missing = self._missing(row.sample_id, row.modality, new=new)
        return (missing, new) if missing else None

    def samples(self, row: InputRow | RowKey) -> int:
        """How many samples the row's task makes or fills: its committed clips lacking a field, else one."""
        return len(self.clips_lacking(row.sample_id, row.source)) if row.sample_id in self.clipped else 1

    def clips_lacking(self, video_id: str, source: str) -> list[tuple[str, tuple[str, ...], list[int]]]:
        """(clip id, the fields it lacks, its recorded frames) of the video's committed clips that
        lack one, record their frames and were not refused one (the last video's kept: a row asks
        twice)."""
        if self._last[0] != (video_id, source):
            store, found = self.store, []
            frames = store.index.column("frame_indices") if store is not None and "frame_indices" in store.index.column_names else None
            for clip in self.clips_of.get(video_id, ()):
                if (clip, source) not in self.refused and (missing := self._missing(clip, "video", new=False)):
                    recorded = frames[store.row(clip)].as_py() if frames is not None else None  # type: ignore[union-attr]
                    if recorded is None:
                        self.unframed += 1
                    else:
                        found.append((clip, missing, recorded))
            self._last = ((video_id, source), found)
        return self._last[1]

    def _missing(self, sample_id: str, modality: str, *, new: bool) -> tuple[str, ...]:
        have: Any = () if new else set(self.store.fields_of(sample_id))  # type: ignore[union-attr]
        own = self.names if modality != "text" or self.fields is None else self.text
        return tuple(f for f in own if f not in have)


def rejected_sources(store: featstore.Store) -> set[str]:
    return set(store.rejects.column("source").to_pylist()) if store.num_rejected() else set()


def refused_pairs(store: featstore.Store) -> set[tuple[str, str]]:
    """(id, source) of the rejects that name an id and are not a duplicate's: what refused a
    committed sample a field (its input changed, its worker died on it)."""
    if not store.num_rejected() or "id" not in store.rejects.column_names:
        return set()
    table = store.rejects
    return {(i, src) for i, src, why in zip(table.column("id").to_pylist(), table.column("source").to_pylist(),
                                            table.column("reason").to_pylist(), strict=True)
            if i and not (why or "").startswith("duplicate id")}
