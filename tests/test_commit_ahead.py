"""A Dask worker encodes its next task while the last one commits (precompute.worker.commit_ahead), on
real S3 (moto over HTTP, every answer late, and a proxy injecting faults): the overlap is seen
in the requests the server answered, each shard still commits in FORMAT.md's order (its index
part after all of its data objects and the check), nothing is lost or doubled, and with
``run.commit_ahead_bytes=0`` no commit overlaps the next task. Real tiny encoders, a real
LocalCluster of one single-threaded worker (so only seceding can overlap two tasks)."""

from __future__ import annotations

import pytest

from mmcache import featstore
from mmcache.featstore.verify import verify_store
from mmcache.precompute.worker.commit_ahead import commit_ahead, committing_bytes
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.runtime.local_cluster import local_cluster
from mmcache.precompute.pipeline import run_encode
from tests.s3_server import FaultProxy
from tests.test_encode import tiny_config


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client

    with local_cluster(1) as local, Client(local) as client:
        yield local.scheduler_address, client


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), num_images=6, num_videos=2)


def _encode(s3_server, cluster, dataset, bucket: str, name: str, *overrides: str):
    """Encode the 8 samples in 4 tasks of 2 into ``bucket/name`` through a fault proxy, every
    answer 50 ms late; the store and the requests for it the server answered meanwhile."""
    config = tiny_config("run.samples_per_task=2", *overrides)
    # Faults on every 7th request (503s and resets), each retried by featstore's retry layer.
    with FaultProxy((s3_server.host, s3_server.port), kinds=("503", "reset"), every=7, max_faults=40, lifetime=120) as proxy:
        options = {"endpoint_url": proxy.endpoint}

        def run(url: str):
            return run_encode(config, str(dataset), url, scheduler=cluster[0], storage_options=options, progress=False, log=lambda *_: None)

        with s3_server.slowed(0.05), s3_server.recording() as requests:
            summary = run(f"{bucket}/{name}")
        faults = proxy.faults
    assert faults > 0 and summary.samples_written == 8 and summary.tasks == 4
    store = featstore.open(f"{bucket}/{name}")
    ids = store.sample_ids()
    assert len(ids) == len(set(ids)) == 8  # nothing lost, nothing twice
    report = verify_store(featstore.open(f"{bucket}/{name}", strict=False))
    assert report.ok and not report.warnings, (report.problems, report.warnings)  # no leftovers either
    mine = [r for r in requests if r.key.startswith(f"{name}/") or f"prefix={name}/" in r.query]
    return store, name, mine


def _per_shard(store, name: str, requests):
    """shard -> (its first data PUT, its data PUTs, its index part PUT), from the recording. A
    task sends nothing before its data (the commit's own check finds a shard committed before)."""
    out = {}
    for shard, info in store.shards.items():
        data = [r for r in requests if r.method in ("PUT", "POST") and r.key.removeprefix(f"{name}/") in info.objects]
        index = [r for r in requests if r.method == "PUT" and r.key == f"{name}/index/{shard}.parquet"]
        assert data and len(index) == 1, (shard, data, index)
        out[shard] = (min(data, key=lambda r: r.start), data, index[0])
    return out


def _checks(name: str, requests):
    """The listings of the whole of index/ (a commit's check)."""
    return [r for r in requests if r.method == "GET" and "list-type=2" in r.query and f"prefix={name}/index/&" in r.query + "&"]


def test_next_task_encodes_while_the_last_commits_in_order(s3_server, cluster, dataset):
    store, name, requests = _encode(s3_server, cluster, dataset, s3_server.make_bucket("ahead"), "on")
    shards = _per_shard(store, name, requests)
    checks = _checks(name, requests)
    for _, data, index in shards.values():
        # FORMAT.md's order within each shard: every data object, then a check, then the index part.
        assert index.start > max(r.end for r in data)
        assert any(max(r.end for r in data) < c.start and c.end < index.start for c in checks)
        assert index.if_none_match == "*"
    # One single-threaded worker: a task whose first data PUT reached the server before the
    # previous task's index part was written ran (and encoded) while that commit was going on.
    ordered = sorted(shards.values(), key=lambda s: s[2].end)
    overlapped = sum(1 for before, after in zip(ordered, ordered[1:]) if after[0].start < before[2].end)
    assert overlapped >= 1, [(p.start, i.end) for p, _, i in ordered]


def test_no_overlap_when_turned_off(s3_server, cluster, dataset):
    store, name, requests = _encode(s3_server, cluster, dataset, s3_server.make_bucket("ahead"), "off", "run.commit_ahead_bytes=0")
    ordered = sorted(_per_shard(store, name, requests).values(), key=lambda s: s[2].end)
    # Each task's data go out only after the previous one's commit point was answered.
    assert all(after[0].start > before[2].end for before, after in zip(ordered, ordered[1:])), [(p.start, i.end) for p, _, i in ordered]


def _hold_commit(nbytes: int, limit: int, release: str, started: str) -> dict:
    """A task that 'commits' ``nbytes`` under ``limit`` until event ``release`` is set."""
    from distributed import Event

    with commit_ahead(nbytes, limit) as ahead:
        Event(started).set()
        held = committing_bytes()
        Event(release).wait(30)
    return {"ahead": ahead, "held": held}


def test_commits_off_the_pool_stay_within_the_byte_budget(cluster):
    """Two tasks of 100 bytes each under a 150-byte budget: the first commits off the thread
    pool (so the one-thread worker runs the second at the same time), the second finds the
    budget spent and commits in place."""
    from distributed import Event

    client = cluster[1]
    first = client.submit(_hold_commit, 100, 150, "release-1", "started-1", pure=False)
    assert Event("started-1", client=client).wait(30)
    second = client.submit(_hold_commit, 100, 150, "release-2", "started-2", pure=False)
    assert Event("started-2", client=client).wait(30)  # it ran while the first still holds its slot's bytes
    Event("release-2", client=client).set()
    assert second.result(30) == {"ahead": False, "held": 100}
    Event("release-1", client=client).set()
    assert first.result(30) == {"ahead": True, "held": 100}
    assert client.submit(committing_bytes, pure=False).result(30) == 0
