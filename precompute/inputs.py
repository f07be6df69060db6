"""Input manifests for ``mmcache encode``: what to encode, checked before any work starts.

INPUT is a JSONL, CSV or Parquet manifest with columns ``path`` and ``caption`` (optional
``id``; ``start`` / ``end``: a video row's span in seconds; ``conversations``: LLaVA-style turns ``[{"from": "human"|"gpt", "value": ...}]``, a list
in JSONL or Parquet, a JSON string in CSV; a row with conversations needs no caption), or a
folder of media with same-stem ``.txt`` captions (the kohya / SimpleTuner convention). Paths
are relative to the manifest's folder, absolute, or any fsspec URL. With ``allow_text_only`` (an
LLM's tokenizer is the text encoder), a manifest row whose path is empty or null but which has
a caption or conversations is a *text-only* sample (modality ``text``, no media; its id is the
``id`` column, else ``text-`` + a hash of its text). Rows that cannot be used
(duplicate id, a path escaping the root, an empty caption when not allowed) become rejects with
a reason; they never stop the job.

Local inputs are contained: the *resolved* path of every file (and of every folder a folder
input walks) must lie under the input root unless ``data.allow_outside_root``, so a symlink
cannot smuggle ``/etc/passwd`` into a store; only regular files are opened (a FIFO would block
the encode forever, ``/dev/zero`` would fill memory), and a file over ``data.max_input_bytes``
is rejected before it is read.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import math
import os
import posixpath
import re
import unicodedata
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator
from typing import IO, Any, NamedTuple

from mmcache.featstore.errors import ConfigError, FeatstoreError, NotAStoreError, SchemaError
from mmcache.featstore.format import MANIFEST_KEY, check_name, parse_root_group
from mmcache.featstore.index import read_parquet
from mmcache.featstore.retry import protocol_of, remote_filesystem, with_retries
from mmcache.featstore.secrets import redact_url
from mmcache.precompute.sources import DEFAULT_MAX_INPUT_BYTES, OUTSIDE_ROOT, InputFileError, read_local_file, stat_problem, under_root

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v"}
MAX_CAPTION_BYTES = 1 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9._:=+-]")
# A relative path that normpath leaves as it is: no '.' or '..' part, no empty part.
_PLAIN = re.compile(r"[^/.][^/]*(?:/[^/.][^/]*)*")
# Unicode category Cc (C0 and C1 controls, DEL) but tab, newline and carriage return.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_LOCAL_PROTOCOLS = ("file", "local")
WALK_PROBLEM = "\0problem"  # a record key no manifest column has: a problem found walking a folder
_MANIFEST_BYTES = 64 << 20  # a store manifest read to tell a store folder from media (see _is_store)


class ManifestError(ConfigError):
    """The input manifest itself cannot be read (not the rows in it: those become rejects)."""


class EmptyInputError(ManifestError):
    """The input holds no rows at all (an empty folder or manifest)."""


@dataclass(frozen=True, kw_only=True)
class InputRow:
    sample_id: str
    uri: str = field(repr=False)  # absolute: a local path or a URL fsspec opens (may be signed: never in reprs)
    caption: str
    source: str       # the path as the manifest wrote it, for rejects and provenance
    modality: str     # "image" | "video", from the suffix; "text": a text-only row (no media, uri "")
    # The resolved input root a local file must lie under, checked where the file is read (None:
    # not checked: a remote file, or data.allow_outside_root). Shared by a manifest's rows.
    root: str | None = field(default=None, repr=False)
    conversations: tuple[tuple[str, str], ...] | None = None  # ((from, value), ...) turns
    metadata: str | None = None  # a WebDataset sample's .json sidecar (JSON text), kept with the sample
    input: str = ""  # the --input it came from (manifest, folder, tar, Parquet file), shown: `mmcache info` counts by it
    start: float | None = None  # a video row's span in seconds (manifest columns start / end): frames at start <= t < end
    end: float | None = None
    # Where a tar member's data lies in its tar (bytes from the start of the uncompressed stream;
    # recorded as source_offset / source_size, read again alone by input_sources.located). None:
    # a file of its own, a Parquet row (its number is in ``uri``), or a sample recorded before offsets.
    offset: int | None = None
    size: int | None = None
    # A committed sample's: the sha256 of the media it was encoded from. A field added to it must
    # come from the same bytes (precompute.tasks), else the sample would mix two inputs.
    content_hash: str | None = None
    # A committed clip sample's (``frames.clips``): the frames it was encoded from. A field added
    # to it is made from that clip (precompute.tasks), checked, not from every clip of its video.
    frames: tuple[int, ...] | None = None

    @property
    def conversations_sha256(self) -> str | None:
        """What the store records of the turns, so a re-run can tell that they were edited."""
        return conversations_digest(self.conversations)


class RowKey(NamedTuple):
    """What planning's first pass keeps of a usable row (``precompute.survey``): building the
    whole ``InputRow`` (a frozen dataclass: ~4 us) would be a fifth of that pass's time. Its
    caption and turns are there for that pass to tell a committed row edited since
    (``precompute.stale``), without a pass of its own."""

    sample_id: str
    source: str
    modality: str
    caption: str | None = None
    conversations: tuple[tuple[str, str], ...] | None = None

    @property
    def conversations_sha256(self) -> str | None:
        return conversations_digest(self.conversations)

    @classmethod
    def of(cls, row: InputRow) -> RowKey:
        return cls(row.sample_id, row.source, row.modality, row.caption, row.conversations)


def conversations_digest(turns: tuple[tuple[str, str], ...] | None) -> str | None:
    if turns is None:
        return None
    return hashlib.sha256(json.dumps([list(t) for t in turns], ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Reject:
    source: str
    reason: str
    sample_id: str | None = None


def modality_of(path: str) -> str | None:
    if "://" in path:
        path = path.split("?", 1)[0]  # a URL's query (a signature, say) is not its suffix
    # posixpath.splitext's suffix (leading dots are the name's), without its cost: once a row.
    name = path[path.rfind("/") + 1 :].lstrip(".")
    suffix = name[name.rfind(".") :].lower() if "." in name else ""
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    return None


@dataclass(frozen=True, kw_only=True)
class _Rules:
    root: str                 # the input root as given (manifest folder or input folder)
    real_root: str | None     # its resolved real path when local
    protocol: str
    allow_outside_root: bool
    max_input_bytes: int
    # Whether reading the rows stats each local file here (a folder walk, the trainer's live
    # manifest); a streamed manifest leaves the check to the task that reads the file.
    check_files: bool = True
    input: str = ""  # the --input rows come from, shown (InputRow.input)
    build: bool = True  # False: a usable row is only its RowKey (planning's first pass)

    @functools.cached_property
    def plain_root(self) -> bool:
        """Whether ``root`` is a normal path that a plain relative path is simply appended to."""
        return len(self.root) > 1 and self.root == posixpath.normpath(self.root)


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


def stream_rules(root: str, protocol: str, *, allow_outside_root: bool, max_input_bytes: int, input: str, build: bool = True) -> _Rules:
    """The rules a streamed manifest's rows are read by: as ``read_inputs``'s, but its local files
    are checked by the task that reads each (``InputRow.root``), not stat'ed here."""
    local = protocol in _LOCAL_PROTOCOLS
    return _Rules(root=root, real_root=os.path.realpath(root) if local else None, protocol=protocol,
                  allow_outside_root=allow_outside_root, max_input_bytes=max_input_bytes, check_files=False, input=input, build=build)


