"""Faults between the store and real S3 (moto over HTTP, through a fault-injecting loopback
proxy): transient ones are retried and nothing is lost, duplicated or partial; persistent ones
fail with a clear message naming the object; no credential ever appears in a message. s3fs and
botocore run at their production settings (what ``mmcache.featstore.retry.remote_filesystem`` sets):
featstore's retry layer is the only one, so its attempts and deadline are what happens."""

from __future__ import annotations

import json
import os
import time
import traceback

import pytest
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore.cli import cli
from mmcache.featstore.secrets import redact, redact_url
from mmcache.featstore.object_storage import FsspecStorage
from mmcache.featstore.retry import RetryPolicy
from mmcache.featstore.verify import verify_store
from tests.featstore.conformance import FIELDS, assert_same, ragged_samples
from tests.s3_server import FAKE_KEY_ID, FAKE_SECRET, FaultProxy

FAST_RETRY = RetryPolicy(attempts=12, base_delay=0.01, max_delay=0.2)


@pytest.fixture
def proxy(s3_server):
    with FaultProxy((s3_server.host, s3_server.port), lifetime=120) as p:
        yield p


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    # featstore's own policy with short back-off, so the tests are quick; nothing below it is touched.
    monkeypatch.setattr(FsspecStorage, "retry", FAST_RETRY)


def via(proxy: FaultProxy, **extra) -> dict:
    # Explicit options (credentials included, as a user may pass them) so the proxy is used
    # whatever the environment says.
    return {"endpoint_url": proxy.endpoint, "key": FAKE_KEY_ID, "secret": FAKE_SECRET, "skip_instance_cache": True, **extra}


def requests_to(proxy: FaultProxy, key: str) -> list:
    hits: list = []
    proxy.rules.insert(0, lambda method, path: hits.append(path) if path.split("?")[0].endswith(key) else None)
    return hits


def write_store(url: str, options: dict, n: int = 30, seed: int = 0) -> list:
    samples = ragged_samples(n, seed=seed)
    with featstore.create(url, fields=FIELDS, storage_options=options, shard_bytes=2500) as writer:
        for sample_id, arrays, meta in samples:
            writer.add(sample_id, arrays, meta)
        writer.reject("in/bad.png", "truncated image")
    return samples


def test_writes_and_reads_survive_transient_faults(s3_bucket, proxy):
    url = f"{s3_bucket}/store"
    proxy.share, proxy.every, proxy.max_faults = 0.3, 5, 60
    options = via(proxy)
    samples = write_store(url, options, n=20)
    store = featstore.open(url, options)
    rows = [store.row(s[0]) for s in samples]
    for (_, arrays, _), got in zip(samples, store.read_rows(rows), strict=True):
        for name in arrays:
            assert_same(got[name], arrays[name])
    for sample_id, arrays, _ in samples[::3]:
        assert_same(store.read(sample_id)["latent"], arrays["latent"])
    assert sorted(i for i, _ in store.scan()) == sorted(s[0] for s in samples)
    assert proxy.faults >= 10, proxy.counts
    assert {"503", "reset", "drop", "cut"} <= set(proxy.counts), proxy.counts
    # Checked directly (no proxy): every sample exactly once, every byte as committed.
    clean = featstore.open(url)
    ids = clean.index.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == len(samples) and clean.num_rejected() == 1
    report = verify_store(featstore.open(url, strict=False))
    assert report.ok, report.problems


def test_timeouts_are_retried(s3_bucket, proxy, monkeypatch):
    monkeypatch.setattr(FsspecStorage, "retry", RetryPolicy(attempts=12, base_delay=0.01, max_delay=0.2, read_timeout=0.3, connect_timeout=0.3))
    url = f"{s3_bucket}/store"
    samples = write_store(url, {}, n=6)
    proxy.kinds, proxy.every, proxy.max_faults, proxy.stall_s = ("stall",), 2, 2, 1.0
    store = featstore.open(url, via(proxy))
    for sample_id, arrays, _ in samples:
        assert_same(store.read(sample_id)["text"], arrays["text"])
    assert proxy.counts["stall"] >= 1


