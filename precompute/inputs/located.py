"""One committed sample's media read again, alone, from where the store says it came from: a tar
member or a Parquet row (``source_uri`` = ``<container>#<part>``), else its own file
(``source_bytes.read_source``). What reads them: a field added to committed samples
(``planning.plan``), ``data.check_content`` (``planning.stale``) and a live encoder
(``train.live.reattach``). A tar member is one ranged read at its recorded offset, else found by an
index of the tar's headers kept per process. How: docs/design/encode.md, "Reading one sample again"."""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ...featstore.retry import protocol_of, remote_filesystem, with_retries
from ...featstore.secrets import redact_url
from .registry import SOURCES, InputSource, Located, SourceUnit, file_name, open_input
from .rows import InputRow
from ...featstore.local_storage import under_root
from .source_bytes import DEFAULT_MAX_INPUT_BYTES, OUTSIDE_ROOT, as_media_errors, open_local, read_source
from .tar_reader import BLOCK, STREAM_ERRORS, TarFormatError, TarReader, decompressed, plain_name
from ..media.clips import clip_parent
from ..media.errors import MediaError

MAX_INDEXED = 1 << 20  # tar members indexed per process, over all tars (~200 bytes each)


def read_recorded(uri: str, storage_options: dict[str, Any] | None = None, max_bytes: int | None = None, root: str | None = None,
                  *, offset: int | None = None, size: int | None = None, column: str | None = None) -> bytes:
    """The media bytes of a sample recorded as ``uri`` (``source_uri``; ``offset`` / ``size``:
    its ``source_offset`` / ``source_size`` where recorded), at most ``max_bytes``; a MediaError
    says why they cannot be read (missing, member not found, member changed size)."""
    limit = DEFAULT_MAX_INPUT_BYTES if max_bytes is None else max_bytes
    found = split_recorded(uri)
    if found is None or (is_local(uri) and os.path.isfile(uri)):  # a file named "a.tar#1.png" is a file
        return read_source(uri, storage_options, limit, root)
    source, where = found
    if root is not None and is_local(where.container) and not under_root(os.path.realpath(where.container), root):
        raise MediaError(OUTSIDE_ROOT, where.shown)
    assert source.member is not None
    return source.member(Located(container=where.container, part=where.part, offset=offset, size=size, column=column),
                         storage_options, limit)


_RECORD = ("id", "input", "caption", "modality", "source_uri", "source_path", "source_json", "source_offset", "source_size", "content_hash",
           "frame_indices")


def recorded_rows(store: Any, units: Sequence[SourceUnit], ids_of: Mapping[tuple[str, tuple[int, ...]], Sequence[str]] | None = None) -> Iterator[InputRow]:
    """The committed samples that came from these units' inputs (tars, Parquet files: the samples'
    ``input`` column), as the rows that read them again: id, caption, modality, the sha256 of
    their media and where it lies, recorded (the container as this job names it: a signed URL
    keeps its signature, which the store does not record). An input whose samples' ids name it
    (``<file stem>:``) is the same by its file name too (as ``worker.unit_encode.same_input`` has it: the
    tars copied to a bucket); a sample recorded before stores kept ``input`` is told by its
    ``source_uri``'s container. The index's columns are turned into Python objects a batch at a time."""
    index = store.index
    inputs = {unit.shown: unit.uri for unit in units}
    if not inputs or "source_uri" not in index.column_names:
        return
    by_name = _by_file_name(units, ids_of or {})
    have = [n for n in _RECORD if n in index.column_names]
    at = 0
    for batch in index.select(have).to_batches(max_chunksize=1 << 16):
        columns = {n: batch.column(n).to_pylist() if n in have else [None] * batch.num_rows for n in _RECORD}
        for k in range(batch.num_rows):
            row = _recorded_row(store, {n: columns[n][k] for n in _RECORD}, at + k, inputs, by_name)
            if row is not None:
                yield row
        at += batch.num_rows


