"""The local read-through cache of a remote store (``mmcache.featstore.open(..., cache_dir=)``) against
real S3 over HTTP: later reads are local, the size bound holds, entries are never stale, partial
or corrupt, several processes can share one directory, and a damaged remote object is refused."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import fsspec
import numpy as np
import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore.cache import LAYOUT
from mmcache.featstore.cli import cli
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples
from tests.s3_server import FaultProxy


def write(url: str, n: int = 24, seed: int = 0, shard_bytes: int = 3000) -> list:
    samples = ragged_samples(n, seed=seed)
    writer = featstore.create(url, fields=FIELDS, shard_bytes=10**9, exist_ok=True)
    for i, (sample_id, arrays, meta) in enumerate(samples):
        writer.add(sample_id, arrays, meta)
        if i % 6 == 5:
            writer.commit(f"part-{i // 6}")  # fixed names: a re-made store reuses them
    writer.close()
    return samples


def read_all(store: featstore.Store, samples: list) -> None:
    got = store.read_rows([store.row(s[0]) for s in samples])
    for (_, arrays, _), sample in zip(samples, got, strict=True):
        for name in arrays:
            assert_same(sample[name], arrays[name])


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / LAYOUT / "objects").rglob("*") if p.is_file())


def test_second_read_is_served_locally(s3_server, s3_bucket, tmp_path):
    url = f"{s3_bucket}/store"
    samples = write(url)
    cache = tmp_path / "cache"
    first = featstore.open(url, cache_dir=cache)
    read_all(first, samples)
    assert first.storage.stats()["downloads"] == 8  # 4 shards x 2 fields, each fetched once
    read_all(first, samples)
    assert first.storage.stats()["downloads"] == 8
    # A new reader (another run) with the data objects unreachable: everything comes from disk.
    with FaultProxy((s3_server.host, s3_server.port), lifetime=60) as proxy:
        proxy.rules.append(lambda method, path: "503" if "/shards/" in path else None)
        second = featstore.open(url, {"endpoint_url": proxy.endpoint, "skip_instance_cache": True}, cache_dir=cache)
        read_all(second, samples)
        assert dict(second.scan()).keys() == {s[0] for s in samples}
        assert second.storage.stats()["downloads"] == 0 and proxy.counts["503"] == 0


def test_size_bound_lru_and_objects_too_large(s3_bucket, tmp_path):
    url = f"{s3_bucket}/store"
    samples = write(url)
    store = featstore.open(url)
    sizes = sorted(o["nbytes"] for info in store.shards.values() for k, o in info.objects.items() if k.endswith("/c/0"))
    bound = sizes[-1] + sizes[-2]  # room for about two data objects
    cache = tmp_path / "cache"
    cached = featstore.open(url, cache_dir=cache, cache_bytes=bound)
    for sample_id, arrays, _ in samples:
        assert_same(cached.read(sample_id)["latent"], arrays["latent"])
        assert sum(p.stat().st_size for p in entries(cache)) <= bound
    assert cached.storage.stats()["downloads"] > len(entries(cache))  # older entries were evicted
    tiny = featstore.open(url, cache_dir=tmp_path / "tiny", cache_bytes=sizes[0] - 1)
    read_all(tiny, samples)  # nothing fits: ranged reads from the store, still exact
    assert tiny.storage.stats()["uncached_reads"] > 0 and entries(tmp_path / "tiny") == []


def test_never_stale_never_corrupt(s3_bucket, tmp_path):
    url = f"{s3_bucket}/store"
    cache = tmp_path / "cache"
    old = write(url, seed=1)
    read_all(featstore.open(url, cache_dir=cache), old)
    # The store is deleted and made again with other data under the same shard names.
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm(root, recursive=True)
    new = write(url, seed=2)
    read_all(featstore.open(url, cache_dir=cache), new)
    # A damaged entry (flipped byte on disk) is found when a reader first opens it, and fetched again.
    reader = featstore.open(url, cache_dir=cache, verify_reads=False)
    key = next(k for k in reader.shards["part-1"].objects if k.endswith("text/c/0"))
    victim = reader.storage._entry_path(reader.storage._entry_name(key))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    read_all(reader, new)
    assert reader.storage.stats()["downloads"] == 1 and victim.read_bytes() != bytes(data)


def test_corrupted_remote_object_is_refused_and_not_cached(s3_bucket, tmp_path):
    url = f"{s3_bucket}/store"
    samples = write(url)
    store = featstore.open(url)
    key = next(k for k in store.shards["part-0"].objects if k.endswith("latent/c/0"))
    fs, root = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(f"{root}/{key}"))
    data[3] ^= 0x01
    fs.pipe_file(f"{root}/{key}", bytes(data))
    cached = featstore.open(url, cache_dir=tmp_path / "cache")
    with pytest.raises(featstore.CorruptionError, match=f"{key} fails its checksum"):
        cached.read(samples[0][0])
    assert all(p.stat().st_size != len(data) for p in entries(tmp_path / "cache"))
    # Without the cache the reader catches it too (the sample's own checksum), and so does verify.
    with pytest.raises(featstore.CorruptionError, match=samples[0][0]):
        featstore.open(url).read(samples[0][0])
    result = CliRunner().invoke(cli, ["verify", url])
    assert result.exit_code == 1 and f"object {key} fails its checksum" in result.output, result.output


def _reader(url: str, cache: str, bound: int, seed: int) -> None:
    store = featstore.open(url, cache_dir=cache, cache_bytes=bound)
    samples = ragged_samples(24, seed=0)
    for i in np.random.default_rng(seed).permutation(len(samples)):
        sample_id, arrays, _ = samples[i]
        got = store.read(sample_id)
        for name in arrays:
            assert got[name].tobytes() == arrays[name].tobytes(), sample_id


def test_processes_share_one_cache_directory(s3_bucket, tmp_path):
    url = f"{s3_bucket}/store"
    write(url)
    store = featstore.open(url)
    total = sum(o["nbytes"] for info in store.shards.values() for k, o in info.objects.items() if k.endswith("/c/0"))
    cache = tmp_path / "cache"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_reader, args=(url, str(cache), total // 2, seed)) for seed in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert sum(p.stat().st_size for p in entries(cache)) <= total // 2
    assert not list((cache / LAYOUT / "tmp").iterdir())  # no partial download left behind


def test_counters_and_size_accounting_under_threads(s3_bucket, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    url = f"{s3_bucket}/store"
    samples = write(url)
    cache = tmp_path / "cache"
    store = featstore.open(url, cache_dir=cache)
    objects = {k: o["nbytes"] for info in store.shards.values() for k, o in info.objects.items() if k.endswith("/c/0")}
    rounds = 6
    with ThreadPoolExecutor(8) as pool:  # readers of one store on many threads, as a loader runs them
        for _ in pool.map(lambda _: read_all(store, samples), range(rounds)):
            pass
    stats = store.storage.stats()
    assert stats["downloads"] == len(objects) and stats["bytes_downloaded"] == sum(objects.values())
    # Every later acquisition of an object is a hit: per round, one per (sample, field) read.
    assert stats["hits"] > 0 and stats["uncached_reads"] == 0
    held = sum(p.stat().st_size for p in entries(cache))
    assert held == sum(objects.values()) == store.storage.cached_bytes()
    assert int((cache / LAYOUT / "usage").read_text()) == held  # the running total is exact
    # O(1) bookkeeping per download: the directory was scanned once, when the cache was opened
    # (cached_bytes above is the second, explicit scan), not once per download.
    assert store.storage.scans == 2


def test_bound_and_running_total_hold_under_concurrent_fetches(s3_bucket, tmp_path):
    # read_all fetches a batch's objects on 8 threads: downloads in flight hold room that
    # eviction cannot free, so a fetch that finds no room reads remotely instead of overrunning.
    url = f"{s3_bucket}/store"
    samples = write(url)
    store = featstore.open(url)
    sizes = sorted(o["nbytes"] for info in store.shards.values() for k, o in info.objects.items() if k.endswith("/c/0"))
    bound = sum(sizes) // 2
    downloads = 0
    for _ in range(3):  # three runs, each a new reader sharing the directory
        cached = featstore.open(url, cache_dir=tmp_path / "cache", cache_bytes=bound)
        read_all(cached, samples)
        downloads += cached.storage.stats()["downloads"]
        held = sum(p.stat().st_size for p in entries(tmp_path / "cache"))
        assert held <= bound and int((tmp_path / "cache" / LAYOUT / "usage").read_text()) == held
    assert len(entries(tmp_path / "cache")) < len(sizes) and downloads > len(sizes)  # it evicted and fetched again