def record_rows(records: list[dict[str, Any]], rules: _Rules, *, allow_empty_caption: bool,
                allow_text_only: bool) -> tuple[list[Any], list[Reject]]:
    """Rows of manifest records (``RowKey``s unless ``rules.build``), each judged on its own:
    duplicate ids across records are the planner's to find (``precompute.survey``), with a
    compact structure rather than a set of ids."""
    rows: list[Any] = []
    rejects: list[Reject] = []
    for record in records:
        row = _row(record, rules, allow_empty_caption, _NO_IDS, allow_text_only)
        if isinstance(row, Reject):
            rejects.append(row)
        else:
            rows.append(row if rules.build or isinstance(row, RowKey) else RowKey.of(row))
    return rows, rejects


_NO_IDS: set[str] = set()  # never written: record_rows leaves duplicate ids to the planner


def _rows(records: list[dict[str, Any]], rules: _Rules, allow_empty_caption: bool, allow_text_only: bool, rejects: list[Reject]) -> list[InputRow]:
    rows: list[InputRow] = []
    seen: set[str] = set()
    for record in records:
        row = _row(record, rules, allow_empty_caption, seen, allow_text_only)
        assert not isinstance(row, RowKey), "read_inputs builds whole rows"
        if isinstance(row, Reject):
            rejects.append(row)
        else:
            seen.add(row.sample_id)
            rows.append(row)
    return rows


