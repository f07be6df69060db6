"""Parquet files with the media inside, as the Hugging Face Hub ships them: an image (or video)
column of ``{bytes, path}`` structs or plain binary, beside a caption column. The client reads only
the footer and names one unit per row group; the worker reads its row group's columns; a committed
row is read again alone (``read_parquet_row``). Column choices and rules: docs/design/encode.md,
"Parquet files with the media inside"."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from ...featstore.retry import protocol_of, remote_filesystem, with_retries
from ...featstore.secrets import redact_url
from .file_sources import manifest_batches, read_rows
from .located import container_key, is_local
from .registry import InputSource, Located, Member, SourceOptions, SourceRead, SourceUnit, duplicate_reason, file_stem, member_or_reject, open_input, register
from .rows import InputRow, ManifestError, Reject, caption_problem, caption_text, has_visible_text, modality_of, safe_id
from .source_bytes import as_media_errors
from ..media.errors import MediaError

MEDIA_COLUMNS = ("image", "video")
CAPTION_COLUMNS = ("caption", "text")


def read_parquet(url: str, options: SourceOptions) -> SourceRead:
    """A media Parquet file -> one unit per row group (from its footer); a manifest -> its rows."""
    return _media_units(url, options) or read_rows(url, options)


def parquet_batches(url: str, options: SourceOptions, build: bool = True) -> Iterator[SourceRead]:
    """What planning reads of a Parquet input on each pass: a manifest's rows in batches, or a
    media file's units (its footer and id column: small, read again rather than kept)."""
    units = _media_units(url, options)
    if units is None:
        yield from manifest_batches(url, options, build)
    else:
        yield units


def _media_units(url: str, options: SourceOptions) -> SourceRead | None:
    """A media Parquet file's units (one per row group, from its footer); None for a manifest."""
    import pyarrow.parquet as pq

    fs, path = remote_filesystem(url, options.storage_options)
    shown = redact_url(url)
    try:
        # Small blocks: only the footer is read here, never the row groups.
        metadata = with_retries(lambda: _footer(fs, path, pq), shown, "read")
    except FileNotFoundError:
        raise ManifestError(f"input {shown!r} does not exist") from None
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid: not a Parquet file
        raise ManifestError(f"input {shown!r} is not a valid parquet file: {exc}") from None
    names = metadata.schema.to_arrow_schema().names  # top-level columns (not a struct's leaves)
    media = options.media_column or next((c for c in MEDIA_COLUMNS if c in names), None)
    if media is None and "path" in names:
        return None  # a manifest: path, caption[, id]
    caption = options.caption_column or next((c for c in CAPTION_COLUMNS if c in names), None)
    missing = [what for what, column in (("media", media), ("caption", caption)) if column is None or column not in names]
    if missing and not (missing == ["caption"] and options.allow_empty_caption):
        raise ManifestError(
            f"input {shown!r} has no {' and no '.join(missing)} column (columns: {names}); name them with "
            "--set data.media_column=NAME / data.caption_column=NAME, or give a manifest with a path column")
    columns = (("media", media or ""),) + ((("caption", caption),) if caption in names else ()) + ((("id", "id"),) if "id" in names else ())
    units, first = [], 0
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        units.append(SourceUnit(kind="parquet", uri=url, shown=shown, id_prefix="" if "id" in names else f"{file_stem(path)}:",
                                row_groups=(group,), first_row=first, columns=columns,
                                allow_empty_caption=options.allow_empty_caption, estimated_samples=rows))
        first += rows
    # Given ids may repeat in another file, which the workers could not see: the client reads the
    # id column (only it) so that the first input to have an id keeps it (read_all).
    ids = with_retries(lambda: _id_column(fs, path, pq), shown, "read") if "id" in names else None
    unit_ids = [] if ids is None else [[(row_id(ids[n], "", n), f"{shown}#{n}") for n in range(u.first_row, u.first_row + u.estimated_samples)]
                                       for u in units]
    return SourceRead(units=units, unit_ids=unit_ids)


def _id_column(fs: Any, path: str, pq: Any) -> list[Any]:
    protocol = protocol_of(fs)
    if protocol in ("file", "local"):
        return pq.read_table(os.fspath(path), columns=["id"], use_threads=False).column("id").to_pylist()
    with fs.open(path, "rb", block_size=1 << 20) as fh:
        return pq.ParquetFile(fh, pre_buffer=False).read(columns=["id"], use_threads=False).column("id").to_pylist()


def row_id(given: Any, prefix: str, number: int) -> str:
    """A row's sample id: its ``id`` cell, else ``<prefix><row number>`` (the file's stem)."""
    return str(given) if given not in (None, "") else f"{prefix}{number}"