def _by_file_name(units: Sequence[SourceUnit], ids_of: Mapping[tuple[str, tuple[int, ...]], Sequence[str]]) -> dict[str, list[_Named]]:
    """File name -> the job's inputs of that name, each with what its samples' ids are: their
    prefix (the file stem), or for a Parquet file with an ``id`` column the ids the client read of
    it (two files of one name hold other ids). A file whose ids are not known is left out."""
    found: dict[str, dict[str, _Named]] = {}
    unknown: set[str] = set()
    for unit in units:
        read = (unit.shown, unit.row_groups)
        if not unit.id_prefix and read not in ids_of:
            unknown.add(unit.uri)  # its ids were not read: what it holds is not known
            continue
        named = found.setdefault(file_name(unit.shown), {}).setdefault(unit.uri, _Named(unit.uri, unit.id_prefix, set()))
        named.ids.update(ids_of.get(read, ()) if not unit.id_prefix else ())
    return {name: [n for uri, n in inputs.items() if uri not in unknown] for name, inputs in found.items()}


@dataclass(frozen=True)
class _Named:
    """A job's input found by file name: its uri, and its samples' id prefix or their ids."""

    uri: str
    prefix: str
    ids: set[str]

    def holds(self, sample_id: str) -> bool:
        return sample_id.startswith(self.prefix) if self.prefix else sample_id in self.ids


def _named_input(by_name: dict[str, list[_Named]], given: str, sample_id: str) -> str | None:
    """The uri of the one input of ``given``'s file name that holds ``sample_id``; None if none
    or several do (two tars of one name from two datasets)."""
    holding = [named.uri for named in by_name.get(file_name(given), ()) if named.holds(sample_id)]
    return holding[0] if len(holding) == 1 else None


def _recorded_row(store: Any, record: dict[str, Any], at: int, inputs: dict[str, str],
                  by_name: dict[str, list[_Named]]) -> InputRow | None:
    """The row of index row ``at`` (``record``), if a sample from one of ``inputs`` and its record
    (a sample whose field was added later has more rows: its first one is its record)."""
    given, recorded = record["input"], record["source_uri"]
    if given is None and recorded and (found := split_recorded(recorded)) is not None:
        given = found[1].container
    if not recorded or given is None or store.row(record["id"]) != at:
        return None
    opened = inputs.get(given)
    if opened is None:
        opened = _named_input(by_name, given, record["id"])
    if opened is None:
        return None
    uri = opened + recorded[len(given):] if recorded.startswith(given + "#") else recorded
    frames = record["frame_indices"]
    return InputRow(sample_id=record["id"], uri=uri, caption=record["caption"] or "", source=record["source_path"] or recorded,
                    modality=record["modality"] or "image", metadata=record["source_json"], input=given,
                    offset=record["source_offset"], size=record["source_size"], content_hash=record["content_hash"],
                    frames=tuple(frames) if frames and clip_parent(record["id"]) is not None else None)


def split_recorded(uri: str) -> tuple[InputSource, Located] | None:
    """(the source, the container and part) of ``<container>#<part>`` where the container has the
    suffix of a source that reads parts again; None: a file of its own."""
    for source in SOURCES.values():
        if source.member is None:
            continue
        for suffix in source.suffixes:
            # The container may be a signed URL: its query comes before the '#'.
            match = re.search(re.escape(suffix) + r"(\?[^#]*)?#", uri, re.IGNORECASE)
            if match:
                return source, Located(container=uri[: match.end() - 1], part=uri[match.end():])
    return None


def is_local(uri: str) -> bool:
    import fsspec

    return fsspec.core.split_protocol(uri)[0] in (None, "file", "local")


def container_key(uri: str, storage_options: dict[str, Any] | None) -> tuple[Any, ...]:
    """What tells one version of a container from another: its path, size and mtime (an object
    store's ETag). One stat (a HEAD request); a missing one raises FileNotFoundError."""
    fs, path = remote_filesystem(uri, storage_options)
    if protocol_of(fs) in ("file", "local"):
        st = os.stat(path)
        return (path, st.st_size, st.st_mtime_ns)
    info = with_retries(lambda: fs.info(path), redact_url(uri), "stat")
    return (protocol_of(fs), path, info.get("size"), info.get("ETag") or info.get("mtime") or info.get("LastModified"))