def test_persistent_fault_fails_naming_the_object(s3_bucket, proxy, monkeypatch):
    monkeypatch.setattr(FsspecStorage, "retry", RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05))
    url = f"{s3_bucket}/store"
    samples = write_store(url, {}, n=6)
    clean = featstore.open(url)
    shard = clean.index.column("shard")[0].as_py()
    key = clean.shards[shard].data_key("text")
    hits = requests_to(proxy, key)
    proxy.rules.append(lambda method, path: "503" if path.split("?")[0].endswith(key) else None)
    options = via(proxy)
    store = featstore.open(url, options)
    with pytest.raises(featstore.StorageError) as info:
        store.read(samples[0][0])
    message = str(info.value)
    assert key in message and "failed 3 time(s)" in message and "SlowDown" in message, message
    # One retry layer: three attempts of featstore's are three requests (s3fs and botocore
    # would otherwise retry each of them, 25 requests per attempt).
    assert len(hits) == 3, hits
    text = "".join(traceback.format_exception(info.value))
    assert FAKE_SECRET not in text and FAKE_KEY_ID not in text
    # The same through the command line: exit 1, the object named, no credential shown.
    result = CliRunner().invoke(cli, ["verify", url, "--storage-options", json.dumps(via(proxy))])
    assert result.exit_code == 1 and key in result.output, result.output
    assert FAKE_SECRET not in result.output and FAKE_KEY_ID not in result.output


def test_deadline_holds_with_production_lower_layers(s3_bucket, proxy, monkeypatch):
    # An object whose every request stalls: attempts end by the per-attempt timeout, and the
    # operation by featstore's deadline (plus at most one attempt), not minutes later.
    policy = RetryPolicy(attempts=1000, base_delay=0.05, max_delay=0.1, deadline=2.0, read_timeout=0.4, connect_timeout=0.4)
    monkeypatch.setattr(FsspecStorage, "retry", policy)
    url = f"{s3_bucket}/store"
    samples = write_store(url, {}, n=6)
    clean = featstore.open(url)
    shard = clean.index.column("shard")[0].as_py()
    key = clean.shards[shard].data_key("latent")  # where the commit record says the data is
    hits = requests_to(proxy, key)
    proxy.stall_s = 5.0
    proxy.rules.append(lambda method, path: "stall" if path.split("?")[0].endswith(key) else None)
    store = featstore.open(url, via(proxy))
    start = time.monotonic()
    with pytest.raises(featstore.StorageError, match="unreachable or overloaded") as info:
        store.read(samples[0][0])
    elapsed = time.monotonic() - start
    # Under the proxy's 5 s stall (what ignoring the deadline would wait), with room for a busy machine.
    assert policy.deadline <= elapsed < policy.deadline + policy.read_timeout + 2.0, elapsed
    attempts = int(str(info.value).split("failed ")[1].split(" time")[0])
    assert 2 <= attempts == len(hits), (attempts, len(hits))  # each attempt one request


def test_denied_writes_fail_clearly(s3_bucket, proxy):
    proxy.deny_writes = True
    with pytest.raises(featstore.StorageError, match=r"shards/zarr.json: write was denied .*check the credentials"):
        featstore.create(f"{s3_bucket}/store", fields=FIELDS, storage_options=via(proxy))


def test_missing_object_is_not_retried(s3_bucket, proxy):
    write_store(f"{s3_bucket}/store", {}, n=3)
    with pytest.raises(featstore.NotAStoreError):
        featstore.open(f"{s3_bucket}/elsewhere", via(proxy))
    assert proxy.requests < 5  # a 404 is an answer, not a fault


def test_redaction():
    signed = "https://bucket.s3.amazonaws.com/a/b.png?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F&X-Amz-Signature=abcdef"
    assert redact_url(signed) == "https://bucket.s3.amazonaws.com/a/b.png?***"
    assert redact_url("https://user:pw@host/x") == "https://***@host/x"
    assert redact_url("s3://bucket/key.png") == "s3://bucket/key.png"
    assert redact_url("https://host/a.png?width=3") == "https://host/a.png?width=3"
    featstore.secrets.register({"client_kwargs": {"aws_secret_access_key": "hush-hush-123"}, "anon": False})
    assert redact(f"failed at {signed} with hush-hush-123") == "failed at https://bucket.s3.amazonaws.com/a/b.png?*** with ***"
    assert "hush" not in repr(featstore.secrets.RedactedOptions({"secret": "hush-hush-123"}))


def test_a_bucket_that_does_not_exist_is_named_as_such(s3_server):
    missing = f"s3://no-such-bucket-{os.getpid()}/ds"
    for attempt in (lambda: featstore.create(missing, fields={"x": "float32"}), lambda: featstore.open(missing)):
        with pytest.raises(featstore.StorageError, match="the bucket does not exist"):
            attempt()
