"""What ``mmcache encode --input`` reads: every input pattern expanded (``expand``), each input
read by the source its suffix names (``base.SOURCES``: manifest, folder, webdataset, parquet,
llava), and the results merged into one ``InputSet``. ``open_unit`` is the worker's side: the
samples of one tar or Parquet row group, read once. docs/encode.md describes the formats."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mmcache.featstore.secrets import redact_url
from mmcache.precompute.input_sources import files, llava, parquet_media, webdataset  # noqa: F401  (they register)
from mmcache.precompute.input_sources.base import SOURCES, InputSource, Member, SourceOptions, SourceRead, SourceUnit, duplicate_reason
from mmcache.precompute.input_sources.expand import expand_inputs
from mmcache.precompute.inputs import EmptyInputError, InputRow, ManifestError, Reject

__all__ = ["InputSet", "Member", "SourceOptions", "SourceUnit", "open_unit", "read_all", "source_for"]


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
    return files.FOLDER


def read_all(patterns: str | list[str], options: SourceOptions) -> InputSet:
    """Every input the patterns name, read and merged. Ids are unique over the whole job: a row
    whose id an earlier input used is a reject, and two containers whose ids would share a
    prefix (``a/00000.tar`` and ``b/00000.tar``) are an error."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    urls = expand_inputs(patterns, options.storage_options)
    single = len(urls) == 1
    each = options if single else dataclasses.replace(options, allow_empty=True)
    out, seen, prefixes = InputSet(), dict[str, str](), dict[str, str]()  # seen: id -> its source
    for url in urls:
        read: SourceRead = source_for(url).read(url, each)
        for row in read.rows:
            if row.sample_id in seen:
                out.rejects.append(Reject(source=row.source, reason=duplicate_reason(row.sample_id, seen[row.sample_id]), sample_id=row.sample_id))
                continue
            seen[row.sample_id] = redact_url(url)
            out.rows.append(dataclasses.replace(row, input=redact_url(url)))
        out.rejects.extend(read.rejects)
        for unit in read.units:
            if unit.id_prefix and prefixes.setdefault(unit.id_prefix, unit.shown) != unit.shown:
                raise ManifestError(
                    f"inputs {prefixes[unit.id_prefix]!r} and {unit.shown!r} share the name {unit.id_prefix.rstrip(':')!r}, so their "
                    f"samples' ids ({unit.id_prefix}<key>) would collide; encode them into separate stores or rename one")
        out.units.extend(_with_duplicates(read, seen))
    if not single and not (out.rows or out.rejects or out.units) and not options.allow_empty:
        shown = ", ".join(redact_url(u) for u in urls[:3])
        raise EmptyInputError(f"inputs {shown}: no rows at all; nothing to encode (pass --allow-empty to accept an empty input)")
    return out


def _with_duplicates(read: SourceRead, seen: dict[str, str]) -> list[SourceUnit]:
    """``read``'s units, each told which of its rows (where the client knows their ids:
    ``unit_ids``) have an id an earlier input or row has: its worker rejects those, naming the
    earlier one (the first row to have an id keeps it, whatever order the tasks run in)."""
    units = []
    for index, unit in enumerate(read.units):
        earlier = []
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
