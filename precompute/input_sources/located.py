"""One committed sample's media read again, alone, from where the store says it came from: a tar
member or a Parquet row (``source_uri`` = ``<container>#<part>``), else its own file.

What reads them: a field added to committed samples (``precompute.plan``), ``data.check_content``
(``precompute.stale``) and a live encoder (``train.live.reattach``). A unit source reads its own
parts (``InputSource.member``, found by the container's suffix: a lookup, no ``if kind``); a plain
file goes to ``sources.read_source``. The callers that hold a recorded ``content_hash`` check the
bytes against it.

A tar member recorded with its offset (``source_offset``, ``source_size``) costs one ranged read
of its header and data (one GET on an object store), the header checked to be the member's. A
compressed tar, a sample recorded before offsets, or a header that no longer matches (the tar was
rewritten) is found by name: the tar's headers are read front to back once per process (data
skipped), and the name -> (offset, size) index is kept for the next members of that tar (keyed by
its size and mtime or ETag; at most ``MAX_INDEXED`` members in all). A compressed tar's member is
then read by decompressing the tar up to it (a gzip stream cannot be entered in the middle); the
stream stays open for the next member, so members asked for in order decompress the tar once.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from mmcache.featstore.retry import protocol_of, remote_filesystem, with_retries
from mmcache.featstore.secrets import redact_url
from mmcache.precompute.input_sources.base import SOURCES, InputSource, Located, open_input
from mmcache.precompute.input_sources.tar_reader import BLOCK, STREAM_ERRORS, TarFormatError, TarReader, decompressed
from mmcache.precompute.inputs import InputRow
from mmcache.precompute.media import MediaError
from mmcache.precompute.sources import DEFAULT_MAX_INPUT_BYTES, OUTSIDE_ROOT, as_media_errors, open_local, read_source, under_root

MAX_INDEXED = 1 << 20  # tar members indexed per process, over all tars (~100 bytes each)


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


def recorded_rows(store: Any, inputs: dict[str, str]) -> Iterator[InputRow]:
    """The committed samples that came from these inputs (tars, Parquet files: their ``input``
    column, as shown -> the uri this job opens it by), as the rows that read them again: id,
    caption, modality and where their media lie, recorded (the container as this job names it: a
    signed URL keeps its signature, which the store does not record). A sample recorded before
    stores kept ``input`` is told by its ``source_uri``'s container."""
    index = store.index
    if not inputs or "source_uri" not in index.column_names:
        return
    names = ("id", "input", "caption", "modality", "source_uri", "source_path", "source_json", "source_offset", "source_size")
    columns: dict[str, list[Any]] = {n: index.column(n).to_pylist() if n in index.column_names else [None] * index.num_rows for n in names}
    for at, (sample_id, given, recorded) in enumerate(zip(columns["id"], columns["input"], columns["source_uri"], strict=True)):
        if given is None and recorded and (found := split_recorded(recorded)) is not None:
            given = found[1].container
        # A sample whose field was added later has more rows: its first one is its record.
        if given not in inputs or not recorded or store.row(sample_id) != at:
            continue
        uri = inputs[given] + recorded[len(given):] if recorded.startswith(given + "#") else recorded
        yield InputRow(sample_id=sample_id, uri=uri, caption=columns["caption"][at] or "",
                       source=columns["source_path"][at] or recorded, modality=columns["modality"][at] or "image",
                       metadata=columns["source_json"][at], input=given, offset=columns["source_offset"][at],
                       size=columns["source_size"][at])


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
        with _LOCK:
            known = _INDEXES.get(where.container)
        # No stat first: a recorded member of a tar not known to be compressed costs one request.
        if where.offset is not None and where.size is not None and (known is None or not known.compressed):
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


def _at_offset(where: Located, storage_options: dict[str, Any] | None) -> bytes | None:
    """The member's data read with its header (one read), or None when that header is not the
    member's (a compressed tar, or one rewritten since): then it is found by name."""
    assert where.offset is not None and where.size is not None
    if where.offset < BLOCK:
        return None
    block = ranged_read(where.container, storage_options, where.offset - BLOCK, BLOCK + where.size)
    try:
        header = TarReader(io.BytesIO(block[:BLOCK])).next()
    except TarFormatError:
        return None
    if header is None or header.kind != "file" or header.size != where.size or len(block) != BLOCK + where.size:
        return None
    name = header.name[2:] if header.name.startswith("./") else header.name
    # A long or non-ASCII name is whole only in a pax / GNU header before this one, which holds
    # a shortened or transliterated name: its size and kind are checked (and the caller's hash).
    if name != where.part and where.part.isascii() and len(where.part) < 100:
        return None
    return block[BLOCK:]


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
                        members[member.name[2:] if member.name.startswith("./") else member.name] = (member.offset, member.size)
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
    if where.size is not None and found[1] != where.size:
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
    """A compressed tar kept open, decompressed up to the member read last."""

    version: tuple[Any, ...]
    closer: contextlib.ExitStack
    stream: IO[bytes]


_STREAMS: OrderedDict[str, _Stream] = OrderedDict()  # by the tar's uri
_STREAMS_KEPT = 2
_STREAM_LOCK = threading.Lock()


def _decompressed_read(where: Located, storage_options: dict[str, Any] | None, index: _TarIndex, offset: int, size: int) -> bytes:
    """A compressed tar's member: its stream kept open between members, so members asked for in
    order cost one decompression of the tar in all (a seek back starts it again: gzip, bzip2 and
    xz streams cannot be entered in the middle)."""
    with _STREAM_LOCK:
        kept = _STREAMS.pop(where.container, None)
        if kept is not None and kept.version != index.version:
            kept.closer.close()
            kept = None
        if kept is None:
            closer = contextlib.ExitStack()
            kept = _Stream(version=index.version, closer=closer, stream=decompressed(closer.enter_context(open_input(where.container, storage_options))))
        try:
            kept.stream.seek(offset)
            data = kept.stream.read(size)
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
