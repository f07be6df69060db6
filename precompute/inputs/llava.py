"""LLaVA / ShareGPT4V JSON arrays: ``[{"id", "image": "00000/x.jpg", "conversations": [{"from":
"human", "value": "<image>\\n..."}, {"from": "gpt", "value": ...}]}, ...]``, read on the client.

``image`` is relative to the JSON's folder, or to ``images/`` beside it where the rows' images are
found there (LLaVA-Pretrain's layout), or to ``data.media_root`` when set; the usual rules of ``precompute.inputs`` hold
(contained paths, regular files, sizes). A row without ``image`` is a text-only sample where the
text encoder takes whole samples (the ``tokenizer``), else a reject saying so.
"""

from __future__ import annotations

import json
import logging
import posixpath
from typing import Any

from ...featstore.retry import protocol_of, remote_filesystem, with_retries
from ...featstore.secrets import redact_url
from .manifest import rows_from_records
from .registry import InputSource, SourceOptions, SourceRead, register
from .rows import ManifestError
from .source_bytes import InputFileError, read_local_file

# A LLaVA array is read whole on the client (it is the manifest): LLaVA-Pretrain's is ~180 MB.
MAX_JSON_BYTES = 4 << 30
log = logging.getLogger(__name__)


def read_llava(url: str, options: SourceOptions) -> SourceRead:
    fs, path = remote_filesystem(url, options.storage_options)
    shown = redact_url(url)
    protocol = protocol_of(fs)
    try:
        raw = read_local_file(path, MAX_JSON_BYTES) if protocol in ("file", "local") else with_retries(lambda: fs.cat_file(path), shown, "read")
    except FileNotFoundError:
        raise ManifestError(f"input {shown!r} does not exist") from None
    except InputFileError as exc:
        raise ManifestError(f"input {shown!r}: {exc.reason}") from None
    try:
        array = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        raise ManifestError(f"input {shown!r} is not valid JSON ({str(exc)[:200]}); a LLaVA input is one JSON array of rows") from None
    if not isinstance(array, list) or not all(isinstance(row, dict) for row in array):
        raise ManifestError(f"input {shown!r}: expected a JSON array of objects with id, image and conversations (LLaVA format)")
    records = [_record(row) for row in array]
    beside = f"{url.split('://', 1)[0]}://{posixpath.dirname(path)}" if "://" in url else posixpath.dirname(path)
    root = options.media_root or media_folder(fs, posixpath.dirname(path), records, beside)
    rows, rejects = rows_from_records(records, root, storage_options=options.storage_options,
                                      allow_empty_caption=options.allow_empty_caption, allow_outside_root=options.allow_outside_root,
                                      max_input_bytes=options.max_input_bytes, allow_text_only=options.allow_text_only)
    return SourceRead(rows=rows, rejects=rejects)


def media_folder(fs: Any, folder: str, records: list[dict[str, Any]], beside: str, probes: int = 4) -> str:
    """Where a LLaVA array's relative ``image`` paths lie: beside the JSON, or in ``images/``
    beside it when none of the first few rows' images is beside it and some are there
    (LLaVA-Pretrain ships ``blip_laion_cc_sbu_558k.json`` next to ``images/``)."""
    paths = [r["path"] for r in records if isinstance(r.get("path"), str) and r["path"] and not r["path"].startswith("/") and "://" not in r["path"]]
    sample = paths[:probes]
    if not sample or any(fs.exists(posixpath.join(folder, p)) for p in sample):
        return beside
    if any(fs.exists(posixpath.join(folder, "images", p)) for p in sample):
        log.info("the images of %s are in images/ beside it (data.media_root overrides)", beside)
        return posixpath.join(beside, "images")
    return beside


def _record(row: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA row as a manifest record (path, conversations, id). Its caption, for a caption
    text encoder (T5), is the first ``gpt`` turn: LLaVA-Pretrain's BLIP caption, ShareGPT4V's
    detailed description; the tokenizer reads the whole conversation."""
    turns = row.get("conversations")
    answer = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "gpt"), None) if isinstance(turns, list) else None
    return {"path": row.get("image"), "conversations": turns, "id": row.get("id"), "caption": row.get("caption", answer)}


register(InputSource(name="llava", suffixes=(".json",), read=read_llava))
