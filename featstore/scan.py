"""Full scans: shards read in large sequential blocks that their samples view without a copy.

A block is about ``BLOCK_BYTES`` of a shard's samples, one contiguous run per field: memory-mapped
locally (the page cache is the buffer), one batched ``read_into`` elsewhere. Blocks are loaded and
CRC-checked on background threads up to ``readahead_bytes`` ahead. A block is never reused: a
yielded array stays valid for as long as it is held (docs/design/store.md, "Full scans").
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import checksums
from .errors import CorruptionError

# ``store`` below is the reader's ``Store`` (its snapshot arrays and storage). It is not imported:
# the reader imports this module, and dependencies here run one way.
Store = Any

# Large enough that per-read costs vanish (and an object store's per-request latency), small
# enough that a remote block in memory and a checked-but-unconsumed run stay modest.
BLOCK_BYTES = 16 << 20
DEFAULT_READAHEAD_BYTES = 128 << 20
# Blocks whose samples average at least this are CRC-checked on the loading threads.
CHECK_AHEAD_BYTES = 256 << 10


@dataclass
class _Block:
    shard: str
    rows: range                      # index rows of the shard, in order
    fields: dict[str, tuple[int, int]]  # field -> element range [lo, hi) of the block's samples
    nbytes: int
    sizes: dict[str, list[int]]      # field -> elements of each row's sample


@dataclass
class _Loaded:
    block: _Block
    flat: dict[str, np.ndarray]      # field -> uint8 bytes of elements [lo, hi)
    elsewhere: dict[int, dict[str, np.ndarray]]  # row -> fields held by other shards
    bad: tuple[int, str] | None      # (row, field) of the first sample failing its checksum
    checked: bool                    # checksums checked (else the consumer checks each sample)


def plan_blocks(store: Store, shard: str, fields: Sequence[str] | None, block_bytes: int | None = None) -> Iterator[_Block]:
    """The blocks of ``shard`` with the fields it holds (of ``fields``, if given)."""
    block_bytes = block_bytes or BLOCK_BYTES
    held = store.shards[shard].layouts
    specs = store.fields
    samples = store.sample_index
    names = [f for f in (fields or specs) if f in held]
    rows = store.shard_rows(shard)
    sizes = {f: [math.prod(s) for s in samples.shapes[f][rows.start : rows.stop]] for f in names}
    offsets = {f: samples.offsets[f][rows.start : rows.stop].tolist() for f in names}
    itemsize = {f: np.dtype(specs[f].zarr_dtype).itemsize for f in names}
    start, nbytes = 0, 0
    for i in range(len(rows)):
        nbytes += sum(sizes[f][i] * itemsize[f] for f in names)
        if nbytes >= block_bytes or i == len(rows) - 1:
            span = range(start, i + 1)
            ranges = {f: (min(offsets[f][j] for j in span), max(offsets[f][j] + sizes[f][j] for j in span)) for f in names}
            # The index rows are the store's word: each block's range is bounded by the data before it is allocated.
            if bad := next((f for f, (lo, hi) in ranges.items() if lo < 0 or hi > held[f].elements), None):
                raise CorruptionError(f"{store.url}: shard {shard!r} field {bad!r}: the index points past the end of the data (run `mmcache verify {store.url}`)")
            yield _Block(shard, range(rows.start + start, rows.start + i + 1), ranges, nbytes, {f: sizes[f][start : i + 1] for f in names})
            start, nbytes = i + 1, 0


class Scanner:
    """Loads blocks for one scan of ``store`` and turns them into samples."""

    def __init__(self, store: Store, fields: Sequence[str] | None, *, whole: bool) -> None:
        self.store = store
        self.index = store.sample_index  # the per-sample index (featstore.sample_index)
        self.fields = fields
        # whole: a sample whose fields live in several shards is yielded once, with every field
        # it has (or ``fields``), at its first row; otherwise each row with this shard's fields.
        self.whole = whole and not (store.dense and all(f in store.fields for f in fields or ()))
        self._maps: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._in_page_cache: dict[str, bool] = {}

    # ---- loading (background threads) -----------------------------------------------------
    def load(self, block: _Block) -> _Loaded:
        store = self.store
        specs = store.fields
        flat: dict[str, np.ndarray] = {}
        requests = []
        for name, (lo, hi) in block.fields.items():
            itemsize = np.dtype(specs[name].zarr_dtype).itemsize
            key, ranges, mapped = self._field_bytes(block, name)
            if mapped is not None and len(ranges) <= 1:
                flat[name] = mapped[ranges[0][0] : ranges[0][1]] if ranges else mapped[:0]
            elif mapped is not None:  # inner chunks not back to back (not what our writer makes)
                flat[name] = np.concatenate([mapped[a:b] for a, b in ranges])
            else:
                flat[name] = np.empty((hi - lo) * itemsize, dtype=np.uint8)
                requests.append((key, ranges, flat[name]))
        if requests:
            store.storage.read_into(requests)
        # Checked here, beside the consumer, without the GIL (the checks fault the pages in):
        # large samples one by one; small ones as a whole run per field against the CRC their
        # CRCs make together (one sample at a time, thousands of short calls would pass the GIL
        # back and forth with the consumer's loop). Without a GIL-free checksum (google_crc32c
        # alone), small samples are checked as they are handed out.
        bad, checked = None, False
        if store.verify_reads and block.nbytes >= CHECK_AHEAD_BYTES * len(block.rows):
            bad, checked = self._check(block, flat), True
        elif store.verify_reads and checksums.crc32c_releases_gil():
            bad, checked = self._check_runs(block, flat)
        if not checked:
            for array in flat.values():
                _fault_in(array)
        return _Loaded(block, flat, self._elsewhere(block, flat), bad, checked)

    def _field_bytes(self, block: _Block, name: str) -> tuple[str, list[tuple[int, int]], np.ndarray | None]:
        """(the object holding field ``name`` of the block, the byte ranges of the block's
        samples in it, the object mapped, or None where it cannot be)."""
        store, (lo, hi) = self.store, block.fields[name]
        info = store.shards[block.shard]
        key = info.data_key(name)
        ranges = store.byte_ranges(block.shard, name, lo, hi - lo)
        return key, ranges, self._map(block.shard, name, key, info.objects[key]["nbytes"])

    def in_page_cache(self, block: _Block) -> bool:
        """Whether the block's shard is (mostly) mapped and in the page cache, judged once per
        shard from its first block's pages (probing every block cost a warm scan ~5%). False
        where that cannot be told; and on an error, which ``load`` then raises in its turn."""
        cached = self._in_page_cache.get(block.shard)
        if cached is None:
            shares = []
            try:
                for name in block.fields:
                    key, ranges, mapped = self._field_bytes(block, name)
                    if mapped is None or not self.store.storage.page_cache_visible(key):
                        shares.append(0.0)
                    elif ranges:
                        shares.append(_resident_share(mapped[ranges[0][0] : ranges[-1][1]]))
            except Exception:  # noqa: BLE001 - the block's own load reports it, in order
                shares.append(0.0)
            # Not all: the page cache may have dropped a few pages of a file read a while ago.
            cached = self._in_page_cache[block.shard] = min(shares, default=1.0) >= 0.75
        return cached

    def _map(self, shard: str, field: str, key: str, nbytes: int) -> np.ndarray | None:
        if self.store.storage.is_remote:
            return None
        with self._lock:
            mapped = self._maps.get((shard, field))
            if mapped is None:
                mapped = self.store.storage.map_object(key, nbytes)
                if mapped is None:
                    return None
                self._maps[(shard, field)] = mapped
                # Only the objects being loaded stay mapped here; samples keep their own maps alive.
                while len(self._maps) > 8:
                    self._maps.popitem(last=False)
            return mapped

    def _yielded(self, block: _Block) -> list[int]:
        if not self.whole:
            return list(block.rows)
        return [row for row in block.rows if self.index.is_first(row)]

    def _check(self, block: _Block, flat: dict[str, np.ndarray]) -> tuple[int, str] | None:
        """The first (row, field) that fails its CRC-32C, of the rows this scan yields (rows it
        skips are duplicates readers ignore, or fields read for their sample from here anyway,
        with their own check, by ``_elsewhere``)."""
        store, index = self.store, self.index
        rows = self._yielded(block)
        crc32c = checksums.crc32c_function(release_gil=True)  # the GIL is free for others meanwhile
        bad: tuple[int, str] | None = None
        for name, (lo, _) in block.fields.items():
            data, shapes = flat[name], index.shapes[name]
            itemsize = np.dtype(store.fields[name].zarr_dtype).itemsize
            offsets, crcs = index.offsets[name], index.crcs[name]
            for row in rows:
                if bad is not None and row >= bad[0]:
                    break
                at = (int(offsets[row]) - lo) * itemsize
                if crc32c(data[at : at + math.prod(shapes[row]) * itemsize]) != crcs[row]:
                    bad = (row, name)
                    break
        return bad

    def _check_runs(self, block: _Block, flat: dict[str, np.ndarray]) -> tuple[tuple[int, str] | None, bool]:
        """(as ``_check``, True) from one checksum per field over the block's run of samples,
        compared with the CRC-32C that the samples' own CRCs make back to back: a flipped byte in
        any one sample changes the run's CRC as surely as its own (advancing a CRC by the bytes
        after it is invertible). On a mismatch, the samples one by one say which. (None, False)
        where the run holds bytes of no sample: then each sample is checked as handed out."""
        store, index, rows = self.store, self.index, block.rows
        for name, (lo, hi) in block.fields.items():
            offsets, sizes = index.offsets[name][rows.start : rows.stop], np.array(block.sizes[name], dtype=np.int64)
            if offsets[0] != lo or offsets[-1] + sizes[-1] != hi or (offsets[1:] != offsets[:-1] + sizes[:-1]).any():
                return None, False
        for name in block.fields:
            itemsize = np.dtype(store.fields[name].zarr_dtype).itemsize
            crcs = index.crcs[name][rows.start : rows.stop]
            if checksums.crc32c(flat[name], release_gil=True) != checksums.crc32c_concat(crcs, np.array(block.sizes[name], dtype=np.int64) * itemsize):
                return self._check(block, flat), True
        return None, True

    def _elsewhere(self, block: _Block, flat: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
        """Fields of the block's samples that other shards hold (added to the store later)."""
        if not self.whole:
            return {}
        store = self.store
        wanted: dict[tuple[str, ...], list[int]] = {}
        for row in block.rows:
            if self.index.is_first(row):
                names = tuple(f for f in store.fields_to_read(row, self.fields) if f not in flat)
                if names:
                    wanted.setdefault(names, []).append(row)
        out: dict[int, dict[str, np.ndarray]] = {}
        for names, group in wanted.items():
            # Copies of what reads map read-only: a scan's arrays are the caller's to write to.
            read = ({f: a if a.flags.writeable else a.copy() for f, a in sample.items()} for sample in store.read_rows(group, list(names)))
            out.update(zip(group, read, strict=True))
        return out

    # ---- handing out (the caller's thread) -------------------------------------------------
    def samples(self, loaded: _Loaded) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        store, index, block = self.store, self.index, loaded.block
        specs = store.fields
        first, stop = block.rows.start, block.rows.stop
        # Per-field columns of the block as plain lists: the loop below runs once per sample.
        views = []
        for name, (lo, _) in block.fields.items():
            dtype = specs[name].numpy_dtype
            views.append((name, loaded.flat[name], dtype, dtype.itemsize, lo, index.offsets[name][first:stop].tolist(),
                          index.shapes[name][first:stop], index.crcs[name][first:stop].tolist()))
        check_here = store.verify_reads and not loaded.checked
        crc32c = checksums.crc32c_function(release_gil=False)  # short calls: releasing costs more
        ids, first_row = index.ids, index.row_of
        for i, row in enumerate(block.rows):
            sample_id = ids[row]
            if self.whole and first_row[sample_id] != row:
                continue  # this row adds fields to a sample listed earlier: yielded there
            if loaded.bad is not None and loaded.bad[0] == row:
                raise self._corrupt(block.shard, sample_id, loaded.bad[1])
            sample = {}
            for name, data, dtype, itemsize, lo, offsets, shapes, crcs in views:
                shape = shapes[i]
                at = (offsets[i] - lo) * itemsize
                raw = data[at : at + math.prod(shape) * itemsize]
                if check_here and crc32c(raw) != crcs[i]:
                    raise self._corrupt(block.shard, sample_id, name)
                sample[name] = raw.view(dtype).reshape(shape)
            if loaded.elsewhere:
                sample.update(loaded.elsewhere.get(row, {}))
            yield sample_id, sample

    def _corrupt(self, shard: str, sample_id: str, field: str) -> CorruptionError:
        store = self.store
        return CorruptionError(
            f"{store.url}: sample {sample_id!r} field {field!r} in shard {shard!r} fails its checksum "
            f"(object {store.shards[shard].data_key(field)}); run `mmcache verify {store.url}` for a full report"
        )


