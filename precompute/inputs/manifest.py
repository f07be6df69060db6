"""Input manifests and folders for ``mmcache encode``, read whole (``read_inputs``): a JSONL, CSV or
Parquet manifest with ``path`` and ``caption`` columns, or a folder of media with same-stem ``.txt``
captions (walked without leaving its root; a feature store inside it is not media). The reader of
folders, LLaVA arrays and the trainer's live manifests; a job's manifests are streamed instead
(``inputs.file_sources``). Formats and containment rules: docs/design/encode.md, "Input manifests"."""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
from collections.abc import Iterable, Iterator
from typing import IO, Any

from ...featstore.errors import FeatstoreError, NotAStoreError
from ...featstore.format import MANIFEST_KEY, parse_root_group
from ...featstore.index import read_parquet
from ...featstore.retry import protocol_of, remote_filesystem, with_retries
from ...featstore.secrets import redact_url
from .row_rules import _LOCAL_PROTOCOLS, WALK_PROBLEM, _rows, _Rules, local_file_problem
from .rows import EmptyInputError, InputRow, ManifestError, Reject, caption_of_bytes
from ...featstore.local_storage import under_root
from .source_bytes import DEFAULT_MAX_INPUT_BYTES, InputFileError, read_local_file

MAX_CAPTION_BYTES = 1 << 20
_MANIFEST_BYTES = 64 << 20  # a store manifest read to tell a store folder from media (see _is_store)


def read_inputs(
    input_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_empty_caption: bool = False,
    allow_outside_root: bool = False,
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
    allow_empty: bool = False,
    allow_text_only: bool = False,
) -> tuple[list[InputRow], list[Reject]]:
    """Parse INPUT into usable rows and rejects, in manifest order. An input with no rows at all
    raises ``EmptyInputError`` unless ``allow_empty``. ``allow_text_only``: rows without a path
    but with text are text-only samples (else they are rejects)."""
    fs, path = remote_filesystem(input_url, storage_options)
    protocol = protocol_of(fs)
    shown = redact_url(str(input_url))
    if not with_retries(lambda: fs.exists(path), shown, "stat"):
        raise ManifestError(f"input {shown!r} does not exist")
    is_folder = with_retries(lambda: fs.isdir(path), shown, "stat")
    root = path.rstrip("/") if is_folder else posixpath.dirname(path)
    local = protocol in _LOCAL_PROTOCOLS
    rules = _Rules(root=root, real_root=os.path.realpath(root) if local else None, protocol=protocol,
                   allow_outside_root=allow_outside_root, max_input_bytes=max_input_bytes)
    rejects: list[Reject] = []
    if is_folder:
        records = _local_folder_records(rules, rejects) if local else with_retries(lambda: _folder_records(fs, root), shown, "list")
    else:
        records = _manifest_records(fs, path, shown, local)
    if not records and not rejects and not allow_empty:
        kind = "folder holds no media files" if is_folder else "manifest has no rows"
        raise EmptyInputError(f"input {shown!r}: the {kind}; nothing to encode (pass --allow-empty to accept an empty input)")
    rows = _rows(records, rules, allow_empty_caption, allow_text_only, rejects)
    return rows, rejects


def rows_from_records(records: list[dict[str, Any]], root_url: str, *, storage_options: dict[str, Any] | None = None,
                      allow_empty_caption: bool = False, allow_outside_root: bool = False,
                      max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES, allow_text_only: bool = False) -> tuple[list[InputRow], list[Reject]]:
    """Manifest-like records (path, caption, conversations, id) whose paths are relative to the
    folder ``root_url``, checked by the manifest's rules (a LLaVA JSON array's rows)."""
    fs, root = remote_filesystem(root_url, storage_options)
    protocol = protocol_of(fs)
    local = protocol in _LOCAL_PROTOCOLS
    rules = _Rules(root=posixpath.normpath(root), real_root=os.path.realpath(root) if local else None, protocol=protocol,
                   allow_outside_root=allow_outside_root, max_input_bytes=max_input_bytes)
    rejects: list[Reject] = []
    return _rows(records, rules, allow_empty_caption, allow_text_only, rejects), rejects


