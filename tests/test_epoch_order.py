"""The shard-aware epoch order (train.order) and the local cache of a store bigger than it.

The order is a permutation per epoch, the same at any world size and after a resume, and reads
one window of shards at a time; through a cache of a quarter of the store on real S3 (moto over
HTTP, with a proxy counting the bytes on the wire) an epoch downloads about the store once,
where the global shuffle downloads it several times."""

from __future__ import annotations

import json
import os
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.cache import LAYOUT
from mmcache.featstore.compact import compact_store
from mmcache.featstore.order import shard_sequence
from mmcache.featstore.config import load_config
from mmcache.featstore.errors import ConfigError
from tests.s3_server import FaultProxy
from mmcache.train.data.balance import BalanceConfig, CostModel
from mmcache.train.data.stream import FeatureStream, StreamOptions
from mmcache.train.models.dit_data import LatentTextData
from mmcache.train.config import DataSection, TrainConfig
from mmcache.train.data.order import auto_window, plan_order, resolve_window, shard_positions, shard_read_bytes
from mmcache.train.data.packing import SAMPLE_ID

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
SHARDS, PER_SHARD = 32, 8


def write_store(url: str, shards: int = SHARDS, per_shard: int = PER_SHARD, *, channels: int = 4, side: int = 16, text_dim: int = 16,
                max_text: int = 10) -> None:
    """``shards`` shards of ``per_shard`` DiT-shaped samples: latents channels x 1 x side x side
    (and a wide shape every third sample), ragged text states (benchmarks/train_bench.py too)."""
    rng = np.random.default_rng(0)
    fields = {"latent": {"dtype": "bfloat16", "ndim": 4, "meta": {"latent_channels": channels, "scaling_factor": 1.0}},
              "text_emb": {"dtype": "bfloat16", "ndim": 2, "meta": {"hidden_size": text_dim}}}
    writer = featstore.create(url, fields=fields, shard_bytes=10**12)
    for i in range(shards * per_shard):
        h, w = (side, side) if i % 3 else (side // 2, side * 2)
        writer.add(f"s{i:05d}", {
            "latent": rng.standard_normal((channels, 1, h, w), dtype=np.float32).astype(ml_dtypes.bfloat16),
            "text_emb": rng.standard_normal((int(rng.integers(3, max_text)), text_dim), dtype=np.float32).astype(ml_dtypes.bfloat16),
        })
        if i % per_shard == per_shard - 1:
            writer.commit(f"shard-{i // per_shard:04d}")
    writer.close()


@pytest.fixture(scope="module")
def local_store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("order") / "store")
    write_store(url)
    return url


def stream(store: featstore.Store, *, window: int | None, dp_size: int = 1, dp_rank: int = 0, seed: int = 3) -> FeatureStream:
    data = LatentTextData(store=store, latent_field="latent", text_field="text_emb")
    return FeatureStream(store, data=data, options=StreamOptions(global_batch=8, seed=seed, dp_size=dp_size, dp_rank=dp_rank, balance=BalanceConfig(),
                                                               cost=CostModel(), tokens_per_sample=lambda shape: int(np.prod(shape[1:])), window=window))