def _fault_in(view: np.ndarray) -> None:
    """Bring a mapped block's pages in now, on this (loading) thread, rather than one page fault
    after another on the consumer's: for a cold block, its reads from disk."""
    owner, mapping = _mapping_of(view)
    if mapping is None or not view.size:
        return
    if checksums.crc32c_releases_gil():
        # A checksum pass (its value unused) faults every page in without the GIL, so the
        # consumer runs meanwhile; Python's mmap.madvise holds the GIL for the whole populate,
        # and MADV_POPULATE_READ called from 8 threads through libc (without the GIL) read a cold
        # store here at 2/3 the speed of these passes' faults.
        checksums.crc32c(view, release_gil=True)
        return
    start = view.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
    aligned = start - start % mmap.PAGESIZE
    try:
        mapping.madvise(_MADV_POPULATE_READ, aligned, start + view.size - aligned)  # Linux 5.14+
    except OSError:
        pass  # an older kernel: the consumer's page faults do the same, a page at a time


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _resident_share(view: np.ndarray) -> float:
    """The share of the pages under a mapped ``view`` that are in the page cache, probed with
    ``mincore`` at one page per 2 MiB (huge folios come whole; the kernel answers ``mincore``
    page by page, so asking for every page of 16 MiB costs a tenth of their checksum). 0.0 where
    it cannot be told (not a mapping, no ``mincore``, a failed call): the pool for the disk."""
    _, mapping = _mapping_of(view)
    if mapping is None or not view.size or _mincore is None:
        return 0.0
    start = view.__array_interface__["data"][0]
    pages = [page - page % mmap.PAGESIZE for page in [*range(start, start + view.size, _PROBE_STRIDE), start + view.size - 1]]
    probe = np.zeros(1, dtype=np.uint8)
    resident = 0
    for page in pages:
        if _mincore(page, mmap.PAGESIZE, probe.ctypes.data) != 0:
            return 0.0
        resident += bool(probe[0] & 1)
    return resident / len(pages)


