"""Reading a source file's bytes for ``mmcache encode`` (and for a live encoder in the trainer):
a local file only if it is a regular file within ``data.max_input_bytes`` (a FIFO would block the
encode forever, ``/dev/zero`` would fill memory), a remote one through fsspec with transient
faults retried. The manifest reader (``precompute.inputs``) checks local files the same way
before any task runs; a task reads them here, and a file that cannot be read becomes a reject
(``MediaError``) with a short reason.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

from ...featstore.errors import StorageError
from ...featstore.local_storage import under_root
from ...featstore.retry import describe, is_transient, remote_filesystem, with_retries
from ...featstore.secrets import redact_url
from ..media.errors import MediaError, MissingMediaError

DEFAULT_MAX_INPUT_BYTES = 1 << 30  # 1 GiB: any photo or clip; not a disk image by mistake
OUTSIDE_ROOT = "path resolves outside the input root (a symlink?); set data.allow_outside_root: true to allow it"


class InputFileError(ValueError):
    """A local input file must not be read (not a regular file, too large); ``reason`` is short."""

    def __init__(self, reason: str, path: str = ""):
        super().__init__(f"{path}: {reason}" if path else reason)
        self.reason = reason


# What a user reads beside a media file that is not where its row says: where it was looked for, and what moves that.
MISSING_HINT = "a relative path is looked up beside its manifest or JSON; set data.media_root if the media lie elsewhere"


def read_source(uri: str, storage_options: dict[str, Any] | None = None, max_bytes: int | None = None, root: str | None = None) -> bytes:
    """A source file's bytes, at most ``max_bytes`` (``data.max_input_bytes``), checked before
    anything decodes them. A local file must be a regular file (never a FIFO or a device: see
    ``read_local_file``) and, with ``root`` (the resolved input root), resolve under it: a
    symlink cannot smuggle ``/etc/passwd`` into a store. Transient faults of an object store are
    retried; one that persists fails the task (Dask retries it), never turning a readable input
    into a reject."""
    import fsspec

    limit = DEFAULT_MAX_INPUT_BYTES if max_bytes is None else max_bytes
    shown = redact_url(uri)
    protocol, path = fsspec.core.split_protocol(uri)

    def fetch() -> bytes:
        fs, remote_path = remote_filesystem(uri, storage_options)
        with fs.open(remote_path, "rb") as fh:
            return fh.read(limit + 1)

    local = protocol in (None, "file", "local")
    if local and root is not None and not under_root(os.path.realpath(path), root):
        raise MediaError(OUTSIDE_ROOT, shown)
    with as_media_errors(shown, local, missing=f"missing file: no {shown} ({MISSING_HINT})"):
        data = read_local_file(path, limit) if local else with_retries(fetch, shown, "read")
    if len(data) > limit:
        raise MediaError(f"file is larger than data.max_input_bytes ({limit:,} bytes); raise the limit to encode it", shown)
    if not data:
        raise MediaError("zero-byte file", shown)
    return data


@contextlib.contextmanager
def open_source(uri: str, storage_options: dict[str, Any] | None = None, max_bytes: int | None = None) -> Iterator[BinaryIO]:
    """A source file opened for its headers only (a trainer sizing media it has not encoded):
    checked as ``read_source`` checks it (a regular file within ``max_bytes``, not empty), then
    read only as far as the parser asks; an object store's file fetches small ranges on demand."""
    import fsspec

    limit = DEFAULT_MAX_INPUT_BYTES if max_bytes is None else max_bytes
    shown = redact_url(uri)
    protocol, path = fsspec.core.split_protocol(uri)
    local = protocol in (None, "file", "local")
    with as_media_errors(shown, local):
        if local:
            fh: Any = os.fdopen(open_local(path, limit), "rb", buffering=_HEADER_BLOCK)
            size = os.fstat(fh.fileno()).st_size
        else:
            fs, remote_path = remote_filesystem(uri, storage_options)
            fh = with_retries(lambda: fs.open(remote_path, "rb", block_size=_HEADER_BLOCK, cache_type="readahead"), shown, "open")
            size = getattr(fh, "size", None)  # None: a server that does not say (HTTP without a length)
    with fh:
        if size is not None and size > limit:
            raise MediaError(_too_large(size, limit), shown)
        if size == 0:
            raise MediaError("zero-byte file", shown)
        yield fh


# Headers are small; a JPEG's EXIF or an MP4's sample table fits a few of these reads.
_HEADER_BLOCK = 1 << 16


@contextlib.contextmanager
def as_media_errors(shown: str, local: bool, missing: str = "missing file") -> Iterator[None]:
    """A file that must not or cannot be read, as the MediaError a task rejects it with (an
    object store's other errors are left to fail the task: they may be transient)."""
    try:
        yield
    except InputFileError as exc:
        raise MediaError(exc.reason, shown) from None
    except FileNotFoundError as exc:
        read_failure(exc, shown)
        raise MissingMediaError(missing, shown) from None
    except IsADirectoryError:
        raise MediaError("is a directory, not a file", shown) from None
    except OSError as exc:
        if not local:
            raise
        raise MediaError(f"cannot stat the file ({exc.strerror})", shown) from None


def read_failure(exc: FileNotFoundError, shown: str) -> None:
    """Raise ``StorageError`` (the task fails and is retried) when a "missing" input is really an
    unreachable source: fsspec's HTTP filesystem reports a refused connection or a timeout as a
    missing file, and that input may well be there. A truly missing one returns (a reject)."""
    if (cause := _transient_cause(exc)) is not None:
        raise StorageError(f"{shown}: read failed with {describe(cause)}; the source is unreachable, try again later") from None


def _transient_cause(exc: BaseException) -> BaseException | None:
    """The transient fault (connection refused, timeout, 5xx) behind an exception, if any."""
    seen = exc.__cause__ or exc.__context__
    while seen is not None:
        if is_transient(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def read_local_file(path: str, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular local file of at most ``max_bytes``, raising ``InputFileError``
    otherwise. The type is checked before opening, and the open itself does not block (a FIFO
    swapped in after the check): only then is the open file checked again and read."""
    fd = open_local(path, max_bytes)
    try:
        chunks, total = [], 0
        while chunk := os.read(fd, min(8 << 20, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # grew after the check
                raise InputFileError(_too_large(total, max_bytes), path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_local(path: str, max_bytes: int) -> int:
    """A descriptor of a regular local file of at most ``max_bytes``, or ``InputFileError``. The
    type is checked before opening and again on the open file (a FIFO swapped in between), and
    the open does not block."""
    problem = stat_problem(os.stat(path), max_bytes)
    if problem:
        raise InputFileError(problem, path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        problem = stat_problem(os.fstat(fd), max_bytes)
    except OSError:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise InputFileError(problem, path)
    return fd


def stat_problem(st: os.stat_result, max_bytes: int) -> str | None:
    """Why a file of this ``stat`` must not be read (not a regular file, over ``max_bytes``), or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({_file_kind(st.st_mode)}); only regular files are read"
    if st.st_size > max_bytes:
        return _too_large(st.st_size, max_bytes)
    return None


def _too_large(size: int, max_bytes: int) -> str:
    return f"file is larger than data.max_input_bytes ({size:,} > {max_bytes:,} bytes); raise the limit to encode it"


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")
