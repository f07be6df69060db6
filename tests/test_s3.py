"""Dataset sharing through real S3 over HTTP (moto on 127.0.0.1), as users run it: media and
manifest on s3, `mmcache encode --output s3://...` and `mmtrain fit --features s3://...` with
only the standard AWS variables set, both through a proxy that injects faults (503s, resets,
drops, cut responses); then verify, info, a cached read-only training run, and a resumed run
that keeps its snapshot while the store grows. No credential appears in any output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmcache import featstore
from mmcache.precompute.demo_data import make_dataset
from tests.s3_server import FAKE_KEY_ID, FAKE_SECRET, FaultProxy

BIN = Path(sys.executable).parent


def run(args: list[str], env: dict[str, str], outputs: list[str], check: bool = True) -> subprocess.CompletedProcess:
    full_env = {"PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(Path.home()), **env}
    result = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=400, env=full_env)
    outputs.extend([result.stdout, result.stderr])
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def outputs() -> list[str]:
    """Everything the commands printed or wrote, checked for credentials at the end."""
    return []


@pytest.fixture(scope="module")
def encoded(s3_server, tmp_path_factory, outputs):
    """Media + manifest uploaded to s3, then encoded from s3 to s3 through the fault proxy."""
    import fsspec

    bucket = s3_server.make_bucket("ds")
    manifest = make_dataset(tmp_path_factory.mktemp("data"), num_images=6, num_videos=2)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put(str(manifest.parent), f"{bucket.removeprefix('s3://')}/raw", recursive=True)
    input_url, store_url = f"{bucket}/raw/manifest.jsonl", f"{bucket}/store"
    with FaultProxy((s3_server.host, s3_server.port), share=0.1, every=9, max_faults=25, seed=3, lifetime=300) as proxy:
        result = run(["mmcache", "encode", "--config", "tiny", "--input", input_url, "--output", store_url,
                      "--workers", "1", "--set", "run.samples_per_task=3", "--no-progress"],
                     s3_server.env(proxy.endpoint), outputs)
        faults = proxy.faults
    ids = [json.loads(line)["path"] for line in manifest.read_text().splitlines()]
    return {"store": store_url, "ids": ids, "faults": faults, "encode": result}


def test_encode_from_and_to_s3_through_faults(encoded, s3_server, outputs):
    assert encoded["faults"] > 0, "the proxy injected no fault"
    assert "encoded 8 sample(s)" in encoded["encode"].stdout
    store = featstore.open(encoded["store"])
    ids = store.index.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 8 and store.num_rejected() == 0  # nothing lost, nothing twice
    assert sorted(store.index.column("source_uri").to_pylist())[0].startswith("s3://")
    verify = run(["mmcache", "verify", encoded["store"]], s3_server.env(), outputs)
    assert verify.stdout.startswith("OK: 3 shard(s), 8 sample(s)")
    info = json.loads(run(["mmcache", "info", encoded["store"], "--json"], s3_server.env(), outputs).stdout)
    assert info["num_samples"] == 8 and info["url"] == encoded["store"]


@pytest.fixture(scope="module")
def trained(encoded, s3_server, tmp_path_factory, outputs):
    """3 steps from s3 through the fault proxy, with a cache, and read-only (writes refused)."""
    root = tmp_path_factory.mktemp("train")
    cache, out = root / "cache", root / "run"
    with FaultProxy((s3_server.host, s3_server.port), share=0.1, every=4, max_faults=20, seed=4, lifetime=300) as proxy:
        proxy.deny_writes = True  # training needs read permission only
        result = run(["mmtrain", "fit", "--config", "tiny-dit", "--features", encoded["store"], "--out", str(out),
                      "--steps", "3", "--cache-dir", str(cache)],
                     s3_server.env(proxy.endpoint), outputs)
        counts, methods = dict(proxy.counts), dict(proxy.methods)
    return {"result": result, "out": out, "cache": cache, "counts": counts, "methods": methods}


def test_train_from_s3_read_only_through_faults_with_cache(encoded, trained, outputs):
    assert trained["counts"].get("403", 0) == 0 and "PUT" not in trained["methods"]
    assert sum(v for k, v in trained["counts"].items() if k != "passed") > 0, trained["counts"]
    assert "trained steps 1-3" in trained["result"].stdout
    info = json.loads((trained["out"] / "run.json").read_text())
    outputs.append(json.dumps(info))
    store = featstore.open(encoded["store"])
    assert info["store"]["shards"] == sorted(store.shards) and info["store"]["samples"] == 8
    assert info["config"]["data"]["cache_dir"] == str(trained["cache"])
    assert any((trained["cache"] / "mmcache-objects-v1" / "objects").rglob("*"))  # the data now read from disk


def test_resumed_run_keeps_its_snapshot_while_the_store_grows(encoded, trained, s3_server, outputs):
    out = trained["out"]
    before = json.loads((out / "run.json").read_text())["store"]
    # An encode job commits a new shard while the run is paused.
    store = featstore.open(encoded["store"])
    sample = store.read(store.sample_ids()[0])
    with featstore.append(encoded["store"]) as writer:
        writer.add("grown-0", sample)
    assert len(featstore.open(encoded["store"])) == 9
    resumed = run(["mmtrain", "fit", "--config", "tiny-dit", "--features", encoded["store"], "--out", str(out),
                   "--steps", "5", "--resume"], s3_server.env(), outputs)
    assert "resumed from" in resumed.stdout and "trained steps 4-5" in resumed.stdout
    after = json.loads((out / "run.json").read_text())["store"]
    assert after["shards"] == before["shards"] and after["samples"] == 8 and after["snapshot"] == before["snapshot"]
    line = f"8 samples in {len(before['shards'])} shard(s), snapshot {before['snapshot']}"
    assert line in trained["result"].stdout and line in resumed.stdout
    assert len(featstore.open(encoded["store"], shards=before["shards"])) == 8


def test_signed_input_urls_are_fetched_but_never_shown(tmp_path):
    from mmcache.precompute.inputs.manifest import read_inputs

    signed = "https://example.invalid/media/cat.png?X-Amz-Credential=AKIAX%2F1&X-Amz-Signature=deadbeef00"
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": signed, "caption": "a cat"}) + "\n")
    (row,), _ = read_inputs(str(manifest), allow_outside_root=True)
    assert row.uri == signed and row.modality == "image"  # fetched as given...
    assert "deadbeef00" not in row.source + row.sample_id  # ...shown (ids, rejects, provenance) without it
    _, (reject,) = read_inputs(str(manifest))
    assert "deadbeef00" not in reject.source and "escapes" in reject.reason


def test_no_credential_in_any_output(encoded, outputs):
    # Runs last in this module: everything above was collected.
    assert len(outputs) >= 10
    for text in outputs:
        assert FAKE_SECRET not in text and FAKE_KEY_ID not in text
