"""64-bit hashes of sample ids (FNV-1a over their UTF-8 bytes), computed for a whole Arrow string
column at once. An index checkpoint keeps the sorted set of its ids' hashes
(``checkpoints/<digest>.ids.u64``, docs/FORMAT.md): whether the few ids committed after it repeat
one it covers is then a binary search, not a read of every id. A hash found there proves nothing
(two ids may share one) and sends the reader to the ids themselves; a hash not found proves the
id new.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_OFFSET = np.uint64(0xCBF29CE484222325)
_PRIME = np.uint64(0x100000001B3)


def id_hashes(ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """FNV-1a 64 of each id, as uint64 (one pass over the column per byte of the longest id)."""
    array = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    array = array.cast(pa.large_string())  # 64-bit offsets, whatever the column's were
    n = len(array)
    hashes = np.full(n, _OFFSET, dtype=np.uint64)
    if not n:
        return hashes
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64, count=n + 1, offset=array.offset * 8)
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    # Longest first: the ids still going at byte j are then a prefix of this order.
    order = np.argsort(-lengths, kind="stable")
    starts, lengths = starts[order], lengths[order]
    h = hashes[order]
    for j in range(int(lengths[0])):
        live = int(np.searchsorted(-lengths, -j, side="left"))  # ids longer than j bytes
        h[:live] = (h[:live] ^ data[starts[:live] + j]) * _PRIME
    hashes[order] = h
    return hashes


def any_known(hashes: np.ndarray, known: np.ndarray) -> bool:
    """Whether any of ``hashes`` is in ``known`` (sorted, unique)."""
    if not len(known) or not len(hashes):
        return False
    at = np.searchsorted(known, hashes)
    return bool((known[np.minimum(at, len(known) - 1)] == hashes).any())