def _manifest_records(fs: Any, path: str, input_url: str, local: bool) -> list[dict[str, Any]]:
    suffix = posixpath.splitext(path.lower())[1]
    if suffix not in (".jsonl", ".ndjson", ".csv", ".parquet"):
        raise ManifestError(f"input {input_url!r}: expected a .jsonl, .csv or .parquet manifest, or a folder of media")

    def fetch() -> bytes:
        with fs.open(path, "rb") as fh:
            return fh.read()

    try:
        raw = read_local_file(path) if local else with_retries(fetch, input_url, "read")
    except InputFileError as exc:
        raise ManifestError(f"input {input_url!r}: {exc.reason}") from None
    if suffix == ".parquet":
        try:  # featstore's reader starts no Arrow thread (one alive at exit can abort the process)
            records = read_parquet(raw).to_pylist()
        except ValueError as exc:  # pyarrow's ArrowInvalid
            raise ManifestError(f"input {input_url!r} is not a valid parquet file: {exc}") from None
    else:
        try:
            text = raw.decode("utf-8-sig")  # Excel's "CSV UTF-8" starts with a byte-order mark
        except UnicodeDecodeError as exc:
            raise ManifestError(f"input {input_url!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
        records = _csv_records(text, input_url) if suffix == ".csv" else _jsonl_records(text, input_url)
    if records and not isinstance(records[0], dict):
        raise ManifestError(f"input {input_url!r}: every row must be an object with path and caption")
    if records and not any("path" in record for record in records):
        raise ManifestError(
            f"input {input_url!r}: no 'path' column (columns: {sorted(records[0])}); "
            "text-only rows leave their path empty, but the column must be there"
        )
    return records


def _jsonl_records(text: str, input_url: str) -> list[dict[str, Any]]:
    return list(jsonl_records(text.splitlines(), input_url))


def jsonl_records(lines: Iterable[str], input_url: str, first: int = 1) -> Iterator[dict[str, Any]]:
    """The objects of a JSONL manifest's lines (the first numbered ``first``), as they are read; a
    bad line stops it (ManifestError)."""
    for number, line in enumerate(lines, start=first):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"input {input_url!r}, line {number}: not valid JSON ({exc.msg} at column {exc.colno}); fix that line") from None
        except RecursionError:
            raise ManifestError(f"input {input_url!r}, line {number}: JSON nested deeper than Python's parser can read; fix that line") from None
        if not isinstance(record, dict):
            raise ManifestError(f"input {input_url!r}, line {number}: expected an object with path and caption, got {type(record).__name__}")
        yield record


def _csv_records(text: str, input_url: str) -> list[dict[str, Any]]:
    return list(csv_records(io.StringIO(text), input_url))


def csv_records(text: IO[str], input_url: str) -> Iterator[dict[str, Any]]:
    """The rows of a CSV manifest (opened with ``newline=""``), as they are read."""
    # A cell is bounded by the manifest's own size limit, not by csv's 128 KiB default: a long
    # caption or conversation is judged (and cut) by the caption rules, never a whole-job error.
    csv.field_size_limit(max(csv.field_size_limit(), (1 << 31) - 1))
    reader = csv.DictReader(text)
    try:
        yield from reader
    except csv.Error as exc:
        # line_num counts the lines read whole: the one that failed is the next.
        raise ManifestError(f"input {input_url!r}, line {reader.line_num + 1}: not valid CSV ({exc}); fix that line") from None


