"""The input-source registry: what ``mmcache encode --input`` can read, one module per kind.

A source turns one input into **rows** read on the client (a manifest, a folder, a LLaVA JSON
array: each names one media file a task reads) or **units** the client only names (a WebDataset
tar, a Parquet row group: read once by the worker that encodes it, as ``Member``s). Sources
register themselves (``register``, by name and file suffix); the dispatch is a lookup, never a
chain of ``if``. More: docs/design/encode.md, "The input-source registry"."""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

from ...featstore.retry import protocol_of, remote_filesystem
from ...featstore.secrets import redact_url
from .rows import InputRow, Reject
from .source_bytes import open_local

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """What the sources read their inputs with: the ``data.*`` settings and the input's fsspec options."""

    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    allow_empty_caption: bool = False
    allow_outside_root: bool = False
    allow_text_only: bool = False
    allow_empty: bool = False  # an input without rows is fine (judged once for all inputs: read_all)
    max_input_bytes: int = 1 << 30
    caption_key: str = "caption"
    media_column: str | None = None
    caption_column: str | None = None
    media_root: str | None = None


@dataclass(frozen=True, kw_only=True)
class SourceUnit:
    """A part of an input that one task reads whole, on the worker: a tar, or Parquet row groups."""

    kind: str                      # the registry name of its source
    uri: str = field(repr=False)   # what fsspec opens (may be signed: never shown)
    shown: str                     # the uri without credentials: rejects and provenance
    id_prefix: str                 # every id it makes starts with this (file stem + ':'); '' if unknown
    row_groups: tuple[int, ...] = ()
    first_row: int = 0             # the file's row number of the first row of row_groups
    columns: tuple[tuple[str, str], ...] = ()  # (role, column): media, caption, id
    caption_key: str = "caption"
    allow_empty_caption: bool = False
    estimated_samples: int = 0     # known from planning (Parquet row counts); 0: unknown until read
    nbytes: int = 0                # the file's size where planning stat-ed it (a tar): sizes the progress total
    # (source, earlier source) of its rows whose id an earlier input or row has: rejects naming it.
    duplicates: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Member:
    """One sample of a unit as its worker found it: a row and its media bytes, or a reject."""

    row: InputRow | None = None
    data: bytes | None = field(default=None, repr=False)
    reject: Reject | None = None


def member_or_reject(source: str, build: Callable[[], Member]) -> Member:
    """``build()``: one member made into a sample from bytes already read; or, when those bytes
    make it fail in any way (JSON nested past the stack, a name that is no text, a bug a file
    finds), a reject that says why. The unit of failure is the member, never its whole input:
    no list of expected exceptions can name everything a hostile file may raise."""
    try:
        return build()
    except Exception as exc:
        log.debug("%s: not a sample", source, exc_info=True)
        return Member(reject=Reject(source=source, reason=f"cannot be read as a sample ({type(exc).__name__}: {str(exc)[:200]})"))


@dataclass(frozen=True, kw_only=True)
class Located:
    """Where one recorded sample of a unit lies: its container and its part, as ``source_uri``
    (``<container>#<part>``) and the ``source_offset`` / ``source_size`` columns say."""

    container: str = field(repr=False)  # the tar or Parquet file, as fsspec opens it
    part: str                           # a tar member's name, a Parquet row's number: data, never a path
    offset: int | None = None           # a tar member's data offset in the (decompressed) tar; None: not recorded
    size: int | None = None
    column: str | None = None           # a Parquet file's media column (None: the first of the usual names)

    @property
    def shown(self) -> str:
        return f"{redact_url(self.container)}#{self.part}"


@dataclass(kw_only=True)
class SourceRead:
    rows: list[Any] = field(default_factory=list)  # InputRows, or only their RowKeys (InputStream.batches)
    rejects: list[Reject] = field(default_factory=list)
    units: list[SourceUnit] = field(default_factory=list)
    # Per unit, the (id, source) of its samples where the client reads them cheaply (a Parquet
    # id column): what read_all checks against the other inputs' ids. Empty: ids known on the worker only.
    unit_ids: list[list[tuple[str, str]]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class InputSource:
    name: str
    suffixes: tuple[str, ...]                 # the file suffixes it claims ("" for folders)
    read: Callable[[str, SourceOptions], SourceRead]
    # The worker side of a unit source: (unit, storage options, max member bytes) -> its members.
    stream: Callable[[SourceUnit, dict[str, Any] | None, int], Iterator[Member]] | None = None
    # A source whose rows the planner reads in batches, again for each pass, never all at once
    # (a manifest); the others are read whole, once (``read``). Its third argument: whole rows
    # (True), or only their ``RowKey``s (planning's first pass).
    batches: Callable[[str, SourceOptions, bool], Iterator[SourceRead]] | None = None
    # One recorded sample's media read again alone: (where, storage options, max bytes) -> bytes,
    # or a MediaError saying why not.
    member: Callable[[Located, dict[str, Any] | None, int], bytes] | None = None


SOURCES: dict[str, InputSource] = {}
_SAFE_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,59}")


def register(source: InputSource) -> InputSource:
    assert source.name not in SOURCES, f"input source {source.name!r} registered twice"
    SOURCES[source.name] = source
    return source


@contextmanager
def open_input(uri: str, storage_options: dict[str, Any] | None, block_size: int = 16 << 20) -> Iterator[IO[bytes]]:
    """A whole input (a tar, a Parquet file) opened for reading: a local one only if it is a
    regular file (a FIFO would block, a device never ends), opened without blocking; a remote one
    through fsspec in large blocks (a sequential read costs one request per ``block_size``)."""
    fs, path = remote_filesystem(uri, storage_options)
    protocol = protocol_of(fs)
    if protocol not in ("file", "local"):
        with fs.open(path, "rb", block_size=block_size) as fh:
            yield fh
        return
    fd = open_local(path, 1 << 62)  # the input's own size is not limited: its members are
    # A small buffer: headers and small members come from it, a larger read goes straight from the
    # kernel into its bytes (a 1 MiB buffer copied each image twice: a tar's reading cost 1.45x).
    with os.fdopen(fd, "rb", buffering=1 << 16) as fh:
        yield fh


def file_stem(path: str) -> str:
    """``s3://b/x/00012.tar`` -> ``00012``: what the ids of a container's samples start with
    (``<stem>:``). A stem that is not a safe id part keeps a readable part plus a hash of it, so
    every id of the container still starts with the same prefix."""
    base = path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    stem = base.split(".", 1)[0] or base
    if _SAFE_STEM.fullmatch(stem):
        return stem
    return f"{re.sub(r'[^A-Za-z0-9._=+-]', '_', stem).strip('._=+-')[:60] or 'input'}-{hashlib.sha1(stem.encode()).hexdigest()[:8]}"


def file_name(uri: str) -> str:
    """``s3://b/x/00012.tar?sig=..`` -> ``00012.tar``: what tells one input from another wherever
    it lies (a resume from another folder or a bucket; a sample's recorded input)."""
    return posixpath.basename(uri.split("#", 1)[0].split("?", 1)[0].rstrip("/"))


def duplicate_reason(sample_id: str, earlier: str) -> str:
    return f"duplicate id {sample_id!r}: an earlier input has it ({earlier}); give one of them other ids"
