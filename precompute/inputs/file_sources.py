"""Today's two inputs as registry entries: a manifest (JSONL, CSV, or Parquet with a ``path``
column) and a folder of media with same-stem ``.txt`` captions. A folder is walked on the client
by ``precompute.inputs`` (its rules: contained paths, regular files, sizes). A manifest is
streamed (a Parquet one through ``parquet_media``, which tells it from a media file): read in batches of ``BATCH_ROWS`` records, again for each planning pass
(``precompute.planning.survey``), its rows' files checked by the task that reads each, so planning holds
one batch of rows, not the job's, and stats no file."""

from __future__ import annotations

import io
import itertools
import json
import posixpath
from collections.abc import Iterator
from typing import Any

from ...featstore.retry import protocol_of, remote_filesystem, with_retries
from ...featstore.secrets import redact_url
from .manifest import csv_records, jsonl_records, read_inputs
from .registry import InputSource, SourceOptions, SourceRead, open_input, register
from .row_rules import record_rows, stream_rules
from .rows import EmptyInputError, ManifestError
from .source_bytes import InputFileError

# Records parsed into rows at a time: a few MB of rows, and few enough batches that their overhead is nil.
BATCH_ROWS = 10_000


def read_rows(url: str, options: SourceOptions) -> SourceRead:
    rows, rejects = read_inputs(url, storage_options=options.storage_options, allow_empty_caption=options.allow_empty_caption,
                                allow_outside_root=options.allow_outside_root, max_input_bytes=options.max_input_bytes,
                                allow_empty=options.allow_empty, allow_text_only=options.allow_text_only)
    return SourceRead(rows=rows, rejects=rejects)


def manifest_batches(url: str, options: SourceOptions, build: bool = True) -> Iterator[SourceRead]:
    """A JSONL or CSV manifest's rows (``RowKey``s unless ``build``) and rejects, ``BATCH_ROWS``
    records at a time, in order.
    Errors of the manifest itself (not UTF-8, a bad line, no ``path`` column, no rows) raise
    ``ManifestError`` as ``read_inputs``'s do, once the batch or the manifest that shows them is read."""
    fs, path = remote_filesystem(url, options.storage_options)
    protocol = protocol_of(fs)
    shown = redact_url(url)
    if not with_retries(lambda: fs.exists(path), shown, "stat"):
        raise ManifestError(f"input {shown!r} does not exist")
    rules = stream_rules(posixpath.dirname(path), protocol, allow_outside_root=options.allow_outside_root,
                         max_input_bytes=options.max_input_bytes, input=shown, build=build)
    count, has_path = 0, False
    try:
        with open_input(url, options.storage_options) as raw:
            for batch in _record_batches(raw, path.lower(), shown):
                count += len(batch)
                has_path = has_path or any("path" in record for record in batch)
                rows, rejects = record_rows(batch, rules, allow_empty_caption=options.allow_empty_caption,
                                            allow_text_only=options.allow_text_only)
                yield SourceRead(rows=rows, rejects=rejects)
    except UnicodeDecodeError as exc:
        raise ManifestError(f"input {shown!r} is not UTF-8 text ({exc.reason}); save it as UTF-8") from None
    except InputFileError as exc:
        raise ManifestError(f"input {shown!r}: {exc.reason}") from None
    if not count and not options.allow_empty:
        raise EmptyInputError(f"input {shown!r}: the manifest has no rows; nothing to encode (pass --allow-empty to accept an empty input)")
    if count and not has_path:
        raise ManifestError(f"input {shown!r}: no 'path' column; text-only rows leave their path empty, but the column must be there")


def _record_batches(raw: Any, path: str, shown: str) -> Iterator[list[dict]]:
    if path.endswith(".parquet"):
        return _parquet_batches(raw, shown)
    text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")  # Excel's "CSV UTF-8" starts with a byte-order mark
    return _csv_batches(text, shown) if path.endswith(".csv") else _jsonl_batches(text, shown)


def _parquet_batches(raw: Any, shown: str) -> Iterator[list[dict]]:
    """A Parquet manifest's records, ``BATCH_ROWS`` at a time (never the whole table)."""
    import pyarrow.parquet as pq

    try:
        # No Arrow thread: one alive at exit can abort the process (featstore.index.parquet_file).
        batches = pq.ParquetFile(raw, pre_buffer=False).iter_batches(batch_size=BATCH_ROWS, use_threads=False)
        for batch in batches:
            yield batch.to_pylist()
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid
        raise ManifestError(f"input {shown!r} is not a valid parquet file: {exc}") from None


def _csv_batches(text: io.TextIOBase, shown: str) -> Iterator[list[dict]]:
    records = csv_records(text, shown)  # type: ignore[arg-type]
    while batch := list(itertools.islice(records, BATCH_ROWS)):
        yield batch


def _jsonl_batches(text: io.TextIOBase, shown: str) -> Iterator[list[dict]]:
    """A JSONL manifest's records, ``BATCH_ROWS`` lines at a time, each batch parsed by one
    ``json.loads`` of the lines joined into an array (a third of a per-line parse's time); a
    batch that does not parse so is parsed line by line, which names the bad line."""
    first = 1
    while lines := list(itertools.islice(text, BATCH_ROWS)):
        filled = [line for line in lines if line.strip()]
        try:
            records = json.loads("[" + ",".join(filled) + "]")
        except (json.JSONDecodeError, RecursionError):  # parsed line by line below: the bad line is named
            records = None
        if records is None or len(records) != len(filled) or not all(isinstance(r, dict) for r in records):
            records = list(jsonl_records(lines, shown, first=first))
        first += len(lines)
        yield records


MANIFEST = register(InputSource(name="manifest", suffixes=(".jsonl", ".ndjson", ".csv"), read=read_rows, batches=manifest_batches))
FOLDER = register(InputSource(name="folder", suffixes=("/",), read=read_rows))
