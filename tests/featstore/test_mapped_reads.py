"""Reads of a local store view its mapped shard objects: no copy, the CRC checked over the mapped
bytes in place, read-only arrays; a byte flipped in the file is still caught (real files)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mmcache import featstore
from mmcache.featstore.errors import CorruptionError
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples


@pytest.fixture
def written(tmp_path) -> tuple[str, list]:
    url = str(tmp_path / "store")
    samples = ragged_samples(12, seed=5)
    with featstore.create(url, fields=FIELDS, shard_bytes=1500) as writer:
        for sample_id, arrays, meta in samples:
            writer.add(sample_id, arrays, meta)
    return url, samples


def _flip(store, position: int, field: str) -> None:
    """Flip one byte of the sample's bytes in its shard's data object, in place in the file (as
    outside damage would: the object keeps its inode, so a map of it already made sees it)."""
    shard = store.index.column("shard")[position].as_py()
    offset = store.index.column(f"{field}.offset")[position].as_py() * np.dtype(store.fields[field].zarr_dtype).itemsize
    fd = os.open(os.path.join(store.url, store.shards[shard].data_key(field)), os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)[0]
        os.pwrite(fd, bytes([byte ^ 0x10]), offset)
    finally:
        os.close(fd)


def test_a_local_read_is_a_read_only_view_of_the_mapped_object_with_the_written_bytes(written):
    url, samples = written
    with featstore.open(url) as store:
        assert len(store.shards) > 2
        for position, (sample_id, arrays, _) in enumerate(samples):
            by_position, by_id = store.read_at(position), store.read(sample_id)
            for name, want in arrays.items():
                assert_same(by_position[name], want)
                assert not by_position[name].flags.writeable
                # Both reads view the same mapped bytes: nothing was copied.
                assert np.shares_memory(by_position[name], by_id[name]) or by_position[name].size == 0
        held = store.read_at(3)["latent"]
        with pytest.raises(ValueError, match="read-only"):
            held[...] = 0
        tensors = store.read_at(3, format="torch")  # torch has no read-only tensors: a copy it may write
        tensors["latent"].zero_()
        assert_same(store.read_at(3)["latent"], samples[3][1]["latent"])
        assert isinstance(tensors["text"], torch.Tensor)
        assert store.storage._views  # the maps kept for the next reads
    assert not store.storage._views  # close() drops them; a view still held keeps its own map
    assert_same(held, samples[3][1]["latent"])


def test_a_flipped_byte_in_a_mapped_object_fails_its_checksum(written):
    url, samples = written
    store = featstore.open(url)
    assert_same(store.read_at(7)["latent"], samples[7][1]["latent"])  # its object is mapped now
    _flip(store, 7, "latent")
    with pytest.raises(CorruptionError, match=rf"sample '{samples[7][0]}' field 'latent' .* fails its checksum"):
        store.read_at(7)
    with pytest.raises(CorruptionError, match="fails its checksum"):
        featstore.open(url).read(samples[7][0])  # a fresh map of the damaged file too
    assert_same(store.read_at(6)["text"], samples[6][1]["text"])  # the others read as written
    unchecked = featstore.open(url, verify_reads=False).read_at(7)["latent"]
    assert not np.array_equal(unchecked.view(np.uint8), samples[7][1]["latent"].view(np.uint8))


def test_mapped_objects_are_kept_up_to_a_bound_and_reads_stay_right(written, monkeypatch):
    url, samples = written
    store = featstore.open(url)
    monkeypatch.setattr(store.storage, "MAX_MAPS", 2)
    held = [store.read_at(p) for p in range(len(samples))]  # every shard, more than two objects
    assert len(store.storage._views) == 2
    for got, (_, arrays, _) in zip(held, samples, strict=True):
        for name, want in arrays.items():
            assert_same(got[name], want)  # views of maps dropped from the cache are still valid
    store.close()


def test_a_truncated_object_is_refused_before_it_is_mapped(written):
    url, samples = written
    store = featstore.open(url)
    shard = store.index.column("shard")[len(samples) - 1].as_py()
    path = os.path.join(url, store.shards[shard].data_key("latent"))
    os.truncate(path, 100)  # a map past the end would SIGBUS when read
    with pytest.raises(CorruptionError, match="truncated"):
        store.read_at(len(samples) - 1)