def _footer(fs: Any, path: str, pq: Any) -> Any:
    protocol = protocol_of(fs)
    if protocol in ("file", "local"):
        return pq.read_metadata(os.fspath(path))
    with fs.open(path, "rb", block_size=1 << 16, cache_type="bytes") as fh:
        return pq.ParquetFile(fh).metadata


def stream_parquet(unit: SourceUnit, storage_options: dict[str, Any] | None, max_bytes: int) -> Iterator[Member]:
    """The rows of the unit's row groups, read column by column on the worker. A row group that
    cannot be decoded (corrupt pages, a bad footer entry) makes its unread rows rejects, and the
    next one is read; a failed read of the file itself fails the task (it is retried)."""
    import pyarrow.parquet as pq

    columns = dict(unit.columns)
    with open_input(unit.uri, storage_options) as fh:
        watched = ReadWatch(fh)
        # No Arrow thread (pre-buffering and threaded decoding start native pools nobody joins,
        # which can abort the process at exit: featstore.index.parquet_file); this may run in the
        # client itself under the in-process executor.
        parquet = pq.ParquetFile(watched, pre_buffer=False)
        number, seen, earlier = unit.first_row, set[str](), dict(unit.duplicates)
        for group in unit.row_groups:
            end = number + parquet.metadata.row_group(group).num_rows
            try:
                for batch in parquet.iter_batches(row_groups=[group], columns=list(dict.fromkeys(columns.values())),
                                                  batch_size=64, use_threads=False):
                    for record in batch.to_pylist():
                        yield member_or_reject(f"{unit.shown}#{number}", lambda: _member(unit, columns, record, number, seen, earlier, max_bytes))
                        number += 1
            except Exception as exc:
                if watched.failed:
                    raise  # the bytes did not arrive: not the file's fault
                reason = f"row group {group} cannot be decoded ({type(exc).__name__}: {str(exc)[:200]})"
                for lost in range(number, end):
                    yield Member(reject=Reject(source=f"{unit.shown}#{lost}", reason=reason))
                number = end