def _local_folder_records(rules: _Rules, rejects: list[Reject]) -> list[dict[str, Any]]:
    """Media files under a local folder, walked without leaving it: a linked folder that resolves
    outside the root is not entered (a reject says so), a link loop is entered once."""
    root, records, visited = rules.root, [], set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        subfolders.sort()
        real = os.path.realpath(folder)
        if real in visited:
            subfolders[:] = []  # a link back to a folder already walked
            continue
        visited.add(real)
        # A feature store (this job's output, written inside its input) is not media. Only a
        # folder that lists a zarr.json is read to tell: no extra request per folder walked.
        manifest = os.path.join(folder, MANIFEST_KEY)
        if folder != root and MANIFEST_KEY in files and _is_store(lambda: read_local_file(manifest, _MANIFEST_BYTES), folder):
            subfolders[:] = []
            continue
        inside = []
        for name in subfolders:
            sub = os.path.join(folder, name)
            if rules.allow_outside_root or under_root(os.path.realpath(sub), rules.real_root):
                inside.append(name)
            else:
                rejects.append(Reject(source=os.path.relpath(sub, root) + "/", reason="folder resolves outside the input root (a symlink?); set data.allow_outside_root: true to follow it"))
        subfolders[:] = inside
        captions = {os.path.splitext(f)[0] for f in files if f.lower().endswith(".txt")}
        for name in sorted(files):
            if name.lower().endswith(".txt") or name.startswith("."):
                continue
            stem = os.path.splitext(name)[0]
            record = {"path": os.path.relpath(os.path.join(folder, name), root), "caption": ""}
            if stem in captions:
                record.update(_local_caption(os.path.join(folder, stem + ".txt"), rules))
            records.append(record)
    return sorted(records, key=lambda r: r["path"])


def _is_store(read_manifest, where: str) -> bool:
    """Whether a folder walked as input is an mmcache feature store (its zarr.json is a store
    manifest, damaged or not): its objects are not media. A store written inside the folder given
    as input is otherwise walked by the next run, each of its objects a reject."""
    try:
        parse_root_group(read_manifest(), where)
    except (OSError, InputFileError, NotAStoreError):
        return False  # no zarr.json (or not a regular file), or another zarr's
    except FeatstoreError:
        return True  # a store, damaged or newer than this code: still not media
    return True


def _local_caption(path: str, rules: _Rules) -> dict[str, str]:
    """The caption from a same-stem .txt file, read under the same rules as the media."""
    problem = local_file_problem(path, _Rules(**{**rules.__dict__, "max_input_bytes": MAX_CAPTION_BYTES}))
    if problem is None:
        try:
            caption, problem = caption_of_bytes(read_local_file(path, MAX_CAPTION_BYTES), "it")
            if problem is None:
                return {"caption": caption}
        except InputFileError as exc:
            problem = exc.reason
        except OSError as exc:
            problem = f"unreadable ({exc.strerror})"
    return {WALK_PROBLEM: f"caption file {os.path.basename(path)}: {problem}"}


def _folder_records(fs: Any, root: str) -> list[dict[str, Any]]:
    """Media files under a remote ``root`` with a same-stem .txt caption beside each (a missing
    .txt is an empty caption, which is then allowed or rejected by config)."""
    files = sorted(fs.find(root))
    stores = [posixpath.dirname(f) + "/" for f in files if posixpath.basename(f) == MANIFEST_KEY
              and _is_store(lambda f=f: fs.cat_file(f), posixpath.dirname(f))]
    files = [f for f in files if not any(f.startswith(store) for store in stores)]
    texts = {posixpath.splitext(f)[0]: f for f in files if f.lower().endswith(".txt")}
    records = []
    for file in files:
        if file.lower().endswith(".txt") or posixpath.basename(file).startswith("."):
            continue
        caption_file = texts.get(posixpath.splitext(file)[0])
        caption, problem = caption_of_bytes(fs.cat_file(caption_file), "it") if caption_file else ("", None)
        records.append({"path": posixpath.relpath(file, root), "caption": caption,
                        **({WALK_PROBLEM: f"caption file {posixpath.basename(caption_file)}: {problem}"} if problem else {})})
    return records
