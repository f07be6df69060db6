"""What a shard commit costs on real S3 (moto over HTTP, requests counted by the server itself):
a fixed number of requests and round trips whatever the number of samples, the data objects in
one concurrent batch, the commit record last and conditional; large objects go up in parts that
are retried on their own, and a failed upload leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore import format as fmt
from mmcache.featstore.reader import open_store
from mmcache.featstore.object_storage import FsspecStorage, UploadPolicy
from mmcache.featstore.retry import RetryPolicy
from mmcache.featstore.verify import verify_store
from tests.featstore.conformance import assert_same, random_array
from tests.s3_server import FAKE_KEY_ID, FAKE_SECRET, FaultProxy, rounds


def _pending_shard(url: str, fields: dict, samples: int, shard: str):
    """A writer holding ``samples`` small samples and a reject, ready to commit ``shard``."""
    rng = np.random.default_rng(samples)
    writer = open_store(url, mode="a").writer()
    for i in range(samples):
        writer.add(f"{shard}-{i}", {name: random_array(rng, spec["dtype"], (3, 5)) for name, spec in fields.items()}, {"caption": f"c{i}"})
    writer.reject("in/bad.png", "truncated image")
    return writer


@pytest.mark.parametrize("num_fields", [1, 3])
def test_commit_costs_a_fixed_number_of_requests_and_round_trips(s3_bucket, s3_server, num_fields):
    url = f"{s3_bucket}/store"
    fields = {f"f{i}": {"dtype": "float16", "ndim": 2} for i in range(num_fields)}
    featstore.create(url, fields=fields).close()
    _pending_shard(url, fields, 2, "warm").commit("warm")  # a first commit also records the fields' ndim
    seen = []
    for samples in (2, 40):
        shard = f"t-{samples}"
        writer = _pending_shard(url, fields, samples, shard)
        # Every answer late, as from a distant object store: requests sent one after the other
        # add up, concurrent ones overlap (so the round trips are measured, not guessed).
        with s3_server.slowed(0.15), s3_server.recording() as requests:
            writer.commit(shard)
        lists = [r for r in requests if r.method == "GET" and "list-type=2" in r.query]
        puts = [r for r in requests if r.method == "PUT"]
        commit = [r for r in puts if r.key.endswith(fmt.index_part_key(shard))]
        data = [r for r in puts if r not in commit]
        # The shard's group, two objects per field, the rejects; one check of index/; the commit record.
        assert (len(lists), len(data), len(commit)) == (1, 2 + 2 * num_fields, 1), [(r.method, r.key, r.query) for r in requests]
        assert len(requests) == len(lists) + len(puts)
        # The data objects at once, the check, the commit: three round trips (sequential
        # requests would take 4 + 2 * num_fields).
        assert rounds(requests) == 3, sorted((round(r.start - requests[0].start, 2), r.method, r.key) for r in requests)
        # The check after every data object is written, the commit record after it and only if absent.
        assert lists[0].start > max(r.end for r in data)
        assert commit[0].start > lists[0].end and commit[0].if_none_match == "*"
        seen.append(len(requests))
        got = featstore.open(url).read(f"{shard}-{samples - 1}")
        assert set(got) == set(fields)
    assert seen[0] == seen[1]  # 2 samples or 40: the same requests


def test_a_writer_reads_back_no_index_part_of_its_own(s3_bucket, s3_server):
    # Each commit checks index/ for what other writers committed since the snapshot; the parts a
    # writer committed itself are known to it, and another writer's are read once.
    url = f"{s3_bucket}/store"
    fields = {"f0": {"dtype": "float16", "ndim": 2}}
    featstore.create(url, fields=fields).close()
    writer = open_store(url, mode="a").writer()
    rng = np.random.default_rng(0)
    reads = []
    for shards in ((0, 1), (2, 3)):
        with s3_server.recording() as requests:
            for shard in shards:
                writer.add(f"s{shard}", {"f0": random_array(rng, "float16", (3, 5))})
                writer.commit(f"own-{shard}")
        reads.append([r.key.removeprefix("store/") for r in requests if r.method == "GET" and r.key.startswith("store/index/")])
        if shards == (0, 1):
            other = open_store(url, mode="a").writer()
            other.add("other", {"f0": random_array(rng, "float16", (3, 5))})
            other.commit("other")
    assert reads == [[], [fmt.index_part_key("other")]], reads
    assert sorted(featstore.open(url).sample_ids()) == ["other", "s0", "s1", "s2", "s3"]


def test_rejects_are_read_once_per_snapshot_all_at_once(s3_bucket, s3_server):
    # A re-run's planning asks for the store's rejects several times (the survey, the plan, each
    # row classifier): each shard's rejects object is read once, the objects at once.
    url = f"{s3_bucket}/store"
    fields = {"f0": {"dtype": "float16", "ndim": 2}}
    featstore.create(url, fields=fields).close()
    for shard in range(4):
        _pending_shard(url, fields, 2, f"t-{shard}").commit(f"t-{shard}")
    store = open_store(url)
    with s3_server.slowed(0.1), s3_server.recording() as requests:  # each request takes 0.1 s: concurrent ones overlap
        for _ in range(3):
            assert store.rejects.column("source").to_pylist() == ["in/bad.png"] * 4
    gets = [r for r in requests if r.method == "GET" and r.key.startswith(f"store/{fmt.REJECTS_DIR}/")]
    assert sorted(r.key for r in gets) == sorted(f"store/{store.shards[f't-{k}'].rejects_key}" for k in range(4)), gets
    spans = sorted((r.start, r.end) for r in gets)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans  # in flight together, not one after another


@pytest.fixture
def proxy(s3_server):
    with FaultProxy((s3_server.host, s3_server.port), lifetime=120) as p:
        yield p


@pytest.fixture
def small_parts(monkeypatch):
    # Parts of S3's minimum size, so a 12 MB object is a 3-part upload; quick retries.
    monkeypatch.setattr(FsspecStorage, "uploads", UploadPolicy(part_bytes=5 << 20, multipart_above=5 << 20))
    monkeypatch.setattr(FsspecStorage, "retry", RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05))


def _options(proxy: FaultProxy) -> dict:
    return {"endpoint_url": proxy.endpoint, "key": FAKE_KEY_ID, "secret": FAKE_SECRET, "skip_instance_cache": True}


def _fault_once(proxy: FaultProxy, kind: str, match) -> list[str]:
    """Answer the first request that ``match``es with fault ``kind``; log every matching one."""
    hits: list[str] = []

    def rule(method: str, path: str) -> str | None:
        if not match(method, path):
            return None
        hits.append(path)
        return kind if len(hits) == 1 else None

    proxy.rules.append(rule)
    return hits


def _big_sample(seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": random_array(np.random.default_rng(seed), "float32", (3 << 20,))}  # 12 MiB


def _part(number: int):
    return lambda method, path: method == "PUT" and f"partNumber={number}&" in path + "&"


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_a_failing_part_is_retried_alone(s3_bucket, proxy, small_parts, kind):
    url = f"{s3_bucket}/store"
    options = _options(proxy)
    featstore.create(url, fields={"x": {"dtype": "float32", "ndim": 1}}, storage_options=options).close()
    part2 = _fault_once(proxy, kind, _part(2))
    others = [_fault_once(proxy, "", _part(n)) for n in (1, 3)]
    sample = _big_sample()
    with featstore.append(url, options) as writer:
        writer.add("big", sample)
    assert len(part2) == 2 and [len(h) for h in others] == [1, 1], (part2, others)  # only part 2 went again
    store = featstore.open(url)
    assert_same(store.read("big")["x"], sample["x"])
    assert verify_store(featstore.open(url, strict=False)).ok


def test_a_lost_completion_answer_counts_as_done(s3_bucket, proxy, small_parts):
    # The service completes the upload but the answer is cut short: the retry finds the upload
    # gone and the object whole (the key is this writer's own), so the commit goes on.
    url = f"{s3_bucket}/store"
    options = _options(proxy)
    featstore.create(url, fields={"x": {"dtype": "float32", "ndim": 1}}, storage_options=options).close()
    completes = _fault_once(proxy, "cut", lambda method, path: method == "POST" and "uploadId=" in path)
    sample = _big_sample(1)
    with featstore.append(url, options) as writer:
        writer.add("big", sample)
    assert len(completes) == 2
    assert_same(featstore.open(url).read("big")["x"], sample["x"])


def test_a_part_that_keeps_failing_aborts_the_upload(s3_bucket, proxy, small_parts):
    url = f"{s3_bucket}/store"
    options = _options(proxy)
    featstore.create(url, fields={"x": {"dtype": "float32", "ndim": 1}}, storage_options=options).close()
    proxy.rules.append(lambda method, path: "503" if _part(2)(method, path) else None)
    writer = featstore.append(url, options)
    writer.add("big", _big_sample())
    with pytest.raises(featstore.StorageError, match=r"part 2\): write failed 4 time\(s\)"):
        writer.commit("t-big")
    store = featstore.open(url)
    assert len(store) == 0 and not store.has_shard("t-big")  # nothing committed
    # ...and no upload left open (its parts would be kept, and billed, by the service).
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = s3_bucket.removeprefix("s3://")
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