def test_each_epoch_is_a_permutation_read_window_by_window(local_store):
    store = featstore.open(local_store)
    s = stream(store, window=3)
    shard_of = shard_positions(store, s.rows)
    assert sorted(np.bincount(shard_of).tolist()) == [PER_SHARD] * SHARDS
    orders = [s.order(epoch) for epoch in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(SHARDS * PER_SHARD))
        # Shards whose positions overlap are read together: those groups hold at most 3 shards
        # (a window), so a step of 8 touches at most two windows.
        shards = shard_of[order]
        spans = sorted((int(np.flatnonzero(shards == k).min()), int(np.flatnonzero(shards == k).max())) for k in range(SHARDS))
        groups, end = [], -1
        for first, last in spans:
            if first > end:
                groups.append(0)
            groups[-1] += 1
            end = max(end, last)
        assert max(groups) <= 3 and len(groups) >= 11 and sum(groups) == SHARDS
        assert max(len(set(shards[i : i + 8].tolist())) for i in range(0, len(shards), 8)) <= 6
    assert not np.array_equal(orders[0], orders[1])  # a new order each epoch
    # The same seed and epoch give the same order in a new process (here: a new stream).
    assert np.array_equal(stream(featstore.open(local_store), window=3).order(1), orders[1])
    # No window (or one of every shard) is the global shuffle of runs before windows, bit for bit.
    global_order = np.random.default_rng([3, 1]).permutation(SHARDS * PER_SHARD)
    assert np.array_equal(stream(store, window=None).order(1), global_order)
    assert np.array_equal(stream(store, window=SHARDS).order(1), global_order)
    # A window below one shard is refused where the config is loaded (the one check of it).
    with pytest.raises(ConfigError, match="shuffle_window must be a number of shards >= 1"):
        load_config(TrainConfig, "tiny-dit", "train", ["data.shuffle_window=0"])


