"""Where a PNG's metadata chunks lie, without decoding it (a trainer sizing media from headers).

Pillow parses a PNG's chunks up to its first IDAT when it opens it; an eXIf chunk, or text that
may hold XMP (whose orientation ``exif_transpose`` also honours), may follow the pixels, and
Pillow finds those only by decoding the picture. ``text_after_pixels`` tells whether there is
any from the file's last bytes: the last IDAT chunk is found in them (its length and CRC-32 must
match, so bytes of compressed pixels that happen to spell "IDAT" are not taken for it) and the
chunks after it are read forward. Where the last IDAT begins before those bytes, every chunk
header is visited instead (a seek over each chunk's data).
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import BinaryIO

TEXT_CHUNKS = (b"eXIf", b"iTXt", b"tEXt", b"zTXt")
TAIL_BYTES = 1 << 17  # encoders write IDAT chunks of 8-64 KiB: the last one fits


def text_after_pixels(data: bytes | BinaryIO) -> bool:
    """Whether the PNG has a metadata chunk after its first IDAT, or cannot be walked to its
    IEND (then the caller decodes it, as Pillow does, and a damaged file says so)."""
    fh = io.BytesIO(data) if isinstance(data, bytes) else data
    end = fh.seek(0, io.SEEK_END)
    start = max(8, end - TAIL_BYTES)
    fh.seek(start)
    tail = fh.read(end - start)
    at = _after_last_pixels(tail)
    if at is None:
        return _walk(fh)
    while at + 8 <= len(tail):
        length, kind = struct.unpack(">I4s", tail[at:at + 8])
        if kind == b"IEND":
            return False
        if kind in TEXT_CHUNKS:
            return True
        at += 12 + length
    return True


def _after_last_pixels(tail: bytes) -> int | None:
    """The offset in ``tail`` just past the last whole, CRC-checked IDAT chunk, or None."""
    hi = len(tail)
    while (kind_at := tail.rfind(b"IDAT", 0, hi)) >= 4:
        length = int.from_bytes(tail[kind_at - 4:kind_at], "big")
        end = kind_at + 4 + length + 4
        if end <= len(tail) and zlib.crc32(tail[kind_at:end - 4]) == int.from_bytes(tail[end - 4:end], "big"):
            return end
        hi = kind_at + 3  # look further left
    return None


def _walk(fh: BinaryIO) -> bool:
    """``text_after_pixels`` by visiting every chunk header from the start."""
    fh.seek(8)
    seen_pixels = False
    while len(header := fh.read(8)) == 8:
        length, kind = struct.unpack(">I4s", header)
        if kind == b"IEND":
            return False
        if seen_pixels and kind in TEXT_CHUNKS:
            return True
        seen_pixels = seen_pixels or kind == b"IDAT"
        fh.seek(length + 4, io.SEEK_CUR)  # the chunk's data and CRC
    return True
