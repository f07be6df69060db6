"""Block scans, reads by position and metadata with samples, on local disk, memory:// and S3.

Scans read shards in blocks (featstore.scan); BLOCK_BYTES is lowered here so that these small
stores have many blocks per shard and many shards, as a real store of MB-sized samples has.
"""

from __future__ import annotations

import gc
import mmap
import os
import threading
import uuid

import google_crc32c
import ml_dtypes
import numpy as np
import pytest
import torch

from mmcache import featstore
from mmcache.featstore import checksums as fmt
from mmcache.featstore import scan as scan_module
from mmcache.featstore.errors import CorruptionError, MissingFieldError, SchemaError
from mmcache.featstore.sample import Sample
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples, random_array

BACKENDS = ["local", "memory", "s3"]


def _url(backend: str, request, tmp_path) -> str:
    if backend == "local":
        return str(tmp_path / "store")
    if backend == "memory":
        return f"memory://reads-{uuid.uuid4().hex[:8]}"
    return f"{request.getfixturevalue('s3_bucket')}/store"


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path) -> str:
    return _url(request.param, request, tmp_path)


# Read-ahead in the caller's thread, a window of about two blocks, and the default; the object
# stores (slower per test) with the default only.
READAHEAD = [("local", 0), ("local", 1500), ("local", None), ("memory", 0), ("memory", None), ("s3", None)]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(scan_module, "BLOCK_BYTES", 700)


def _write(url: str, n: int = 30, shard_bytes: int = 1800) -> list:
    samples = ragged_samples(n, seed=3)
    with featstore.create(url, fields=FIELDS, shard_bytes=shard_bytes) as writer:
        for sample_id, arrays, meta in samples:
            writer.add(sample_id, arrays, meta)
    return samples


@pytest.mark.parametrize(("backend", "readahead_bytes"), READAHEAD)
def test_scan_equals_per_sample_reads_and_holds_its_samples(backend, readahead_bytes, request, tmp_path):
    url = _url(backend, request, tmp_path)
    readahead_bytes = scan_module.DEFAULT_READAHEAD_BYTES if readahead_bytes is None else readahead_bytes
    samples = _write(url, n=14 if backend == "s3" else 30)  # every request to moto costs ~10-50 ms
    store = featstore.open(url)
    assert len(store.shards) >= 3 and any(len(list(scan_module.plan_blocks(store, s, None))) > 2 for s in store.shards)
    # Every sample is held until the end: a block reused or overwritten by a later read would
    # show here as a changed earlier sample.
    scanned = list(store.scan(readahead_bytes=readahead_bytes))
    assert [sid for sid, _ in scanned] == store.sample_ids() == [s[0] for s in samples]
    rereads = store.read_rows([store.row(s[0]) for s in samples])  # per sample (batched remotely)
    for (sid, arrays, _), (_, got), reread in zip(samples, scanned, rereads, strict=True):
        for name in FIELDS:
            assert_same(got[name], arrays[name])
            assert_same(got[name], reread[name])
    per_shard = [pair for shard in store.shards for pair in store.iter_shard(shard, readahead_bytes=readahead_bytes)]
    assert [sid for sid, _ in per_shard] == store.sample_ids()
    for (_, a), (_, b) in zip(per_shard, scanned, strict=True):
        assert_same(a["latent"], b["latent"])


def test_a_sample_written_to_does_not_change_the_store_or_its_neighbours(tmp_path):
    url = str(tmp_path / "store")
    samples = _write(url)
    store = featstore.open(url)
    scanned = list(store.scan(["text"]))
    first, second = scanned[0][1]["text"], scanned[1][1]["text"]
    first[...] = 7  # writable (copy-on-write locally): the mapping's file is untouched
    assert_same(second, samples[1][1]["text"])
    assert_same(store.read(samples[0][0])["text"], samples[0][1]["text"])
    assert_same(dict(featstore.open(url).scan(["text"]))[samples[0][0]]["text"], samples[0][1]["text"])


def _corrupt(store, sample_id: str, field: str) -> str:
    """Flip one byte of a sample's bytes in its shard's data object; returns the shard."""
    row = store.row(sample_id)
    shard = store.index.column("shard")[row].as_py()
    key = store.shards[shard].data_key(field)
    data = bytearray(store.storage.read(key))
    itemsize = np.dtype(store.fields[field].zarr_dtype).itemsize
    data[int(store.index.column(f"{field}.offset")[row].as_py()) * itemsize + 1] ^= 0x10
    store.storage.write_atomic(key, bytes(data))
    return shard