def test_two_encodes_whose_shards_committed_in_other_orders_train_alike(tmp_path):
    """An encode's tasks commit in whatever order they finish, and its shards' names hash where the
    inputs lay: the epoch order visits the shards by their first sample's id, so the same samples
    give the same sequence of ids, globally and windowed, through an index checkpoint too (one of
    an older mmcache: from each commit record); a run that predates this (run.json's data_order
    without shard_sequence) resumes in its old order."""
    rng = np.random.default_rng(1)
    samples = {k: {f"k{k}-{i}": rng.standard_normal((4, 1, 8, 8), dtype=np.float32) for i in range(5)} for k in range(6)}
    fields = {"latent": {"dtype": "float32", "ndim": 4, "meta": {"latent_channels": 4, "scaling_factor": 1.0}},
              "text_emb": {"dtype": "float32", "ndim": 2, "meta": {"hidden_size": 4}}}
    urls = []
    # The second encode's inputs lay elsewhere: its task names (hashes) sort otherwise.
    for name, commits, shard in (("ascending", range(6), "t-{k:04d}"), ("shuffled", (3, 0, 5, 1, 4, 2), "t-{n:04d}x{k}")):
        writer = featstore.create(str(tmp_path / name), fields=fields, shard_bytes=10**12)
        for k in commits:
            for sample_id, latent in samples[k].items():
                writer.add(sample_id, {"latent": latent, "text_emb": np.ones((3, 4), np.float32)})
            writer.commit(shard.format(k=k, n=(7 * k + 3) % 10))
        writer.close()
        urls.append(str(tmp_path / name))
    stores = [featstore.open(url) for url in urls]
    assert list(stores[0].shards) != list(stores[1].shards)  # listed (and positioned) in commit order
    assert [stores[1].shards[n].first_id for n in sorted(stores[1].shards)] != [f"k{k}-0" for k in range(6)]  # by name: another order
    assert [stores[1].shards[n].first_id for n in shard_sequence(stores[1])] == [f"k{k}-0" for k in range(6)]

    def ids(store, window, epoch=1, **kw):
        s = stream(store, window=window)
        if kw:
            s = FeatureStream(store, data=s.data, options=replace(s.options, **kw))
        return [s.ids[p] for p in s.order(epoch)]

    for window in (None, 2):
        assert ids(stores[0], window) == ids(stores[1], window)
    compact_store(stores[1].storage)
    checkpointed = featstore.open(urls[1])
    assert checkpointed.storage.url == stores[1].storage.url and ids(checkpointed, None) == ids(stores[0], None)
    assert shard_sequence(checkpointed) == shard_sequence(stores[1])
    assert _older_checkpoint_sequence(checkpointed) == shard_sequence(stores[1])
    assert ids(stores[0], None, epoch=2) == ids(stores[1], None, epoch=2) != ids(stores[0], None)
    # The order of a run that started before: a global shuffle of the positions in commit order,
    # bit for bit; windows of the shards by name (the same as by first id where names sort alike).
    legacy = np.random.default_rng([3, 1]).permutation(30)
    assert ids(stores[1], None, legacy_order=True) == [stores[1].index.column("id")[int(p)].as_py() for p in legacy]
    assert ids(stores[0], 2, legacy_order=True) == ids(stores[0], 2) and ids(stores[1], 2, legacy_order=True) != ids(stores[1], 2)
    data = load_config(TrainConfig, "tiny-dit", "train", []).data
    assert plan_order(stores[1], ["latent"], data, None).legacy_order is False  # a new run
    assert plan_order(stores[1], ["latent"], data, {"shuffle_window": None, "shards": 6, "shard_sequence": "first_id"}).legacy_order is False
    assert plan_order(stores[1], ["latent"], data, {"shuffle_window": 2, "shards": 6}).legacy_order is True  # an older run's
    assert plan_order(stores[1], ["latent"], data, {}).legacy_order is True
    with pytest.raises(ConfigError, match="shard_sequence 'by_hash', which this mmcache does not know"):
        plan_order(stores[1], ["latent"], data, {"shuffle_window": None, "shards": 6, "shard_sequence": "by_hash"})
    # The library's dataset visits them alike too; a state an older mmcache saved of a shuffle
    # (no "order" in it) is refused with the way out, and that way resumes it.
    from mmcache.featstore.dataset import StreamingDataset

    datasets = [StreamingDataset(url, shuffle=True, seed=3, rank=0, world_size=1) for url in urls]
    assert [x["id"] for x in datasets[0]] == [x["id"] for x in datasets[1]]
    saved = {k: v for k, v in datasets[1].state_dict().items() if k != "order"} | {"yielded": 4}
    with pytest.raises(ValueError, match="legacy_order=True to finish that epoch"):
        datasets[1].load_state_dict(saved)
    older = StreamingDataset(urls[1], shuffle=True, seed=3, rank=0, world_size=1, legacy_order=True)
    older.load_state_dict(saved)
    epoch0 = np.random.default_rng([3, 0]).permutation(30)  # the dataset's epoch 0, in commit order
    assert [x["id"] for x in older] == [stores[1].index.column("id")[int(p)].as_py() for p in epoch0[4:]]
    windowed = StreamingDataset(urls[1], shuffle=True, seed=3, rank=0, world_size=1, window=2)
    assert windowed.state_dict()["order"] == "shards by first id"  # windows of shards by first id, not by name as before
    # A data compaction groups the small shards in that sequence too, not in commit order: the two
    # stores compact alike and still train alike.
    from mmcache.featstore.rewrite import DataCompaction, compact_data, shard_nbytes

    target = int(4.5 * max(shard_nbytes(info) for info in stores[0].shards.values()))  # groups of 5 shards, 1 left alone
    for url in urls:
        compact_data(featstore.open(url), DataCompaction(target_bytes=target))
    compacted = [featstore.open(url) for url in urls]
    for store in compacted:  # k0..k4 rewritten into one shard (in sequence), k5 left as it was
        assert [(store.shards[n].first_id, store.shards[n].num_samples) for n in shard_sequence(store)] == [("k0-0", 25), ("k5-0", 5)]
    for window in (None, 1):
        assert ids(compacted[0], window) == ids(compacted[1], window)


def _older_checkpoint_sequence(store) -> list[str]:
    """The shard sequence read through ``store``'s index checkpoint as an older mmcache wrote it:
    without the first ids copied out of the commit records (each read from its record instead)."""

    from mmcache.featstore.checkpoints import CHECKPOINT_METADATA_KEY, _parse_parts, checkpoint_keys, markers, read_parts_object
    from mmcache.featstore.index import IN_RECORD, list_index, parquet_bytes

    (_, digest, marker), *_ = markers(list_index(store.storage))
    parts, metadata, _ = read_parts_object(store.storage.read(checkpoint_keys(digest)[0]))
    doc = json.loads(metadata[CHECKPOINT_METADATA_KEY])
    assert len(doc.pop("first_ids")) == len(store.shards)
    older = parquet_bytes(parts.replace_schema_metadata(None), {CHECKPOINT_METADATA_KEY: json.dumps(doc).encode()})
    checkpoint = _parse_parts(older, digest, marker, store.url, lambda: None, len(older))
    infos = {part.info.name: part.info for part in checkpoint.parts.values()}
    assert {info.first_id for info in infos.values()} == {IN_RECORD}

    class Shards:
        shards = infos

    return shard_sequence(Shards)