def ranged_read(uri: str, storage_options: dict[str, Any] | None, start: int, length: int) -> bytes:
    """``length`` bytes of a container from ``start`` (fewer at its end): one read, on an object
    store one ranged GET, never the whole file."""
    fs, path = remote_filesystem(uri, storage_options)
    if protocol_of(fs) not in ("file", "local"):
        return with_retries(lambda: fs.cat_file(path, start=start, end=start + length), redact_url(uri), "read")
    fd = open_local(path, 1 << 62)  # the container's own size is not limited: its members are
    try:
        chunks, got = [], 0
        while got < length and (chunk := os.pread(fd, min(length - got, 8 << 20), start + got)):
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _TarIndex:
    version: tuple[Any, ...]  # the tar's container_key when it was read
    compressed: bool
    members: dict[str, tuple[int, int]]  # member name -> (data offset, size)


_INDEXES: OrderedDict[str, _TarIndex] = OrderedDict()  # by the tar's uri
_LOCK = threading.Lock()  # decoding threads ask for members of one tar at once: it is scanned once


def read_tar_member(where: Located, storage_options: dict[str, Any] | None, max_bytes: int) -> bytes:
    """A tar member's data: at its recorded offset in one read, else found by name (see the module doc)."""
    with as_media_errors(where.shown, is_local(where.container)):
        known = _INDEXES.get(where.container)  # a read of one entry: no lock (a scan may hold it)
        # No stat first: a recorded member of a tar not known to be compressed costs one request.
        if _recorded_place(where) and (known is None or not known.compressed):
            _check_size(where, where.size, max_bytes)
            data = _at_offset(where, storage_options)
            if data is not None:
                return data
        index = _indexed(where, storage_options)
        offset, size = _lookup(index, where, max_bytes)
        if not index.compressed:
            data = ranged_read(where.container, storage_options, offset, size)
        else:
            data = _decompressed_read(where, storage_options, index, offset, size)
    if len(data) != size:
        raise MediaError(f"member is cut short ({len(data):,} of {size:,} bytes)", where.shown)
    return data


# A member up to this size is read with its header in one request; a larger one after its header
# (a second request), so a store that records a wrong size cannot make a reader fetch a large
# range for a small member.
ONE_READ_BYTES = 4 << 20


def _at_offset(where: Located, storage_options: dict[str, Any] | None) -> bytes | None:
    """The member's data read with its header, or None when that header is not the member's (a
    compressed tar, one rewritten since, or a long or non-ASCII name, which only a pax or GNU
    header before this one holds whole): then it is found by name."""
    assert where.offset is not None and where.size is not None
    if where.offset < BLOCK:
        return None
    first = BLOCK + where.size if where.size <= ONE_READ_BYTES else BLOCK
    block = ranged_read(where.container, storage_options, where.offset - BLOCK, first)
    try:
        header = TarReader(io.BytesIO(block[:BLOCK])).next()
    except TarFormatError:
        return None
    if header is None or header.kind != "file" or header.size != where.size:
        return None
    if plain_name(header.name) != where.part:
        return None
    data = block[BLOCK:] if first > BLOCK else ranged_read(where.container, storage_options, where.offset, where.size)
    return data if len(data) == where.size else None


def _recorded_place(where: Located) -> bool:
    """Whether the sample records a place in its tar: offset and size, whole numbers (a store is
    data: anything else there is ignored, and the member found by name)."""
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (where.offset, where.size))


def _indexed(where: Located, storage_options: dict[str, Any] | None) -> _TarIndex:
    """The tar's name -> (offset, size) index: kept while the tar is unchanged (its size and mtime
    or ETag: one stat), else its headers read front to back (data skipped) and kept."""
    version = container_key(where.container, storage_options)
    with _LOCK:
        if (index := _INDEXES.get(where.container)) is not None and index.version == version:
            _INDEXES.move_to_end(where.container)
            return index
        members: dict[str, tuple[int, int]] = {}
        with open_input(where.container, storage_options) as fh:
            reader = TarReader(fh)
            try:
                while (member := reader.next()) is not None:
                    if member.kind == "file":
                        members[plain_name(member.name)] = (member.offset, member.size)
            except TarFormatError as exc:
                raise MediaError(f"tar is truncated or corrupt ({exc})", redact_url(where.container)) from None
        index = _INDEXES[where.container] = _TarIndex(version=version, compressed=reader.compressed, members=members)
        while len(_INDEXES) > 1 and sum(len(i.members) for i in _INDEXES.values()) > MAX_INDEXED:
            _INDEXES.popitem(last=False)  # the tar indexed or used least recently
        return index


