"""A tar read front to back once, header by header, each member's data in one read: ustar, GNU and
pax headers, gzip / bzip2 / xz compression, the member's kind (a link, a device or a sparse file is
named, never followed or read) and where its data starts (``TarMember.offset``), so a sample's
member is read again alone (``located``). A header that does not add up, or data cut short:
``TarFormatError``. Why not ``tarfile``: docs/design/encode.md, "The tar reader"."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from typing import IO, NamedTuple

BLOCK = 512
_ZEROS = bytes(BLOCK)
_KINDS = {b"0": "file", b"\0": "file", b"7": "file", b"5": "directory", b"1": "a hard link", b"2": "a symbolic link",
          b"3": "a character device", b"4": "a block device", b"6": "a FIFO", b"S": "a sparse file"}
_NO_DATA = ("directory", "a hard link", "a symbolic link", "a character device", "a block device", "a FIFO")
_COMPRESSED = ((b"\x1f\x8b", gzip.GzipFile), (b"BZh", bz2.BZ2File), (b"\xfd7zXZ\x00", lzma.LZMAFile))
_SIGNED = struct.Struct("148b8x356b")
_MAX_EXTENDED = 1 << 20
# What a compressed tar cut short or corrupt raises while it is decompressed.
STREAM_ERRORS = (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)


class TarFormatError(Exception):
    """Not a tar, or one cut short or corrupt where it was read."""


class TarMember(NamedTuple):
    """One member's header (a tuple: three are made per sample, a frozen dataclass costs more)."""

    name: str
    kind: str   # "file", "directory", or what else it is ("a symbolic link", ...)
    size: int   # its data's bytes (what ``read`` returns for a file)
    offset: int = 0  # where its data starts in the tar (after its headers; in a compressed tar, the decompressed stream)


def plain_name(name: str) -> str:
    """A member's path as archivers write it for files given as ``./x``: without that ``./``."""
    return name[2:] if name.startswith("./") else name


class TarReader:
    """``next()`` the next member's header (None at the end), then ``read()`` its data if it is
    wanted (the next ``next()`` passes over data not read)."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = decompressed(fh)
        self.compressed = self.fh is not fh
        self.pending = 0  # data + padding of the member last returned, not read yet
        self.started = False
        self.position = 0  # bytes of the (decompressed) tar read or skipped so far

    def next(self) -> TarMember | None:
        self._skip(self.pending)
        self.pending = 0
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            block = self._exact(BLOCK, "a header", allow_empty=True)
            if not block or block == _ZEROS:
                return None  # the end: two zero blocks (or a tar that stops after a member)
            kind, name, size = self._header(block)
            self.started = True
            padded = -size % BLOCK + size
            if kind in (b"x", b"L"):  # a pax extended header / a GNU long name, for the member after it
                if size > _MAX_EXTENDED:  # names and a few numbers: never read a huge one into memory
                    raise TarFormatError(f"an extended header of {size:,} bytes (at most {_MAX_EXTENDED:,} are read)")
                data = self._exact(padded, "an extended header")[:size]
                if kind == b"L":
                    long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                else:
                    pax = _pax_records(data)
                continue
            if kind in (b"g", b"K"):  # pax global header, GNU long link name: nothing a sample needs
                self._skip(padded)
                continue
            if kind == b"S":
                self._skip_sparse_map(block)
            name = pax.get("path") or long_name or name
            size = _pax_size(pax["size"]) if "size" in pax else size
            described = _KINDS.get(kind, f"of type {kind!r}")
            if any(key.startswith("GNU.sparse.") for key in pax):
                described = "a sparse file"
            self.pending = 0 if described in _NO_DATA else -size % BLOCK + size
            return TarMember(name=name.rstrip("/") if described == "directory" else name, kind=described, size=size,
                             offset=self.position)

    def read(self, member: TarMember) -> bytes:
        """The data of the member ``next`` returned last (once)."""
        data = self._exact(member.size, f"member {member.name!r}")
        self._skip(self.pending - member.size)
        self.pending = 0
        return data

    def _header(self, block: bytes) -> tuple[bytes, str, int]:
        try:
            stored = _number(block[148:156], "checksum")
            # Unsigned bytes, as POSIX says; some old writers summed signed ones (tarfile accepts both).
            if stored != sum(block) - sum(block[148:156]) + 256 and stored != sum(_SIGNED.unpack(block)) + 256:
                raise TarFormatError("a header's checksum does not match")
            size = _number(block[124:136], "size")
        except TarFormatError as exc:
            raise TarFormatError(f"not a tar file ({exc})" if not self.started else str(exc)) from None
        name = block[:100].split(b"\0", 1)[0]
        if block[257:265] == b"ustar\x0000" and block[345] != 0:  # POSIX ustar: a name prefix
            name = block[345:500].split(b"\0", 1)[0] + b"/" + name
        return block[156:157], name.decode("utf-8", "surrogateescape"), size

    def _exact(self, size: int, what: str, *, allow_empty: bool = False) -> bytes:
        data = self._read(size)
        while len(data) < size:
            more = self._read(size - len(data))
            if not more:
                if allow_empty and not data:
                    return b""
                raise TarFormatError(f"{what} is cut short ({len(data)} of {size} bytes)")
            data += more
        return data

    def _read(self, size: int) -> bytes:
        try:
            data = self.fh.read(size)
            self.position += len(data)
            return data
        except STREAM_ERRORS as exc:
            raise TarFormatError(f"{type(exc).__name__}: {exc}") from None

    def _skip(self, size: int) -> None:
        if size <= 0:
            return
        if self.fh.seekable():  # a large member over the limit is passed over, not read
            self.fh.seek(size, 1)
            self.position += size
            return
        while size > 0:
            size -= len(self._exact(min(size, 1 << 20), "a skipped member"))

    def _skip_sparse_map(self, block: bytes) -> None:
        """An old GNU sparse member's extra map blocks (their own flag says whether one more follows)."""
        extended = block[482]
        while extended:
            extended = self._exact(BLOCK, "a sparse map")[504]


def decompressed(fh: IO[bytes]) -> IO[bytes]:
    """``fh``, or a decompressing reader of it if its first bytes are a gzip, bzip2 or xz magic."""
    head = fh.read(6)
    fh.seek(-len(head), 1)
    for magic, opener in _COMPRESSED:
        if head.startswith(magic):
            return opener(fileobj=fh) if opener is gzip.GzipFile else opener(fh)  # type: ignore[operator]
    return fh


def _number(field: bytes, what: str) -> int:
    """A header's number: octal digits, or GNU's base-256 (first byte 0x80) for large sizes."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise TarFormatError(f"a header's {what} is not a number ({digits[:16]!r})") from None


def _pax_size(text: str) -> int:
    """A pax ``size`` record (decimal; what a member over 8 GiB has)."""
    if not text.isdigit():
        raise TarFormatError(f"a pax header's size is not a number ({text[:16]!r})")
    return int(text)


def _pax_records(data: bytes) -> dict[str, str]:
    """``"%d key=value\\n"`` records of a pax header."""
    records, at = {}, 0
    while at < len(data) and data[at:at + 1] != b"\0":
        space = data.find(b" ", at)
        try:
            length = int(data[at:space])
        except ValueError:
            raise TarFormatError("a pax header's record length is not a number") from None
        key, equals, value = data[space + 1:at + length - 1].partition(b"=")
        if length <= 0 or not equals:
            raise TarFormatError("a pax header's record is malformed")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records
