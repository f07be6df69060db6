"""`mmcache copy SRC DST` between local disk and real S3 (moto over HTTP): identical stores,
resumable after an interruption, committed shard by shard, refusing damaged sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mmcache import featstore
import mmcache.featstore.copy as copy_module
from mmcache.featstore.cli import cli
from mmcache.featstore.verify import verify_store
from tests.featstore.conformance import FIELDS, assert_same, committed_files, ragged_samples


@pytest.fixture
def local_store(tmp_path) -> str:
    url = str(tmp_path / "src")
    with featstore.create(url, fields=FIELDS, shard_bytes=2500) as writer:
        for sample_id, arrays, meta in ragged_samples(30):
            writer.add(sample_id, arrays, meta)
        writer.reject("in/bad.png", "truncated image")
    return url


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_local_to_s3_to_local_is_identical(local_store, s3_bucket, tmp_path):
    remote = f"{s3_bucket}/copied"
    back = str(tmp_path / "back")
    first = run("copy", local_store, remote, "--verify")
    assert first.exit_code == 0, first.output
    assert "copied" in first.output and "verified: " in first.output
    assert run("copy", remote, back).exit_code == 0
    assert committed_files(back) == committed_files(local_store)  # every object, byte for byte
    store = featstore.open(remote)
    assert store.checkpoint is not None and store.checkpoint_covered == len(store.shards)  # a copy opens from its own
    for sample_id, arrays, _ in ragged_samples(30)[::5]:
        assert_same(store.read(sample_id)["latent"], arrays["latent"])
    again = run("copy", local_store, remote)
    assert again.exit_code == 0 and "copied 0 shard(s)" in again.output  # nothing left to do
    info = json.loads(run("info", remote, "--json").output)
    assert info["num_samples"] == 30 and info["num_rejected"] == 1


def test_interrupted_copy_resumes_and_never_shows_half_a_shard(local_store, s3_bucket, monkeypatch):
    remote = f"{s3_bucket}/copied"
    source = featstore.open(local_store)
    real = copy_module._copy_object
    calls = {"n": 0}

    def flaky(src, dest, key, expected, budget):
        calls["n"] += 1
        if calls["n"] > 12:
            raise RuntimeError("simulated crash of the copy")
        return real(src, dest, key, expected, budget)

    monkeypatch.setattr(copy_module, "_copy_object", flaky)
    with pytest.raises(RuntimeError, match="simulated crash"):
        featstore.copy_store(local_store, remote, workers=2)
    # What a reader of the destination sees: some whole shards, nothing partial.
    partial = featstore.open(remote)
    assert 0 < len(partial.shards) < len(source.shards)
    for sample_id in partial.sample_ids():
        assert_same(partial.read(sample_id)["text"], source.read(sample_id)["text"])
    assert verify_store(featstore.open(remote, strict=False)).ok
    monkeypatch.setattr(copy_module, "_copy_object", real)
    summary = featstore.copy_store(local_store, remote)
    assert summary.shards_skipped == len(partial.shards)
    assert summary.shards_copied == len(source.shards) - len(partial.shards)
    assert summary.objects_kept > 0  # objects the crashed try had finished were not copied again
    final = featstore.open(remote)
    assert sorted(final.sample_ids()) == sorted(source.sample_ids())
    assert verify_store(featstore.open(remote, strict=False)).ok


def test_damaged_source_is_not_copied(local_store, s3_bucket):
    store = featstore.open(local_store)
    shard = sorted(store.shards)[1]
    data = Path(local_store) / store.shards[shard].data_key("latent")
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0x10
    data.write_bytes(bytes(raw))
    remote = f"{s3_bucket}/copied"
    result = run("copy", local_store, remote)
    assert result.exit_code == 1 and f"{store.shards[shard].data_key('latent')} fails its checksum" in result.output
    assert shard not in featstore.open(remote).shards  # never committed at the destination


def test_destination_holding_another_store_is_refused(local_store, s3_bucket):
    other = f"{s3_bucket}/other"
    featstore.create(other, fields={"x": "float32"}).close()
    result = run("copy", local_store, other)
    assert result.exit_code == 1 and "holds a different feature store" in result.output


def test_copy_of_a_store_with_an_added_field(local_store, s3_bucket):
    remote = f"{s3_bucket}/with-extra"
    assert run("copy", local_store, remote).exit_code == 0  # a first copy, before the field is added
    store = featstore.open(local_store, mode="a")
    store.add_fields({"extra": {"dtype": "float32", "ndim": 1}})
    samples = ragged_samples(30)
    with store.writer(fields=["extra"]) as writer:
        for sample_id, arrays, _ in samples[:10]:
            writer.add(sample_id, {"extra": arrays["text"][:, 0].astype("float32")})
    result = run("copy", local_store, remote, "--verify")  # brings the copy up to date
    assert result.exit_code == 0, result.output
    assert "copied 1 shard(s)" in result.output
    copied = featstore.open(remote)
    assert copied.format_version == featstore.FORMAT_VERSION and copied.samples_per_field()["extra"] == 10
    assert_same(copied.read(samples[3][0])["extra"], samples[3][1]["text"][:, 0].astype("float32"))
    assert set(copied.read(samples[20][0])) == {"latent", "text"}
