"""CRC-32C, the checksum of every object and sample in a store: which library computes it
(whether the GIL is released), and the CRC of a concatenation from its parts' CRCs.

Its home is here; featstore.format re-exports the public names for older importers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import google_crc32c
import numpy as np

# awscrt (a dependency) releases the GIL and is the faster; google_crc32c (zarr's) holds it for
# anything but ``bytes``, and is the fallback. awscrt is imported on first use: a CLI command that
# never checks a large buffer should not pay for it. (Figures: docs/design/store.md, "Checksums".)
_LARGE = 1 << 20  # from here on (or on request) a buffer goes to the releasing library


@functools.cache
def _releasing_crc32c() -> Callable[[Any, int], int] | None:
    """A CRC-32C (data, crc) -> crc that releases the GIL: awscrt's, or None where it is missing."""
    try:
        from awscrt import checksums
    except ImportError:
        return None
    return checksums.crc32c  # type: ignore[no-any-return]


def crc32c_releases_gil() -> bool:
    return _releasing_crc32c() is not None


def crc32c(data: Any, crc: int = 0, *, release_gil: bool | None = None) -> int:
    """CRC-32C of a buffer (continuing from ``crc``), hardware-accelerated.

    ``release_gil``: True on a background thread, so the check runs beside other threads' Python
    code; False for many short calls on a thread others wait on (each release may hand the GIL to
    a waiting thread for a whole switch interval); None: released for buffers of 1 MiB or more.
    The GIL is released only where ``crc32c_releases_gil()``."""
    # A view as uint8 makes any contiguous array (bfloat16 too) acceptable to both libraries,
    # and google_crc32c takes no writable memoryview.
    if not isinstance(data, bytes):
        data = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytearray, memoryview)) else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if release_gil is not False and (release_gil or len(data) >= _LARGE) and (releasing := _releasing_crc32c()) is not None:
        return releasing(data, crc)
    return google_crc32c.extend(crc, data)


def crc32c_function(*, release_gil: bool) -> Callable[[Any], int]:
    """``crc32c(data, release_gil=...)`` for hot loops over contiguous uint8 arrays: the library
    call itself, without ``crc32c``'s conversions (a few microseconds a call, as much as the
    checksum of a 32 KB sample takes)."""
    releasing = _releasing_crc32c() if release_gil else None
    if releasing is not None:
        return lambda data: releasing(data, 0)
    return functools.partial(google_crc32c.extend, 0)


# CRC-32C (reflected polynomial 0x82F63B78) of a concatenation from the CRCs of its parts, as
# zlib's crc32_combine does for CRC-32: appending n zero bytes to a CRC register is a linear map
# over GF(2), and the maps for n = 2^k bytes are precomputed once. A writer thus checksums each
# sample once and derives the whole object's CRC without a second pass over the bytes.
def _gf2_times(matrix: list[int], vector: int) -> int:
    out, row = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[row]
        vector >>= 1
        row += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, column) for column in matrix]


def _zero_byte_operators(count: int = 48) -> list[list[int]]:
    one_bit = [0x82F63B78] + [1 << n for n in range(31)]
    op = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # 8 zero bits: one byte
    ops = []
    for _ in range(count):
        ops.append(op)
        op = _gf2_square(op)
    return ops


_ZERO_BYTES = _zero_byte_operators()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of A+B from crc(A), crc(B) and len(B)."""
    bit = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_BYTES[bit], crc1)
        len2 >>= 1
        bit += 1
    return crc1 ^ crc2


def crc32c_concat(crcs: Any, lengths: Any) -> int:
    """CRC-32C of buffers back to back, from their CRCs and byte lengths (in order): what folding
    ``crc32c_combine`` over them gives, for many at once in ~100 numpy calls whatever their
    number. crc(A+B) is crc(A) advanced by len(B) zero bytes, XOR crc(B); so the whole is the XOR
    of every CRC advanced by the bytes after it. Advancing by n is the product of the operators
    for n's hexadecimal digits, each applied to all CRCs at once through byte tables."""
    values = np.array(crcs, dtype=np.uint32)
    sizes = np.asarray(lengths, dtype=np.int64)
    if not values.size:
        return 0
    after = np.cumsum(sizes[::-1])[::-1] - sizes
    for position in range((int(after.max()).bit_length() + 3) // 4):
        tables, digit = _advance_tables(position), (after >> (4 * position)) & 15
        values = (tables[digit, 0, values & 0xFF] ^ tables[digit, 1, (values >> 8) & 0xFF]
                  ^ tables[digit, 2, (values >> 16) & 0xFF] ^ tables[digit, 3, values >> 24])
    return int(np.bitwise_xor.reduce(values))


@functools.cache
def _advance_tables(position: int) -> np.ndarray:
    """[d, b, v]: the operator for d * 16**position zero bytes applied to the value v in byte b
    of a CRC; the XOR over a CRC's four bytes is the operator applied to it (d = 0: itself)."""
    has_bit = (np.arange(256)[None, :] >> np.arange(8)[:, None]) & 1 == 1  # [i, v]: bit i of v
    tables = np.zeros((16, 4, 256), dtype=np.uint32)
    operator = [1 << n for n in range(32)]  # identity, then each digit's operator in turn
    for d in range(16):
        if d:
            operator = [_gf2_times(_ZERO_BYTES[4 * position], column) for column in operator]  # one more 16**position
        columns = np.array(operator, dtype=np.uint32).reshape(4, 8, 1)  # [byte, i]: the image of bit 8 * byte + i
        tables[d] = np.bitwise_xor.reduce(np.where(has_bit, columns, np.uint32(0)), axis=1)
    return tables