@pytest.mark.parametrize(("backend", "readahead_bytes"), [p for p in READAHEAD if p[1] != 1500])
def test_scan_detects_a_flipped_byte_naming_shard_and_sample(backend, readahead_bytes, request, tmp_path):
    url = _url(backend, request, tmp_path)
    readahead_bytes = scan_module.DEFAULT_READAHEAD_BYTES if readahead_bytes is None else readahead_bytes
    samples = _write(url, n=20)
    victim = samples[17][0]
    shard = _corrupt(featstore.open(url), victim, "latent")
    store = featstore.open(url)
    seen = []
    with pytest.raises(CorruptionError, match=rf"sample '{victim}' field 'latent' in shard '{shard}' fails its checksum"):
        for sid, _ in store.scan(readahead_bytes=readahead_bytes):
            seen.append(sid)
    assert seen == [s[0] for s in samples[:17]]  # every sample before the damaged one, then the error
    with pytest.raises(CorruptionError, match=victim):
        list(store.iter_shard(shard))
    unchecked = featstore.open(url, verify_reads=False)
    assert len(list(unchecked.scan())) == len(samples)


def _checksum_library(library: str, monkeypatch) -> None:
    """Make ``library`` the one featstore uses: awscrt (a dependency), which releases the GIL, or
    google_crc32c alone (what is left on a platform without awscrt): each must check."""
    found = fmt._releasing_crc32c() if library == "awscrt" else None
    assert library == "google_crc32c" or found is not None, "awscrt (a dependency) is not importable"
    monkeypatch.setattr(fmt, "_releasing_crc32c", lambda: found)


# Where a scan checks a sample: large samples one by one on the loading threads; small ones on
# the loading threads as a run per field (with a GIL-free checksum library), or as each is handed
# out (google_crc32c alone). The threshold moves every block of these stores to one or the other.
PLACES = [("one by one", "awscrt"), ("one by one", "google_crc32c"), ("as a run", "awscrt"), ("handed out", "google_crc32c")]


@pytest.mark.parametrize(("where", "library"), PLACES)
def test_every_place_a_checksum_is_checked_catches_a_flipped_byte(where, library, tmp_path, monkeypatch):
    monkeypatch.setattr(scan_module, "CHECK_AHEAD_BYTES", 0 if where == "one by one" else 1 << 40)
    _checksum_library(library, monkeypatch)
    url = str(tmp_path / "store")
    samples = _write(url, n=20)
    runs = []  # the scan's checks as runs (spied after the write, whose object CRCs use it too)
    concat = fmt.crc32c_concat
    monkeypatch.setattr(fmt, "crc32c_concat", lambda crcs, lengths: runs.append(len(crcs)) or concat(crcs, lengths))
    clean = featstore.open(url)
    for (_, got), (_, arrays, _) in zip(clean.scan(), samples, strict=True):
        assert_same(got["text"], arrays["text"])
    # Runs of several samples were checked as runs there, and only there.
    assert (max(runs) > 1) if where == "as a run" else not runs
    shard = _corrupt(clean, samples[11][0], "text")
    seen = []
    with pytest.raises(CorruptionError, match=rf"sample '{samples[11][0]}' field 'text' in shard '{shard}'"):
        for sid, _ in featstore.open(url).scan():
            seen.append(sid)
    assert seen == [s[0] for s in samples[:11]]
    # Another damaged sample in the same block, before it where there is one: the first is named.
    ids = [sid for sid, _, _ in samples]
    block = next(b for s in clean.shards for b in scan_module.plan_blocks(clean, s, None) if clean.row(ids[11]) in b.rows)
    other_row = block.rows[0] if block.rows[0] != clean.row(ids[11]) else block.rows[1]
    other = ids.index(clean.index.column("id")[other_row].as_py())
    _corrupt(featstore.open(url), ids[other], "latent")
    first = min(other, 11)
    seen.clear()
    with pytest.raises(CorruptionError, match=rf"sample '{ids[first]}'"):
        for sid, _ in featstore.open(url).scan():
            seen.append(sid)
    assert seen == ids[:first]