_PROBE_STRIDE = 2 << 20


def _libc_mincore() -> Callable[[int, int, int], int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    call.argtypes, call.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int
    return call  # type: ignore[no-any-return]


_mincore = _libc_mincore()
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; Python 3.11 lacks the name


def _mapping_of(view: np.ndarray) -> tuple[np.ndarray, mmap.mmap | None]:
    """(the array over the whole mapping, the mmap) that ``view`` is a view of, if it is one."""
    owner = view
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    exporter = owner.base.obj if isinstance(owner.base, memoryview) else owner.base  # numpy 2 wraps it
    return owner, exporter if isinstance(exporter, mmap.mmap) else None


def pipelined(blocks: Iterator[_Block], load: Callable[[_Block], _Loaded], readahead_bytes: int, workers: int,
              in_memory: Callable[[_Block], bool] | None = None) -> Iterator[_Loaded]:
    """``load`` of each block in order, up to ``readahead_bytes`` of blocks ahead of the one the
    caller holds (always at least one), on ``workers`` threads; 0 loads in the caller's thread.

    ``in_memory``: blocks it finds in memory load on as many threads as there are cores, the rest
    on ``workers``. Closing this generator (or dropping it) cancels the blocks not started and
    joins every thread before it returns. Loading a block in memory is pure CPU (checksums over mapped pages), and more
    such threads than cores thrash each other (warm, 8 on 2 cores: 1.5x the CPU of 2, a scan
    ~15% slower); a block on disk mostly waits, and many waits at once keep the disk busy."""
    if readahead_bytes <= 0:
        yield from map(load, blocks)
        return
    with contextlib.ExitStack() as pools:
        waiting = pools.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="featstore-scan"))
        busy = pools.enter_context(ThreadPoolExecutor(_usable_cores(), thread_name_prefix="featstore-check")) if in_memory else waiting
        ahead: deque[tuple[int, Future[_Loaded]]] = deque()
        in_flight = 0
        pending = iter(blocks)
        exhausted = False
        try:
            while True:
                while not exhausted and (not ahead or in_flight < readahead_bytes):
                    block = next(pending, None)
                    if block is None:
                        exhausted = True
                        break
                    pool = busy if in_memory and in_memory(block) else waiting
                    ahead.append((block.nbytes, pool.submit(load, block)))
                    in_flight += block.nbytes
                if not ahead:
                    return
                nbytes, future = ahead.popleft()
                in_flight -= nbytes
                yield future.result()
        finally:
            for _, future in ahead:
                future.cancel()


def scan_samples(store: Store, shards: Sequence[str], fields: Sequence[str] | None, *, whole: bool, readahead_bytes: int,
                 block_bytes: int | None = None) -> Generator[tuple[str, dict[str, Any]], None, None]:
    scanner = Scanner(store, fields, whole=whole)
    blocks = (b for shard in shards for b in plan_blocks(store, shard, fields, block_bytes))
    # Remote: requests in flight. Local, blocks on disk: every block of the read-ahead window
    # loading at once (within reason): their page faults are a cold scan's disk reads in flight
    # (4 threads read a cold store here at a third of the speed of 8). Blocks in the page cache:
    # one thread a core.
    remote = store.storage.is_remote
    workers = 4 if remote else max(2, min(16, readahead_bytes // (block_bytes or BLOCK_BYTES)))
    for loaded in pipelined(blocks, scanner.load, readahead_bytes, workers, None if remote else scanner.in_page_cache):
        yield from scanner.samples(loaded)