def test_same_batches_at_any_world_size_and_after_a_resume(local_store):
    store = featstore.open(local_store)
    one = stream(store, window=2)
    two = [stream(store, window=2, dp_size=2, dp_rank=r) for r in (0, 1)]
    steps = 2 * SHARDS * PER_SHARD // 8 + 3  # two epochs and a bit: steps cross epoch boundaries
    for step in range(steps):
        single = one.plan(step)
        halves = [s.plan(step) for s in two]
        assert halves[0].global_indices == halves[1].global_indices == single.global_indices
        ids = lambda data: sorted(x[SAMPLE_ID] for _, samples in data.micro_batches for x in samples)  # noqa: E731
        assert sorted(ids(halves[0]) + ids(halves[1])) == ids(single)
        assert set(ids(halves[0])).isdisjoint(ids(halves[1]))
    # A resumed run (a new process: a new stream) at step 13, mid-epoch, with the prefetch thread.
    uninterrupted = [d.global_indices for d in stream(store, window=2).steps(0, steps, prefetch=2)]
    resumed = [d.global_indices for d in stream(featstore.open(local_store), window=2).steps(13, steps, prefetch=2)]
    assert resumed == uninterrupted[13:]


def test_window_from_the_cache_size_and_kept_on_resume(local_store):
    store = featstore.open(local_store)
    sizes = shard_read_bytes(store, ["latent", "text_emb"])
    mean = sum(sizes) / len(sizes)
    assert auto_window(None, sizes) is None  # no bound: a global shuffle
    assert auto_window(int(sum(sizes) * 10), sizes) is None  # the store fits twice over
    assert auto_window(int(8 * mean), sizes) == 3  # two windows of 3 under 90% of 8 shards
    assert auto_window(int(mean), sizes) == 1
    # Room is kept for the steps in flight: here 3 shards' worth of samples.
    assert auto_window(int(8 * mean), sizes, in_flight_bytes=3 * mean) == 2
    assert auto_window(int(2 * mean), sizes, in_flight_bytes=3 * mean) == 1  # too small: the trainer warns
    assert resolve_window(None, int(8 * mean), sizes, None) == 3
    assert resolve_window(5, int(8 * mean), sizes, None) == 5
    assert resolve_window(SHARDS, None, sizes, None) is None
    # On resume: the recorded window wins over a changed cache size; a run from before windows
    # ({} recorded) keeps its global shuffle; an explicit window that differs is refused.
    assert resolve_window(None, int(2 * mean), sizes, {"shuffle_window": 3}) == 3
    assert resolve_window(None, int(8 * mean), sizes, {}) is None
    with pytest.raises(ConfigError, match="started with 3"):
        resolve_window(2, None, sizes, {"shuffle_window": 3})


@pytest.fixture(scope="module")
def s3_store(s3_server, local_store) -> str:
    url = f"{s3_server.make_bucket()}/store"
    featstore.copy_store(local_store, url)  # parallel: faster than writing it there shard by shard
    return url