@pytest.mark.parametrize("library", ["awscrt", "google_crc32c"])
def test_every_checksum_library_computes_the_same_crc32c(library, monkeypatch):
    _checksum_library(library, monkeypatch)
    assert fmt.crc32c(b"123456789") == fmt.crc32c(b"123456789", release_gil=True) == 0xE3069283  # the check value
    rng = np.random.default_rng(0)
    # Around the 1 MiB from which fmt.crc32c releases the GIL unasked, and empty.
    for size in (0, 1, 7, 40_000, (1 << 20) - 1, (1 << 20) + 3):
        data = rng.integers(0, 256, size=size, dtype=np.uint8)
        want = google_crc32c.value(data.tobytes())
        for release_gil in (None, True, False):
            assert fmt.crc32c(data, release_gil=release_gil) == want
        assert fmt.crc32c_function(release_gil=True)(data) == fmt.crc32c_function(release_gil=False)(data) == want
        assert fmt.crc32c(bytearray(data)) == fmt.crc32c(memoryview(bytearray(data))) == fmt.crc32c(data.tobytes()) == want
        cut = size // 3
        assert fmt.crc32c(data[cut:], fmt.crc32c(data[:cut])) == want  # continued from a CRC
    bf16 = rng.standard_normal((3, 5, 7)).astype(ml_dtypes.bfloat16)
    assert fmt.crc32c(bf16) == fmt.crc32c(bf16.view(np.uint16)) == google_crc32c.value(bf16.tobytes())


def test_the_crc32c_of_buffers_back_to_back_from_their_crcs():
    rng = np.random.default_rng(1)
    for count in (0, 1, 2, 9, 300):
        lengths = rng.integers(0, 70_000, size=count)
        lengths[::4] = 0  # empty samples too
        parts = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in lengths]
        crcs = [google_crc32c.value(p) for p in parts]
        folded = 0
        for crc, n in zip(crcs, lengths, strict=True):
            folded = fmt.crc32c_combine(folded, crc, int(n))
        assert fmt.crc32c_concat(crcs, lengths) == folded == google_crc32c.value(b"".join(parts))
    # Lengths past 32 bits, and one flipped bit in any CRC changes the result.
    assert fmt.crc32c_concat([7, 9], [1, 5 << 32]) == fmt.crc32c_combine(7, 9, 5 << 32)
    crcs = rng.integers(0, 1 << 32, size=50, dtype=np.uint32)
    lengths = rng.integers(1, 1 << 20, size=50)
    whole = fmt.crc32c_concat(crcs, lengths)
    for i in range(50):
        flipped = crcs.copy()
        flipped[i] ^= np.uint32(1 << (i % 32))
        assert fmt.crc32c_concat(flipped, lengths) != whole


def test_truncated_local_object_is_an_error_not_a_crash(tmp_path):
    url = str(tmp_path / "store")
    _write(url)
    store = featstore.open(url)
    shard = next(iter(store.shards))
    path = tmp_path / "store" / store.shards[shard].data_key("text")
    path.write_bytes(path.read_bytes()[:100])  # a mapping past the end would SIGBUS
    with pytest.raises(CorruptionError, match="truncated"):
        list(featstore.open(url).scan())


def test_read_by_position_equals_read_by_id_in_snapshot_order(url):
    samples = _write(url, n=8)
    store = featstore.open(url)
    ids = store.sample_ids()
    for position, sample_id in enumerate(ids):
        assert store.id_at(position) == sample_id == store.id_at(position - len(ids))
        by_id, by_position = store.read(sample_id), store.read_at(position)
        assert_same(by_position["latent"], by_id["latent"])
        assert_same(store[position]["text"], by_id["text"])
        assert_same(store[np.int64(position)]["text"], by_id["text"])
        assert_same(store[sample_id]["latent"], by_id["latent"])
    assert_same(store[-1]["latent"], samples[-1][1]["latent"])
    assert list(store.read_at(0, ["text"])) == ["text"]
    for bad in (len(ids), -len(ids) - 1):
        with pytest.raises(IndexError, match=rf"position {bad} is out of range: .* holds 8 samples \(positions 0..7"):
            store.read_at(bad)
    for bad in (1.0, True, None):
        with pytest.raises(TypeError, match="indexed by position"):
            store[bad]
    with pytest.raises(KeyError, match="nope"):
        store["nope"]
    with pytest.raises(TypeError, match="store.scan()"):
        list(store)


def test_positions_and_metadata_when_fields_were_added_later(tmp_path):
    url = str(tmp_path / "store")
    samples = _write(url, n=8)
    store = featstore.open(url, mode="a")
    store.add_fields({"vit": "float32"})
    rng = np.random.default_rng(5)
    vit = {sid: rng.standard_normal((2, 3), dtype=np.float32) for sid, _, _ in samples[2:6]}
    with store.writer(fields=["vit"], shard_prefix="0000") as writer:
        for sid, array in vit.items():
            writer.add(sid, {"vit": array}, {"vit_source": f"image of {sid}", "caption": "later, ignored"})
    after = featstore.open(url)
    assert after.index.num_rows == 12 and len(after) == 8
    assert [after.id_at(i) for i in range(8)] == after.sample_ids() == [s[0] for s in samples]
    for i, (sid, arrays, meta) in enumerate(samples):
        got = after.read_at(i, with_meta=True)
        assert got.id == sid and set(got) == ({"latent", "text", "vit"} if sid in vit else {"latent", "text"})
        assert_same(got["latent"], arrays["latent"])
        # The first row's caption wins; the added field's own metadata comes along.
        assert got.meta == ({**meta, "vit_source": f"image of {sid}"} if sid in vit else meta)
    with pytest.raises(IndexError):
        after.read_at(8)
    scanned = list(after.scan(with_meta=True))
    assert [s.meta for _, s in scanned] == [after.meta(sid) for sid in after.sample_ids()]
    with pytest.raises(MissingFieldError):
        list(after.scan(["vit"]))