def _lookup(index: _TarIndex, where: Located, max_bytes: int) -> tuple[int, int]:
    found = index.members.get(where.part)
    if found is None:
        raise MediaError(f"member {where.part!r} not found in the tar", redact_url(where.container))
    if _recorded_place(where) and found[1] != where.size:
        raise MediaError(f"member {where.part!r} changed size since it was encoded (recorded {where.size:,} bytes, now {found[1]:,})",
                         redact_url(where.container))
    _check_size(where, found[1], max_bytes)
    return found


def _check_size(where: Located, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise MediaError(f"member is larger than data.max_input_bytes ({size:,} > {max_bytes:,} bytes); raise the limit to read it",
                         where.shown)
    if size == 0:
        raise MediaError("zero-byte member", where.shown)


@dataclass
class _Stream:
    """A compressed tar kept open, decompressed up to ``position``; the last ``WINDOW_BYTES`` of
    it kept (from ``start``), so a member asked for a little out of order (decoding threads
    finish in any order) is served from memory, not by decompressing the tar again."""

    version: tuple[Any, ...]
    closer: contextlib.ExitStack
    stream: IO[bytes]
    position: int = 0
    start: int = 0
    window: bytearray = field(default_factory=bytearray)

    def read(self, offset: int, size: int) -> bytes:
        if self.start <= offset and offset + size <= self.position:
            return bytes(self.window[offset - self.start : offset - self.start + size])
        if offset < self.start:
            raise _Behind
        if offset - self.position > WINDOW_BYTES or size > WINDOW_BYTES:  # far ahead, or too large to keep
            self.stream.seek(offset)
            data = self.stream.read(size)
            self.position, self.start, self.window = offset + len(data), offset + len(data), bytearray()
            return data
        self.window += self.stream.read(offset + size - self.position)
        self.position = self.start + len(self.window)
        data = bytes(self.window[offset - self.start : offset - self.start + size])
        if len(self.window) > WINDOW_BYTES:
            drop = len(self.window) - WINDOW_BYTES
            del self.window[:drop]
            self.start += drop
        return data


class _Behind(Exception):
    """A member before the kept window: the stream starts again."""


WINDOW_BYTES = 32 << 20
_STREAMS: OrderedDict[str, _Stream] = OrderedDict()  # by the tar's uri
_STREAMS_KEPT = 2
# One lock for all: a compressed tar's members are read again only when a field is added to them
# or their content is checked, a rare path, and a kept stream must not be read by two threads.
_STREAM_LOCK = threading.Lock()


def _decompressed_read(where: Located, storage_options: dict[str, Any] | None, index: _TarIndex, offset: int, size: int) -> bytes:
    """A compressed tar's member: its stream kept open between members, so members asked for in
    order (or nearly: ``_Stream``'s window) cost one decompression of the tar in all (an earlier
    member starts it again: gzip, bzip2 and xz streams cannot be entered in the middle)."""
    with _STREAM_LOCK:
        kept = _STREAMS.pop(where.container, None)
        if kept is not None and kept.version != index.version:
            kept.closer.close()
            kept = None
        kept = kept or _opened_stream(where, storage_options, index)
        try:
            try:
                data = kept.read(offset, size)
            except _Behind:
                kept.closer.close()
                kept = _opened_stream(where, storage_options, index)
                data = kept.read(offset, size)
        except STREAM_ERRORS as exc:
            kept.closer.close()
            raise MediaError(f"tar is truncated or corrupt ({type(exc).__name__}: {exc})", where.shown) from None
        except BaseException:
            kept.closer.close()
            raise
        _STREAMS[where.container] = kept
        while len(_STREAMS) > _STREAMS_KEPT:
            _STREAMS.popitem(last=False)[1].closer.close()
        return data


def _opened_stream(where: Located, storage_options: dict[str, Any] | None, index: _TarIndex) -> _Stream:
    closer = contextlib.ExitStack()
    try:
        return _Stream(version=index.version, closer=closer, stream=decompressed(closer.enter_context(open_input(where.container, storage_options))))
    except BaseException:
        closer.close()
        raise