class ReadWatch:
    """A file handle that remembers whether a read or seek of it failed: what tells a file that
    could not be read (a network fault, retried) from bytes that could not be decoded (a reject)."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.failed = False

    def read(self, *args: Any) -> bytes:
        return self._watched(self._fh.read, *args)

    def seek(self, *args: Any) -> int:
        return self._watched(self._fh.seek, *args)

    def _watched(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BaseException:
            self.failed = True
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def _member(unit: SourceUnit, columns: dict[str, str], record: dict[str, Any], number: int, seen: set[str],
            earlier: dict[str, str], max_bytes: int) -> Member:
    sample_id = row_id(record.get(columns["id"]) if "id" in columns else None, unit.id_prefix, number)
    source = f"{unit.shown}#{number}"
    data, path, problem = _media(record.get(columns["media"]), columns["media"], max_bytes)
    caption, bad_caption = caption_text(record.get(columns["caption"])) if "caption" in columns else ("", None)
    problem = problem or bad_caption or caption_problem(caption)
    if problem is None and not unit.allow_empty_caption and not has_visible_text(caption):
        problem = "empty caption: no visible text (set data.allow_empty_caption: true to allow it)"
    if problem is None and not safe_id(sample_id):
        problem = f"id {sample_id!r} is not a safe name (A-Z a-z 0-9 . _ : = + -)"
    if problem is None and (source in earlier or sample_id in seen):  # the planned duplicates; a safeguard
        problem = duplicate_reason(sample_id, earlier.get(source, "this row group"))
    seen.add(sample_id)
    if problem is not None:
        return Member(reject=Reject(source=source, reason=problem, sample_id=sample_id))
    modality = "video" if columns["media"] == "video" or modality_of(path or "") == "video" else "image"
    row = InputRow(sample_id=sample_id, uri=f"{unit.uri}#{number}", caption=caption, source=source, modality=modality, input=unit.shown)
    return Member(row=row, data=data)


def _media(value: Any, column: str, max_bytes: int) -> tuple[bytes | None, str | None, str | None]:
    """(bytes, path, why unusable) of a media cell: a {bytes, path} struct or plain binary."""
    path = None
    if isinstance(value, dict):
        path, value = value.get("path"), value.get("bytes")
        if value is None and path:
            return None, path, f"{column} holds only a path ({path!r}), no bytes; give a manifest with a path column to read files"
    if value is None:
        return None, path, f"null {column}"
    if not isinstance(value, bytes):
        return None, path, f"{column} is {type(value).__name__}, not bytes or {{bytes, path}}"
    if not value:
        return None, path, f"zero-byte {column}"
    if len(value) > max_bytes:
        return None, path, f"{column} is larger than data.max_input_bytes ({len(value):,} > {max_bytes:,} bytes)"
    return value, path, None


# (file version, column) -> (its media column, first row, media cells, bytes) of the row groups
# read last: rows are asked for in order, so a task's rows of one row group cost one read of its media
# column. Bounded in bytes (a row group of videos is large); the one read last is always kept.
_ROW_GROUPS: OrderedDict[tuple[Any, ...], list[tuple[str, int, list[Any], int]]] = OrderedDict()
_ROW_GROUPS_BYTES = 256 << 20
_ROW_LOCK = threading.Lock()


def read_parquet_row(where: Located, storage_options: dict[str, Any] | None, max_bytes: int) -> bytes:
    """The media bytes of row ``where.part`` (its number in the file) of a media Parquet file: a
    row group read already (of the file as it is now: one stat) is not read again."""
    if not (where.part.isascii() and where.part.isdigit()):
        raise MediaError(f"{where.part!r} is not a row number", redact_url(where.container))
    number = int(where.part)
    with as_media_errors(where.shown, is_local(where.container)):
        key = (*container_key(where.container, storage_options), where.column)
        with _file_lock(key):  # one reader of a file at a time: its row group is read once, other files' go on
            with _ROW_LOCK:
                kept = next((g for g in _ROW_GROUPS.get(key, ()) if g[1] <= number < g[1] + len(g[2])), None)
            if kept is None:
                kept = _row_group(where, storage_options, number)
                _keep(key, kept)
    column, first, cells, _ = kept
    data, _path, problem = _media(cells[number - first], column, max_bytes)
    if problem is not None or data is None:
        raise MediaError(problem or f"null {column}", where.shown)
    return data


_FILE_LOCKS: dict[tuple[Any, ...], threading.Lock] = {}


def _file_lock(key: tuple[Any, ...]) -> threading.Lock:
    with _ROW_LOCK:
        if len(_FILE_LOCKS) > 64:  # the files of a few tasks at most; a lock held now is not lost (its holder has it)
            _FILE_LOCKS.clear()
        return _FILE_LOCKS.setdefault(key, threading.Lock())


def _keep(key: tuple[Any, ...], group: tuple[str, int, list[Any], int]) -> None:
    with _ROW_LOCK:
        groups = _ROW_GROUPS.setdefault(key, [])
        groups[:] = [g for g in groups if g[1] != group[1]] + [group]
        _ROW_GROUPS.move_to_end(key)
        while sum(g[3] for gs in _ROW_GROUPS.values() for g in gs) > _ROW_GROUPS_BYTES:
            oldest = next(iter(_ROW_GROUPS))
            if oldest == key and len(_ROW_GROUPS[key]) == 1:
                break  # the one just read
            if len(_ROW_GROUPS[oldest]) > 1:
                _ROW_GROUPS[oldest].pop(0)
            else:
                del _ROW_GROUPS[oldest]


def _row_group(where: Located, storage_options: dict[str, Any] | None, number: int) -> tuple[str, int, list[Any], int]:
    """(media column, first row, its cells, their bytes) of the row group holding row ``number``:
    the footer, then that row group's media column only."""
    import pyarrow.parquet as pq

    with open_input(where.container, storage_options) as fh:
        try:
            parquet = pq.ParquetFile(fh, pre_buffer=False)
            names = parquet.metadata.schema.to_arrow_schema().names
            column = where.column or next((c for c in MEDIA_COLUMNS if c in names), None)
            if column is None or column not in names:
                raise MediaError(f"no media column {where.column or MEDIA_COLUMNS} (columns: {names})", redact_url(where.container))
            first = 0
            for group in range(parquet.metadata.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if number < first + rows:
                    cells = parquet.read_row_group(group, columns=[column], use_threads=False).column(column)
                    return column, first, cells.to_pylist(), cells.nbytes
                first += rows
        except MediaError:
            raise
        except ValueError as exc:  # pyarrow's ArrowInvalid: not Parquet, or a corrupt row group
            raise MediaError(f"not a valid parquet file ({exc})", redact_url(where.container)) from None
    raise MediaError(f"row {number} is not in the file (it has {first} rows)", redact_url(where.container))


register(InputSource(name="parquet", suffixes=(".parquet",), read=read_parquet, stream=stream_parquet, batches=parquet_batches,
                     member=read_parquet_row))
