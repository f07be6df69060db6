"""Input manifests for ``mmcache encode``: what to encode, checked before any work starts.

INPUT is a JSONL, CSV or Parquet manifest with columns ``path`` and ``caption`` (optional
``id``; ``conversations``: LLaVA-style turns ``[{"from": "human"|"gpt", "value": ...}]``, a list
in JSONL or Parquet, a JSON string in CSV; a row with conversations needs no caption), or a
folder of media with same-stem ``.txt`` captions (the kohya / SimpleTuner convention). Paths
are relative to the manifest's folder, absolute, or any fsspec URL. Rows that cannot be used
(duplicate id, a path escaping the root, an empty caption when not allowed) become rejects with
a reason; they never stop the job.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec

from featstore.errors import ConfigError, SchemaError
from featstore.format import check_name
from featstore.secrets import redact_url
from featstore.retry import with_retries

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v"}
_UNSAFE = re.compile(r"[^A-Za-z0-9._:=+-]")


class ManifestError(ConfigError):
    """The input manifest itself cannot be read (not the rows in it: those become rejects)."""


@dataclass(frozen=True, kw_only=True)
class InputRow:
    sample_id: str
    uri: str = field(repr=False)  # absolute: a local path or a URL fsspec opens (may be signed: never in reprs)
    caption: str
    source: str       # the path as the manifest wrote it, for rejects and provenance
    modality: str     # "image" | "video", from the suffix
    conversations: tuple[tuple[str, str], ...] | None = None  # ((from, value), ...) turns


@dataclass(frozen=True, kw_only=True)
class Reject:
    source: str
    reason: str
    sample_id: str | None = None


def modality_of(path: str) -> str | None:
    if "://" in path:
        path = path.split("?", 1)[0]  # a URL's query (a signature, say) is not its suffix
    suffix = posixpath.splitext(path.lower())[1]
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    return None


def read_inputs(
    input_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_empty_caption: bool = False,
    allow_outside_root: bool = False,
) -> tuple[list[InputRow], list[Reject]]:
    """Parse INPUT into usable rows and rejects, in manifest order."""
    fs, path = fsspec.core.url_to_fs(input_url, **(storage_options or {}))
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    shown = redact_url(str(input_url))
    if not with_retries(lambda: fs.exists(path), shown, "stat"):
        raise ManifestError(f"input {shown!r} does not exist")
    if with_retries(lambda: fs.isdir(path), shown, "stat"):
        root, records = path.rstrip("/"), with_retries(lambda: _folder_records(fs, path.rstrip("/")), shown, "list")
    else:
        root, records = posixpath.dirname(path), _manifest_records(fs, path, shown)
    rows, rejects, seen = [], [], set()
    for record in records:
        raw = record.get("path")
        if not isinstance(raw, str) or not raw.strip():
            rejects.append(Reject(source=str(raw), reason="row has no path"))
            continue
        # A signed URL is fetched as given, but only shown (ids, rejects, provenance) without
        # its signature: the credential must not end up in the store.
        source = redact_url(raw) if "://" in raw else raw
        caption = record.get("caption")
        caption = "" if caption is None else str(caption)
        sample_id = str(record["id"]) if record.get("id") not in (None, "") else sample_id_for(source)
        uri = _resolve(raw, root, protocol, allow_outside_root)
        conversations, bad_conversations = _conversations(record.get("conversations"))
        reason = None
        if uri is None:
            reason = "path escapes the manifest's folder (set data.allow_outside_root: true to allow it)"
        elif bad_conversations:
            reason = bad_conversations
        elif not caption.strip() and not allow_empty_caption and conversations is None:
            reason = "empty caption (set data.allow_empty_caption: true to allow it)"
        elif sample_id in seen:
            reason = f"duplicate id {sample_id!r}"
        elif modality_of(source) is None:
            reason = f"unsupported file type {posixpath.splitext(source)[1] or '(none)'!r}"
        elif not _safe_id(sample_id):
            reason = f"id {sample_id!r} is not a safe name (A-Z a-z 0-9 . _ : = + -)"
        if reason:
            rejects.append(Reject(source=source, reason=reason, sample_id=sample_id))
            continue
        seen.add(sample_id)
        rows.append(InputRow(sample_id=sample_id, uri=uri, caption=caption, source=source, modality=modality_of(source), conversations=conversations))
    return rows, rejects


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
    """A stable, safe sample id from a path: readable when the path is, unique when it is not."""
    text = path.strip().lstrip("./").replace("/", ":")
    safe = _UNSAFE.sub("_", text).strip("._:=+-")[:180] or "sample"
    if safe != text or not safe[0].isalnum():
        safe = f"{safe}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    return safe


def _safe_id(sample_id: str) -> bool:
    # The store's own rule, so a row that passes here is never refused by the writer.
    try:
        check_name("sample id", sample_id)
    except SchemaError:
        return False
    return True


def _resolve(source: str, root: str, protocol: str, allow_outside_root: bool) -> str | None:
    if "://" in source:
        return source if allow_outside_root else None
    if source.startswith("/"):
        return source if allow_outside_root else None
    joined = posixpath.normpath(posixpath.join(root, source))
    if not allow_outside_root and not (joined == root or joined.startswith(root.rstrip("/") + "/")):
        return None
    return joined if protocol in ("file", "local") else f"{protocol}://{joined}"


def _manifest_records(fs: Any, path: str, input_url: str) -> list[dict[str, Any]]:
    suffix = posixpath.splitext(path.lower())[1]
    def fetch() -> bytes:
        with fs.open(path, "rb") as fh:
            return fh.read()

    raw = with_retries(fetch, input_url, "read")
    try:
        if suffix in (".jsonl", ".ndjson"):
            records = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        elif suffix == ".csv":
            records = list(csv.DictReader(io.StringIO(raw.decode())))
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            records = pq.read_table(io.BytesIO(raw), use_threads=False).to_pylist()
        else:
            raise ManifestError(f"input {input_url!r}: expected a .jsonl, .csv or .parquet manifest, or a folder of media")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"input {input_url!r} is not a valid {suffix} manifest: {exc}") from None
    if records and not all(isinstance(r, dict) for r in records):
        raise ManifestError(f"input {input_url!r}: every row must be an object with path and caption")
    if records and "path" not in records[0]:
        raise ManifestError(f"input {input_url!r}: no 'path' column (columns: {sorted(records[0])})")
    return records


def _folder_records(fs: Any, root: str) -> list[dict[str, Any]]:
    """Media files under ``root`` with a same-stem .txt caption beside each (a missing .txt is an
    empty caption, which is then allowed or rejected by config)."""
    files = sorted(fs.find(root))
    texts = {posixpath.splitext(f)[0]: f for f in files if f.lower().endswith(".txt")}
    records = []
    for file in files:
        if file.lower().endswith(".txt") or posixpath.basename(file).startswith("."):
            continue
        caption_file = texts.get(posixpath.splitext(file)[0])
        caption = fs.cat_file(caption_file).decode("utf-8", errors="replace").strip() if caption_file else ""
        records.append({"path": posixpath.relpath(file, root), "caption": caption})
    return records