def _row(record: dict[str, Any], rules: _Rules, allow_empty_caption: bool, seen: set[str], allow_text_only: bool = False) -> InputRow | RowKey | Reject:
    raw = record.get("path")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        if allow_text_only:
            return _text_row(record, seen, rules)
        given = str(record["id"]) if record.get("id") not in (None, "") else None
        return Reject(source=str(raw) if given is None else f"text:{given}", sample_id=given,
                      reason="row has no path (text-only rows need the tokenizer text encoder)")
    if not isinstance(raw, str):
        return Reject(source=str(raw), reason="row has no path")
    # A signed URL is fetched as given, but only shown (ids, rejects, provenance) without
    # its signature: the credential must not end up in the store.
    source = redact_url(raw) if "://" in raw else raw
    caption, bad_caption = caption_text(record.get("caption"))
    sample_id = str(record["id"]) if record.get("id") not in (None, "") else sample_id_for(source)
    uri = _resolve(raw, rules)
    conversations, bad_conversations = _conversations(record.get("conversations"))
    # A row with conversations needs no caption: its text is the turns.
    modality = modality_of(source)
    reason = (record.get(WALK_PROBLEM) or bad_caption or bad_conversations
              or _row_problem(uri, source, modality, caption, sample_id, rules, allow_empty_caption or conversations is not None, seen))
    span, bad_span = _span(record, modality)
    if reason or bad_span or uri is None or modality is None:
        return Reject(source=source, reason=reason or bad_span or "unusable row", sample_id=sample_id)
    contained = rules.real_root if rules.real_root is not None and not rules.allow_outside_root and "://" not in uri else None
    if not rules.build:
        return RowKey(sample_id, source, modality, caption, conversations)
    return InputRow(sample_id=sample_id, uri=uri, caption=caption, source=source, modality=modality, conversations=conversations,
                    start=span[0], end=span[1], root=contained, input=rules.input)


def _span(record: dict[str, Any], modality: str | None) -> tuple[tuple[float | None, float | None], str | None]:
    """A row's ``start`` / ``end`` columns (seconds, a video's span), or why they are unusable."""
    if "start" not in record and "end" not in record:
        return (None, None), None
    span: list[float | None] = []
    for key in ("start", "end"):
        value = record.get(key)
        if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
            span.append(None)  # absent (a CSV's empty cell, a Parquet null: NaN in a float column)
            continue
        try:
            seconds = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            return (None, None), f"{key} {str(value)[:40]!r} is not a time in seconds >= 0"
        span.append(seconds)
    start, end = span
    if (start is not None or end is not None) and modality != "video":
        return (None, None), "start / end restrict videos only; leave them empty for this row"
    if start is not None and end is not None and end <= start:
        return (None, None), f"end {end:g}s is not after start {start:g}s"
    return (start, end), None


def _text_row(record: dict[str, Any], seen: set[str], rules: _Rules) -> InputRow | Reject:
    """A row without media: a caption or conversations for the LLM alone."""
    caption, bad_caption = caption_text(record.get("caption"))
    conversations, bad_conversations = _conversations(record.get("conversations"))
    text = json.dumps([caption, [list(t) for t in conversations or ()]], ensure_ascii=False)
    given = record.get("id") not in (None, "")
    sample_id = str(record["id"]) if given else f"text-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    source = f"text:{sample_id}"  # what rejects and re-runs know the row by
    reason = bad_caption or bad_conversations
    if reason is None and conversations is None and not has_visible_text(caption):
        reason = "row has no path and no text (a text-only row needs a caption or conversations)"
    reason = reason or caption_problem(caption)
    if reason is None and sample_id in seen:
        reason = f"duplicate id {sample_id!r}" + ("" if given else " (the same text twice: give the rows ids)")
    if reason is None and not safe_id(sample_id):
        reason = f"id {sample_id!r} is not a safe name (A-Z a-z 0-9 . _ : = + -)"
    if reason:
        return Reject(source=source, reason=reason, sample_id=sample_id)
    return InputRow(sample_id=sample_id, uri="", caption=caption, source=source, modality="text", conversations=conversations, input=rules.input)


def _row_problem(uri: str | None, source: str, modality: str | None, caption: str, sample_id: str, rules: _Rules, allow_empty_caption: bool,
                 seen: set[str]) -> str | None:
    if uri is None:
        return "path escapes the input root (set data.allow_outside_root: true to allow it)"
    if rules.check_files and rules.real_root is not None and "://" not in uri and (problem := local_file_problem(uri, rules)):
        return problem  # first: what a file is decides before anything about the row
    if not has_visible_text(caption) and not allow_empty_caption:
        return "empty caption: no visible text (set data.allow_empty_caption: true to allow it)"
    if (problem := caption_problem(caption)) is not None:
        return problem
    if sample_id in seen:
        return f"duplicate id {sample_id!r}"
    if modality is None:
        return f"unsupported file type {posixpath.splitext(source)[1] or '(none)'!r}"
    if not safe_id(sample_id):
        return f"id {sample_id!r} is not a safe name (A-Z a-z 0-9 . _ : = + -)"
    return None


def caption_text(value: Any) -> tuple[str, str | None]:
    """(the caption, why it is not one): a caption is a string, or absent. A number, list or
    dict is refused rather than encoded from its Python repr (``['a', 'list']``)."""
    if value is None or isinstance(value, str):
        return value or "", None
    return "", f"caption {str(value)[:40]!r} is not text but {type(value).__name__}: write captions as strings"


