"""Every storage backend through the one storage conformance suite: local files, fsspec's
memory filesystem, real S3 over HTTP (the tests' moto server), and the local read-through cache
in front of a remote storage."""

import uuid

import fsspec
import pytest

from mmcache.featstore.cache import CachingStorage
from mmcache.featstore.backends import open_storage
from tests.featstore.storage_conformance import StorageConformance


def _memory_url():
    name = f"storage-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


class TestLocalStorage(StorageConformance):
    @pytest.fixture
    def storage(self, tmp_path):
        return open_storage(str(tmp_path / "store"))


class TestMemoryStorage(StorageConformance):
    shared_across_processes = False  # memory:// lives inside one process

    @pytest.fixture
    def storage(self):
        for url in _memory_url():
            yield open_storage(url)


class TestS3Storage(StorageConformance):
    @pytest.fixture
    def storage(self, s3_bucket):
        return open_storage(f"{s3_bucket}/store")


class TestCachingStorage(StorageConformance):
    shared_across_processes = False  # its remote here is memory://

    @pytest.fixture
    def storage(self, tmp_path):
        for url in _memory_url():
            cache = CachingStorage(open_storage(url), tmp_path / "cache", 1 << 20)
            assert cache.local_cache is cache
            yield cache
            cache.close()


def test_only_the_cache_reports_a_local_cache(tmp_path):
    assert open_storage(str(tmp_path / "s")).local_cache is None


def test_the_cache_serves_a_known_object_from_local_disk(tmp_path):
    from mmcache.featstore import format as fmt

    for url in _memory_url():
        remote = open_storage(url)
        data = bytes(range(256)) * 40
        remote.write_parts("k/obj", [data])
        cache = CachingStorage(remote, tmp_path / "cache", 1 << 20)
        cache.known_objects({"k/obj": {"nbytes": len(data), "crc32c": fmt.crc32c(data)}})
        assert cache.read_range("k/obj", 0, 10) == data[:10]
        remote.delete("k/obj")  # gone remotely: only the local copy can answer now
        assert cache.read_range("k/obj", 100, 110) == data[100:110]
        assert cache.stats()["hits"] >= 1
        cache.close()
