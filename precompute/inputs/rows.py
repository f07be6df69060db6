"""What an input row is: ``InputRow`` (one sample to encode, as read from its input), ``RowKey`` (what
planning's first pass keeps of one), ``Reject`` (a row that cannot be used, and why), and the checks
every reader applies to ids and captions (``sample_id_for``, ``safe_id``, ``caption_problem``).
A module of its own: every reader, the planner and the tasks share these types."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ...featstore.errors import ConfigError, SchemaError
from ...featstore.format import check_name

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v"}
_UNSAFE = re.compile(r"[^A-Za-z0-9._:=+-]")
# Unicode category Cc (C0 and C1 controls, DEL) but tab, newline and carriage return.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


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
    # recorded as source_offset / source_size, read again alone by inputs.located). None:
    # a file of its own, a Parquet row (its number is in ``uri``), or a sample recorded before offsets.
    offset: int | None = None
    size: int | None = None
    # A committed sample's: the sha256 of the media it was encoded from. A field added to it must
    # come from the same bytes (precompute.worker.tasks), else the sample would mix two inputs.
    content_hash: str | None = None
    # A committed clip sample's (``frames.clips``): the frames it was encoded from. A field added
    # to it is made from that clip (precompute.worker.tasks), checked, not from every clip of its video.
    frames: tuple[int, ...] | None = None

    @property
    def conversations_sha256(self) -> str | None:
        """What the store records of the turns, so a re-run can tell that they were edited."""
        return conversations_digest(self.conversations)


class RowKey(NamedTuple):
    """What planning's first pass keeps of a usable row (``precompute.planning.survey``): building the
    whole ``InputRow`` (a frozen dataclass: ~4 us) would be a fifth of that pass's time. Its
    caption and turns are there for that pass to tell a committed row edited since
    (``precompute.planning.stale``), without a pass of its own."""

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

    def __post_init__(self) -> None:
        # Names read from data may hold bytes that are not UTF-8 (kept as surrogates): a reject
        # shows them escaped, so it can always be written and printed.
        for name in ("source", "reason"):
            object.__setattr__(self, name, printable(getattr(self, name)))


def printable(text: str) -> str:
    """``text`` with any undecodable byte (a surrogate ``surrogateescape`` made) as ``\\xNN``."""
    if text.isascii():
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no undecodable byte made (JSON's "\\ud800")
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def caption_of_bytes(raw: bytes, what: str) -> tuple[str, str | None]:
    """(the caption in ``raw``, stripped; or why it is not usable text) for a caption file or
    member: UTF-8, a byte-order mark allowed. Other bytes are a reject everywhere, never text
    with replacement characters in place of what the file said (a UTF-16 file is named as such:
    Windows' Notepad saves "Unicode" so)."""
    try:
        return raw.decode("utf-8-sig").strip(), None
    except UnicodeDecodeError as exc:
        utf16 = "; it is UTF-16 (its byte-order mark)" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        return "", f"{what} is not UTF-8 ({exc.reason} at byte {exc.start}{utf16}); save it as UTF-8"


def utf8_problem(text: str, what: str) -> str | None:
    """Why ``text`` (a name read as bytes, undecodable ones kept as surrogates) is not UTF-8, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return f"{what} {printable(text)!r} is not UTF-8; rename it"
    return None


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


def safe_id(sample_id: str) -> bool:
    # The store's own rule, so a row that passes here is never refused by the writer.
    try:
        check_name("sample id", sample_id)
    except SchemaError:
        return False
    return True