def has_visible_text(caption: str) -> bool:
    """Whether a caption has a character a reader would see: whitespace, zero-width and other
    format characters (U+200B, U+FEFF, ...) alone are an empty caption."""
    if caption[:1].isalnum():
        return True  # a letter or digit first (most captions): no need to look further
    return any(not char.isspace() and unicodedata.category(char) not in ("Cc", "Cf", "Zs", "Zl", "Zp") for char in caption)


def caption_problem(caption: str) -> str | None:
    """Captions with NUL or other control characters are rejected, not cleaned: silently
    editing a caption would train on text nobody wrote. Tab, newline and carriage return are
    ordinary whitespace and allowed."""
    # One regex search, not a category lookup per character (a quarter of planning's time).
    found = _CONTROL.search(caption)
    if found is None:
        return None
    return (f"caption has a control character U+{ord(found.group()):04X} at position {found.start()}; "
            "remove it from the caption (tab and newline are allowed)")


def _conversations(value: Any) -> tuple[tuple[tuple[str, str], ...] | None, str | None]:
    """A manifest's conversations cell -> ((from, value), ...) turns, or a reject reason."""
    if value is None or value == "":
        return None, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            return None, f"conversations is not valid JSON ({exc})"
    if not isinstance(value, list) or not value:
        return None, "conversations must be a non-empty list of {from, value} turns"
    turns = []
    for turn in value:
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
            return None, f"conversation turn {str(turn)[:60]!r} is not {{from: str, value: str}}"
        turns.append((turn["from"], turn["value"]))
    return tuple(turns), None


def sample_id_for(path: str) -> str:
    """A stable, safe sample id from a path: readable when the path maps to one unambiguously,
    otherwise the readable part plus a hash of the whole path. '/' becomes ':', so a path that
    itself holds ':' (or anything else that is changed or dropped) gets the hash: ``a/b.png`` is
    ``a:b.png`` and ``a:b.png`` is ``a:b.png-<hash>``."""
    text = path.strip()
    text = text[2:] if text.startswith("./") else text
    readable = text.replace("/", ":")
    safe = _UNSAFE.sub("_", readable).strip("._:=+-")[:180] or "sample"
    if safe != readable or ":" in text or not safe[0].isalnum():
        safe = f"{safe}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    return safe


def local_file_problem(path: str, rules: _Rules) -> str | None:
    """Why the local file at ``path`` must not be encoded (escapes the root, not a regular file,
    too large), or None. A missing file is left to the task, which rejects it when it reads."""
    if not rules.allow_outside_root and not under_root(os.path.realpath(path), rules.real_root):
        return OUTSIDE_ROOT
    try:
        return stat_problem(os.stat(path), rules.max_input_bytes)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot stat the file ({exc.strerror})"


def safe_id(sample_id: str) -> bool:
    # The store's own rule, so a row that passes here is never refused by the writer.
    try:
        check_name("sample id", sample_id)
    except SchemaError:
        return False
    return True


def _resolve(source: str, rules: _Rules) -> str | None:
    if "://" in source or source.startswith("/"):
        return source if rules.allow_outside_root else None
    if rules.plain_root and _PLAIN.fullmatch(source):
        joined = f"{rules.root}/{source}"  # what normpath(join) gives a plain relative path, in a tenth of its time
    else:
        joined = posixpath.normpath(posixpath.join(rules.root, source))
    if not rules.allow_outside_root and not under_root(joined, rules.root):
        return None
    return joined if rules.protocol in _LOCAL_PROTOCOLS else f"{rules.protocol}://{joined}"


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
        if not isinstance(record, dict):
            raise ManifestError(f"input {input_url!r}, line {number}: expected an object with path and caption, got {type(record).__name__}")
        yield record


def _csv_records(text: str, input_url: str) -> list[dict[str, Any]]:
    return list(csv_records(io.StringIO(text), input_url))


def csv_records(text: IO[str], input_url: str) -> Iterator[dict[str, Any]]:
    """The rows of a CSV manifest (opened with ``newline=""``), as they are read."""
    reader = csv.DictReader(text)
    try:
        yield from reader
    except csv.Error as exc:
        raise ManifestError(f"input {input_url!r}, line {reader.line_num}: not valid CSV ({exc}); fix that line") from None


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
            return {"caption": read_local_file(path, MAX_CAPTION_BYTES).decode("utf-8-sig", errors="replace").strip()}
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
        caption = fs.cat_file(caption_file).decode("utf-8-sig", errors="replace").strip() if caption_file else ""
        records.append({"path": posixpath.relpath(file, root), "caption": caption})
    return records
