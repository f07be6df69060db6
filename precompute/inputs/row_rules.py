"""Manifest records -> rows, by the rules of the input they come from (``_Rules``: its root,
containment, sizes): paths resolved under the root, local files checked, captions, conversations
and video spans judged. A record that cannot be used becomes a ``Reject`` with its reason; it never
stops the job. Shared by the whole-input reader (``inputs.manifest``) and the streamed manifest
source (``inputs.file_sources``). The rules themselves: docs/design/encode.md, "Input manifests"."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from ...featstore.secrets import redact_url
from .rows import InputRow, Reject, RowKey, caption_problem, caption_text, has_visible_text, modality_of, safe_id, sample_id_for
from ...featstore.local_storage import under_root
from .source_bytes import OUTSIDE_ROOT, stat_problem

# A relative path that normpath leaves as it is: no '.' or '..' part, no empty part.
_PLAIN = re.compile(r"[^/.][^/]*(?:/[^/.][^/]*)*")
_LOCAL_PROTOCOLS = ("file", "local")
WALK_PROBLEM = "\0problem"  # a record key no manifest column has: a problem found walking a folder


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


def stream_rules(root: str, protocol: str, *, allow_outside_root: bool, max_input_bytes: int, input: str, build: bool = True) -> _Rules:
    """The rules a streamed manifest's rows are read by: as ``read_inputs``'s, but its local files
    are checked by the task that reads each (``InputRow.root``), not stat'ed here."""
    local = protocol in _LOCAL_PROTOCOLS
    return _Rules(root=root, real_root=os.path.realpath(root) if local else None, protocol=protocol,
                  allow_outside_root=allow_outside_root, max_input_bytes=max_input_bytes, check_files=False, input=input, build=build)


def record_rows(records: list[dict[str, Any]], rules: _Rules, *, allow_empty_caption: bool,
                allow_text_only: bool) -> tuple[list[Any], list[Reject]]:
    """Rows of manifest records (``RowKey``s unless ``rules.build``), each judged on its own:
    duplicate ids across records are the planner's to find (``precompute.planning.survey``), with a
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


def _conversations(value: Any) -> tuple[tuple[tuple[str, str], ...] | None, str | None]:
    """A manifest's conversations cell -> ((from, value), ...) turns, or a reject reason."""
    if value is None or value == "":
        return None, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
            return None, f"conversations is not valid JSON ({str(exc)[:200]})"
    if not isinstance(value, list) or not value:
        return None, "conversations must be a non-empty list of {from, value} turns"
    turns = []
    for turn in value:
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
            return None, f"conversation turn {str(turn)[:60]!r} is not {{from: str, value: str}}"
        turns.append((turn["from"], turn["value"]))
    return tuple(turns), None


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
