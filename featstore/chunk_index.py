"""Where a sample's bytes are in its shard's objects: each field object's zarr shard index (its
tail), read once per (shard, field) and kept, and the byte ranges of a run of elements.

The reader's (``Store.chunk_index``): per-sample reads, batched reads and scans all ask it.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from . import format as fmt
from .errors import CorruptionError
from .index import ShardInfo
from .storage import Storage


class ChunkIndex:
    """The shard indexes of ``shards``' field objects in ``storage``, read when first needed."""

    def __init__(self, storage: Storage, shards: dict[str, ShardInfo], url: str) -> None:
        self.storage, self.shards, self.url = storage, shards, url
        self._lock = threading.Lock()
        self._chunks: dict[tuple[str, str], np.ndarray] = {}

    def ranges(self, shard: str, spec: fmt.FieldSpec, start: int, count: int) -> list[tuple[int, int]]:
        """The byte ranges of elements ``[start, start + count)`` of field ``spec`` in ``shard``'s
        object; a CorruptionError where the index row points past the end of the data."""
        layout = self.shards[shard].layouts[spec.name]
        itemsize = np.dtype(spec.zarr_dtype).itemsize
        if start < 0 or count < 0 or start + count > layout.elements:
            raise CorruptionError(f"{self.url}: shard {shard!r} field {spec.name!r}: the index points past the end of the data "
                                  f"(run `mmcache verify {self.url}`)")
        return fmt.byte_ranges(self.chunks(shard, spec.name), layout, start, count, itemsize)

    def load(self, pairs: set[tuple[str, str]]) -> None:
        """Fetch the shard indexes of many (shard, field) pairs in one batched read."""
        missing = sorted(p for p in pairs if p not in self._chunks)
        if len(missing) < 2:
            for shard, field in missing:
                self.chunks(shard, field)
            return
        requests = []
        for shard, field in missing:
            info = self.shards[shard]
            data_key = self.shards[shard].data_key(field)
            size = info.objects[data_key]["nbytes"]
            tail = np.empty(fmt.index_nbytes(info.layouts[field].num_chunks), dtype=np.uint8)
            requests.append((data_key, [(size - tail.size, size)], tail))
        self.storage.read_into(requests)
        for (shard, field), (data_key, _, tail) in zip(missing, requests, strict=True):
            chunks = fmt.parse_shard_index(tail.tobytes(), self.shards[shard].layouts[field].num_chunks, f"{self.url}/{data_key}")
            with self._lock:
                self._chunks[(shard, field)] = chunks

    def chunks(self, shard: str, field: str) -> np.ndarray:
        """The parsed shard index of ``field``'s object in ``shard``."""
        key = (shard, field)
        chunks = self._chunks.get(key)
        if chunks is None:
            info = self.shards[shard]
            layout = info.layouts[field]
            data_key = self.shards[shard].data_key(field)
            size = info.objects[data_key]["nbytes"]
            tail_len = fmt.index_nbytes(layout.num_chunks)
            tail = self.storage.read_range(data_key, size - tail_len, size)
            chunks = fmt.parse_shard_index(tail, layout.num_chunks, f"{self.url}/{data_key}")
            with self._lock:
                self._chunks[key] = chunks
        return chunks

    def field_bytes(self, shard: str, name: str, ranges: list[tuple[int, int]], nbytes: int) -> np.ndarray:
        """A field's bytes, flat: where the storage maps objects (local disk) and they are one range
        (the writer puts a sample's chunks back to back), a read-only view of the mapped object,
        checked in place by the caller: no copy at all; else read into a new buffer."""
        key = self.shards[shard].data_key(name)
        if len(ranges) == 1:
            view = self.storage.view_range(key, self.shards[shard].objects[key]["nbytes"], *ranges[0])
            if view is not None:
                return view
        out = np.empty(nbytes, dtype=np.uint8)
        if ranges:
            self.storage.read_ranges(key, ranges, out)
        return out

    def read_field(self, shard: str, spec: fmt.FieldSpec, shape: tuple[int, ...], offset: int) -> np.ndarray:
        """The array of shape ``shape`` whose elements start at ``offset`` of field ``spec`` in
        ``shard`` (unchecked: the caller checks its CRC-32C)."""
        count = math.prod(shape)
        # The ranges first: they bound the index row's shape by the shard's data before anything is allocated.
        ranges = self.ranges(shard, spec, offset, count) if count else []
        return self.field_bytes(shard, spec.name, ranges, count * spec.numpy_dtype.itemsize).view(spec.numpy_dtype).reshape(shape)

    def read_many(self, samples: list[dict[str, tuple[str, fmt.FieldSpec, tuple[int, ...], int]]]) -> list[dict[str, np.ndarray]]:
        """Many samples' arrays, given per field as (shard, spec, shape, element offset), read in
        one batch of requests (concurrent on an object store); unchecked, as ``read_field``."""
        self.load({(shard, name) for sample in samples for name, (shard, *_) in sample.items()})
        requests, out = [], []
        for sample in samples:
            arrays = {}
            for name, (shard, spec, shape, offset) in sample.items():
                count = math.prod(shape)
                ranges = self.ranges(shard, spec, offset, count) if count else []
                array = np.empty(shape, dtype=spec.numpy_dtype)
                if count:
                    requests.append((self.shards[shard].data_key(name), ranges, array.reshape(-1).view(np.uint8)))
                arrays[name] = array
            out.append(arrays)
        self.storage.read_into(requests)
        return out
