"""What ``mmcache encode --input`` reads, as one job's inputs: every input pattern expanded
(``inputs.expand``), each input read by the source its suffix names (``inputs.registry.SOURCES``:
manifest, folder, webdataset, parquet, llava), merged into one ``InputSet`` or streamed in batches
for the planner (``InputStream``). ``open_unit`` is the worker's side: the samples of one tar or
Parquet row group, read once. docs/encode.md describes the formats."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...featstore.secrets import redact_url
from .expand import expand_inputs
from .file_sources import FOLDER
from .registry import SOURCES, InputSource, Member, SourceOptions, SourceRead, SourceUnit, duplicate_reason
from .rows import EmptyInputError, InputRow, ManifestError, Reject, RowKey

__all__ = ["InputSet", "InputStream", "Member", "SourceOptions", "SourceUnit", "open_unit", "read_all", "source_for"]


@dataclass(kw_only=True)
class InputSet:
    """All inputs of a job: rows read on the client, units its workers read, rejects so far."""

    rows: list[InputRow] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    units: list[SourceUnit] = field(default_factory=list)


def source_for(url: str) -> InputSource:
    """The source whose suffix ``url`` ends with; a folder, or anything else, goes to the files
    reader (which tells a folder from a manifest, and says what it expected)."""
    name = url.split("?", 1)[0].rstrip("/").lower()
    for source in SOURCES.values():
        if any(name.endswith(suffix) for suffix in source.suffixes if suffix != "/"):
            return source
    return FOLDER


def read_all(patterns: str | list[str], options: SourceOptions) -> InputSet:
    """Every input the patterns name, read and merged. Ids are unique over the whole job: a row
    whose id an earlier input used is a reject, and two containers whose ids would share a
    prefix (``a/00000.tar`` and ``b/00000.tar``) are an error."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    urls = expand_inputs(patterns, options.storage_options)
    single = len(urls) == 1
    each = options if single else dataclasses.replace(options, allow_empty=True)
    out, seen = InputSet(), dict[str, str]()  # seen: id -> its source
    for url in urls:
        read: SourceRead = source_for(url).read(url, each)
        for row in read.rows:
            if row.sample_id in seen:
                out.rejects.append(Reject(source=row.source, reason=duplicate_reason(row.sample_id, seen[row.sample_id]), sample_id=row.sample_id))
                continue
            seen[row.sample_id] = redact_url(url)
            out.rows.append(dataclasses.replace(row, input=redact_url(url)))
        out.rejects.extend(read.rejects)
        add_units(out.units, _with_duplicates(read, seen))
    if not single and not (out.rows or out.rejects or out.units) and not options.allow_empty:
        shown = ", ".join(redact_url(u) for u in urls[:3])
        raise EmptyInputError(f"inputs {shown}: no rows at all; nothing to encode (pass --allow-empty to accept an empty input)")
    return out


def add_units(units: list[SourceUnit], new: list[SourceUnit]) -> None:
    """Append ``new`` to ``units``; two containers whose ids would share a prefix are an error."""
    prefixes = {unit.id_prefix: unit.shown for unit in units if unit.id_prefix}
    for unit in new:
        if unit.id_prefix and prefixes.setdefault(unit.id_prefix, unit.shown) != unit.shown:
            raise ManifestError(
                f"inputs {prefixes[unit.id_prefix]!r} and {unit.shown!r} share the name {unit.id_prefix.rstrip(':')!r}, so their "
                f"samples' ids ({unit.id_prefix}<key>) would collide; encode them into separate stores or rename one")
    units.extend(new)


class InputStream:
    """Every input of a job, for the planner to read in batches, once per pass: a manifest
    (JSONL, CSV, Parquet) is streamed again each time (``InputSource.batches``), and so is a media
    Parquet file's footer; a folder, a LLaVA JSON or a tar's name is read whole the first time and
    kept (their rows fit in memory). ``units`` is complete once one pass has ended."""

    def __init__(self, patterns: str | list[str], options: SourceOptions) -> None:
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        self.urls = expand_inputs(patterns, options.storage_options)
        self.allow_empty = options.allow_empty
        # Each input of several may be empty: whether all are is judged once (precompute.planning.survey).
        self.options = options if len(self.urls) == 1 else dataclasses.replace(options, allow_empty=True)
        self.units: list[SourceUnit] = []
        self._whole: dict[int, SourceRead] = {}
        # Ids the client knows of containers' rows (a Parquet id column): the first input keeps each.
        self._unit_ids: dict[str, str] = {}
        # Those ids by unit ((shown, row groups) -> ids): what planning tells a unit's task to leave
        # out is the committed ones among them, not every id the store has.
        self.ids_of: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        self._units_of: set[int] = set()  # inputs read in batches whose units are in ``units``

    def batches(self, keys_only: bool = False) -> Iterator[tuple[int, SourceRead]]:
        """(the input's position in ``urls``, a batch of its rows and rejects), in input order;
        ``keys_only``: each row only its ``RowKey`` (what planning's first pass needs)."""
        for index, url in enumerate(self.urls):
            source = source_for(url)
            if source.batches is not None:
                for batch in source.batches(url, self.options, not keys_only):
                    if batch.units and index not in self._units_of:  # read again on each pass, kept from the first
                        add_units(self.units, _with_duplicates(batch, self._unit_ids, self.ids_of))
                        self._units_of.add(index)
                    yield index, batch
                continue
            if index not in self._whole:
                self._whole[index] = self._read_whole(url, source)
            whole = self._whole[index]
            if keys_only:
                whole = SourceRead(rows=[RowKey.of(r) for r in whole.rows], rejects=whole.rejects)
            yield index, whole

    def _read_whole(self, url: str, source: InputSource) -> SourceRead:
        read = source.read(url, self.options)
        add_units(self.units, _with_duplicates(read, self._unit_ids, self.ids_of))
        shown = redact_url(url)
        return SourceRead(rows=[dataclasses.replace(row, input=shown) for row in read.rows], rejects=read.rejects, units=read.units)


def _with_duplicates(read: SourceRead, seen: dict[str, str], ids_of: dict[tuple[str, tuple[int, ...]], list[str]] | None = None) -> list[SourceUnit]:
    """``read``'s units, each told which of its rows (where the client knows their ids:
    ``unit_ids``) have an id an earlier input or row has: its worker rejects those, naming the
    earlier one (the first row to have an id keeps it, whatever order the tasks run in). Each
    unit's ids go to ``ids_of``."""
    units = []
    for index, unit in enumerate(read.units):
        earlier = []
        own = [sample_id for sample_id, _ in read.unit_ids[index]] if read.unit_ids else []
        if read.unit_ids and ids_of is not None:  # an empty row group's too: its ids are known (none)
            ids_of[(unit.shown, unit.row_groups)] = own
        for sample_id, source in read.unit_ids[index] if read.unit_ids else ():
            if sample_id in seen:
                earlier.append((source, seen[sample_id]))
            else:
                seen[sample_id] = source
        units.append(dataclasses.replace(unit, duplicates=tuple(earlier)) if earlier else unit)
    return units


def open_unit(unit: SourceUnit, storage_options: dict[str, Any] | None, max_bytes: int) -> Iterator[Member]:
    """The samples of ``unit``, read once front to back (run by the task that encodes them)."""
    stream = SOURCES[unit.kind].stream
    assert stream is not None, f"input source {unit.kind!r} has no units"
    return stream(unit, storage_options, max_bytes)
