"""The storage conformance suite, in the style of zarr-python's StoreTests: what every
``featstore.storage.Storage`` must do, one class of tests that each backend's module subclasses
with a ``storage`` fixture (a fresh, empty location). The store-level suite (conformance.py)
runs the whole store through each URL scheme; this one pins down the object layer beneath it,
create-if-absent races included, so a new backend (or a layer such as the local cache) is
checked against the same contract."""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mmcache.featstore import format as fmt
from mmcache.featstore.storage import Storage


class StorageConformance:
    # Backends whose objects other processes see: the race also runs across processes.
    shared_across_processes = True

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError

    def test_is_a_storage(self, storage: Storage) -> None:
        assert isinstance(storage, Storage)
        assert isinstance(storage.is_remote, bool)
        assert storage.url

    def test_write_atomic_then_read(self, storage: Storage) -> None:
        storage.write_atomic("a/b/one.bin", b"hello")
        assert storage.read("a/b/one.bin") == b"hello"
        storage.write_atomic("a/b/one.bin", b"replaced")  # write_atomic replaces
        assert storage.read("a/b/one.bin") == b"replaced"
        assert storage.exists("a/b/one.bin") and storage.size("a/b/one.bin") == 8

    def test_missing_objects(self, storage: Storage) -> None:
        assert not storage.exists("nope/x")
        with pytest.raises(FileNotFoundError):
            storage.read("nope/x")
        assert storage.list_dir("nope") == []
        assert storage.list_fingerprints("nope") == {}
        storage.delete("nope/x")  # deleting what is not there is fine

    def test_write_parts_and_ranges(self, storage: Storage) -> None:
        parts = [b"0123", np.arange(6, dtype=np.uint8), memoryview(b"xyz")]
        storage.write_parts("big/obj", parts)
        whole = b"0123" + bytes(range(6)) + b"xyz"
        assert storage.read("big/obj") == whole
        out = np.empty(5, dtype=np.uint8)
        storage.read_ranges("big/obj", [(1, 3), (10, 13)], out)
        assert out.tobytes() == whole[1:3] + whole[10:13]
        assert storage.read_range("big/obj", 4, 8) == whole[4:8]

    def test_write_many_and_read_into(self, storage: Storage) -> None:
        objects = [(f"many/o{i}", [bytes([i]) * (i + 1), b"!"]) for i in range(5)]
        storage.write_many(objects)
        requests = [(key, [(0, 1), (len(parts[0]), len(parts[0]) + 1)], np.empty(2, dtype=np.uint8)) for key, parts in objects]
        storage.read_into(requests)
        for i, (_, _, out) in enumerate(requests):
            assert out.tobytes() == bytes([i]) + b"!"

    def test_listing(self, storage: Storage) -> None:
        assert storage.is_empty()
        for key in ("d/x1", "d/x2", "d/y1", "d/sub/z", "other"):
            storage.write_atomic(key, key.encode())
        assert not storage.is_empty()
        assert set(storage.list_dir("d")) >= {"x1", "x2", "y1"}
        assert "z" not in storage.list_dir("d")  # names directly under the prefix only
        assert storage.list_names("d", "x") == ["x1", "x2"]
        fingerprints = storage.list_fingerprints("d")
        assert {"x1", "x2", "y1"} <= set(fingerprints)

    def test_fingerprint_changes_when_an_object_is_rewritten(self, storage: Storage) -> None:
        storage.write_atomic("f/part", b"first version")
        before = storage.list_fingerprints("f")["part"]
        storage.delete("f/part")
        assert "part" not in storage.list_fingerprints("f")
        storage.write_atomic("f/part", b"other version")
        after = storage.list_fingerprints("f")["part"]
        if before:  # a backend with no fingerprint says '' (names only)
            assert after != before

    def test_write_new_creates_only_if_absent(self, storage: Storage) -> None:
        assert storage.write_new("n/key", b"mine")
        assert storage.write_new("n/key", b"mine")  # the very bytes: a retried request, not a loss
        assert not storage.write_new("n/key", b"theirs")
        assert storage.read("n/key") == b"mine"

    def test_write_new_race_between_threads(self, storage: Storage) -> None:
        start = threading.Barrier(8)

        def create(i: int) -> bool:
            start.wait()
            return storage.write_new("race/key", f"writer {i}".encode())

        with ThreadPoolExecutor(8) as pool:
            won = list(pool.map(create, range(8)))
        assert sum(won) == 1
        assert storage.read("race/key") == f"writer {won.index(True)}".encode()

    def test_write_new_race_between_processes(self, storage: Storage) -> None:
        if not self.shared_across_processes:
            pytest.skip("this backend's objects live inside one process (the thread race covers it)")
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(4) as pool:
            won = pool.starmap(_create_in_process, [(storage.url, i) for i in range(4)])
        assert sum(won) == 1
        assert storage.read("race/key") == f"process {won.index(True)}".encode()

    def test_get_file(self, storage: Storage, tmp_path) -> None:
        storage.write_parts("g/obj", [b"a" * 1000, b"b" * 10])
        storage.get_file("g/obj", str(tmp_path / "copy"))
        assert (tmp_path / "copy").read_bytes() == b"a" * 1000 + b"b" * 10

    def test_map_object_is_the_object_or_none(self, storage: Storage) -> None:
        storage.write_parts("m/obj", [bytes(range(200))])
        view = storage.map_object("m/obj", 200)
        assert view is None or view.tobytes() == bytes(range(200))

    def test_known_immutable_objects_read_the_same(self, storage: Storage) -> None:
        data = bytes(range(256)) * 40
        storage.write_parts("k/obj", [data])
        storage.known_objects({"k/obj": {"nbytes": len(data), "crc32c": fmt.crc32c(data)}})
        for _ in range(2):  # the second read may come from a cache
            out = np.empty(100, dtype=np.uint8)
            storage.read_ranges("k/obj", [(0, 50), (len(data) - 50, len(data))], out)
            assert out.tobytes() == data[:50] + data[-50:]


def _create_in_process(url: str, i: int) -> bool:
    from mmcache.featstore.backends import open_storage

    return open_storage(url).write_new("race/key", f"process {i}".encode())
