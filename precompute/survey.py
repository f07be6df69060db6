"""Planning's first pass over a job's inputs: what they hold and what the job will do, counted
in a few bytes per row, never a Python object per row of the job.

The inputs (``InputStream``) are read in batches. Each usable row leaves a 64-bit hash of its id
and a 16-bit code of what it needs (the fields it lacks, new or not, its kind, or nothing: in the
store already, rejected before); ~10 bytes a row, 20 MB for 2M rows. Duplicate ids are found
once the pass ends, by sorting the hashes: a row whose hash an earlier row has is a duplicate
(the second pass, which makes the tasks, confirms each by its id: two ids of one hash are not
duplicates). ``mmcache encode --dry-run`` prints this pass's counts; a real run sizes its tasks
from them (``precompute.plan``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmcache import featstore
from mmcache.featstore.secrets import redact_url
from mmcache.precompute.clips import clip_parents
from mmcache.precompute.input_sources import InputStream, SourceUnit
from mmcache.precompute.inputs import EmptyInputError, InputRow, Reject, RowKey

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
    missing = row_classifier(store, fields, clips=clips)
    out = Survey()
    hashes, codes = array("q"), array("H")
    code_of: dict[tuple[GroupKey | None, str], int] = {}

    def code(row: RowKey) -> int:
        key = None if row.source in rejected_before else missing(row)
        return code_of.setdefault((key, row.modality), len(code_of))

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
        out.retried = out.retried or (retry_rejects and any(row.source in rejected for row in rows))
    out.rows, out.units = len(hashes), list(inputs.units)
    if len(inputs.urls) > 1 and not (out.rows or out.rejects or out.units) and not inputs.allow_empty:
        shown = ", ".join(redact_url(url) for url in inputs.urls[:3])
        raise EmptyInputError(f"inputs {shown}: no rows at all; nothing to encode (pass --allow-empty to accept an empty input)")
    counts = np.bincount(np.frombuffer(codes, dtype=np.uint16), minlength=len(code_of)) if len(codes) else np.zeros(len(code_of), int)
    later = _later_duplicates(np.frombuffer(hashes, dtype=np.int64) if len(hashes) else np.zeros(0, np.int64))
    if later.size:
        out.duplicate_hashes = frozenset(np.frombuffer(hashes, dtype=np.int64)[later].tolist())
        counts = counts - np.bincount(np.frombuffer(codes, dtype=np.uint16)[later], minlength=len(code_of))
        out.duplicates = int(later.size)
    for (key, kind), at in code_of.items():
        n = int(counts[at])
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


def row_classifier(store: featstore.Store | None, fields: dict[str, str] | None, *,
                   clips: bool) -> Callable[[InputRow | RowKey], GroupKey | None]:
    """row -> (the configured fields it still lacks, whether its sample is new), or None when it
    lacks none: all fields for a new sample, those added to the store since for a committed one.
    A text-only row has only the text fields (no image field: zero image tokens), so its task runs
    no visual encoder. With ``clips`` (``frames.clips``), a video whose clips are committed is done."""
    names = list(fields) if fields is not None else ["*"]
    text = [name for name, modality in (fields or {}).items() if modality == "text"]
    # Only under frames.clips: otherwise an id ``a=1`` is an ordinary id and says nothing of ``a``.
    clipped = clip_parents(store.sample_ids()) if clips and store is not None else set()

    def lacking(row: InputRow | RowKey) -> GroupKey | None:
        if row.sample_id in clipped:
            return None
        new = store is None or row.sample_id not in store
        if not new and fields is None:
            return None  # fields unknown on this client: a committed sample counts as complete
        have: Any = () if new else set(store.fields_of(row.sample_id))  # type: ignore[union-attr]
        own = names if row.modality != "text" or fields is None else text
        missing = tuple(f for f in own if f not in have)
        return (missing, new) if missing else None

    return lacking


def rejected_sources(store: featstore.Store) -> set[str]:
    return set(store.rejects.column("source").to_pylist()) if store.num_rejected() else set()