def test_metadata_comes_with_a_sample(url):
    samples = _write(url, n=10)
    store = featstore.open(url)
    assert store.meta_columns == ["caption", "frames"]
    sample_id, arrays, meta = samples[4]
    got = store.read(sample_id, with_meta=True)
    assert isinstance(got, Sample) and got.id == sample_id and got.meta == meta == store.meta(sample_id)
    assert dict(got).keys() == arrays.keys() and len(got) == 2
    assert_same(got["latent"], arrays["latent"])
    assert store.read(sample_id).keys() == arrays.keys()  # without it, the plain dict as before
    as_torch = store.read_at(4, ["latent"], format="torch", with_meta=True)
    assert as_torch["latent"].dtype == torch.bfloat16 and as_torch.meta["caption"] == "caption 4"
    for (sid, s), (want_id, _, want_meta) in zip(store.scan(["text"], with_meta=True), samples, strict=True):
        assert sid == s.id == want_id and s.meta == want_meta and list(s) == ["text"]


def test_metadata_keys_a_sample_did_not_set_are_absent(tmp_path):
    url = str(tmp_path / "store")
    with featstore.create(url, fields={"x": "int8"}) as writer:
        writer.add("a", {"x": np.zeros(2, np.int8)}, {"caption": "one", "source": "s3://b/a.jpg"})
        writer.add("b", {"x": np.zeros(1, np.int8)})
    store = featstore.open(url)
    assert store.meta("a") == {"caption": "one", "source": "s3://b/a.jpg"} and store.meta("b") == {}


def test_scan_refuses_unknown_fields_and_formats_before_reading(tmp_path):
    url = str(tmp_path / "store")
    _write(url, n=3)
    store = featstore.open(url)
    with pytest.raises(SchemaError, match="no field 'nope'"):
        next(store.scan(["nope"]))
    with pytest.raises(ValueError, match="format must be one of"):
        next(store.scan(format="jax"))
    got = dict(store.scan(format="torch"))
    assert all(t["latent"].dtype == torch.bfloat16 for t in got.values())


def _evict(root) -> None:
    """Drop every file under ``root`` from the page cache (clean pages: synced first)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_a_scan_checks_shards_in_the_page_cache_on_a_thread_per_core_and_shards_on_disk_on_many(tmp_path, monkeypatch):
    # Samples of 64-128 KiB, so that a block's pages are not the few the shard index shares (reading
    # the index, to find the samples' bytes, brings its pages back into the page cache).
    rng = np.random.default_rng(5)
    url = str(tmp_path / "store")
    ids = [f"s-{i}" for i in range(12)]
    with featstore.create(url, fields=FIELDS, shard_bytes=600_000) as writer:
        for sample_id in ids:
            t = int(rng.integers(4, 9))
            writer.add(sample_id, {"latent": random_array(rng, "bfloat16", (4, t, 64, 64)), "text": random_array(rng, "float16", (16, 8))})
    threads: dict[str, set[str]] = {}
    load = scan_module.Scanner.load
    monkeypatch.setattr(scan_module.Scanner, "load", lambda self, block: threads.setdefault(block.shard, set()).add(
        threading.current_thread().name.split("_")[0]) or load(self, block))
    store = featstore.open(url)
    list(store.scan())  # reads every shard: all in the page cache now
    threads.clear()
    assert [sid for sid, _ in store.scan()] == ids
    assert len(threads) > 1 and set().union(*threads.values()) == {"featstore-check"}
    store.close()
    gc.collect()  # the scans' samples, which keep their pages mapped (the page cache keeps mapped pages)
    _evict(tmp_path / "store")
    data = max((p for p in (tmp_path / "store" / "shards").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        share = scan_module._resident_share(view)
        del view
    if share == 1.0:
        pytest.skip("this file system keeps its pages in memory (tmpfs?): nothing to evict")
    threads.clear()
    assert [sid for sid, _ in featstore.open(url).scan()] == ids
    assert set().union(*threads.values()) == {"featstore-scan"}