def epoch_through_cache(url: str, proxy: FaultProxy, cache: Path, cache_bytes: int, window: int | None,
                        steps: int = SHARDS * PER_SHARD // 8) -> tuple[dict, int, int]:
    """The first ``steps`` (default: one epoch) of the trainer's stream from S3 through a cache
    of ``cache_bytes``: the cache's counters, the bytes on the wire meanwhile, and the bytes an
    epoch reads."""
    options = {"endpoint_url": proxy.endpoint, "skip_instance_cache": True}
    store = featstore.open(url, options, cache_dir=cache, cache_bytes=cache_bytes)
    s = stream(store, window=window)
    wire = proxy.bytes_down
    for _ in s.steps(0, steps, prefetch=2):
        pass
    return store.storage.stats(), proxy.bytes_down - wire, sum(shard_read_bytes(store, ["latent", "text_emb"]))


def test_a_cache_of_a_quarter_of_the_store_downloads_it_about_once_per_epoch(s3_server, s3_store, tmp_path):
    store_bytes = sum(shard_read_bytes(featstore.open(s3_store), ["latent", "text_emb"]))
    bound = store_bytes // 4
    sizes = shard_read_bytes(featstore.open(s3_store), ["latent", "text_emb"])
    window = auto_window(bound, sizes)
    assert window is not None and window >= 2
    with FaultProxy((s3_server.host, s3_server.port), lifetime=120) as proxy:
        stats, wire, read = epoch_through_cache(s3_store, proxy, tmp_path / "windowed", bound, window)
        assert read == store_bytes
        assert stats["bytes_downloaded"] <= 1.3 * store_bytes, stats
        # The counters are the bytes that moved: on the wire they come with HTTP heads.
        assert stats["bytes_downloaded"] <= wire <= stats["bytes_downloaded"] + 2000 * (stats["downloads"] + stats["uncached_reads"] + 50)
        assert stats["requests"] == stats["hits"] + stats["misses"] + stats["uncached_reads"]
        assert stats["hit_rate"] > 0.5 and stats["downloads"] >= 2 * SHARDS  # every object once at least
        held = sum(p.stat().st_size for p in (tmp_path / "windowed" / LAYOUT / "objects").rglob("*") if p.is_file())
        assert held <= bound
        # The same cache under a global shuffle thrashes (the reason for the windowed order): a
        # quarter of an epoch downloads more than the whole windowed epoch did.
        shuffled, _, _ = epoch_through_cache(s3_store, proxy, tmp_path / "global", bound, None, steps=SHARDS * PER_SHARD // 32)
        assert shuffled["bytes_downloaded"] > 1.3 * store_bytes, shuffled


def test_plan_order_warns_when_the_cache_cannot_hold_the_order(s3_store, tmp_path):
    sizes = shard_read_bytes(featstore.open(s3_store), ["latent", "text_emb"])
    mean = sum(sizes) / len(sizes)
    fields = ["latent", "text_emb"]
    # Room for two shards, not for them and the 3 global batches in flight (prefetch 2 + 1).
    small = featstore.open(s3_store, cache_dir=tmp_path / "small", cache_bytes=int(2 * mean))
    plan = plan_order(small, fields, DataSection(cache_bytes=int(2 * mean)), None)
    assert plan.window == 1 and plan.store_bytes == sum(sizes)
    (warning,) = plan.warnings
    assert "holds less than 3 global batches" in warning and "Raise data.cache_bytes" in warning
    # data.cache_bytes unset: the cache is bounded by its disk (here as if that disk were small)
    # and the order is a global shuffle, which downloads the store several times per epoch.
    (warning,) = plan_order(small, fields, DataSection(), None).warnings
    assert "does not fit the cache" in warning and "Set data.cache_bytes" in warning
    # Room enough: no warning; without a cache (a local read) none either.
    roomy = featstore.open(s3_store, cache_dir=tmp_path / "roomy", cache_bytes=int(8 * mean))
    assert plan_order(roomy, fields, DataSection(cache_bytes=int(8 * mean)), None) == plan_order(
        featstore.open(s3_store), fields, DataSection(cache_bytes=int(8 * mean)), None)
    assert plan_order(roomy, fields, DataSection(cache_bytes=int(8 * mean)), None).warnings == ()
    # A resumed run keeps the window it recorded.
    assert plan_order(small, fields, DataSection(cache_bytes=int(2 * mean)), {"shuffle_window": 3}).window == 3


def test_objects_that_will_not_fit_are_read_by_ranges(s3_store, tmp_path):
    plain = featstore.open(s3_store)
    latents = {k: o["nbytes"] for info in plain.shards.values() for k, o in info.objects.items() if "/latent/" in k}
    texts = {k: o["nbytes"] for info in plain.shards.values() for k, o in info.objects.items() if "/text_emb/" in k}
    # Room for any one latent object, but not for two of them: those go by ranges; texts fit.
    bound = int(1.5 * max(latents.values()))
    assert max(texts.values()) * 2 <= 0.9 * bound
    store = featstore.open(s3_store, cache_dir=tmp_path / "cache", cache_bytes=bound)
    ids = plain.sample_ids()[: 3 * PER_SHARD : 2]  # half the samples of three shards
    got = store.read_rows([store.row(i) for i in ids], ["latent"])
    for sample_id, sample in zip(ids, got, strict=True):
        assert sample["latent"].tobytes() == plain.read(sample_id, ["latent"])["latent"].tobytes()
    stats = store.storage.stats()
    # Three chunk-index tails + one range per sample (only the bytes asked for), nothing
    # downloaded whole, nothing kept.
    assert stats["downloads"] == 0 and stats["uncached_reads"] == stats["requests"] == 3 + len(ids)
    assert stats["bytes_downloaded"] == stats["bytes_read"] < sum(sorted(latents.values())[-3:])
    assert not [p for p in (tmp_path / "cache" / LAYOUT / "objects").rglob("*") if p.is_file()]
    store.read_rows([store.row(i) for i in ids], ["text_emb"])
    assert store.storage.stats()["downloads"] == 3  # a text object fits: downloaded whole, once


def mmtrain_fit(store: str, out: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    # No checkpoint mid-run (tiny-dit saves every 20 steps): what is tested here is the cache.
    cmd = [str(BIN / "mmtrain"), "fit", "--config", "tiny-dit", "--features", store, "--out", str(out),
           "--set", "checkpoint.every=0", *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_fit_from_s3_on_four_ranks_reports_the_cache_per_epoch(s3_store, tmp_path):
    # Four ranks sharing one cache directory (the ranks of a node): 2 data-parallel ranks, each a
    # 2-way Ulysses group whose ranks read the same samples. The counters are summed over the
    # ranks, so the epoch record is what the node downloaded, and the bytes read count each
    # sample once per data-parallel rank, not once per rank. (That the ranks train on the same
    # global batches as one process is test_same_batches_at_any_world_size_and_after_a_resume
    # plus test_train's parity tests, which hold for any order the stream hands out.)
    bound = sum(shard_read_bytes(featstore.open(s3_store), ["latent", "text_emb"])) // 4
    epoch = SHARDS * PER_SHARD // 8
    run = tmp_path / "run"
    result = mmtrain_fit(s3_store, run, "--steps", str(epoch + 2), "--cache-dir", str(tmp_path / "cache"), "--set", f"data.cache_bytes={bound}",
                         "--set", "parallel.ulysses=2", nproc=4)
    # Cache: 8 shards' worth; 90% of it less 3 global batches of 8 (3 shards) leaves two windows of 2.
    assert "windows of 2 shard(s)" in result.stdout and "epoch 0: downloaded" in result.stdout and "warning" not in result.stdout
    info = json.loads((run / "run.json").read_text())
    assert info["data_order"] == {"shuffle_window": 2, "shards": SHARDS, "shard_sequence": "first_id"} and info["world_size"] == 4
    assert (info["mesh"]["dp_shard"], info["mesh"]["ulysses"]) == (2, 2)
    rows = records(run)
    assert len(rows) == epoch + 2 and all("cache_bytes_downloaded" in r for r in rows)
    summary = [r["epoch_cache"] for r in rows if "epoch_cache" in r]
    assert len(summary) == 1 and summary[0]["epoch"] == 0 and summary[0]["steps"] == epoch
    # The data-parallel ranks' reads: the epoch's samples once (plus each rank's own copy of the chunk indexes).
    assert summary[0]["store_bytes"] <= summary[0]["bytes_read"] <= 1.01 * summary[0]["store_bytes"]
    assert summary[0]["download_ratio"] <= 1.3 and summary[0]["hit_rate"] > 0.5
